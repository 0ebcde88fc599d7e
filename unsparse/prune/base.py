"""The pruner lifecycle, shaped like ``torch.ao.pruning``'s sparsifiers: ``prepare`` -> ``step`` -> ``squash_mask``.

``prepare`` attaches :class:`~unsparse.prune.masks.WeightMask` parametrizations, ``step`` updates the masks,
``squash_mask`` folds them into the weights. :meth:`Pruner.run` is the whole schedule of a method (how
``step`` interleaves with training) and returns a :class:`PruneResult`.
"""

from __future__ import annotations

import inspect
import json
import math
import shlex
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from unsparse.prune.masks import (
    WeightMask,
    attach_masks,
    layer_sparsity,
    mask_of,
    model_weighted_sparsity,
    prunable_layers,
    remove_masks,
    weighted_sparsity,
)
from unsparse.settings import check_number
from unsparse.train import Trainer, tensor_digest


@dataclass
class PruneResult:
    """Outcome of a pruning run.

    Attributes:
        method: the pruner's name.
        weighted_sparsity: paper 004 eq. 7-8 over all prunable layers, in ``[0, 1]``.
        layer_sparsity: per-layer fraction of zeros.
        masked_weighted_sparsity: eq. 7-8 over the masked layers only, what a whole-model ``target`` is measured
            on (:meth:`target_reached`); equal to ``weighted_sparsity`` unless ``layers`` named a subset.
        history: one dict per epoch/iteration (method-specific keys; at least ``val`` metric and sparsity).
        wall_time_s: seconds spent in ``run``.
    """

    method: str
    weighted_sparsity: float
    layer_sparsity: dict[str, float]
    masked_weighted_sparsity: float
    history: list[dict[str, Any]] = field(default_factory=list)
    wall_time_s: float = 0.0

    def target_reached(self, target: float) -> bool:
        """Whether the masked layers reached the weighted sparsity ``target`` (paper 004 eq. 7-8; 1e-9 tolerance):
        the goal of a pruner whose ``target`` is one figure over all its layers (for per-layer goals:
        :meth:`layers_short`)."""
        return self.masked_weighted_sparsity >= target - 1e-9

    def layers_short(self, targets: Mapping[str, float]) -> dict[str, float]:
        """The layers of ``targets`` whose sparsity (paper 004 eq. 6) is below their own final sparsity
        ``targets[name]`` (layer-wise sparsity, §3.1), each with the sparsity it reached; empty when every one
        reached its own. A pruner's exact threshold zeros ``ceil(target * size)`` weights
        (:func:`~unsparse.prune.masks.pruned_count`), so a layer that reached its target reads at most ``1e-9 / size``
        below it: the 1e-9 tolerance of :meth:`target_reached`.

        Raises:
            KeyError: a name of ``targets`` that ``layer_sparsity`` lacks.
        """
        return {name: self.layer_sparsity[name] for name, target in targets.items()
                if self.layer_sparsity[name] < target - 1e-9}


class LayerMapping(dict[str, float]):
    """A per-layer setting as :func:`layer_mapping` returns it: ``{layer name: number}``, which remembers its field and
    the names it read from float keys, for :meth:`check_float_keys` (a dict: the pruners use it as one, and it
    enters :meth:`Pruner.identity` as one)."""

    def __init__(self, items: Mapping[str, float], field: str, float_keys: list[str]) -> None:
        super().__init__(items)
        self.field, self.float_keys = field, float_keys

    def check_float_keys(self, layers: Sequence[str]) -> None:
        """Refuse a float key that could stand for more than one of ``layers``: Hydra and YAML read an unquoted
        ``1.10`` as the float 1.1, whose ``str`` is ``"1.1"``, so with layers ``1.1`` and ``1.10`` (or ``1.10`` alone)
        the setting would go to another layer than meant (or be refused as naming none).

        Raises:
            ValueError: naming the field, the key and the layers it could stand for, and saying how to quote the
                key (YAML quotes a key; Hydra's command line cannot, but passes a YAML mapping through
                ``oc.create``).
        """
        for name in self.float_keys:
            alike = [layer for layer in layers if "." in layer and reads_as(layer, float(name))]  # "7" reads as int
            other = next((layer for layer in alike if layer != name), None)
            if other is not None:
                quoted = json.dumps({other if key == name else key: value for key, value in self.items()})
                created = "${oc.create:'" + quoted.replace('"', r'\"') + "'}"  # oc.create reads YAML
                override = shlex.quote(f'prune.{self.field}="{created}"')
                raise ValueError(
                    f"{self.field}: the key {name} is a number (Hydra and YAML read an unquoted {other} as {name}) "
                    f"that could stand for the layers {alike}; quote the layer's name, in a YAML config as "
                    f"{self.field}: {quoted}, or on the command line, where Hydra cannot quote a mapping's key, "
                    f"as {override}")


