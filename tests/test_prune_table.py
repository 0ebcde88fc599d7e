"""scripts/prune_table.py without training: budgets, output paths and the results page's device text; the
pruning scripts' shared options."""

from __future__ import annotations

import itertools
import json
import lzma
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from unsparse.data import FASHION_MNIST_FILES


@pytest.fixture(scope="module")
def table(load_script):
    return load_script("prune_table")


def test_budgets_share_their_keys_and_the_gpu_budget_is_bounded(table):
    keys = set(table.BUDGETS["full"])
    assert all(set(budget) == keys for budget in table.BUDGETS.values())
    gpu = table.BUDGETS["gpu"]
    assert gpu["limit_train"] is None and gpu["test"] is None
    # 55,000 training images in batches of 128: 430 an epoch; at most 21,200 batches a CNN (full: 1,621).
    assert table.planned_batches(gpu, 430, gpu["iterations"], gpu["batches"], gpu["dense_epochs"]) == 21200
    full = table.BUDGETS["full"]
    assert table.planned_batches(full, 47, full["iterations"], full["batches"], full["dense_epochs"]) == 1621


def test_output_path_takes_a_markdown_file_or_a_folder(table, tmp_path):
    assert table.output_path(tmp_path / "x.md", "gpu", tmp_path) == tmp_path / "x.md"
    assert table.output_path(tmp_path, "gpu", tmp_path) == tmp_path / "pruning_results.md"
    assert table.output_path(None, "quick", tmp_path) == tmp_path / "pruning_results.md"
    assert table.output_path(None, "gpu", tmp_path) == Path("docs/pruning_results.md")


def test_markdown_names_the_device_and_what_is_missing(table):
    meta = {"host": "h", "torch": "t", "threads": 16, "commit": "abc1234", "budget": {}, "notes": []}
    legacy = table.markdown([], {**meta, "quick": False})
    assert "on the CPU" in legacy and "CPU seconds" not in legacy and "--budget" not in legacy
    failed = {"model": "vgg_small", "model_kwargs": {"width": 16}, "error": "Traceback\nRuntimeError: boom\n"}
    page = table.markdown([failed], {**meta, "budget_name": "gpu", "device": "cuda",
                                     "device_name": "NVIDIA H100 80GB HBM3"})
    assert "`scripts/prune_table.py --budget gpu`" in page
    assert "the GPU NVIDIA H100 80GB HBM3" in page and "on the CPU" not in page
    assert "vgg_small failed; resnet_small, autoencoder1d not run" in page and "RuntimeError: boom" in page


def test_markdown_counts_only_the_requested_models_as_missing(table):
    meta = {"host": "h", "torch": "t", "threads": 16, "commit": "abc1234", "budget": {}, "notes": ["- shared"],
            "budget_name": "gpu_w32", "device": "cuda", "models": ["vgg_small", "autoencoder1d"]}
    page = table.markdown([], meta)
    assert "vgg_small, autoencoder1d not run" in page and "resnet_small" not in page
    assert "chosen after the `gpu` and `gpu_long` runs" in page and "- shared" in page


def test_the_autoencoders_verdict_states_its_target_and_the_trivial_mse(table):
    """A run below the autoencoder's sparsity target says NOT met, and methods no better than predicting each
    window's mean are not counted as having learned anything (the verdict compared two such models)."""
    def row(method, mse, sparsity):
        return {"method": method, "test": {"mse": mse}, "weighted_sparsity": sparsity, "layer_sparsity": {},
                "history": [{"phase": "prune", "iteration": 1, "events": []}] if method == "evolutionary" else []}

    block = {"iterations": 5, "trivial_mse": 1.19,
             "rows": [row("dense", 0.03, 0.0), row("evolutionary", 1.03, 0.7959), row("gradual", 1.07, 0.7959),
                      row("magnitude", 1.2, 0.7959)]}
    lines = " ".join(table.verdict(block, "mse"))
    assert "Target (90% weighted sparsity): NOT met, evolutionary reached 79.59% after 1 of 5 iterations" in lines
    assert "below it: dense, evolutionary, gradual" in lines
    block["rows"][1]["weighted_sparsity"] = 0.9
    assert "Target (90% weighted sparsity): met" in table.verdict(block, "mse")[0]


def test_a_null_test_metric_renders_as_nan(table):
    """The results JSON holds null for a NaN test MSE (a diverged model; strict JSON), and the page still renders
    from it: the value shows as nan, and NaN neither beats nor learns anything."""
    def row(method, mse):
        return {"method": method, "test": {"mse": mse}, "weighted_sparsity": 0.9, "layer_sparsity": {"0": 0.9},
                "wall_time_s": 1.0, "train_batches": 3,
                "history": [{"phase": "prune", "iteration": 1, "events": []}] if method == "evolutionary" else []}

    block = {"model": "autoencoder1d", "model_kwargs": {}, "data": "co2", "iterations": 5, "trivial_mse": 1.19,
             "rows": [row("dense", 0.03), row("evolutionary", None), row("gradual", 1.07), row("magnitude", 1.2)]}
    meta = {"host": "h", "torch": "t", "threads": 2, "commit": "abc1234", "budget": {}, "notes": [],
            "models": ["autoencoder1d"]}
    page = table.markdown([block], meta)
    assert "| evolutionary | nan | nanx |" in page
    assert ("Evolutionary does NOT beat gradual magnitude at matched sparsity (the difference of its test MSE from "
            "gradual magnitude's is not a number)." in page)
    assert "below it: dense, gradual" in page


