"""The torch.ao-style lifecycle of every pruner (``prepare`` -> ``step`` -> ``squash_mask``) and its misuse: calls out
of order, models or settings with nothing to prune, and the invariants of the masks along the way."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from unsparse.prune import MagnitudePruner, masks_of
from unsparse.prune.evolutionary import EvolutionaryPruner
from unsparse.prune.gradual import GradualMagnitudePruner

PRUNERS = [MagnitudePruner, GradualMagnitudePruner, EvolutionaryPruner]


def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Conv2d(4, 8, 3), nn.ReLU(), nn.Flatten(),
                         nn.Linear(8 * 4 * 4, 3))


def test_an_evolutionary_step_before_prepare_asks_for_prepare():
    """It returned silently, as if it had pruned; the magnitude pruners raise."""
    with pytest.raises(RuntimeError, match=r"call prepare\(model\) first"):
        EvolutionaryPruner(0.5).step()


def test_an_evolutionary_step_with_no_layers_chosen_says_what_to_call():
    """Right after prepare, step() left every mask at ones without a word, where the magnitude pruners' step
    prunes to the target: its step applies an iteration's pruning of the layers that iteration chose."""
    model = tiny_model()
    pruner = EvolutionaryPruner(0.5)
    pruner.prepare(model)
    with pytest.raises(RuntimeError, match=r"no layers chosen.*run\(model, trainer, workdir\)"):
        pruner.step()
    pruner.chosen = ["2"]
    pruner.step()
    assert pruner.zero_counts()["2"] > 0
