"""scripts/prune_select.py: a validation-only grid over evolutionary settings and fine-tuning learning rate."""

from __future__ import annotations

import json
import lzma

import pytest
import torch

from unsparse.data import Splits
from unsparse.train import Trainer


@pytest.fixture(scope="module")
def selector(load_script):
    return load_script("prune_select")


def test_grid_is_scored_on_validation_only_and_best_takes_the_highest(selector, tmp_path, monkeypatch):
    generator = torch.Generator().manual_seed(0)

    def split(count: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.rand(count, 1, 28, 28, generator=generator), torch.randint(0, 10, (count,), generator=generator)

    splits = Splits(train=split(256), val=split(64), test=split(64), num_classes=10, name="noise")
    seen: list[str] = []
    evaluate = Trainer.evaluate

    def spy(self, model, split_name="val", desc=None):
        seen.append(split_name)
        return evaluate(self, model, split_name, desc)

    monkeypatch.setattr(Trainer, "evaluate", spy)
    budget = {**selector.TABLE.BUDGETS["quick"], "iterations": 4, "batches": 1}
    recorded: list[int] = []
    candidates = selector.select(
        "vgg_small", budget, {"epsilon": [0.015, 0.005]}, [0.01, 0.05],
        lambda: Trainer(splits.loaders(32, seed=0), lr=0.05, progress=False), tmp_path, 0,
        lambda found: recorded.append(len(found)))
    assert [(c["epsilon"], c["fine_tune_lr"]) for c in candidates] == [(0.015, 0.01), (0.015, 0.05),
                                                                       (0.005, 0.01), (0.005, 0.05)]
    assert recorded == [1, 2, 3, 4]
    assert all(0.0 <= c["val_top1"] <= 100.0 and c["iterations"] <= 4 for c in candidates)
    assert seen and "test" not in seen
    assert selector.best([{"val_top1": 80.0, "k": 1}, {"val_top1": 81.0, "k": 2}, {"val_top1": 81.0, "k": 3}])["k"] == 2


def test_page_has_a_column_per_grid_setting(selector):
    meta = {"budget_name": "quick", "budget": {}, "seed": 0, "device_name": "cpu", "commit": "abc1234",
            "grid": {"epsilon": [0.015], "alpha": [0.1, 1.0], "fine_tune_lr": [0.05]}}
    candidates = [{"model": "resnet_small", "epsilon": 0.015, "alpha": alpha, "fine_tune_lr": 0.05, "val_top1": top1,
                   "stalls": 1, "iterations": 40} for alpha, top1 in ((0.1, 91.5), (1.0, 92.25))]
    lines = selector.markdown([{"meta": meta, "candidates": {"resnet_small": candidates}}]).splitlines()
    header = lines.index("| model | epsilon | alpha | fine-tune lr | val top1 | stalls / iterations | chosen |")
    assert lines[header + 1].count("---") == 7
    assert lines[header + 3] == "| resnet_small | 0.015 | 1.0 | 0.05 | 92.25 | 1 / 40 | yes |"


def test_jobs_of_one_selection_join_into_one_table_with_one_choice(selector):
    def job(alpha: float, top1: float, commit: str = "abc1234") -> dict:
        meta = {"budget_name": "quick", "budget": {}, "seed": 0, "device_name": "cpu", "commit": commit,
                "grid": {"alpha": [alpha], "fine_tune_lr": [0.05]}}
        candidate = {"model": "resnet_small", "alpha": alpha, "fine_tune_lr": 0.05, "val_top1": top1, "stalls": 0,
                     "iterations": 30}
        return {"meta": meta, "candidates": {"resnet_small": [candidate]}}

    merged = selector.merge([job(0.1, 91.0), job(10.0, 92.0), job(1.0, 93.0, commit="other")])
    assert len(merged) == 2
    assert merged[0]["meta"]["grid"] == {"alpha": [0.1, 10.0], "fine_tune_lr": [0.05]}
    assert [c["alpha"] for c in merged[0]["candidates"]["resnet_small"]] == [0.1, 10.0]
    lines = selector.markdown([job(0.1, 91.0), job(10.0, 92.0)]).splitlines()
    assert lines.count("| model | alpha | fine-tune lr | val top1 | stalls / iterations | chosen |") == 1
    assert "| resnet_small | 10.0 | 0.05 | 92.00 | 0 / 30 | yes |" in lines
    assert "| resnet_small | 0.1 | 0.05 | 91.00 | 0 / 30 |  |" in lines


def test_a_finished_dense_checkpoint_is_loaded_not_trained_again(selector, tmp_path, monkeypatch):
    generator = torch.Generator().manual_seed(0)
    data = (torch.rand(64, 1, 28, 28, generator=generator), torch.randint(0, 10, (64,), generator=generator))
    splits = Splits(train=data, val=data, test=data, num_classes=10, name="noise")
    budget = {**selector.TABLE.BUDGETS["quick"], "dense_epochs": 1}

    def trainer() -> Trainer:
        return Trainer(splits.loaders(32, seed=0), lr=0.05, progress=False)

    first = selector.train_dense("vgg_small", budget, trainer(), tmp_path, seed=0)
    monkeypatch.setattr(Trainer, "train_epoch", lambda *args, **kwargs: pytest.fail("trained again"))
    again = selector.train_dense("vgg_small", budget, trainer(), tmp_path, seed=1)
    for key, value in first.state_dict().items():
        assert torch.equal(value, again.state_dict()[key]), key


@pytest.fixture
def no_training(selector, monkeypatch):
    """No CUDA device, and data loading (which every run does before training) fails the test."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(selector, "run_setup", lambda *args: pytest.fail("started a run"))


@pytest.mark.parametrize(("options", "message"), [
    (["--device", "bogus"], "argument --device: device: 'bogus' is not a device"),
    (["--device", "cuda"], "argument --device: device: 'cuda' requested, but torch sees 0 CUDA device(s)"),
    (["--fine-tune-lr", "0.05", "-0.1"], "argument --fine-tune-lr: expected a learning rate"),
    (["--grid", "nonsense=[1, 2]"], "--grid: nonsense not in evolutionary.yaml"),
    (["--grid", "target=[0.5]"], "--grid: target is set by the budget"),
    (["--grid", "min_step=[0.01, 2.0]"], "--grid: min_step: expected a number in (0, 1], got 2.0"),
    (["--grid", "alpha=[]"], "--grid: alpha has no values"),
    (["--grid", "alpha=[0.1]", "--grid", "alpha=[1.0]"], "--grid: alpha given more than once"),
    (["--data-root", "/nonexistent/fashion"],
     "--data-root: Fashion-MNIST file /nonexistent/fashion/train-images-idx3-ubyte.gz not found"),
])
def test_bad_values_are_refused_before_any_training(selector, run_script, no_training, tmp_path, options, message):
    """Every value is checked as the command line is read (exit status 2, naming the option), not after hours of
    dense training or with a torch traceback."""
    code, output = run_script(selector, ["--budget", "quick", "--out", str(tmp_path / "select.json"), *options])
    assert code == 2 and message in output


def test_out_must_not_be_a_folder(selector, run_script, no_training, tmp_path):
    code, output = run_script(selector, ["--budget", "quick", "--out", str(tmp_path)])
    assert code == 2 and f"--out: {tmp_path} is a folder" in output


def test_render_reads_committed_xz_files_and_names_a_missing_one(selector, run_script, tmp_path):
    meta = {"budget_name": "quick", "budget": {}, "seed": 0, "device_name": "cpu", "commit": "abc1234",
            "grid": {"alpha": [0.1], "fine_tune_lr": [0.05]}}
    candidate = {"model": "vgg_small", "alpha": 0.1, "fine_tune_lr": 0.05, "val_top1": 91.0, "stalls": 0,
                 "iterations": 30}
    with lzma.open(tmp_path / "select.json.xz", "wt") as handle:
        json.dump({"meta": meta, "candidates": {"vgg_small": [candidate]}}, handle)
    code, _ = run_script(selector, ["--render", str(tmp_path / "select.json.xz"), "--out", str(tmp_path / "page.md")])
    assert code == 0 and "| vgg_small | 0.1 | 0.05 | 91.00 | 0 / 30 | yes |" in (tmp_path / "page.md").read_text()
    code, output = run_script(selector, ["--render", str(tmp_path / "gone.json"), "--out", str(tmp_path / "page.md")])
    assert code == 2 and "--render:" in output and "gone.json" in output


def test_help_states_defaults_and_the_long_default_budget(selector, run_script):
    code, output = run_script(selector, ["--help"])
    assert code == 0
    assert "(default gpu_w32: all 55,000 training images" in output and "many hours on a CPU" in output
    assert "(default auto)" in output and "(default 0.01 0.05)" in output


@pytest.mark.parametrize(("content", "lacks"), [
    ({"meta": {"model": "resnet_small"}, "arms": {}}, "'candidates'"),  # a prune_allocation.py JSON
    ({"meta": {"budget_name": "quick", "seed": 0}, "candidates": {}}, "meta lacks budget, commit, device_name, grid"),
])
def test_render_names_a_file_this_script_did_not_write(selector, run_script, tmp_path, content, lacks):
    """A JSON of another script (or a hand-cut one) ended in a KeyError traceback."""
    (tmp_path / "other.json").write_text(json.dumps(content))
    code, output = run_script(selector, ["--render", str(tmp_path / "other.json"), "--out", str(tmp_path / "page.md")])
    assert code == 2 and f"--render: {tmp_path / 'other.json'}" in output and lacks in output
    assert not (tmp_path / "page.md").exists()


def test_render_needs_out_with_dense_only_too(selector, run_script, tmp_path):
    """--dense-only waived --out, and --render then wrote to None: a TypeError traceback."""
    code, output = run_script(selector, ["--dense-only", "--render", str(tmp_path / "select.json")])
    assert code == 2 and "--out is required with --render" in output


def test_best_ranks_a_diverged_candidate_last(selector):
    """A NaN top-1 first in the grid won: max() keeps it, as no number compares greater than NaN."""
    nan = float("nan")
    assert selector.best([{"val_top1": nan, "id": 0}, {"val_top1": 20.0, "id": 1}, {"val_top1": 30.0, "id": 2},
                          {"val_top1": 30.0, "id": 3}])["id"] == 2
