"""scripts/quant_table.py's command line, without training."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def quant_table(load_script):
    return load_script("quant_table")


def test_an_out_folder_is_refused_before_any_training(quant_table, run_script, monkeypatch, tmp_path):
    """``--out`` names the markdown file (its JSON goes beside it): a folder is refused at once, not after the
    training, when the page could not be written into it."""
    monkeypatch.setattr(quant_table, "fashion_mnist", lambda *args, **kwargs: pytest.fail("started a run"))
    code, output = run_script(quant_table, ["--quick", "--workdir", str(tmp_path / "work"), "--out", str(tmp_path)])
    assert code == 2 and f"--out: {tmp_path} is a folder" in output
    assert not list(tmp_path.parent.glob(f"{tmp_path.name}.json"))


def test_help_states_the_defaults(quant_table, run_script):
    code, output = run_script(quant_table, ["--help"])
    assert code == 0 and "(default outputs/quant_table)" in output and "not a folder" in output


def test_a_quick_page_says_it_is_a_smoke_run_and_the_committed_page_does_not(quant_table):
    """The committed page re-renders byte for byte from its JSON (a full run), without the smoke-run line; the same
    figures marked ``--quick`` open with it under the heading."""
    import json
    from pathlib import Path

    committed = Path(__file__).resolve().parent.parent / "docs" / "quantization_results"
    result = json.loads(committed.with_suffix(".json").read_text(encoding="utf-8"))
    assert not result["meta"]["quick"]
    assert quant_table.markdown(result["blocks"], result["meta"]) == committed.with_suffix(".md").read_text(
        encoding="utf-8")
    quick = quant_table.markdown(result["blocks"], {**result["meta"], "quick": True}).splitlines()
    assert quick[2].startswith("**Smoke run (budget `quick`): figures are not results.**")