@pytest.mark.parametrize(("key", "evolutionary", "gradual", "sentence"), [
    ("top1", 72.5, 89.6875, "does NOT beat gradual magnitude at matched sparsity (its test top-1 is 17.19 points "
                            "below gradual magnitude's)."),
    ("top1", 90.42, 90.0, "beats gradual magnitude at matched sparsity (its test top-1 is 0.42 points above "
                          "gradual magnitude's)."),
    ("top1", 90.0, 90.0, "does NOT beat gradual magnitude at matched sparsity (its test top-1 equals gradual "
                         "magnitude's)."),
    ("mse", 0.05, 0.041284, "does NOT beat gradual magnitude at matched sparsity (its test MSE is 0.008716 above "
                            "gradual magnitude's)."),
    ("mse", 0.041284, 0.05, "beats gradual magnitude at matched sparsity (its test MSE is 0.008716 below gradual "
                            "magnitude's)."),
])
def test_the_comparison_with_gradual_says_above_or_below_in_either_direction(table, key, evolutionary, gradual,
                                                                            sentence):
    """The evolutionary vs gradual sentence gives the difference's size and says which side evolutionary is on; a
    negative difference "in evolutionary's favour" read as a contradiction."""
    def row(method, value):
        return {"method": method, "test": {key: value}, "weighted_sparsity": 0.92, "layer_sparsity": {},
                "history": [{"phase": "prune", "iteration": 1, "events": []}] if method == "evolutionary" else []}

    block = {"iterations": 5, "rows": [row("dense", 90.0 if key == "top1" else 0.03), row("evolutionary", evolutionary),
                                       row("gradual", gradual)]}
    lines = table.verdict(block, key)
    assert f"Evolutionary {sentence}" in lines
    assert not any("favour" in line for line in lines)


def test_setting_reads_yaml_values_and_rejects_text_without_a_key(table):
    assert table.setting("epsilon=0.005") == ("epsilon", 0.005)
    assert table.setting(" deadline = null") == ("deadline", None)
    with pytest.raises(Exception, match="KEY=VALUE"):
        table.setting("0.005")


@pytest.mark.parametrize("script", ["prune_table", "prune_select", "prune_allocation"])
def test_pruning_scripts_offer_deterministic_runs(script: str) -> None:
    root = Path(__file__).resolve().parent.parent
    result = subprocess.run([sys.executable, str(root / "scripts" / f"{script}.py"), "--help"], capture_output=True,
                            text=True, cwd=root)
    assert result.returncode == 0, result.stderr
    assert "--deterministic" in result.stdout


