"""Evolutionary pruner (paper 004 §3.1, Alg. 2): mask operations, ranked list, invariants, exact resume."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from unsparse.prune import evolutionary as evo
from unsparse.prune.base import metric_score
from unsparse.prune.evolution import crossover_masks, importance, resize_mask, share
from unsparse.prune.evolutionary import EvolutionaryPruner
from unsparse.prune.masks import (
    WeightMask,
    dense_weight,
    model_weighted_sparsity,
    prunable_layers,
    straight_through,
    threshold_mask,
    weighted_sparsity,
)
from unsparse.prune.ranked_list import RankedList, Solution
from unsparse.train import Trainer


def tiny_model(seed: int = 0, dropout: float = 0.0) -> nn.Module:
    """With ``dropout`` the training steps draw from torch's global generator, which a resume must restore."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Conv2d(4, 8, 3), nn.ReLU(), nn.Flatten(),
                         *([nn.Dropout(dropout)] if dropout else []), nn.Linear(8 * 4 * 4, 3))


def tiny_trainer(cls: type[Trainer] = Trainer) -> Trainer:
    data = torch.Generator().manual_seed(1)
    images, labels = torch.randn(96, 1, 8, 8, generator=data), torch.randint(0, 3, (96,), generator=data)
    loaders = {"train": DataLoader(TensorDataset(images[:64], labels[:64]), batch_size=16, shuffle=True,
                                   generator=torch.Generator().manual_seed(2)),
               "val": DataLoader(TensorDataset(images[64:], labels[64:]), batch_size=32),
               "test": DataLoader(TensorDataset(images[64:], labels[64:]), batch_size=32)}
    return cls(loaders, lr=0.05, progress=False)


def pruner(**kwargs) -> EvolutionaryPruner:
    settings = {"target": 0.7, "iterations": 6, "batches_per_iteration": 2, "unit_step": 0.2, "fine_tune_epochs": 1,
                "seed": 3}
    return EvolutionaryPruner(**{**settings, **kwargs})


def test_weighted_sparsity_is_size_weighted_mean():
    assert weighted_sparsity({"a": 0.5, "b": 0.0}, {"a": 100, "b": 300}) == pytest.approx(0.125)
    model = tiny_model()
    layers = prunable_layers(model)
    with torch.no_grad():
        layers["0"].weight[:2] = 0
    zeros = sum(int((layer.weight == 0).sum()) for layer in layers.values())
    total = sum(layer.weight.numel() for layer in layers.values())
    assert model_weighted_sparsity(model) == pytest.approx(zeros / total)
    with pytest.raises(ValueError):
        weighted_sparsity({"a": 0.5}, {"b": 3})


@pytest.mark.parametrize("sparsity", [0.0, 0.1, 0.37, 0.5, 0.99, 1.0])
def test_threshold_hits_sparsity_exactly_even_with_ties(sparsity):
    for values in (torch.rand(7, 5, 3), torch.ones(7, 5, 3)):
        keep = threshold_mask(values, sparsity)
        assert keep.shape == values.shape and keep.dtype == torch.bool
        assert int((~keep).sum()) == math.ceil(sparsity * values.numel() - 1e-9)


def test_resize_mask_grows_and_shrinks_monotonically():
    generator = torch.Generator().manual_seed(0)
    score = torch.rand(10, 10, generator=generator)
    keep = threshold_mask(torch.rand(10, 10, generator=generator), 0.3)
    sparser = resize_mask(keep, score, 55)
    assert int((~sparser).sum()) == 55 and not (sparser & ~keep).any()
    kept_scores = score[keep & ~sparser]
    assert kept_scores.max() <= score[sparser].min()
    denser = resize_mask(sparser, score, 20)
    assert int((~denser).sum()) == 20 and not (sparser & ~denser).any()
    with pytest.raises(ValueError):
        resize_mask(keep, score, 101)


def test_resize_mask_with_regrow_thresholds_every_entry():
    """Eq. 13-14 over all entries: the ``pruned`` lowest scores are zero whichever side they were on, so a pruned
    entry scoring above kept ones comes back, growing or shrinking."""
    score = torch.tensor([0.5, 0.1, 0.9, 0.3, 0.7, 0.2])
    keep = torch.tensor([True, True, False, True, True, False])
    for pruned in (1, 2, 3, 4):
        regrown = resize_mask(keep, score, pruned, regrow=True)
        assert int((~regrown).sum()) == pruned
        assert score[regrown].min() > score[~regrown].max()
    assert bool(resize_mask(keep, score, 3, regrow=True)[2])  # pruned, scores highest: back
    assert not bool(resize_mask(keep, score, 3)[2])  # without regrow a growth keeps it pruned


