"""Masks as parametrizations, exact thresholds, weighted sparsity, and one-shot magnitude pruning."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from unsparse import create_model
from unsparse.prune import (
    MagnitudePruner,
    attach_masks,
    layer_sparsity,
    masks_of,
    model_weighted_sparsity,
    remove_masks,
    threshold_mask,
    weighted_sparsity,
)
from unsparse.prune.masks import lowest_mask, pack_mask, squashed_copy, unpack_mask


@pytest.mark.parametrize("sparsity", [0.0, 0.3, 0.9, 0.999, 1.0])
def test_threshold_mask_prunes_exactly_the_requested_count(sparsity):
    importance = torch.randint(0, 3, (7, 5, 3, 3)).float()  # many ties
    keep = threshold_mask(importance, sparsity)
    assert int((~keep).sum()) == math.ceil(sparsity * importance.numel() - 1e-9)
    if keep.any() and (~keep).any():
        assert importance[keep].min() >= importance[~keep].max()


def test_pruned_count_reaches_the_sparsity_without_overshooting_float_error():
    from unsparse.prune.masks import pruned_count

    assert pruned_count(0.9, 16) == 15 and 15 / 16 >= 0.9  # round() gave 14 = 0.875
    assert pruned_count(0.9, 10) == 9  # 0.9 * 10 = 9.000000000000002 in float
    assert pruned_count(0.0, 7) == 0 and pruned_count(1.0, 7) == 7


def test_threshold_mask_rejects_bad_sparsity():
    with pytest.raises(ValueError, match="sparsity"):
        threshold_mask(torch.ones(4), 1.5)


def test_weighted_sparsity_formula():
    assert weighted_sparsity({"a": 0.5, "b": 1.0}, {"a": 300, "b": 100}) == pytest.approx(0.625)
    with pytest.raises(ValueError, match="layers"):
        weighted_sparsity({"a": 0.5}, {"b": 1})


def magnitude_pruned(target: float, scope: str):
    """A small VGG (seed 0) after one magnitude step to ``target``."""
    torch.manual_seed(0)
    model = create_model("vgg_small", width=8)
    pruner = MagnitudePruner(target, scope=scope)
    pruner.prepare(model)
    pruner.step()
    return model


@pytest.mark.parametrize("scope", ["global", "layer"])
def test_magnitude_step_reaches_target_and_masks_survive_training(scope):
    model = magnitude_pruned(0.8, scope)
    assert model_weighted_sparsity(model) == pytest.approx(0.8, abs=1e-3)
    if scope == "layer":
        assert all(value == pytest.approx(0.8, abs=0.01) for value in layer_sparsity(model).values())
    masks = {name: mask.mask.clone() for name, mask in masks_of(model).items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9, weight_decay=1e-3)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(8, 1, 28, 28)).square().mean().backward()
        optimizer.step()
    # the masks are no parameters: momentum and weight decay leave them as they were
    assert all(torch.equal(mask.mask, masks[name]) for name, mask in masks_of(model).items())
    remove_masks(model)
    for name, layer in model.named_modules():  # squashed: the dense weights are zero where the masks were
        if name in masks:
            assert torch.all(layer.weight[masks[name] == 0] == 0)
    assert not masks_of(model)
    assert model_weighted_sparsity(model) >= 0.8 - 1e-3


def test_squashed_copy_leaves_the_original_parametrized():
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Flatten(), nn.Linear(3 * 4 * 4, 2))
    masks = attach_masks(model)
    masks["0"].set(torch.rand(3, 2, 3, 3) > 0.5)
    copy = squashed_copy(model)
    assert not masks_of(copy) and masks_of(model)
    assert torch.equal(copy[0].weight, model[0].weight)
    x = torch.randn(2, 2, 6, 6)
    assert torch.equal(copy(x), model(x))


@pytest.mark.parametrize("squashed", ["copy", "original"])
def test_removing_the_masks_of_a_deep_copy_leaves_the_other_model_masked_and_running(squashed):
    """Deep copies share torch's parametrized class; removing a parametrization deletes its property from that
    class, so squashing one model broke the other (AttributeError: no attribute 'weight')."""
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Conv2d(3, 2, 3))
    for mask in attach_masks(model).values():
        mask.set(torch.rand_like(mask.mask) > 0.5)
    other = copy.deepcopy(model)
    x = torch.randn(2, 2, 8, 8)
    expected = model(x)
    kept, squashed_model = (model, other) if squashed == "copy" else (other, model)
    remove_masks(squashed_model)
    assert not masks_of(squashed_model) and set(masks_of(kept)) == {"0", "2"}
    assert torch.equal(kept(x), expected) and torch.equal(squashed_model(x), expected)
    remove_masks(kept)
    assert not masks_of(kept) and torch.equal(kept(x), expected)


def test_a_layer_subset_reaches_its_target_over_the_masked_layers_only():
    """With ``layers`` naming a subset, the target is measured on the masked layers; the model-wide figure is lower
    (the other layers stay dense) and the result carries both, so the target is not reported as missed."""
    torch.manual_seed(0)
    model = create_model("vgg_small", width=8)
    chosen = sorted(layer_sparsity(model))[:2]
    pruner = MagnitudePruner(0.9, layers=chosen)
    pruner.prepare(model)
    pruner.step()
    result = pruner.result([], 0.0)
    assert 0.9 <= result.masked_weighted_sparsity < 0.91 and result.target_reached(0.9)
    assert result.weighted_sparsity == pytest.approx(model_weighted_sparsity(model))
    assert result.weighted_sparsity < 0.5
    assert not result.target_reached(0.95)


def test_pruner_needs_prepare():
    with pytest.raises(RuntimeError, match="prepare"):
        MagnitudePruner(0.5).step()
    with pytest.raises(ValueError, match="target"):
        MagnitudePruner(1.0)


def test_a_squashed_pruner_asks_for_prepare_again():
    """After squash_mask, step and result raised torch.cat's and the weighted sparsity's errors."""
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Flatten(), nn.Linear(3 * 4 * 4, 2))
    pruner = MagnitudePruner(0.5)
    pruner.prepare(model)
    pruner.step()
    assert pruner.squash_mask() is model and not masks_of(model)
    for call in (pruner.step, lambda: pruner.result([], 0.0), pruner.squash_mask):
        with pytest.raises(RuntimeError, match="prepare"):
            call()
    pruner.prepare(model)
    pruner.step(0.75)
    assert model_weighted_sparsity(model) == pytest.approx(0.75, abs=0.01)


@pytest.mark.parametrize("scope", ["global", "layer"])
@pytest.mark.parametrize("sparsity", [-0.1, 1.5])
def test_a_step_outside_zero_one_is_refused_in_either_scope(scope, sparsity):
    """In the layer scope 1.5 pruned every layer to 100 %, and -0.1 was reported scaled by layer_targets."""
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Flatten(), nn.Linear(3 * 4 * 4, 2))
    pruner = MagnitudePruner(0.5, scope=scope, layer_targets={"0": 0.6} if scope == "layer" else None)
    pruner.prepare(model)
    with pytest.raises(ValueError, match=rf"sparsity: {sparsity} outside \[0, 1\]"):
        pruner.step(sparsity)
    assert model_weighted_sparsity(model) == 0


def test_unknown_layer_names_are_refused_naming_them_before_anything_is_attached():
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Flatten(), nn.Linear(3 * 4 * 4, 2))
    with pytest.raises(ValueError, match=r"layers: \['conv9'\] are not .* it has 0, 2"):
        MagnitudePruner(0.5, layers=["0", "conv9"]).prepare(model)
    assert not masks_of(model)


@pytest.mark.parametrize("shape", [(1,), (8,), (3, 5, 7), (16, 3, 3, 3), (0,)])
def test_pack_mask_round_trips_and_takes_an_eighth_of_the_bytes(shape):
    keep = torch.rand(shape, generator=torch.Generator().manual_seed(1)) < 0.4
    bits = pack_mask(keep)
    assert bits.dtype == torch.uint8 and bits.numel() == -(-keep.numel() // 8)
    assert torch.equal(unpack_mask(bits, shape), keep)


def test_pack_mask_bit_order_and_unpack_validation():
    assert pack_mask(torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 1])).tolist() == [0b10000001, 0b10000000]
    with pytest.raises(ValueError, match="bits"):
        unpack_mask(torch.zeros(2, dtype=torch.uint8), (17,))
    with pytest.raises(ValueError, match="bits"):
        unpack_mask(torch.zeros(2, dtype=torch.int32), (9,))


@pytest.mark.parametrize("scope", ["global", "layer"])
def test_magnitude_target_zero_prunes_nothing(scope):
    """Target 0 is a valid baseline (the dense model behind masks); the layer scope divided by it."""
    model = magnitude_pruned(0.0, scope)
    assert all(bool(mask.mask.all()) for mask in masks_of(model).values())


def test_a_mask_takes_only_zeros_and_ones_of_the_weights_shape():
    from unsparse.prune.masks import WeightMask

    mask = WeightMask(torch.randn(2, 3))
    mask.set(torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]]))
    mask.set(torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="values other than 0 and 1"):
        mask.set(torch.full((2, 3), 0.5))
    with pytest.raises(ValueError, match="shape"):
        mask.set(torch.ones(3, 2))
    assert torch.equal(mask.mask, torch.ones(2, 3))  # a refused set leaves the mask as it was


@pytest.mark.parametrize("values", ["ties", "infinities", "nan"])
def test_lowest_mask_zeros_what_a_stable_sort_puts_first(values: str) -> None:
    """Exactly ``pruned`` zeros, the entries a stable sort ranks first: below the threshold all, at it the first by
    position; with heavy ties (eight distinct values), infinite entries (as ``resize_mask`` writes them) and NaN
    (ranked above everything), for every count from none to all."""
    generator = torch.Generator().manual_seed(3)
    importance = torch.randint(0, 8, (6, 7), generator=generator).double()
    if values != "ties":
        importance[0, :3] = -math.inf
        importance[5, 4:] = math.inf
    if values == "nan":
        importance[2, 2] = importance[4, 0] = math.nan
    flat = importance.view(-1).tolist()
    order = sorted(range(len(flat)), key=lambda i: (math.isnan(flat[i]), 0.0 if math.isnan(flat[i]) else flat[i], i))
    for pruned in range(importance.numel() + 1):
        expected = torch.ones(importance.numel(), dtype=torch.bool)
        expected[order[:pruned]] = False
        assert torch.equal(lowest_mask(importance, pruned), expected.view(6, 7)), pruned
