"""The torch.ao-style lifecycle of every pruner (``prepare`` -> ``step`` -> ``squash_mask``) and its misuse: calls out
of order, models or settings with nothing to prune, and the invariants of the masks along the way."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from unsparse.prune import MagnitudePruner, layer_sparsity, masks_of, model_weighted_sparsity, remove_masks
from unsparse.prune.evolutionary import EvolutionaryPruner
from unsparse.prune.gradual import GradualMagnitudePruner
from unsparse.prune.masks import prunable_layers

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


@pytest.mark.parametrize("cls", PRUNERS)
@pytest.mark.parametrize(("dense", "layers", "message"), [
    (False, None, "layers: the model has no Conv1d/Conv2d/Linear layer to prune"),
    (True, [], r"layers: names no layer to prune \(null: every one of 0, 2, 5\)"),
])
def test_nothing_to_prune_is_refused_by_check_layers_naming_the_setting(cls, dense, layers, message):
    """The magnitude pruners' step crashed in torch.cat and the evolutionary run in a ZeroDivisionError, after the
    main job had trained the dense model (it calls check_layers before training)."""
    model = tiny_model() if dense else nn.Sequential(nn.ReLU(), nn.Flatten())
    pruner = cls(0.5, layers=layers)
    with pytest.raises(ValueError, match=message):
        pruner.check_layers(model)
    with pytest.raises(ValueError, match=message):
        pruner.prepare(model)
    assert not masks_of(model)


@pytest.mark.parametrize(("cls", "field"), [(MagnitudePruner, "lr"), (GradualMagnitudePruner, "lr"),
                                            (EvolutionaryPruner, "lr"), (EvolutionaryPruner, "fine_tune_lr")])
def test_a_bad_learning_rate_is_refused_naming_the_pruners_setting(cls, field):
    """The refusal of prune.lr=-1 named 'lr' alone, and the job's config has a train.lr too."""
    with pytest.raises(ValueError,
                       match=rf"^{field}: expected a number > 0 and finite \(or null\), got -1 \(.*prune\.{field}"):
        cls(0.5, **{field: -1})


@pytest.mark.parametrize("cls", PRUNERS)
def test_a_step_on_masks_removed_behind_the_pruners_back_asks_for_prepare(cls):
    """After remove_masks(model) the pruner's step set masks no layer carried any more: the model stayed dense and
    nothing said so."""
    model = tiny_model()
    pruner = cls(0.5)
    pruner.prepare(model)
    pruner.chosen = ["0"]  # the evolutionary step's layers; an attribute the magnitude pruners do not read
    remove_masks(model)
    with pytest.raises(RuntimeError, match=r"masks of \['0', '2', '5'\] are no longer on the model.*prepare"):
        pruner.step()
    pruner.prepare(model)
    pruner.chosen = ["0"]
    pruner.step()
    assert model_weighted_sparsity(model) > 0
    assert pruner.squash_mask() is model and not masks_of(model)


def test_squash_mask_after_remove_masks_returns_the_plain_model():
    model = tiny_model()
    pruner = MagnitudePruner(0.5)
    pruner.prepare(model)
    pruner.step()
    remove_masks(model)
    assert pruner.squash_mask() is model and not masks_of(model)
    with pytest.raises(RuntimeError, match=r"call prepare\(model\) first"):
        pruner.squash_mask()


def layer_masks(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: mask.mask.clone() for name, mask in masks_of(model).items()}


@pytest.mark.parametrize("cls", PRUNERS)
def test_preparing_a_model_twice_keeps_its_masks_and_stacks_none(cls):
    model = tiny_model()
    pruner = cls(0.5)
    pruner.prepare(model)
    pruner.chosen = ["2", "5"]
    pruner.step()
    pruned = layer_masks(model)
    assert any(bool((keep == 0).any()) for keep in pruned.values())
    cls(0.5).prepare(model)
    pruner.prepare(model)
    assert all(len(layer.parametrizations.weight) == 1 for layer in prunable_layers(model).values())
    assert all(torch.equal(keep, pruned[name]) for name, keep in layer_masks(model).items())


def test_an_evolutionary_step_refuses_chosen_layers_it_does_not_mask():
    model = tiny_model()
    pruner = EvolutionaryPruner(0.5, layers=["0", "2"])
    pruner.prepare(model)
    pruner.chosen = ["2", "5", "conv9"]
    with pytest.raises(ValueError, match=r"chosen: \['5', 'conv9'\] are not masked layers; the pruner masks 0, 2"):
        pruner.step()
    assert all(bool(keep.all()) for keep in layer_masks(model).values())