def test_straight_through_mask_passes_the_dense_gradient_with_the_masked_value():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(4, 5, generator=generator, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(4, 5, generator=generator, dtype=torch.float64)
    mask = WeightMask(weight)
    mask.set(torch.rand(4, 5, generator=generator) < 0.5)
    with straight_through([mask]):
        through = mask(weight)
        (through * upstream).sum().backward()
    assert not mask.straight_through
    assert torch.equal(through.detach(), weight.detach() * mask.mask)
    assert torch.equal(weight.grad, upstream)
    weight.grad = None
    (mask(weight) * upstream).sum().backward()
    assert torch.equal(weight.grad, upstream * mask.mask)


def test_importance_weights_gradient_statistics():
    weight, grad = torch.tensor([-1.0, 0.5, 0.0]), torch.tensor([2.0, -10.0, 3.0])
    assert torch.equal(importance(weight, grad, 0.1), torch.tensor([1.2, 1.5, 0.3]))


def solution(score: float, iteration: int) -> Solution:
    return Solution.from_masks(score, iteration, 0.0, {"a": torch.ones(2, dtype=torch.bool)})


def test_ranked_list_keeps_best_length_sorted():
    ranked = RankedList(4)
    scores = [3.0, 9.0, 1.0, 7.0, 5.0, 9.0, 2.0, 8.0]
    entered = [ranked.offer(solution(score, i)) for i, score in enumerate(scores)]
    assert [s.score for s in ranked.solutions] == [9.0, 9.0, 8.0, 7.0]
    assert [s.iteration for s in ranked.solutions][:2] == [1, 5]
    assert entered == [True, True, True, True, True, True, False, True]
    assert not ranked.accepts(7.0) and ranked.accepts(7.5)
    assert not ranked.accepts(math.inf) and not ranked.accepts(math.nan)
    restored = RankedList(4)
    restored.load_state(ranked.state())
    assert [(s.score, s.iteration) for s in restored.solutions] == [(s.score, s.iteration) for s in ranked.solutions]
    old_format = [{"score": 1.0, "iteration": 0, "weighted_sparsity": 0.0, "masks": {}, "state": {}}]
    with pytest.raises(ValueError, match="ranked: checkpoint entry has fields"):
        restored.load_state(old_format)


def test_a_nan_score_does_not_block_the_ranked_list():
    """NaN compares false with everything: once in a list it would stay last, and no later solution could beat it."""
    ranked = RankedList(2)
    assert [ranked.offer(solution(score, i)) for i, score in enumerate([1.0, math.nan, 5.0, 6.0])] == \
        [True, False, True, True]
    assert [s.score for s in ranked.solutions] == [6.0, 5.0]


def test_relative_change_treats_a_diverged_score_as_the_worst():
    assert evo.relative_change(90.0, 100.0) == pytest.approx(-0.1)
    assert evo.relative_change(-math.inf, 100.0) == -math.inf
    assert evo.relative_change(90.0, -math.inf) == 0.0
    assert metric_score({"mse": math.nan}) == -math.inf and metric_score({"top1": math.nan}) == -math.inf


def test_solution_keeps_masks_bit_packed_and_returns_them_unchanged():
    generator = torch.Generator().manual_seed(0)
    masks = {"odd": torch.rand(3, 5, 7, generator=generator) < 0.3, "ones": torch.ones(9, dtype=torch.bool),
             "zeros": torch.zeros(4, 2), "float": (torch.rand(2, 3, 3, 3, generator=generator) < 0.5).float()}
    kept = Solution.from_masks(1.0, 3, 0.5, masks)
    assert {name: bits.numel() for name, bits in kept.packed_masks.items()} == {
        "odd": 14, "ones": 2, "zeros": 1, "float": 7}
    for name, keep in kept.masks().items():
        assert keep.dtype == torch.bool and torch.equal(keep, masks[name].bool())


def test_crossover_copies_named_layers_only():
    current = {"a": torch.ones(3, 3, dtype=torch.bool), "b": torch.ones(4, dtype=torch.bool)}
    donor = {"a": torch.eye(3, dtype=torch.bool), "b": torch.zeros(4, dtype=torch.bool)}
    crossed = crossover_masks(current, donor, ["a"])
    assert torch.equal(crossed["a"], donor["a"]) and crossed["a"] is not donor["a"]
    assert torch.equal(crossed["b"], current["b"])
    with pytest.raises(ValueError):
        crossover_masks(current, {"a": torch.ones(2, dtype=torch.bool)}, ["a"])


def prepared(**kwargs) -> EvolutionaryPruner:
    result = pruner(**kwargs)
    result.prepare(tiny_model())
    return result


def test_step_prunes_each_chosen_layer_by_its_delta_and_stops_at_target():
    p = prepared(target=0.9)
    sizes = p.layer_sizes()
    p.chosen, p.delta = ["0", "2"], {"0": 0.25, "2": 0.5, "5": 0.1}
    p.step()
    zeros = p.zero_counts()
    assert zeros == {"0": math.ceil(0.25 * sizes["0"]), "2": math.ceil(0.5 * sizes["2"]), "5": 0}
    p.chosen, p.delta = ["0", "2", "5"], dict.fromkeys(sizes, 0.99)
    p.step()
    assert sum(p.zero_counts().values()) == p.target_zeros() == math.ceil(0.9 * sum(sizes.values()))
    assert p.mask_weighted_sparsity() >= 0.9


def test_a_step_below_half_a_weight_still_reaches_its_sparsity():
    """Eq. 13: the layer goes from s_l to at least s_l + Δ_l, so a 36-weight layer with Δ = 0.01 loses one weight
    (rounding to nearest would leave it unpruned for ever)."""
    p = prepared(target=0.9, min_step=0.001)
    p.chosen, p.delta = ["0"], {"0": 0.01, "2": 0.1, "5": 0.1}
    assert p.layer_sizes()["0"] == 36
    p.step()
    assert p.zero_counts()["0"] == 1


def test_settings_are_checked_before_a_run():
    with pytest.raises(ValueError, match="mutation_threshold"):
        pruner(mutation_threshold=1.5)
    with pytest.raises(ValueError, match="alpha"):
        pruner(alpha=-0.1)
    with pytest.raises(ValueError, match=r"unit_step: no step for the masked layers \['2', '5'\]"):
        prepared(unit_step={"0": 0.1})


def test_a_run_resumes_only_its_own_checkpoints(tmp_path):
    """Methods keep their checkpoints apart, and a run with other settings, or of the same settings on another
    model, refuses a folder's checkpoint instead of continuing someone else's model."""
    from unsparse.prune import MagnitudePruner

    settings = {"iterations": 50, "unit_step": 0.3, "layers_per_iteration": 3, "epsilon": math.inf, "beta": 0.0}
    MagnitudePruner(target=0.3, fine_tune_epochs=1).run(tiny_model(), tiny_trainer(), tmp_path)
    result = pruner(target=0.5, **settings).run(tiny_model(), tiny_trainer(), tmp_path)
    assert result.weighted_sparsity >= 0.5  # its own masks, not the magnitude run's 0.3
    with pytest.raises(ValueError, match=r"evolutionary.pt: written by a run with other settings \(target: 0.5"):
        pruner(target=0.6, **settings).run(tiny_model(), tiny_trainer(), tmp_path)
    with pytest.raises(ValueError, match=r"magnitude_finetune.pt: .*scope: 'global' there, 'layer' here"):
        MagnitudePruner(target=0.3, scope="layer", fine_tune_epochs=1).run(tiny_model(), tiny_trainer(), tmp_path)
    MagnitudePruner(target=0.3, fine_tune_epochs=1).run(tiny_model(), tiny_trainer(), tmp_path)  # its own model
    with pytest.raises(ValueError, match=r"magnitude_finetune.pt: .*input_model: '[0-9a-f]{16}' there, '[0-9a-f]{16}'"):
        MagnitudePruner(target=0.3, fine_tune_epochs=1).run(tiny_model(seed=1), tiny_trainer(), tmp_path)


def test_a_checkpoint_that_records_no_identity_is_refused(tmp_path):
    """Checkpoints written before the pruners recorded their settings resumed unchecked, whatever settings wrote
    them (a helper's find); they are refused before anything is loaded, naming the file."""
    from unsparse.train import load_checkpoint, save_checkpoint

    pruner(iterations=2).run(tiny_model(), tiny_trainer(), tmp_path)
    state = load_checkpoint(tmp_path / evo.CHECKPOINT)
    del state["identity"]
    save_checkpoint(tmp_path / evo.CHECKPOINT, state)
    with pytest.raises(ValueError, match=r"evolutionary.pt: records no 'identity' .*start the run in a new folder"):
        pruner(iterations=2).run(tiny_model(), tiny_trainer(), tmp_path)


def test_a_resume_with_another_kind_of_loader_generator_is_refused(tmp_path):
    """A checkpoint of a loader without a generator made torch fail on the state after the model was loaded, and
    one whose loader had a generator resumed a loader without one in another order, silently."""
    from unsparse.train import load_checkpoint, save_checkpoint

    pruner(iterations=2).run(tiny_model(), tiny_trainer(), tmp_path)
    state = load_checkpoint(tmp_path / evo.CHECKPOINT)
    state["loader_rng"] = torch.empty(0)
    save_checkpoint(tmp_path / evo.CHECKPOINT, state)
    with pytest.raises(ValueError, match=r"evolutionary.pt: loader_rng: the train loader of the run that wrote it "
                                         r"had no generator"):
        pruner(iterations=2).run(tiny_model(), tiny_trainer(), tmp_path)


def test_mutation_lowers_sparsity_of_previous_layers_with_valid_masks():
    p = prepared()
    p.chosen, p.delta = list(p.masks), dict.fromkeys(p.masks, 0.5)
    p.step()
    before = {name: mask.mask.clone() for name, mask in p.masks.items()}
    p.pending = ["2"]
    p.mutate()
    for name, mask in p.masks.items():
        assert mask.mask.shape == before[name].shape
        assert set(mask.mask.unique().tolist()) <= {0.0, 1.0}
        assert not (before[name].bool() & ~mask.mask.bool()).any()
    assert p.zero_counts()["0"] == int((before["0"] == 0).sum())
    dropped = int((before["2"] == 0).sum()) - p.zero_counts()["2"]
    assert 1 <= dropped <= math.ceil(0.5 * p.layer_sizes()["2"])
    revived = before["2"].bool() != p.masks["2"].mask.bool()
    still_pruned = ~p.masks["2"].mask.bool()
    score = importance(prunable_layers(p._prepared())["2"].parametrizations.weight.original, p.grad_stats["2"],
                       p.alpha)
    assert score[revived].min() >= score[still_pruned].max()  # eq. 15-16 revive the most important


def test_crossover_never_copies_the_masks_being_repaired():
    """The solution ranked in the current iteration holds the masks that stalled; a crossover with it would
    change nothing, so the donor comes from an earlier iteration."""
    p = prepared()
    p.iteration, p.pending = 4, ["5"]
    current = {name: m.mask.bool() for name, m in p.masks.items()}
    p.ranked.offer(Solution.from_masks(9.0, 4, 0.0, current))
    assert p.ranked.candidates(before_iteration=4) == []
    with pytest.raises(IndexError, match="before iteration 4"):
        p.crossover()
    p.ranked.offer(Solution.from_masks(1.0, 2, 0.0, {name: torch.zeros_like(keep) for name, keep in current.items()}))
    assert all(p.crossover() == 2 for _ in range(8))


def test_crossover_takes_masks_from_ranked_solution():
    p = prepared()
    p.ranked.offer(Solution.from_masks(1.0, 0, 0.0, {name: torch.zeros_like(m.mask, dtype=torch.bool)
                                                      for name, m in p.masks.items()}))
    p.iteration, p.pending = 1, ["5"]
    assert p.crossover() == 0
    assert p.zero_counts()["5"] == p.layer_sizes()["5"] and p.zero_counts()["0"] == 0


class CheckingTrainer(Trainer):
    """Asserts that no optimizer step changes a mask (weight decay or momentum would, were a mask a parameter):
    the effective weight ``original * mask`` is then zero wherever the mask is."""

    def train_epoch(self, model, optimizer, after_step=None, desc="train"):
        masks = current_masks(model)

        def checked():
            if after_step is not None:
                after_step()
            assert all(torch.equal(masks[name], mask) for name, mask in current_masks(model).items())

        return super().train_epoch(model, optimizer, checked, desc)


def current_masks(model: nn.Module) -> dict[str, torch.Tensor]:
    masks = {name: layer.parametrizations.weight[0].mask.clone() for name, layer in prunable_layers(model).items()}
    assert all(set(mask.unique().tolist()) <= {0.0, 1.0} for mask in masks.values())
    return masks


def assert_pruned_zero(model: nn.Module) -> None:
    """Squash a copy's masks into its weights: the dense weights are zero exactly where the masks were."""
    import copy

    from unsparse.prune.masks import remove_masks

    masks, squashed = current_masks(model), copy.deepcopy(model)
    remove_masks(squashed)
    for name, layer in prunable_layers(squashed).items():
        assert not hasattr(layer, "parametrizations")
        assert torch.all(layer.weight[masks[name] == 0] == 0)


def test_pruned_weights_stay_zero_through_training_and_rewinds(tmp_path):
    model = tiny_model()
    result = pruner(epsilon=-math.inf, iterations=6, target=0.95).run(model, tiny_trainer(CheckingTrainer), tmp_path)
    events = [event for entry in result.history if entry["phase"] == "prune" for event in entry["events"]]
    assert "rewind" in events and any(e == "mutation" or e.startswith("crossover") for e in events)
    iterations = [entry for entry in result.history if entry["phase"] == "prune" and entry["iteration"] > 0]
    assert all(entry["revived"] >= 1 for entry in iterations if "mutation" in entry["events"])
    assert all(entry["revived"] == 0 for entry in iterations if entry["events"][-1:] != ["rewind"])
    assert_pruned_zero(model)
    for entry in result.history:
        assert {"iteration", "weighted_sparsity", "val_score", "val_top1"} <= set(entry)
    lines = (tmp_path / evo.LOG).read_text().splitlines()
    assert len(lines) == sum(entry["phase"] == "prune" for entry in result.history)


class ZeroCheckingTrainer(Trainer):
    """Asserts that after every optimizer step of the iterations the dense weights are 0 under the masks (eq. 9 as
    ``mask_application="after_step"`` reads it) and that the gradient reached some pruned entries."""

    pruned_gradients = 0

    def train_epoch(self, model, optimizer, after_step=None, desc="train"):
        layers = prunable_layers(model)

        def checked():
            ZeroCheckingTrainer.pruned_gradients += sum(
                int((dense_weight(layer).grad[current_masks(model)[name] == 0] != 0).sum())
                for name, layer in layers.items())
            after_step()
            for name, layer in layers.items():
                assert torch.all(dense_weight(layer)[current_masks(model)[name] == 0] == 0)

        return super().train_epoch(model, optimizer, checked if "iteration" in desc else after_step, desc)


def test_after_step_zeroes_pruned_weights_gathers_their_gradients_and_regrows(tmp_path):
    ZeroCheckingTrainer.pruned_gradients = 0
    model = tiny_model()
    p = pruner(mask_application="after_step", epsilon=-math.inf, iterations=6, target=0.95)
    result = p.run(model, tiny_trainer(ZeroCheckingTrainer), tmp_path)
    assert ZeroCheckingTrainer.pruned_gradients > 0
    assert any(entry["events"] for entry in result.history if entry["phase"] == "prune")
    assert_pruned_zero(model)
    keep = {name: mask.mask.bool() for name, mask in p.masks.items()}
    assert any(bool((p.grad_stats[name][~kept] != 0).any()) for name, kept in keep.items())
    name = next(name for name, kept in keep.items() if (~kept).any())
    revived = int((~keep[name]).flatten().nonzero()[0])
    p.grad_stats[name].view(-1)[revived] = 1e6  # a pruned weight with a huge gradient statistic comes back
    p.chosen, p.target = [name], 0.99
    p.step()
    assert bool(p.masks[name].mask.view(-1)[revived]) and p.zero_counts()[name] > int((~keep[name]).sum())


def test_rewind_restores_the_weights_and_keeps_the_repaired_masks():
    """A stall (line 25) mutates the masks, then rewinds (line 34): parameters and buffers return to their values
    before the iteration's training, while the masks stay the mutated ones, not the state dict's older copy."""
    p = pruner(epsilon=-math.inf, mutation_threshold=1.0)
    model = tiny_model()
    p.prepare(model)
    trainer = tiny_trainer()
    optimizer = trainer.optimizer(model, p.lr)
    p._begin(trainer)
    p._iterate(trainer, optimizer)  # prunes its chosen layers: something pending for the stall below
    assert p.pending
    masks_before = current_masks(model)
    weights = {key: value.clone() for key, value in model.state_dict().items() if "mask" not in key}
    mutated = {}
    mutate = p.mutate

    def recording_mutate():
        mutate()
        mutated.update(current_masks(model))

    p.mutate = recording_mutate
    entry = p._iterate(trainer, optimizer)
    assert entry["events"][-2:] == ["mutation", "rewind"]
    assert all(torch.equal(value, weights[key]) for key, value in model.state_dict().items() if "mask" not in key)
    assert any(not torch.equal(mutated[name], masks_before[name]) for name in mutated)
    assert all(torch.equal(mask, mutated[name]) for name, mask in current_masks(model).items())


def test_a_diverged_iteration_stalls_and_stays_out_of_the_ranked_list(tmp_path):
    """A NaN validation score (a diverged model) is the worst outcome: a stall with ``Δ_l`` at ``min_step``, a
    repair and a rewind, nothing ranked; the next change is measured as 0 against it, not NaN."""

    class DivergingTrainer(Trainer):
        calls = 0

        def evaluate(self, model, split="val", desc=None):
            metrics = super().evaluate(model, split, desc)
            DivergingTrainer.calls += 1
            return {**metrics, "top1": math.nan} if DivergingTrainer.calls == 3 else metrics

    p = pruner(iterations=5, target=0.95, epsilon=0.5)
    result = p.run(tiny_model(), tiny_trainer(DivergingTrainer), tmp_path)
    diverged = result.history[2]
    assert diverged["iteration"] == 2 and diverged["relative_change"] == -math.inf
    assert "ranked" not in diverged["events"] and diverged["events"][-1] == "rewind"
    hit = [name for name, value in diverged["sensitivity"].items() if value == -math.inf]
    assert hit and all(diverged["delta"][name] == p.min_step for name in hit)
    assert result.history[3]["relative_change"] == 0.0
    assert all(math.isfinite(solution.score) for solution in p.ranked.solutions)


def test_reaches_target_then_fine_tunes(tmp_path):
    model = tiny_model()
    result = pruner(target=0.5, iterations=50, unit_step=0.3, layers_per_iteration=3, epsilon=math.inf, beta=0.0).run(
        model, tiny_trainer(), tmp_path)
    assert result.history[-2]["iteration"] < 50
    assert result.weighted_sparsity >= 0.5
    assert result.history[-1]["phase"] == "fine_tune"
    assert result.method == "evolutionary"


@pytest.mark.parametrize("mask_application", ["forward", "after_step"])
def test_resume_after_crash_equals_uninterrupted_run(tmp_path, crash_at_save, mask_application):
    settings = {"epsilon": 0.0, "iterations": 7, "target": 0.95, "mask_application": mask_application}
    reference_model = tiny_model(dropout=0.3)
    reference = pruner(**settings).run(reference_model, tiny_trainer(), tmp_path / "a")

    with crash_at_save(evo, 4):
        pruner(**settings).run(tiny_model(dropout=0.3), tiny_trainer(), tmp_path / "b")
    resumed_model = tiny_model(dropout=0.3)
    torch.manual_seed(12345)  # a fresh process's generator state; the resume must restore the checkpoint's
    resumed = pruner(**settings).run(resumed_model, tiny_trainer(), tmp_path / "b")

    reference_state, resumed_state = reference_model.state_dict(), resumed_model.state_dict()
    assert reference_state.keys() == resumed_state.keys()
    assert all(torch.equal(reference_state[key], resumed_state[key]) for key in reference_state)
    assert resumed.history == reference.history
    assert (tmp_path / "b" / evo.LOG).read_bytes() == (tmp_path / "a" / evo.LOG).read_bytes()


@pytest.mark.parametrize("damage", ["shorter", "missing", "longer"])
def test_a_resume_sets_the_log_to_the_checkpoints_history(tmp_path, crash_at_save, caplog, damage):
    """The log is appended without fsync and the checkpoint then renamed; after a crash of the machine the log can
    be shorter than the checkpoint's history, and truncate() padded it with NUL bytes. A longer log (lines of an
    iteration the checkpoint does not hold) is cut back, as before, without a warning."""
    settings = {"epsilon": 0.0, "iterations": 5, "target": 0.95}
    pruner(**settings).run(tiny_model(), tiny_trainer(), tmp_path / "a")
    with crash_at_save(evo, 4):
        pruner(**settings).run(tiny_model(), tiny_trainer(), tmp_path / "b")
    log_path = tmp_path / "b" / evo.LOG
    if damage == "shorter":
        log_path.write_bytes(log_path.read_bytes()[:40])
    elif damage == "missing":
        log_path.unlink()
    else:
        assert len(log_path.read_text().splitlines()) == 4  # the iteration whose checkpoint was not written
    with caplog.at_level("WARNING", logger="unsparse.prune.evolutionary"):
        pruner(**settings).run(tiny_model(), tiny_trainer(), tmp_path / "b")
    assert log_path.read_bytes() == (tmp_path / "a" / evo.LOG).read_bytes()
    assert ("rebuilt from the checkpoint's history (3 entries)" in caplog.text) == (damage != "longer")


def test_share_is_proportional_capped_and_falls_back_to_room():
    assert share(10, {"a": 1.0, "b": 4.0}, {"a": 100, "b": 100}) == {"a": 2, "b": 8}
    assert share(10, {"a": 1.0, "b": 4.0}, {"a": 100, "b": 3}) == {"a": 7, "b": 3}
    assert share(10, {"a": 1.0, "b": 0.0}, {"a": 4, "b": 100}) == {"a": 4, "b": 6}
    assert share(50, {"a": 1.0}, {"a": 4, "b": 5}) == {"a": 4, "b": 5}
    assert share(0, {"a": 1.0}, {"a": 4}) == {"a": 0}
    with pytest.raises(ValueError):
        share(-1, {}, {})


def test_floor_raises_a_small_step_to_the_deadline_pace():
    p = prepared(target=0.8, iterations=10, deadline=0.5, unit_step=0.005, min_step=0.005)
    sizes = p.layer_sizes()
    p.chosen = ["2", "5"]
    floor = p.floor_zeros()
    assert floor == math.ceil(p.target_zeros() / 5)
    p.step()
    zeros = p.zero_counts()
    assert sum(zeros.values()) >= floor and zeros["0"] == 0
    assert all(zeros[name] <= math.floor(0.99 * sizes[name]) for name in zeros)
    assert prepared(target=0.8, iterations=10).floor_zeros() == 0


def one_step_to_the_deadline(max_step: float):
    """A pruner whose floor asks for the whole target in one step, having chosen only layer "0"."""
    p = prepared(target=0.8, iterations=10, deadline=0.1, unit_step=0.1, max_step=max_step)
    p.chosen = ["0"]
    p.step()
    return p, p.layer_sizes(), p.zero_counts()


def test_floor_beyond_the_chosen_layers_room_spills_over_all_layers_by_room():
    p, sizes, zeros = one_step_to_the_deadline(max_step=1.0)
    assert zeros["0"] == math.floor(0.99 * sizes["0"])
    assert sum(zeros.values()) == p.target_zeros()
    assert zeros["5"] > zeros["2"] > 0


def test_floor_spill_over_grows_no_layer_by_more_than_max_step():
    p, sizes, zeros = one_step_to_the_deadline(max_step=0.2)
    assert all(zeros[name] <= math.ceil(0.2 * sizes[name]) for name in zeros)
    assert 0 < sum(zeros.values()) < p.target_zeros()


def test_deadline_reaches_target_within_budget_where_tiny_steps_do_not(tmp_path):
    settings = {"target": 0.8, "iterations": 8, "unit_step": 0.005, "min_step": 0.005, "epsilon": math.inf,
                "layers_per_iteration": 2, "fine_tune_epochs": 0}
    crawling = pruner(**settings).run(tiny_model(), tiny_trainer(), tmp_path / "a")
    assert crawling.weighted_sparsity < 0.1
    paced = pruner(**settings, deadline=0.5).run(tiny_model(), tiny_trainer(), tmp_path / "b")
    assert paced.weighted_sparsity >= 0.8
    assert max(entry["iteration"] for entry in paced.history) <= 4


def test_deadline_reaches_target_despite_stalls(tmp_path):
    result = pruner(target=0.8, iterations=12, deadline=0.5, epsilon=0.0, unit_step=0.05,
                    fine_tune_epochs=0).run(tiny_model(), tiny_trainer(), tmp_path)
    assert result.weighted_sparsity >= 0.8
    stalls = [entry for entry in result.history if "rewind" in entry.get("events", [])]
    assert stalls and all(entry["next_weighted_sparsity"] <= entry["weighted_sparsity"] for entry in stalls)


def test_initial_sparsity_prunes_each_layer_by_magnitude(tmp_path):
    model = tiny_model()
    dense = {name: layer.weight.detach().abs().clone() for name, layer in prunable_layers(model).items()}
    p = pruner(iterations=0, initial_sparsity=0.5, deadline=0.5, fine_tune_epochs=0)
    p.run(model, tiny_trainer(), tmp_path)
    for name, mask in p.masks.items():
        keep = mask.mask.bool()
        assert int((~keep).sum()) == round(0.5 * keep.numel())
        assert dense[name][~keep].max() <= dense[name][keep].min()


def test_crossover_donors_are_at_most_max_regress_below_current_masks():
    p = prepared(crossover_max_regress=0.05)
    p.chosen, p.delta = list(p.masks), dict.fromkeys(p.masks, 0.5)
    p.step()
    masks = {name: m.mask.bool() for name, m in p.masks.items()}
    p.ranked.offer(Solution.from_masks(9.0, 1, 0.0, {name: torch.ones_like(keep) for name, keep in masks.items()}))
    assert p.ranked.candidates(p.donor_floor()) == []
    p.iteration, p.pending = 3, ["5"]
    with pytest.raises(IndexError):
        p.crossover()
    p.ranked.offer(Solution.from_masks(1.0, 2, 0.46, masks))
    assert {p.crossover() for _ in range(5)} == {2}
    assert prepared().donor_floor() < 0


def test_rejects_bad_constants():
    with pytest.raises(ValueError):
        EvolutionaryPruner(min_step=0.3, max_step=0.2)
    with pytest.raises(ValueError):
        EvolutionaryPruner(target=1.0)
    with pytest.raises(ValueError):
        EvolutionaryPruner(layers_per_iteration=0)
    with pytest.raises(ValueError):
        EvolutionaryPruner(deadline=0.0)
    with pytest.raises(ValueError):
        EvolutionaryPruner(crossover_max_regress=-0.1)
    with pytest.raises(ValueError, match="mask_application"):
        EvolutionaryPruner(mask_application="backward")


def test_log_and_checkpoint_written(tmp_path: Path, caplog):
    with caplog.at_level("INFO", logger="unsparse.prune.evolutionary"):
        result = pruner(iterations=2, fine_tune_epochs=0).run(tiny_model(), tiny_trainer(), tmp_path)
    assert (tmp_path / evo.CHECKPOINT).exists()
    assert len((tmp_path / evo.LOG).read_text().splitlines()) == 3
    lines = [record.getMessage() for record in caplog.records if " iteration " in record.getMessage()]
    assert [line.split(":")[0] for line in lines] == ["evolutionary iteration 1", "evolutionary iteration 2"]
    assert f"weighted sparsity {result.history[2]['weighted_sparsity']:.4f}" in lines[1]


def test_iteration_batches_keep_the_train_loaders_collation_and_last_batch_setting():
    """The loader of ``batches_per_iteration`` random batches collates and drops a short last batch as the train
    loader does (both were lost: the iterations trained on default-collated batches)."""
    trainer = tiny_trainer()
    train = trainer.loaders["train"]
    seen = []

    def collate(samples):
        seen.append(len(samples))
        return torch.utils.data.default_collate(samples)

    trainer.loaders["train"] = DataLoader(train.dataset, batch_size=10, shuffle=True, drop_last=True,
                                          collate_fn=collate, generator=torch.Generator().manual_seed(2))
    batches = pruner(batches_per_iteration=3)._iteration_trainer(trainer).loaders["train"]
    assert len(list(batches)) == 3 and seen == [10, 10, 10] and batches.drop_last
