"""scripts/prune_seeds.py: means, spreads and verdicts over seeds from hand-made results."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def seeds(load_script):
    return load_script("prune_seeds")


def run(seed: int, dense: float, evolutionary: float, gradual: float) -> dict:
    rows = [{"method": method, "test": {"top1": top1}, "weighted_sparsity": 0.0 if method == "dense" else 0.92}
            for method, top1 in (("dense", dense), ("evolutionary", evolutionary), ("gradual", gradual))]
    return {"meta": {"budget_name": "gpu_long", "seed": seed, "commit": "abc1234"},
            "blocks": [{"model": "vgg_small", "rows": rows}]}


def test_summary_means_changes_per_seed_and_judges_the_mean(seeds) -> None:
    text = seeds.summary([run(0, 93.0, 92.6, 92.0), run(1, 92.0, 91.2, 91.5)], [Path("a.json"), Path("b.json")])
    assert "| evolutionary | 91.90 ± 0.99 (n=2) | -0.60 ± 0.28 (n=2) | 0.9200 |" in text
    assert "Evolutionary beats gradual magnitude in 1 of 2 seeds." in text
    assert "NOT met on the mean (drop 0.60 points; per seed 0.40, 0.80)" in text
    assert "met on the mean (drop 0.40" in seeds.summary([run(0, 93.0, 92.6, 92.0)], [Path("a.json")])


def test_runs_of_one_seed_split_by_model_are_merged_and_partial_models_left_out(seeds) -> None:
    split = run(1, 92.0, 91.2, 91.5)
    resnet = {"meta": split["meta"], "blocks": [{**split["blocks"][0], "model": "resnet_small"}]}
    text = seeds.summary([run(0, 93.0, 92.6, 92.0), split, resnet],
                         [Path("a.json"), Path("b_vgg.json"), Path("b_resnet.json")])
    assert "seeds [0, 1]" in text and "`b_resnet.json` (seed 1, commit abc1234)" in text
    assert "| evolutionary | 91.90 ± 0.99 (n=2) |" in text
    assert "## resnet_small" not in text  # seed 0 has no resnet_small: no mean over one seed posing as two
    other = {"meta": {**split["meta"], "budget": {"width": 32}}, "blocks": resnet["blocks"]}
    with pytest.raises(ValueError, match="different budgets"):
        seeds.merge_by_seed([split, other])


def test_summary_states_each_models_settings(seeds) -> None:
    tuned = run(0, 93.0, 92.6, 92.0)
    tuned["meta"] |= {"fine_tune_lr": 0.05, "evolutionary_overrides": {"epsilon": 0.005}}
    text = seeds.summary([tuned], [Path("a.json")], ["Chosen on validation."])
    assert "\n\nChosen on validation.\n\n" in text
    assert 'Run with {"evolutionary_overrides": {"epsilon": 0.005}, "fine_tune_lr": 0.05}' in text


def test_pooled_runs_count_every_file_even_of_one_seed(seeds) -> None:
    """Repeated runs of one protocol (same seeds, another commit) pool into one mean over all of them."""
    first, again = run(0, 93.0, 92.6, 92.0), run(0, 93.0, 92.2, 92.5)
    resnet = {"meta": again["meta"], "blocks": [{**again["blocks"][0], "model": "resnet_small"}]}
    text = seeds.summary([first, again, resnet], [Path("a.json"), Path("b.json"), Path("c.json")], pool=True)
    assert "| evolutionary | 92.40 ± 0.28 (n=2) | -0.60 ± 0.28 (n=2) | 0.9200 |" in text
    assert "Evolutionary beats gradual magnitude in 1 of 2 runs." in text
    assert "NOT met on the mean (drop 0.60 points; per run 0.40, 0.80)" in text
    assert "## resnet_small" in text and "(n=1)" in text.split("## resnet_small")[1]
    assert "| evolutionary | 92.60 (n=1) |" in seeds.summary([first, again], [Path("a"), Path("b")])  # merged


def test_a_history_holding_minus_infinity_is_read(seeds, tmp_path) -> None:
    """A diverged evolutionary iteration records its change as -Infinity (Python's JSON writes it); the summary reads
    such files (the strict reader of benchmark results refused them)."""
    from unsparse.atomic import atomic_write_json

    result = run(0, 93.0, 92.6, 92.0)
    result["blocks"][0]["rows"][1]["history"] = [{"relative_change": float("-inf")}]
    path = atomic_write_json(tmp_path / "seed0.json", result)
    assert "-Infinity" in path.read_text()
    seeds.main([str(path), "--out", str(tmp_path / "seeds.md")])
    assert "| evolutionary | 92.60" in (tmp_path / "seeds.md").read_text()