def _check_colliding_keys(mapping: Mapping[Any, float], field: str) -> None:
    """Refuse keys that become one name as strings (the float ``1.1`` and the string ``"1.1"``): one value would be
    dropped unseen.

    Raises:
        ValueError: naming ``field`` and the keys.
    """
    names: dict[str, Any] = {}
    for key in mapping:
        if str(key) in names:
            raise ValueError(f"{field}: the keys {names[str(key)]!r} and {key!r} name the same layer {str(key)!r}")
        names[str(key)] = key


def reads_as(text: str, number: float) -> bool:
    """Whether ``text`` reads as the float ``number`` (``"1.10"`` and ``"1.1"`` as 1.1; a name that is no number
    reads as none)."""
    try:
        return float(text) == number
    except ValueError:
        return False


def layer_mapping(mapping: Mapping[Any, float], field: str, valid: Callable[[float], bool],
                  expected: str) -> LayerMapping:
    """A per-layer setting as ``{layer name: number}``: keys as strings (Hydra reads a command-line key such as
    ``7.0`` or ``10`` as a number, and ``str`` gives the layer's name back), each value a number ``valid`` accepts.
    The :class:`LayerMapping` remembers the float keys: ``str(1.1)`` gives ``"1.1"`` back for a ``1.10`` too, which
    :meth:`Pruner.check_layers` refuses once the model's layers show the key ambiguous.

    Raises:
        ValueError: naming ``field`` and the layer, for a value that is no such number, a ``mapping`` that is no
            mapping, or keys that become one name as strings (``1.1`` and ``"1.1"``).
    """
    if not isinstance(mapping, Mapping):
        raise ValueError(f"{field}: expected a mapping of layer names to numbers, got {mapping!r}")
    for name, value in mapping.items():
        check_number(value, f"{field}.{name}", valid, expected)
    _check_colliding_keys(mapping, field)
    # values as given: they enter Pruner.identity
    return LayerMapping({str(name): value for name, value in mapping.items()}, field,
                        [str(name) for name in mapping if isinstance(name, float)])


def optional_rate(rate: float | None, field: str) -> float | None:
    """A pruner's learning rate that may be None (the trainer's): else a finite number > 0.

    Raises:
        ValueError: naming ``field`` otherwise, and ``prune.<field>``, its key in the main job's config (where
            ``train.lr`` is another setting, which the bare name could be taken for).
    """
    if rate is not None:
        try:
            check_number(rate, field, lambda value: 0 < value < math.inf, "> 0 and finite (or null)")
        except ValueError as error:
            raise ValueError(f"{error} (the pruner's learning rate: prune.{field} in the job's config, not "
                             "train.lr)") from None
    return rate  # as given: it enters Pruner.identity


