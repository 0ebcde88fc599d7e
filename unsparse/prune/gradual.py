"""Gradual magnitude pruning with the cubic schedule of Zhu & Gupta (2017), "To prune, or not to prune".

Sparsity rises from ``s_i`` to ``s_f`` over ``n`` pruning steps every ``Δt`` training steps from ``t0``:
``s_t = s_f + (s_i - s_f) * (1 - (t - t0) / (n Δt))^3``. At each pruning step the masks are recomputed by
magnitude of the masked weights (:meth:`MagnitudePruner.step`), so pruned weights stay pruned; training
continues with masks applied, and ``fine_tune_epochs`` epochs follow the last pruning step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from pathlib import Path

from torch import nn

from unsparse.prune.base import PruneResult, val_metrics
from unsparse.prune.magnitude import MagnitudePruner
from unsparse.settings import check_choice, check_integer, check_number
from unsparse.train import Trainer, check_resumable, fit_seconds, load_checkpoint

CHECKPOINT = "gradual.pt"
UNITS = ("epoch", "step")


def cubic_sparsity(t: float, initial: float, final: float, start: float, frequency: float, steps: int) -> float:
    """Zhu & Gupta (2017) eq. 1: ``s_f + (s_i - s_f)(1 - (t - t0)/(n Δt))^3``, held at ``s_f`` after the end.

    Args:
        t: training time (steps or epochs, same unit as ``start`` and ``frequency``).
        initial, final: ``s_i`` and ``s_f`` in ``[0, 1]``.
        start: ``t0``; before it the sparsity is 0 (no pruning yet).
        frequency: ``Δt`` (> 0).
        steps: ``n`` (>= 0; 0 prunes straight to ``final`` at ``t0``).
    """
    if t < start:
        return 0.0
    if steps == 0:
        return final
    progress = min((t - start) / (steps * frequency), 1.0)
    return final + (initial - final) * (1.0 - progress) ** 3


class GradualMagnitudePruner(MagnitudePruner):
    """Zhu & Gupta (2017) gradual pruning to ``target`` by magnitude, then fine-tuning.

    Args:
        target: ``s_f``, the final weighted sparsity (exact for ``scope="global"``).
        initial_sparsity: ``s_i``.
        start: ``t0`` in ``unit``s.
        frequency: ``Δt`` in ``unit``s.
        pruning_steps: ``n``.
        unit: ``"epoch"`` (prune at epoch boundaries) or ``"step"`` (after optimizer steps).
        scope: ``"global"`` (one magnitude threshold) or ``"layer"`` (each layer at ``s_t``, as in the paper).
        fine_tune_epochs: masked training epochs after the epoch of the last pruning step.
        lr: learning rate (None: the trainer's); cosine-annealed over the whole run.
        layers: layers to prune (default all prunable).
        layer_targets: with ``scope="layer"``, each named layer's ``s_f``; its schedule is the cubic one scaled by
            ``layer_targets[l] / target`` (:class:`MagnitudePruner`).

    Raises:
        ValueError: naming the setting: a bad unit, a schedule constant that is no integer in range (``start`` and
            ``pruning_steps`` >= 0, ``frequency`` >= 1), an ``initial_sparsity`` outside ``[0, target]``, or as
            :class:`MagnitudePruner`.
    """

    name = "gradual"
    history_axis = "epoch (pruning, then fine-tuning)"

    def __init__(self, target: float = 0.9, initial_sparsity: float = 0.0, start: int = 0, frequency: int = 1,
                 pruning_steps: int = 5, unit: str = "epoch", scope: str = "global", fine_tune_epochs: int = 3,
                 lr: float | None = None, layers: list[str] | None = None,
                 layer_targets: Mapping[str, float] | None = None) -> None:
        super().__init__(target, scope, fine_tune_epochs, lr, layers, layer_targets)
        check_choice(unit, UNITS, "unit")
        check_integer(start, "start", low=0)
        check_integer(frequency, "frequency")
        check_integer(pruning_steps, "pruning_steps", low=0)
        check_number(initial_sparsity, "initial_sparsity", lambda value: 0.0 <= value <= target,
                     f"in [0, target = {target}]")
        self.initial_sparsity, self.start, self.frequency = initial_sparsity, start, frequency
        self.pruning_steps, self.unit = pruning_steps, unit

    def sparsity_at(self, t: float) -> float:
        """The scheduled sparsity at time ``t`` (in ``unit``s)."""
        return cubic_sparsity(t, self.initial_sparsity, self.target, self.start, self.frequency,
                              self.pruning_steps)

    def epochs(self, steps_per_epoch: int) -> int:
        """Total training epochs: through the epoch of the last pruning step, plus ``fine_tune_epochs``."""
        end = self.start + self.pruning_steps * self.frequency
        return (end if self.unit == "epoch" else math.ceil(end / steps_per_epoch)) + self.fine_tune_epochs

    def run(self, model: nn.Module, trainer: Trainer, workdir: str | Path) -> PruneResult:
        """Masked training with the cubic schedule (checkpoint ``workdir/gradual.pt`` per epoch, exact resume of a
        run of the same settings: :meth:`~unsparse.prune.base.Pruner.identity`).

        Mutates ``model`` (masks stay attached).

        Returns:
            A :class:`PruneResult`; ``history`` has one entry per epoch with ``phase`` (``"prune"`` through the
            epoch of the last pruning step, then ``"fine_tune"``), ``iteration`` (the epoch),
            ``weighted_sparsity`` (the value of the last pruning step at or before the epoch's end: what the
            masks hold, up to the rounding to whole weights), ``val_score`` and ``val_top1`` or ``val_mse``.

        Raises:
            ~unsparse.train.CheckpointRefusedError: (a ``ValueError``) ``workdir/gradual.pt`` written by a run of
                other settings, or one this run cannot resume from otherwise (:meth:`~unsparse.train.Trainer.fit`).
        """
        started = time.perf_counter()
        checkpoint = Path(workdir) / CHECKPOINT
        self.prepare(model)
        steps_per_epoch = len(trainer.loaders["train"])
        scale = steps_per_epoch if self.unit == "epoch" else 1
        points = {(self.start + i * self.frequency) * scale for i in range(self.pruning_steps + 1)}
        state = {"history": []}
        if checkpoint.exists():
            state = load_checkpoint(checkpoint)
            check_resumable(checkpoint, state, self.identity())
        done = len(state["history"])
        counter = done * steps_per_epoch
        if counter == 0 and 0 in points:
            self.step(self.sparsity_at(0))

        def after_step() -> None:
            nonlocal counter
            counter += 1
            if counter in points:
                self.step(self.sparsity_at(counter / scale))

        setup_s = time.perf_counter() - started
        tuned = trainer.fit(model, self.epochs(steps_per_epoch), checkpoint, lr=self.lr, desc=self.name,
                            after_step=after_step, identity=self.identity())
        def reached(epoch: int) -> float:
            """The sparsity the last pruning step at or before ``epoch``'s end set (0 before the first): the
            masks change only at pruning points, so with ``unit="step"`` an epoch's end can lie between them."""
            done = [point for point in points if point <= epoch * steps_per_epoch]
            return self.sparsity_at(max(done) / scale) if done else 0.0

        last_pruned = math.ceil(max(points) / steps_per_epoch)  # the epoch of the last pruning step
        history = [{"phase": "prune" if entry["epoch"] <= last_pruned else "fine_tune", "iteration": entry["epoch"],
                    "weighted_sparsity": reached(entry["epoch"]), **val_metrics(entry)} for entry in tuned]
        return self.result(history, setup_s + fit_seconds(tuned))