@pytest.mark.parametrize(("options", "message"), [
    (["--device", "bogus"], "argument --device: device: 'bogus' is not a device"),
    (["--device", "cuda"], "argument --device: device: 'cuda' requested, but torch sees 0 CUDA device(s)"),
    (["--fine-tune-lr", "nan"], "argument --fine-tune-lr: expected a learning rate"),
    (["--seed", "-1"], "argument --seed: seed: expected an integer in [0, 4294967295], got -1"),
    (["--seed", "4294967296"], "would draw what seed 0 draws"),
    (["--seed", "1.5"], "argument --seed: expected an integer seed, got '1.5'"),
    (["--evolutionary", "iterations=5"], "--evolutionary: iterations is set by the budget"),
    (["--data-root", "/nonexistent/fashion"],
     "--data-root: Fashion-MNIST file /nonexistent/fashion/train-images-idx3-ubyte.gz not found"),
])
def test_bad_values_are_refused_before_any_training(table, run_script, monkeypatch, tmp_path, options, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(table, "fashion_mnist", lambda *args, **kwargs: pytest.fail("started a run"))
    code, output = run_script(table, ["--models", "vgg_small", "--out", str(tmp_path / "t.md"), *options])
    assert code == 2 and message in output


def test_a_data_root_missing_a_file_is_refused_unless_only_the_autoencoder_runs(table, run_script, monkeypatch,
                                                                                tmp_path):
    """A folder without Fashion-MNIST's files ran the autoencoder, then recorded each classifier's traceback as a
    failed block (a scripts audit's find): it is refused before any training, naming the file it lacks. The
    autoencoder alone reads no Fashion-MNIST, so such a folder does not stop it."""
    root = tmp_path / "fashion"
    root.mkdir()
    for name in FASHION_MNIST_FILES[:3]:
        (root / f"{name}.gz").touch()
    monkeypatch.setattr(table, "fashion_mnist", lambda *args, **kwargs: pytest.fail("started a run"))
    common = ["--out", str(tmp_path / "t.md"), "--workdir", str(tmp_path / "work"), "--data-root", str(root)]
    code, output = run_script(table, common)
    assert code == 2 and f"--data-root: Fashion-MNIST file {root}/t10k-labels-idx1-ubyte.gz not found" in output
    assert not (tmp_path / "t.md").exists()

    class Started(BaseException):
        """Raised where the autoencoder's run starts (``except Exception`` records ordinary errors)."""

    def started(*args, **kwargs):
        raise Started

    monkeypatch.setattr(table, "timeseries", started)
    with pytest.raises(Started):
        run_script(table, ["--models", "autoencoder1d", *common])


def test_a_series_file_that_cannot_be_read_is_named_by_its_option(table, run_script, tmp_path):
    """The autoencoder's failed block named ``data.source``, the main job's setting, which this script does not
    have (``timeseries`` named it for every caller)."""
    missing = tmp_path / "co2.txt"
    code, output = run_script(table, ["--models", "autoencoder1d", "--series-file", str(missing), "--out",
                                      str(tmp_path / "t.md"), "--workdir", str(tmp_path / "work")])
    assert code == 1 and f"--series-file: {missing}: cannot be read (No such file or directory)" in output
    assert "data.source" not in output


def test_render_reads_a_committed_xz_file_beside_the_page(table, run_script, tmp_path):
    meta = {"host": "h", "torch": "t", "threads": 16, "commit": "abc1234", "budget": {}, "notes": [],
            "budget_name": "gpu_w32", "device": "cuda", "models": []}
    with lzma.open(tmp_path / "seed0.json.xz", "wt") as handle:
        json.dump({"meta": meta, "blocks": []}, handle)
    code, _ = run_script(table, ["--render", "--out", str(tmp_path / "seed0.md")])
    assert code == 0 and "`scripts/prune_table.py --budget gpu_w32`" in (tmp_path / "seed0.md").read_text()


def test_the_matched_gradual_baseline_prunes_as_often_as_the_evolutionary_run(table):
    """The baseline pruned only at epoch ends: 3 cubic steps (0.65, then 0.89, then 0.92) where the evolutionary run
    made 31 (an audit of the comparison's fairness); the step schedule prunes once per evolutionary iteration over
    the same batches, and both train as many epochs."""
    used, batches, steps_per_epoch = 31, 40, 430
    fine = table.matched_gradual(0.92, used, batches, steps_per_epoch, "step", 15, 0.05)
    coarse = table.matched_gradual(0.92, used, batches, steps_per_epoch, "epoch", 15, 0.05)
    assert fine.epochs(steps_per_epoch) == coarse.epochs(steps_per_epoch) == 3 + 15
    points = [fine.sparsity_at(i * batches) for i in range(used + 1)]
    assert points[-1] == pytest.approx(0.92) and all(b > a for a, b in itertools.pairwise(points))
    assert max(b - a for a, b in itertools.pairwise(points)) < 0.1
    assert [round(coarse.sparsity_at(epoch), 4) for epoch in range(4)] == [0.0, 0.6474, 0.8859, 0.92]


@pytest.mark.parametrize(("schedule", "text"), [
    ("step", "pruning as often as it did (after every iteration's batches)"),
    (None, "pruning only at the ends of those epochs (one pruning step an epoch"),
])
def test_the_page_says_how_often_the_gradual_baseline_pruned(table, schedule, text):
    meta = {"host": "h", "torch": "t", "threads": 16, "commit": "abc1234", "budget": {}, "notes": [],
            "budget_name": "gpu_w32", "device": "cuda", **({"gradual_schedule": schedule} if schedule else {})}
    assert text in table.markdown([], meta)


def pages(load_script, budget_name: str) -> dict[str, str]:
    """Per pruning script, the page it renders from a run of ``budget_name`` with nothing else in it."""
    meta = {"host": "h", "torch": "t", "threads": 2, "commit": "abc1234", "budget": {}, "notes": [], "seed": 0,
            "budget_name": budget_name, "device_name": "cpu", "grid": {"fine_tune_lr": [0.05]}, "model": "vgg_small",
            "overrides": {}, "fine_tune_lr": 0.05}
    arm = {"val_top1": 90.0, "test_top1": 89.0, "weighted_sparsity": 0.92, "layer_sparsity": {}, "wall_time_s": 1.0}
    return {"prune_table": load_script("prune_table").markdown([], meta),
            "prune_select": load_script("prune_select").markdown([{"meta": meta, "candidates": {}}]),
            "prune_allocation": load_script("prune_allocation").markdown([{"meta": meta,
                                                                           "arms": {"evolutionary": arm}}])}


def test_a_smoke_run_says_so_under_the_heading(load_script):
    """A page of the quick budget (a few training batches) named the budget only among the settings, so its
    figures could pass for results (a scripts audit's find); the line is on no page of another budget."""
    for script, page in pages(load_script, "quick").items():
        assert page.splitlines()[2].startswith("**Smoke run (budget `quick`): figures are not results.**"), script
    for script, page in pages(load_script, "gpu_w32").items():
        assert "Smoke run" not in page, script