class Pruner(ABC):
    """Base class of pruning methods.

    Args:
        target: target weighted sparsity in ``[0, 1)`` over the masked layers (paper 004 eq. 7-8); with a subset in
            ``layers`` the model-wide figure is lower, since unmasked layers stay dense.
            (:class:`~unsparse.prune.magnitude.MagnitudePruner` with ``scope="layer"`` reads it as the final sparsity
            of each layer that its ``layer_targets`` does not name.)
        layers: names of the layers to prune (default: every Conv1d/Conv2d/Linear).

    Raises:
        ValueError: a ``target`` that is no number in ``[0, 1)``, or ``layers`` that is no list of names.
    """

    name: str = "pruner"
    history_axis: str = "iteration"
    """What the ``iteration`` of the :class:`PruneResult` history entries counts (a plot's x-axis label)."""

    def __init__(self, target: float, layers: list[str] | None = None) -> None:
        check_number(target, "target", lambda value: 0.0 <= value < 1.0, "in [0, 1) (a sparsity)")
        if layers is not None and (not isinstance(layers, Sequence) or isinstance(layers, str)
                                   or not all(isinstance(name, str) for name in layers)):
            raise ValueError(f"layers: expected a list of layer names, got {layers!r}")
        self.target = target
        self.layer_names = layers
        self.model: nn.Module | None = None
        self.input_digest: str | None = None
        self.masks: dict[str, WeightMask] = {}

    def named_layers(self) -> dict[str, list[str]]:
        """The layer names the settings hold, by setting: ``layers`` here; subclasses add per-layer settings, which
        must name masked layers."""
        return {"layers": list(self.layer_names or [])}

    def check_layers(self, model: nn.Module) -> None:
        """Check the layer names of the settings (:meth:`named_layers`) against ``model`` before any work: ``layers``
        must name prunable layers, and every per-layer setting a masked one (the main job calls this before it
        trains, so that a typo does not surface after dense training; :meth:`prepare` calls it too).

        A float key of a per-layer setting (:func:`layer_mapping`) that could stand for several layers is refused
        first (:meth:`LayerMapping.check_float_keys`), before it reads as an unknown name.

        Raises:
            ValueError: naming ``layers`` where nothing would be masked (a model without a Conv1d/Conv2d/Linear
                layer, or an empty ``layers``); naming the setting and its unknown names, listing the layers that
                would do; or from :meth:`LayerMapping.check_float_keys`.
        """
        prunable = list(prunable_layers(model))
        if not prunable:
            raise ValueError("layers: the model has no Conv1d/Conv2d/Linear layer to prune")
        if self.layer_names is not None and not self.layer_names:
            raise ValueError(f"layers: names no layer to prune (null: every one of {', '.join(prunable)})")
        for setting in vars(self).values():
            if isinstance(setting, LayerMapping):
                setting.check_float_keys(prunable)
        masked = self.layer_names if self.layer_names is not None else prunable
        for setting, names in self.named_layers().items():
            allowed = prunable if setting == "layers" else masked
            unknown = [name for name in names if name not in allowed]
            if unknown:
                raise ValueError(f"{setting}: {unknown} are not {'prunable' if setting == 'layers' else 'masked'} "
                                 f"Conv1d/Conv2d/Linear layers of the model; it has {', '.join(allowed) or 'none'}")

    def prepare(self, model: nn.Module) -> None:
        """Attach masks (all ones) to the chosen layers of ``model`` (mutated) and remember it, with a digest of the
        weights and buffers it held before (:func:`~unsparse.train.tensor_digest`, part of :meth:`identity`).

        A layer that already carries a mask (an earlier ``prepare`` of this or another pruner, without
        :meth:`squash_mask`) keeps it, zeros included (:func:`~unsparse.prune.masks.attach_masks`): preparing twice
        stacks no second mask and undoes no pruning.

        Raises:
            ValueError: from :meth:`check_layers`.
        """
        self.check_layers(model)
        self.input_digest = tensor_digest(model.state_dict().values())
        self.model = model
        self.masks = attach_masks(model, self.layer_names)

    @abstractmethod
    def step(self) -> None:
        """Update the masks of the prepared model."""

    def squash_mask(self, fold_others: bool = False) -> nn.Module:
        """Fold the pruner's masks into their weights and detach them (masks that another pruner put on other layers
        of the model stay, and so do other parametrizations of the weights, such as ``weight_norm``, unless
        ``fold_others``: :func:`~unsparse.prune.masks.remove_masks`); returns the (mutated) model, which the pruner
        then forgets (prepare a model again to prune more).

        Raises:
            ValueError: from :func:`~unsparse.prune.masks.remove_masks` (nothing is changed then).
        """
        model = self._prepared(masked=False)
        remove_masks(model, self.masks, fold_others)
        self.model, self.masks = None, {}
        return model

    def identity(self) -> str:
        """What a checkpoint must have been written by for this pruner to resume from it: the method, the layers
        and every constructor setting the pruner keeps under its own name, and once prepared the digest of the
        model it started from (``input_model``: a run that prunes another model, e.g. another dense model trained
        into the same folder, refuses the checkpoint), as sorted JSON (:func:`~unsparse.train.check_resumable`)."""
        parameters = inspect.signature(type(self).__init__).parameters
        settings = {name: getattr(self, name) for name in parameters if name != "self" and hasattr(self, name)}
        started = {} if self.input_digest is None else {"input_model": self.input_digest}
        return json.dumps({**settings, **started, "method": self.name, "layers": self.layer_names}, sort_keys=True,
                          default=str)

    def layer_sizes(self) -> dict[str, int]:
        """Weight element count of each masked layer."""
        layers = prunable_layers(self._prepared())
        return {name: layers[name].weight.numel() for name in self.masks}

    def layer_goals(self) -> dict[str, float] | None:
        """The final sparsity each masked layer was asked for, where the goal is per layer (paper 004 §3.1's
        layer-wise sparsity, eq. 6); None here: ``target`` is one weighted sparsity over the masked layers
        (eq. 7-8, :meth:`PruneResult.target_reached`). Subclasses with per-layer goals override it."""
        return None

    def shortfall_reason(self) -> str | None:
        """Why this pruner can stop below its target, where the method knows; None here (a pruner without a budget
        reaches its threshold exactly but for the weight each layer keeps, which its ``step`` logs)."""
        return None

    def result(self, history: list[dict[str, Any]], wall_time_s: float) -> PruneResult:
        """A :class:`PruneResult` describing the prepared model now."""
        model = self._prepared()
        per_layer = layer_sparsity(model)
        sizes = self.layer_sizes()
        masked = weighted_sparsity({name: per_layer[name] for name in sizes}, sizes)
        return PruneResult(self.name, model_weighted_sparsity(model), per_layer, masked, history, wall_time_s)

    @abstractmethod
    def run(self, model: nn.Module, trainer: Trainer, workdir: str | Path) -> PruneResult:
        """Prune ``model`` (mutated; masks stay attached) with training from ``trainer``.

        ``workdir`` holds the method's checkpoints so an interrupted run resumes.

        Raises:
            ~unsparse.train.CheckpointRefusedError: (a ``ValueError``, before anything is resumed) a checkpoint in
                ``workdir`` that this run cannot resume from: written by a run of other settings
                (:meth:`identity`), by an older version, or damaged.
        """

    def _prepared(self, masked: bool = True) -> nn.Module:
        """The prepared model.

        Raises:
            RuntimeError: before :meth:`prepare` or after :meth:`squash_mask`, or, with ``masked``, where masks of the
                pruner are no longer on the model (:func:`~unsparse.prune.masks.remove_masks`, or another pruner's
                ``squash_mask``): setting them would change nothing the model computes.
        """
        if self.model is None:
            raise RuntimeError(f"{type(self).__name__}: call prepare(model) first (squash_mask forgets the model)")
        if not masked:
            return self.model
        layers = prunable_layers(self.model)
        detached = [name for name, mask in self.masks.items()
                    if name not in layers or mask_of(layers[name]) is not mask]
        if detached:
            raise RuntimeError(f"{type(self).__name__}: the masks of {detached} are no longer on the model (removed "
                               "by remove_masks or another pruner's squash_mask); call prepare(model) again")
        return self.model


