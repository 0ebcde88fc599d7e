"""Edges of the pruners: other parametrizations under the masks, targets that would leave a layer without a weight,
an evolutionary run on a model that is already masked, and the pruning scripts' ``--render`` on files they did not
write."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

from unsparse.prune import MagnitudePruner, attach_masks, masks_of, remove_masks
from unsparse.prune.masks import WeightMask


def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Conv2d(4, 8, 3), nn.ReLU(), nn.Flatten(),
                         nn.Linear(8 * 4 * 4, 3))


def weight_normed_and_pruned() -> nn.Module:
    model = tiny_model()
    weight_norm(model[2])
    pruner = MagnitudePruner(0.5)
    pruner.prepare(model)
    pruner.step()
    return model


class Doubled(nn.Module):
    """A parametrization with no ``right_inverse``."""

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return 2 * weight


@pytest.mark.parametrize("squash", ["remove_masks", "squash_mask"])
def test_removing_masks_leaves_weight_norm_on_the_layer_and_the_outputs_as_they_were(squash):
    """remove_masks folded weight_norm's original0/original1 into a plain weight too: the layer stopped being
    weight-normalised, though only the masks were asked to go."""
    model = tiny_model()
    weight_norm(model[2])
    pruner = MagnitudePruner(0.5)
    pruner.prepare(model)
    pruner.step()
    inputs = torch.randn(2, 1, 8, 8)
    expected, pruned = model(inputs), model[2].weight == 0
    remove_masks(model) if squash == "remove_masks" else pruner.squash_mask()
    assert not masks_of(model)
    assert [type(step).__name__ for step in model[2].parametrizations.weight] == ["_WeightNorm"]
    assert not parametrize.is_parametrized(model[0]) and isinstance(model[0].weight, nn.Parameter)
    assert torch.equal(model[2].weight == 0, pruned)
    torch.testing.assert_close(model(inputs), expected)


def test_fold_others_folds_every_parametrization_of_a_masked_weight():
    model = weight_normed_and_pruned()
    inputs = torch.randn(2, 1, 8, 8)
    expected = model(inputs)
    remove_masks(model, fold_others=True)
    assert not parametrize.is_parametrized(model[2]) and isinstance(model[2].weight, nn.Parameter)
    torch.testing.assert_close(model(inputs), expected)


def test_a_mask_registered_first_is_folded_into_the_original_under_the_later_parametrization():
    """Exact without any right_inverse: ``Doubled(original * mask)`` is ``Doubled(original') `` with
    ``original' = original * mask``."""
    model = tiny_model()
    attach_masks(model, ["0"])["0"].set(torch.rand(4, 1, 3, 3, generator=torch.Generator().manual_seed(1)) > 0.5)
    parametrize.register_parametrization(model[0], "weight", Doubled())
    expected = model[0].weight.detach().clone()
    remove_masks(model)
    assert [type(step) for step in model[0].parametrizations.weight] == [Doubled]
    assert torch.equal(model[0].weight, expected)


def test_a_mask_other_parametrizations_cannot_hold_is_refused_naming_the_layer_and_nothing_changes():
    """A whole output channel pruned under weight_norm: its norm is 0, and weight_norm gives NaN for it."""
    model = weight_normed_and_pruned()
    keep = torch.ones(8, 4, 3, 3, dtype=torch.bool)
    keep[3] = False
    masks_of(model)["2"].set(keep)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"layers \['2'\].*weight_norm.*fold_others=True"):
        remove_masks(model)
    assert set(masks_of(model)) == {"0", "2", "5"}
    assert all(torch.equal(value, before[key]) for key, value in model.state_dict().items())
    assert isinstance(model[2].parametrizations.weight[1], WeightMask)