def test_squash_mask_folds_only_the_pruners_own_masks():
    """Squashing one pruner's masks dropped those another pruner had on other layers of the model, whose pruned
    weights then trained back."""
    model = tiny_model()
    first, second = MagnitudePruner(0.5, layers=["0"]), MagnitudePruner(0.5, layers=["2", "5"])
    first.prepare(model)
    first.step()
    second.prepare(model)
    second.step()
    kept = layer_masks(model)
    first.squash_mask()
    assert list(masks_of(model)) == ["2", "5"] and torch.equal(masks_of(model)["2"].mask, kept["2"])
    second.step(0.6)
    assert second.result([], 0.0).masked_weighted_sparsity >= 0.6 and layer_sparsity(model)["0"] == 0.5


def sgd_steps(model: nn.Module, steps: int = 5) -> None:
    """SGD with Nesterov momentum and a large weight decay, which keep moving the dense weights under the masks."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9, weight_decay=0.1, nesterov=True)
    inputs = torch.randn(8, 1, 8, 8, generator=torch.Generator().manual_seed(4))
    for _ in range(steps):
        optimizer.zero_grad()
        model(inputs).square().mean().backward()
        optimizer.step()


@pytest.mark.parametrize("cls", PRUNERS)
def test_masks_stay_binary_and_pruned_weights_zero_through_sgd_then_squash_leaves_weight_times_mask(cls):
    model = tiny_model()
    pruner = cls(0.6)
    pruner.prepare(model)
    pruner.chosen = ["0", "2", "5"]
    pruner.delta = dict.fromkeys(pruner.chosen, 0.6)  # the evolutionary step: 0.6 of each chosen layer
    pruner.step()
    sgd_steps(model)
    masks = layer_masks(model)
    dense = {name: layer.parametrizations.weight.original.detach().clone()
             for name, layer in prunable_layers(model).items()}
    for name, layer in prunable_layers(model).items():
        assert bool(((masks[name] == 0) | (masks[name] == 1)).all())
        assert bool((layer.weight[masks[name] == 0] == 0).all())
    assert any(bool((dense[name][masks[name] == 0] != 0).any()) for name in masks)  # the dense weights did move
    assert pruner.squash_mask() is model
    for name, layer in prunable_layers(model).items():
        assert not hasattr(layer, "parametrizations") and isinstance(layer.weight, nn.Parameter)
        assert torch.equal(layer.weight.detach(), dense[name] * masks[name])
    assert sum((layer.weight == 0).sum().item() for layer in prunable_layers(model).values()) >= 0.6 * 708


@pytest.mark.parametrize("sparsity", [0.0, 0.37, 0.5, 0.999, 1.0])
def test_a_layer_step_prunes_exactly_its_count_whatever_the_ties(sparsity):
    """Every |w| tied (a layer of equal weights, and one all zero): the count is still ceil(sparsity * size), short
    of the size (a layer keeps a weight)."""
    model = tiny_model()
    with torch.no_grad():
        model[0].weight.fill_(0.25)
        model[2].weight.zero_()
        model[5].weight.copy_(torch.randint(-1, 2, model[5].weight.shape).float())
    pruner = MagnitudePruner(0.5, scope="layer")
    pruner.prepare(model)
    pruner.step(sparsity)
    for name, mask in masks_of(model).items():
        assert int((mask.mask == 0).sum()) == min(math.ceil(sparsity * mask.mask.numel() - 1e-9),
                                                  mask.mask.numel() - 1), name


def test_a_state_dict_saved_mid_run_resumes_to_the_same_masks(tmp_path):
    model = tiny_model()
    pruner = GradualMagnitudePruner(0.8, scope="layer")
    pruner.prepare(model)
    pruner.step(0.4)
    sgd_steps(model)
    torch.save(model.state_dict(), tmp_path / "mid.pt")
    pruner.step(0.8)
    resumed = tiny_model(seed=1)
    other = GradualMagnitudePruner(0.8, scope="layer")
    other.prepare(resumed)
    resumed.load_state_dict(torch.load(tmp_path / "mid.pt", weights_only=True))
    other.step(0.8)
    assert all(torch.equal(keep, layer_masks(model)[name]) for name, keep in layer_masks(resumed).items())


def test_the_evolutionary_pruner_refuses_weights_under_another_parametrization():
    """It reads the dense weight and its gradient (eq. 10, 12), which a weight_norm layer does not have: prepare
    crashed in an AttributeError of torch's ParametrizationList."""
    from torch.nn.utils.parametrizations import weight_norm

    model = tiny_model()
    weight_norm(model[2])
    with pytest.raises(ValueError, match=r"layers: the weights of \['2'\] carry a parametrization other than"):
        EvolutionaryPruner(0.5).prepare(model)
    assert not masks_of(model)
    EvolutionaryPruner(0.5, layers=["0", "5"]).prepare(model)
