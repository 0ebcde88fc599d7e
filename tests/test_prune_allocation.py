"""scripts/prune_allocation.py: gradual magnitude on the evolutionary pruner's per-layer allocation, and the
mask-swap arms that retrain each method's final masks from the dense model."""

from __future__ import annotations

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
