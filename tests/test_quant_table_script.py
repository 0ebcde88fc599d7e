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
