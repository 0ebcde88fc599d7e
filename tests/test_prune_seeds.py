"""scripts/prune_seeds.py: means, spreads and verdicts over seeds from hand-made results."""

from __future__ import annotations

import json
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
    assert ("Evolutionary beats gradual magnitude in 1 of 2 seeds (the baseline pruning only at epoch ends, one "
            "step an epoch against one per evolutionary iteration: a coarse baseline).") in text
    assert "NOT met on the mean (drop 0.60 points; per seed 0.40, 0.80)" in text
    assert "met on the mean (drop 0.40" in seeds.summary([run(0, 93.0, 92.6, 92.0)], [Path("a.json")])


def test_runs_of_one_seed_split_by_model_are_merged_and_partial_models_marked(seeds, capsys) -> None:
    split = run(1, 92.0, 91.2, 91.5)
    resnet = {"meta": split["meta"], "blocks": [{**split["blocks"][0], "model": "resnet_small"}]}
    text = seeds.summary([run(0, 93.0, 92.6, 92.0), split, resnet],
                         [Path("a.json"), Path("b_vgg.json"), Path("b_resnet.json")])
    assert "seeds [0, 1]" in text and "`b_resnet.json` (seed 1, commit abc1234)" in text
    assert "| evolutionary | 91.90 ± 0.99 (n=2) |" in text
    assert "**Partial**" not in text.split("## resnet_small")[0]
    # seed 0 has no resnet_small: its mean over one seed says so, on the page and on stderr
    assert ("## resnet_small\n\n**Partial**: these figures cover seed(s) [1] only; resnet_small is missing from "
            "seed(s) [0] (not run or failed).") in text
    assert "warning: resnet_small is missing from seed(s) [0]" in capsys.readouterr().err
    other = {"meta": {**split["meta"], "budget": {"width": 32}}, "blocks": resnet["blocks"]}
    with pytest.raises(ValueError, match="different budgets"):
        seeds.merge_by_seed([split, other], [Path("b_vgg.json"), Path("c.json")])


def test_a_duplicate_seed_is_refused_naming_both_files(seeds, run_script, tmp_path) -> None:
    """Two files with a result for one model and seed are not one seed's runs split by model; a failed block gives
    way to a finished one of the same seed (a model rerun after it failed)."""
    from unsparse.atomic import atomic_write_json

    first = atomic_write_json(tmp_path / "seed0.json", run(0, 93.0, 92.6, 92.0))
    again = atomic_write_json(tmp_path / "seed0_again.json", run(0, 93.0, 92.2, 92.5))
    code, output = run_script(seeds, [str(first), str(again), "--out", str(tmp_path / "seeds.md")])
    assert code == 2 and f"seed 0: vgg_small is in both {first} and {again}" in output
    failed = run(0, 93.0, 92.6, 92.0)
    failed["blocks"] = [{"model": "vgg_small", "error": "Traceback"}]
    merged = seeds.merge_by_seed([failed, run(0, 93.0, 92.2, 92.5)], [Path("failed.json"), Path("rerun.json")])
    assert [block["rows"][1]["test"]["top1"] for block in merged[0]["blocks"]] == [92.2]


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
    assert "Evolutionary beats gradual magnitude in 1 of 2 runs (the baseline pruning only at epoch ends" in text
    assert "NOT met on the mean (drop 0.60 points; per run 0.40, 0.80)" in text
    assert "## resnet_small" in text and "(n=1)" in text.split("## resnet_small")[1]
    with pytest.raises(ValueError, match="vgg_small is in both a and b"):  # not pooled: a duplicate seed
        seeds.summary([first, again], [Path("a"), Path("b")])