def metric_score(metrics: Mapping[str, float]) -> float:
    """Higher-is-better score of :meth:`Trainer.evaluate` metrics: top-1 %, or ``-mse`` (as ``Trainer.score``);
    ``-inf`` for a NaN (a diverged model)."""
    score = metrics["top1"] if "top1" in metrics else -metrics["mse"]
    return -math.inf if math.isnan(score) else score


def val_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """History keys of validation ``metrics`` (from :meth:`Trainer.evaluate`): ``val_score`` (higher is
    better) plus ``val_top1`` or ``val_mse``, and ``val_loss``."""
    return {"val_score": metric_score(metrics), **{f"val_{key}": value for key, value in metrics.items()
                                                   if key in ("top1", "mse", "loss")}}


def fine_tune_history(tuned: list[dict[str, Any]], sparsity: float, first: int = 0) -> list[dict[str, Any]]:
    """History entries of the fine-tuning epochs ``tuned`` (from :meth:`Trainer.fit`) at the masks' weighted
    ``sparsity``: ``phase: "fine_tune"``, ``iteration`` = ``first`` + the epoch, and :func:`val_metrics`."""
    return [{"phase": "fine_tune", "iteration": first + entry["epoch"], "weighted_sparsity": sparsity,
             **val_metrics(entry)} for entry in tuned]
