"""One-shot magnitude (L1 unstructured) pruning followed by masked fine-tuning.

The baseline of Han et al. (Deep Compression), as compared against in paper 004 Tables 1-4: keep the
weights of largest ``|w|``, either over the whole model at once (``scope="global"``, which reaches the
target weighted sparsity of eq. 7-8 exactly) or layer by layer (``scope="layer"``), each layer to the target
or to its own entry of ``layer_targets`` (a per-layer allocation, e.g. the one another pruner reached).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import time
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from unsparse.prune.base import Pruner, PruneResult, fine_tune_history, layer_mapping, optional_rate
from unsparse.prune.masks import lowest_mask, prunable_layers, pruned_count
from unsparse.settings import check_choice, check_integer
from unsparse.train import Trainer, fit_seconds

log = logging.getLogger(__name__)


class MagnitudePruner(Pruner):
    """Prune to ``target`` by ``|w|`` in one step, then fine-tune ``fine_tune_epochs`` epochs with masks on.

    Every masked layer keeps at least one weight, its largest ``|w|`` (:meth:`step`), so a layer (or a
    ``layer_targets`` entry) whose sparsity would empty it stops one weight short of it, with a warning.

    Args:
        target: weighted sparsity to reach.
        scope: ``"global"`` (one threshold over all masked layers) or ``"layer"`` (each layer to ``target``).
        fine_tune_epochs: masked training epochs after the step.
        lr: fine-tuning learning rate (None: the trainer's).
        layers: layers to prune (default all prunable).
        layer_targets: with ``scope="layer"``, final sparsity per layer name (layers not named get ``target``);
            a step to ``s`` puts layer ``l`` at ``layer_targets[l] * s / target``, so gradual schedules scale
            every layer's path alike. ``target`` is then both the final sparsity of the layers not named and the
            scale of those steps, not the model's weighted sparsity (eq. 7-8); :meth:`layer_goals` gives each
            layer's.

    Raises:
        ValueError: bad ``scope``; ``layer_targets`` with ``scope="global"``, with ``target`` 0, or with a value
            outside ``[0, 1)`` (its keys are read as strings: Hydra reads ``7.0`` as a number); a
            ``fine_tune_epochs`` that is no integer >= 0; an ``lr`` that is neither None nor > 0; as
            :class:`~unsparse.prune.base.Pruner`. (A ``target`` that cannot leave every masked layer a weight is
            refused by :meth:`check_layers`, which knows the layers' sizes.)
    """

    name = "magnitude"
    history_axis = "fine-tuning epoch"

    def __init__(self, target: float = 0.9, scope: str = "global", fine_tune_epochs: int = 3,
                 lr: float | None = None, layers: list[str] | None = None,
                 layer_targets: Mapping[str, float] | None = None) -> None:
        super().__init__(target, layers)
        check_choice(scope, ("global", "layer"), "scope")
        if layer_targets is not None and (scope != "layer" or target == 0.0):
            raise ValueError("layer_targets: needs scope='layer' and a target above 0")
        self.layer_targets = layer_mapping(layer_targets or {}, "layer_targets", lambda value: 0.0 <= value < 1.0,
                                           "in [0, 1) (a sparsity)")
        self.scope, self.fine_tune_epochs = scope, check_integer(fine_tune_epochs, "fine_tune_epochs", low=0)
        self.lr = optional_rate(lr, "lr")

    def layer_goals(self) -> dict[str, float] | None:
        """With ``scope="layer"`` each masked layer's own final sparsity (paper 004 §3.1, eq. 6): its entry in
        ``layer_targets``, else ``target``; a layer of no weights has nothing to reach and is left out. None with
        ``scope="global"``, whose ``target`` is the weighted sparsity of eq. 7-8.

        Raises:
            RuntimeError: as :meth:`~unsparse.prune.base.Pruner.layer_sizes`, where the pruner is not prepared.
        """
        if self.scope != "layer":
            return None
        return {name: self.layer_targets.get(name, self.target) for name, size in self.layer_sizes().items() if size}

    def named_layers(self) -> dict[str, list[str]]:
        """``layers`` and the names of ``layer_targets``."""
        return {**super().named_layers(), "layer_targets": list(self.layer_targets)}

    def check_layers(self, model: nn.Module) -> None:
        """:meth:`Pruner.check_layers`; and ``target`` must leave at least one weight per masked layer, which
        :meth:`step` keeps (a layer without weights would pass only its bias): at most ``(total - n) / total`` for
        ``n`` masked layers of ``total`` weights (a layer of no weights, which has none to keep, not counted in ``n``).

        Raises:
            ValueError: as :meth:`Pruner.check_layers`; naming ``target`` and the most that keeps a weight in each
                masked layer.
        """
        super().check_layers(model)
        layers = prunable_layers(model)
        sizes = [layers[name].weight.numel() for name in self.layer_names or layers]
        total, count, kept = sum(sizes), pruned_count(self.target, sum(sizes)), sum(1 for size in sizes if size)
        if count > total - kept:
            raise ValueError(f"target: {self.target} prunes {count} of the {total} weights of the {kept} masked "
                             "layer(s), but each keeps one (a layer without weights would pass only its bias); at most "
                             f"{(total - kept) / total:.6g}")

    @torch.no_grad()
    def step(self, sparsity: float | None = None) -> None:
        """Set every mask so the masked layers reach ``sparsity`` (default ``target``) by magnitude; with
        ``layer_targets``, layer ``l`` reaches ``layer_targets[l] * sparsity / target`` (at most 1).

        Ranks the effective (masked) weights, so weights already pruned rank lowest and stay pruned while the
        sparsity grows (Zhu & Gupta 2017); ties are broken by position. Every masked layer keeps at least its
        largest ``|w|`` (a layer without weights would pass only its bias; a layer of no weights is left as it is):
        with ``scope="layer"`` a layer's zeros are at most its size less one, with ``scope="global"`` each layer's
        largest ``|w|`` ranks above every other weight and the zeros are at most the masked weights less one per
        layer; below those floors the count of zeros is exact, ``ceil(sparsity * size)`` (paper 004 eq. 6). A layer
        held one weight short of its sparsity with ``scope="layer"`` (e.g. a ``layer_targets`` entry of 0.99 on a
        layer of 36 weights) is logged as a warning on this module's logger, naming the layer, the sparsity asked
        for and the one reached.

        Raises:
            ValueError: a ``sparsity`` outside ``[0, 1]``.
            RuntimeError: before :meth:`prepare`, after :meth:`squash_mask`, or with the masks removed from the
                model since :meth:`prepare` (:func:`~unsparse.prune.masks.remove_masks`).
        """
        sparsity = self.target if sparsity is None else sparsity
        if not 0.0 <= sparsity <= 1.0:
            raise ValueError(f"sparsity: {sparsity} outside [0, 1]")
        layers = prunable_layers(self._prepared())
        magnitudes = {name: layers[name].weight.abs() for name in self.masks}
        if self.scope == "layer":  # layer_targets name masked layers (checked by prepare)
            for name, magnitude in magnitudes.items():
                # layer_targets imply target > 0 (checked in __init__); a layer without one follows the step
                share = self.layer_targets[name] / self.target if name in self.layer_targets else 1.0
                asked = min(sparsity * share, 1.0)
                pruned = pruned_count(asked, magnitude.numel())
                held = min(pruned, max(magnitude.numel() - 1, 0))
                if held < pruned:
                    log.warning("%s: layer %s held at sparsity %.6g (%d of its %d weights pruned), not the %.6g asked "
                                "for, which would prune every weight: each masked layer keeps its largest |w|",
                                self.name, name, held / magnitude.numel(), held, magnitude.numel(), asked)
                self.masks[name].set(lowest_mask(magnitude, held))
            return
        flat = torch.cat([m.reshape(-1).float().cpu() for m in magnitudes.values()])
        starts = [0, *itertools.accumulate(m.numel() for m in magnitudes.values())][:-1]
        tops = torch.tensor([start + int(m.argmax()) for start, m in zip(starts, magnitudes.values(), strict=True)
                             if m.numel()], dtype=torch.int64)
        flat[tops] = math.inf  # each layer's largest weight goes last
        keep = lowest_mask(flat, min(pruned_count(sparsity, flat.numel()), flat.numel() - len(tops)))
        start = 0
        for name, magnitude in magnitudes.items():
            stop = start + magnitude.numel()
            self.masks[name].set(keep[start:stop].reshape(magnitude.shape).to(magnitude.device))
            start = stop

    def run(self, model: nn.Module, trainer: Trainer, workdir: str | Path) -> PruneResult:
        """``prepare``, one ``step``, then masked fine-tuning (checkpointed in ``workdir/magnitude_finetune.pt``,
        which resumes only a run of the same settings: :meth:`~unsparse.prune.base.Pruner.identity`); the history
        has one ``phase: "fine_tune"`` entry per epoch with ``iteration``, ``weighted_sparsity`` and validation
        metrics.

        Raises:
            ~unsparse.train.CheckpointRefusedError: (a ``ValueError``) a fine-tuning checkpoint this run cannot resume
                from (:meth:`~unsparse.train.Trainer.fit`).
        """
        started = time.perf_counter()
        self.prepare(model)
        self.step()
        pruning_s = time.perf_counter() - started
        tuned = trainer.fit(model, self.fine_tune_epochs, Path(workdir) / f"{self.name}_finetune.pt", lr=self.lr,
                            desc=f"{self.name} fine-tune", identity=self.identity())
        result = self.result([], pruning_s + fit_seconds(tuned))
        return dataclasses.replace(result, history=fine_tune_history(tuned, result.masked_weighted_sparsity))
