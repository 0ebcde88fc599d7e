"""scripts/prune_allocation.py: gradual magnitude on the evolutionary pruner's per-layer allocation."""

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


def test_allocation_arm_takes_the_evolutionary_layer_sparsity_and_the_page_joins_seeds(ablation, tmp_path):
    generator = torch.Generator().manual_seed(0)

    def split(count: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.rand(count, 1, 28, 28, generator=generator), torch.randint(0, 10, (count,), generator=generator)

    splits = Splits(train=split(128), val=split(32), test=split(32), num_classes=10, name="noise")
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
    assert "over the 2 seed(s) with all arms" in page
    assert "| gradual_allocation | " in page and page.count("| 1 | abc1234 | cpu |") == 3
