"""Gradual magnitude pruning (Zhu & Gupta 2017): cubic schedule values, monotone masks, exact final sparsity."""

from __future__ import annotations

import pytest
from test_prune_evolutionary import tiny_model, tiny_trainer

from unsparse.prune.gradual import GradualMagnitudePruner, cubic_sparsity
from unsparse.prune.masks import layer_sparsity, model_weighted_sparsity, prunable_layers, pruned_count
from unsparse.train import Trainer


def test_cubic_schedule_values():
    assert cubic_sparsity(0, 0.0, 0.8, start=1, frequency=1, steps=4) == 0.0
    assert cubic_sparsity(1, 0.1, 0.8, start=1, frequency=1, steps=4) == pytest.approx(0.1)
    assert cubic_sparsity(3, 0.0, 0.8, start=1, frequency=1, steps=4) == pytest.approx(0.8 - 0.8 * 0.5 ** 3)
    assert cubic_sparsity(5, 0.0, 0.8, start=1, frequency=1, steps=4) == pytest.approx(0.8)
    assert cubic_sparsity(50, 0.0, 0.8, start=1, frequency=1, steps=4) == pytest.approx(0.8)
    assert cubic_sparsity(7, 0.0, 0.8, start=0, frequency=10, steps=0) == 0.8
    values = [cubic_sparsity(t, 0.0, 0.9, start=0, frequency=2, steps=5) for t in range(12)]
    assert values == sorted(values)


def test_epochs_cover_schedule_and_fine_tune():
    assert GradualMagnitudePruner(start=1, frequency=2, pruning_steps=3, fine_tune_epochs=2).epochs(10) == 9
    assert GradualMagnitudePruner(unit="step", start=0, frequency=7, pruning_steps=3,
                                  fine_tune_epochs=1).epochs(10) == 4
    with pytest.raises(ValueError):
        GradualMagnitudePruner(unit="batch")


measured: list[float] = []


class MonotoneTrainer(Trainer):
    """Asserts after each optimizer step that pruned mask entries never come back, and records the model's
    weighted sparsity then (``measured``)."""

    def train_epoch(self, model, optimizer, after_step=None, desc="train"):
        def checked():
            previous = {name: layer.parametrizations.weight[0].mask.clone()
                        for name, layer in prunable_layers(model).items()}
            if after_step is not None:
                after_step()
            for name, layer in prunable_layers(model).items():
                mask = layer.parametrizations.weight[0].mask
                assert not ((previous[name] == 0) & (mask == 1)).any()
            measured.append(model_weighted_sparsity(model))

        return super().train_epoch(model, optimizer, checked, desc)


