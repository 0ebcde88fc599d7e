"""scripts/prune_allocation.py: gradual magnitude on the evolutionary pruner's per-layer allocation, and the
mask-swap arms that retrain each method's final masks from the dense model."""

from __future__ import annotations

import json
import lzma

import pytest
import torch

from unsparse.data import Splits
from unsparse.models import create_model
from unsparse.prune.masks import prunable_layers
from unsparse.train import Trainer


@pytest.fixture(scope="module")
def ablation(load_script):
    return load_script("prune_allocation")


def noise_splits() -> Splits:
    generator = torch.Generator().manual_seed(0)

    def split(count: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.rand(count, 1, 28, 28, generator=generator), torch.randint(0, 10, (count,), generator=generator)

    return Splits(train=split(128), val=split(32), test=split(32), num_classes=10, name="noise")


def test_allocation_arm_takes_the_evolutionary_layer_sparsity_and_the_page_joins_seeds(ablation, tmp_path):
    splits = noise_splits()
    budget = {**ablation.TABLE.BUDGETS["quick"], "iterations": 4, "batches": 1}
    recorded: list[list[str]] = []
    arms = ablation.ablate("vgg_small", budget, {"unit_step": 0.3}, 0.05,
                           lambda: Trainer(splits.loaders(32, seed=0), lr=0.05, progress=False), tmp_path, 0,
                           lambda found: recorded.append(list(found)))
    assert recorded == [list(ablation.ARMS[:n]) for n in (1, 2, 3)]
    evolutionary, global_, allocated = (arms[arm] for arm in ablation.ARMS)
    sizes = {name: layer.weight.numel()
             for name, layer in prunable_layers(create_model("vgg_small", width=budget["width"])).items()}
    assert allocated["layer_sparsity"] == {name: pytest.approx(value, abs=1.0 / sizes[name])
                                           for name, value in evolutionary["layer_sparsity"].items()}
    assert global_["weighted_sparsity"] == pytest.approx(evolutionary["weighted_sparsity"], abs=1e-3)
    assert all(0.0 <= row[split] <= 100.0 for row in arms.values() for split in ("val_top1", "test_top1"))
    meta = {"model": "vgg_small", "budget_name": "quick", "overrides": {}, "fine_tune_lr": 0.05, "seed": 0,
            "commit": "abc1234", "device_name": "cpu"}
    page = ablation.markdown([{"meta": meta, "arms": arms}, {"meta": {**meta, "seed": 1}, "arms": arms}])
    assert "Differences to `gradual_global` in points, over 2 seed(s)" in page and "Mask swap" not in page
    assert "| gradual_allocation | " in page and page.count("| 1 | abc1234 | cpu |") == 3
    # the gradual arms prune once per evolutionary iteration (1 batch here), as the table's baseline now does
    assert {(arms[arm]["pruning_unit"], arms[arm]["pruning_steps"]) for arm in ablation.ARMS[1:]} == {
        ("step", evolutionary["iterations"])}
    assert "pruning only at the ends of those epochs" in page  # meta without gradual_schedule: an old file
    assert "pruning as often as it did" in ablation.markdown([{"meta": {**meta, "gradual_schedule": "step"},
                                                                "arms": arms}])


def test_mask_swap_arms_retrain_their_source_masks_and_the_page_splits_the_shortfall(ablation, tmp_path):
    splits = noise_splits()
    budget = {**ablation.TABLE.BUDGETS["quick"], "iterations": 4, "batches": 1}
    recorded: list[list[str]] = []
    chosen = ("evolutionary_masks", "allocation_masks")
    arms = ablation.ablate("vgg_small", budget, {"unit_step": 0.3}, 0.05,
                           lambda: Trainer(splits.loaders(32, seed=0), lr=0.05, progress=False), tmp_path, 0,
                           lambda found: recorded.append(list(found)), chosen)
    order = ["evolutionary", "gradual_allocation", *chosen]  # sources run although not chosen; no gradual_global
    assert recorded == [order[:n] for n in range(1, 5)]
    for arm, source in ablation.MASK_ARMS.items():
        assert arms[arm]["layer_sparsity"] == arms[source]["layer_sparsity"]
        assert arms[arm]["epochs"] == arms["evolutionary_masks"]["epochs"] >= 1
    meta = {"model": "vgg_small", "budget_name": "quick", "overrides": {}, "fine_tune_lr": 0.05, "seed": 0,
            "commit": "abc1234", "device_name": "cpu"}
    page = ablation.markdown([{"meta": meta, "arms": arms}])
    assert "| M = C - D: the masks | " in page and "Differences to `gradual_global`" not in page
    shortfall = arms["evolutionary"]["test_top1"] - arms["gradual_allocation"]["test_top1"]
    assert "| S = A - B: shortfall against gradual_allocation | " in page and f"{shortfall:+.2f} |" in page


@pytest.mark.parametrize(("options", "message"), [
    (["--device", "bogus"], "argument --device: device: 'bogus' is not a device"),
    (["--device", "cuda:0"], "argument --device: device: 'cuda:0' requested, but torch sees 0 CUDA device(s)"),
    (["--fine-tune-lr", "0"], "argument --fine-tune-lr: expected a learning rate"),
    (["--evolutionary", "nonsense=1"], "--evolutionary: nonsense not in evolutionary.yaml"),
    (["--evolutionary", "fine_tune_lr=0.1"], "--evolutionary: fine_tune_lr is set by the budget"),
    (["--evolutionary", "alpha=-1"], "--evolutionary: alpha: expected a number >= 0 and finite, got -1"),
    (["--evolutionary", "epsilon=0.01", "--evolutionary", "epsilon=0.02"], "--evolutionary: epsilon given more"),
    (["--data-root", "/nonexistent/fashion"],
     "--data-root: Fashion-MNIST file /nonexistent/fashion/train-images-idx3-ubyte.gz not found"),
])
def test_bad_values_are_refused_before_any_training(ablation, run_script, monkeypatch, tmp_path, options, message):
    """Every value is checked as the command line is read (exit status 2, naming the option), not after the dense
    training or with a torch traceback."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(ablation.SELECT, "run_setup", lambda *args: pytest.fail("started a run"))
    code, output = run_script(ablation, ["--budget", "quick", "--out", str(tmp_path / "arms.json"), *options])
    assert code == 2 and message in output


def test_render_reads_committed_xz_files(ablation, run_script, tmp_path):
    row = {"val_top1": 90.0, "test_top1": 89.5, "weighted_sparsity": 0.92, "layer_sparsity": {"0": 0.5},
           "wall_time_s": 1.0}
    meta = {"model": "vgg_small", "budget_name": "quick", "overrides": {}, "fine_tune_lr": 0.05, "seed": 0,
            "commit": "abc1234", "device_name": "cpu"}
    with lzma.open(tmp_path / "s0.json.xz", "wt") as handle:
        json.dump({"meta": meta, "arms": {"evolutionary": row}}, handle)
    code, _ = run_script(ablation, ["--render", str(tmp_path / "s0.json.xz"), "--out", str(tmp_path / "page.md")])
    assert code == 0 and "| 0 | abc1234 | cpu | evolutionary | 90.00 | 89.50 |" in (tmp_path / "page.md").read_text()


def test_render_names_a_file_of_another_script_or_of_another_model(ablation, run_script, tmp_path):
    """A prune_select.py JSON ended in KeyError: 'model', and seeds of two models in a KeyError on the second
    model's layer names, both as tracebacks."""
    row = {"val_top1": 90.0, "test_top1": 89.5, "weighted_sparsity": 0.92, "layer_sparsity": {"0": 0.5},
           "wall_time_s": 1.0}
    meta = {"model": "vgg_small", "budget_name": "quick", "overrides": {}, "fine_tune_lr": 0.05, "seed": 0,
            "commit": "abc1234", "device_name": "cpu"}
    files = {"select.json": {"meta": {**meta, "grid": {}}, "candidates": {}},
             "vgg.json": {"meta": meta, "arms": {"evolutionary": row}},
             "resnet.json": {"meta": {**meta, "model": "resnet_small"},
                             "arms": {"evolutionary": {**row, "layer_sparsity": {"1.body.0.0": 0.5}}}}}
    for name, content in files.items():
        (tmp_path / name).write_text(json.dumps(content))
    page = str(tmp_path / "page.md")
    code, output = run_script(ablation, ["--render", str(tmp_path / "select.json"), "--out", page])
    assert code == 2 and f"--render: {tmp_path / 'select.json'}" in output and "'arms'" in output
    code, output = run_script(ablation, ["--render", str(tmp_path / "vgg.json"), str(tmp_path / "resnet.json"),
                                         "--out", page])
    assert code == 2 and "--render: the files are of several models (resnet_small, vgg_small)" in output
    code, output = run_script(ablation, ["--render", str(tmp_path / "vgg.json"), "--out", page])
    assert code == 0