def test_a_history_holding_minus_infinity_is_read(seeds, tmp_path) -> None:
    """A diverged evolutionary iteration records its change as -inf: files written before the JSON writer wrote
    null for it hold -Infinity (Python's JSON), which the summary reads (the strict reader of benchmark results
    refused them), as it reads the null of files written since then and the -1e999 written now."""
    from unsparse.atomic import atomic_write_json

    result = run(0, 93.0, 92.6, 92.0)
    result["blocks"][0]["rows"][1]["history"] = [{"relative_change": float("-inf")}]
    older = tmp_path / "seed0.json"
    older.write_text(json.dumps(result))
    assert "-Infinity" in older.read_text()
    seeds.main([str(older), "--out", str(tmp_path / "seeds.md")])
    assert "| evolutionary | 92.60" in (tmp_path / "seeds.md").read_text()
    now = atomic_write_json(tmp_path / "seed0_now.json", result)
    assert "Infinity" not in now.read_text() and '"relative_change": -1e999' in now.read_text()
    between = tmp_path / "seed0_null.json"
    between.write_text(now.read_text().replace("-1e999", "null"))
    for written in (now, between):
        seeds.main([str(written), "--out", str(tmp_path / f"{written.stem}.md")])
        assert "| evolutionary | 92.60" in (tmp_path / f"{written.stem}.md").read_text()


def test_a_null_test_metric_reads_as_nan(seeds, tmp_path) -> None:
    """A diverged model's test metric is NaN, which the results file holds as null (strict JSON): the summary reads
    it as NaN (the change and the goal's verdict too) instead of stopping on arithmetic with None."""
    from unsparse.atomic import atomic_write_json

    result = run(0, 93.0, float("nan"), 92.0)
    path = atomic_write_json(tmp_path / "seed0.json", result)
    assert '"top1": null' in path.read_text()
    seeds.main([str(path), "--out", str(tmp_path / "seeds.md")])
    text = (tmp_path / "seeds.md").read_text()
    assert "| evolutionary | nan (n=1) | nan (n=1) | 0.9200 |" in text and "NOT met on the mean" in text


def test_help_gives_the_whole_first_paragraph(seeds, run_script) -> None:
    code, output = run_script(seeds, ["--help"])
    assert code == 0 and "and how often evolutionary beats gradual magnitude." in output


def test_the_comparison_with_gradual_says_how_often_the_baseline_pruned(seeds) -> None:
    """Tables before the twenty-first session pruned the baseline at 3-4 epoch ends only; later ones as often as the
    evolutionary run; a pool of both says so."""
    fine = run(0, 93.0, 92.6, 92.0)
    fine["meta"] |= {"gradual_schedule": "step"}
    text = seeds.summary([fine], [Path("a.json")])
    assert "in 1 of 1 seeds (the baseline pruning as often as the evolutionary run: after every iteration's" in text
    both = seeds.summary([fine, run(0, 93.0, 92.2, 92.5)], [Path("a.json"), Path("b.json")], pool=True)
    assert "in 1 of 2 runs (baselines of both schedules pooled: see the tables)." in both
    # said per model: a ResNet file of the new schedule beside an old VGG one (a reviewer's repro)
    resnet = run(1, 92.0, 91.2, 91.5)
    resnet["meta"] |= {"gradual_schedule": "step"}
    resnet["blocks"][0]["model"] = "resnet_small"
    page = seeds.summary([run(0, 93.0, 92.6, 92.0), resnet], [Path("a.json"), Path("b.json")])
    assert "a coarse baseline" in page.split("## resnet_small")[0]
    assert "as often as the evolutionary run" in page.split("## resnet_small")[1]
    split = run(0, 93.0, 92.6, 92.0)
    split["meta"] |= {"gradual_schedule": "step"}
    split["blocks"][0]["model"] = "resnet_small"
    with pytest.raises(ValueError, match="runs of seed 0 have different gradual schedules"):
        seeds.summary([run(0, 93.0, 92.6, 92.0), split], [Path("a.json"), Path("b.json")])
    odd = run(0, 93.0, 92.6, 92.0)
    odd["meta"] |= {"gradual_schedule": "weekly"}
    with pytest.raises(ValueError, match=r"c.json: gradual_schedule 'weekly', expected one of \['epoch', 'step'\]"):
        seeds.summary([odd], [Path("c.json")])