@pytest.mark.parametrize("unit", ["epoch", "step"])
def test_run_reaches_target_with_monotone_masks(tmp_path, unit):
    model = tiny_model()
    pruner = GradualMagnitudePruner(target=0.75, pruning_steps=3, frequency=1 if unit == "epoch" else 3, unit=unit,
                                    fine_tune_epochs=1, lr=0.05)
    measured.clear()
    trainer = tiny_trainer(MonotoneTrainer)
    result = pruner.run(model, trainer, tmp_path)
    assert model_weighted_sparsity(model) == pytest.approx(0.75, abs=1e-3)
    assert [entry["iteration"] for entry in result.history] == list(range(1, len(result.history) + 1))
    steps = len(trainer.loaders["train"])
    total = sum(layer.weight.numel() for layer in prunable_layers(model).values())
    for entry in result.history:  # what the masks held at the epoch's end, up to whole weights per layer
        assert entry["weighted_sparsity"] == pytest.approx(measured[entry["iteration"] * steps - 1], abs=1 / total)
    assert {"iteration", "weighted_sparsity", "val_score", "val_top1"} <= set(result.history[0])
    # the last pruning step falls in epoch 3 (epochs) or 9 // steps + 1 (steps); the epochs after it fine-tune
    last = 3 if unit == "epoch" else -(-9 // steps)
    assert [entry["phase"] for entry in result.history] == (
        ["prune"] * last + ["fine_tune"] * (len(result.history) - last))


def test_layer_targets_give_each_layer_its_own_final_sparsity_along_one_schedule(tmp_path):
    targets = {"0": 0.25, "2": 0.5, "5": 0.9}
    pruner = GradualMagnitudePruner(target=0.8, scope="layer", layer_targets=targets, pruning_steps=2,
                                    fine_tune_epochs=1, lr=0.05)
    model = tiny_model()
    pruner.prepare(model)
    pruner.step(0.4)
    halfway = layer_sparsity(model)
    assert halfway == {name: pytest.approx(pruned_count(value / 2, size) / size)
                       for (name, value), size in zip(targets.items(), pruner.layer_sizes().values(), strict=True)}
    pruner.run(tiny_model(), tiny_trainer(MonotoneTrainer), tmp_path)
    final = layer_sparsity(pruner.model)
    assert final == {name: pytest.approx(pruned_count(value, size) / size)
                     for (name, value), size in zip(targets.items(), pruner.layer_sizes().values(), strict=True)}


def test_layer_targets_are_validated():
    with pytest.raises(ValueError, match="layer_targets"):
        GradualMagnitudePruner(target=0.8, layer_targets={"0": 0.5})
    with pytest.raises(ValueError, match="layer_targets"):
        GradualMagnitudePruner(target=0.8, scope="layer", layer_targets={"0": 1.0})
    pruner = GradualMagnitudePruner(target=0.8, scope="layer", layer_targets={"missing": 0.5})
    with pytest.raises(ValueError, match=r"layer_targets: \['missing'\] are not masked"):
        pruner.prepare(tiny_model())


def test_a_gradual_run_refuses_the_checkpoint_of_another_schedule(tmp_path):
    GradualMagnitudePruner(target=0.5, pruning_steps=2, fine_tune_epochs=0).run(tiny_model(), tiny_trainer(), tmp_path)
    with pytest.raises(ValueError, match=r"gradual.pt: written by a run with other settings \(pruning_steps: 2 there"):
        GradualMagnitudePruner(target=0.5, pruning_steps=3, fine_tune_epochs=0).run(tiny_model(), tiny_trainer(),
                                                                                   tmp_path)


def test_a_gradual_checkpoint_that_records_no_identity_is_refused(tmp_path):
    """Written before the pruners recorded their settings, such a checkpoint resumed unchecked; its pruning steps
    would have been counted from another run's epochs."""
    from unsparse.train import load_checkpoint, save_checkpoint

    GradualMagnitudePruner(target=0.5, pruning_steps=2, fine_tune_epochs=0).run(tiny_model(), tiny_trainer(), tmp_path)
    state = load_checkpoint(tmp_path / "gradual.pt")
    del state["identity"]
    save_checkpoint(tmp_path / "gradual.pt", state)
    with pytest.raises(ValueError, match=r"gradual.pt: records no 'identity' .*start the run in a new folder"):
        GradualMagnitudePruner(target=0.5, pruning_steps=2, fine_tune_epochs=0).run(tiny_model(), tiny_trainer(),
                                                                                   tmp_path)


@pytest.mark.parametrize("method", ["magnitude", "gradual"])
def test_wall_time_after_a_resume_counts_the_epochs_of_the_interrupted_process(tmp_path, interrupt_at_epoch,
                                                                                method, monkeypatch):
    """A resumed run reported only its own process's seconds (0.04 s against 1.0 s uninterrupted, in a user test);
    the evolutionary pruner already summed its iterations over processes. On a clock that only training epochs move
    (0.2 s each), the resumed run's figure is exactly its three epochs: two before the interruption, one after."""
    from types import SimpleNamespace

    import unsparse.prune.gradual
    import unsparse.prune.magnitude
    import unsparse.train
    from unsparse.prune.magnitude import MagnitudePruner

    clock = SimpleNamespace(seconds=0.0)
    for module in (unsparse.train, unsparse.prune.gradual, unsparse.prune.magnitude):  # each reads perf_counter
        monkeypatch.setattr(module, "time", SimpleNamespace(perf_counter=lambda: clock.seconds))

    def slow_trainer() -> Trainer:
        trainer = tiny_trainer()
        train_epoch = trainer.train_epoch

        def slow(*args, **kwargs):
            clock.seconds += 0.2
            return train_epoch(*args, **kwargs)
        trainer.train_epoch = slow
        return trainer

    def pruner():
        if method == "magnitude":
            return MagnitudePruner(0.5, fine_tune_epochs=3)
        return GradualMagnitudePruner(target=0.5, pruning_steps=1, fine_tune_epochs=2)

    trainer = slow_trainer()
    interrupt_at_epoch(trainer, 3)
    with pytest.raises(KeyboardInterrupt):
        pruner().run(tiny_model(), trainer, tmp_path)
    resumed_at = clock.seconds
    resumed = pruner().run(tiny_model(), slow_trainer(), tmp_path)
    assert clock.seconds - resumed_at == pytest.approx(0.2)  # the resumed process trained one epoch
    assert resumed.wall_time_s == pytest.approx(3 * 0.2)


def test_checking_the_settings_keeps_the_values_a_checkpoint_records():
    """``Pruner.identity`` records the settings as given; the type checks must not turn ``lr: 1`` into ``1.0``, or a
    run started before them could not resume."""
    import json

    pruner = GradualMagnitudePruner(target=0.8, scope="layer", lr=1, layer_targets={7.0: 1 / 2})
    identity = json.loads(pruner.identity())
    assert type(identity["lr"]) is int and identity["layer_targets"] == {"7.0": 0.5}


def test_one_shot_magnitude_history_gives_each_fine_tuning_epoch_its_sparsity(tmp_path):
    """Its history was the trainer's raw epochs: no weighted sparsity or phase, which a result's history promises."""
    from unsparse.prune.magnitude import MagnitudePruner

    result = MagnitudePruner(0.6, fine_tune_epochs=2, lr=0.05).run(tiny_model(), tiny_trainer(), tmp_path)
    assert [(entry["phase"], entry["iteration"]) for entry in result.history] == [("fine_tune", 1), ("fine_tune", 2)]
    assert all(entry["weighted_sparsity"] == result.masked_weighted_sparsity for entry in result.history)
    assert {"val_score", "val_top1", "val_loss"} <= set(result.history[0])
