"""Pruning masks carried by ``torch.nn.utils.parametrize`` and the sparsity measures of UnSparse-Opt §3.1.

A mask is a binary tensor of the weight's shape (paper 004 eq. 3, 5). It rides on the layer as a
parametrization, so ``layer.weight`` always evaluates to ``original * mask`` (eq. 9) during training and the
dense original stays in ``layer.parametrizations.weight.original``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn.utils import parametrize

PRUNABLE_TYPES = (nn.Conv1d, nn.Conv2d, nn.Linear)
"""Layer types whose ``weight`` is pruned (convolutional and fully-connected, paper 004 eq. 2)."""


class WeightMask(nn.Module):
    """Parametrization ``weight -> weight * mask`` (paper 004 eq. 9).

    Attributes:
        mask: buffer of the weight's shape and dtype holding 0 and 1; mutated by pruners through
            :meth:`set` (in place, so optimizers and references stay valid).
        straight_through: when True, the gradient reaches the dense weight unmasked (the forward value is still
            ``weight * mask``), as if the pruned weights were zeros of a dense tensor rather than masked out: the
            reading of eq. 9 in which pruned weights are set to zero after each batch (:func:`straight_through`).
            Not part of the state dict; False unless a pruner sets it.
    """

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("mask", torch.ones_like(weight))
        self.straight_through = False

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        if self.straight_through:
            return weight - (weight * (1 - self.mask)).detach()
        return weight * self.mask

    def set(self, keep: torch.Tensor) -> None:
        """Overwrite the mask in place with ``keep`` (bool or 0/1 tensor of the weight's shape).

        Raises:
            ValueError: on a shape mismatch, or values other than 0 and 1 (a 0.5 would scale weights, not prune).
        """
        if keep.shape != self.mask.shape:
            raise ValueError(f"mask: shape {tuple(keep.shape)} differs from weight {tuple(self.mask.shape)}")
        if keep.dtype != torch.bool and not bool(((keep == 0) | (keep == 1)).all()):
            raise ValueError("mask: values other than 0 and 1")
        self.mask.copy_(keep.to(self.mask.dtype))


@contextmanager
def straight_through(masks: Iterable[WeightMask]) -> Iterator[None]:
    """Within the block, ``masks`` pass the dense gradient to their weights (:attr:`WeightMask.straight_through`).

    With the pruned weights zero before each forward (:func:`zero_pruned_weights` after every optimizer step),
    training is then the dense training of paper 004 §3.1 whose "chosen layer weights are set to zero using the
    element wise multiplication with the layer mask" after each batch (eq. 9): the same forward values, and a
    gradient (hence eq. 10's ``G``) at pruned entries too. Mutates the masks' flag and restores it on exit.
    """
    masks = list(masks)
    previous = [mask.straight_through for mask in masks]
    try:
        for mask in masks:
            mask.straight_through = True
        yield
    finally:
        for mask, flag in zip(masks, previous, strict=True):
            mask.straight_through = flag


@torch.no_grad()
def zero_pruned_weights(model: nn.Module) -> None:
    """Set every dense weight under a mask zero to 0 (``original <- original * mask``, paper 004 eq. 9 applied to
    the stored weight). Mutates the masked layers' dense weights in place; the effective weights are unchanged."""
    for layer in prunable_layers(model).values():
        if (mask := mask_of(layer)) is not None:
            dense_weight(layer).mul_(mask.mask)


def prunable_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Conv1d/Conv2d/Linear layers of ``model`` by qualified name, in module order."""
    return {name: module for name, module in model.named_modules() if isinstance(module, PRUNABLE_TYPES)}


def attach_masks(model: nn.Module, names: Iterable[str] | None = None) -> dict[str, WeightMask]:
    """Register a :class:`WeightMask` (all ones) on the weight of each named prunable layer (default: all).

    Layers that already carry a mask keep it. Mutates ``model``.

    Returns:
        The masks by layer name.

    Raises:
        ValueError: naming the ``names`` that are not prunable layers of ``model`` (nothing is attached then).
    """
    layers = prunable_layers(model)
    if names is not None:
        names = list(names)
        unknown = [name for name in names if name not in layers]
        if unknown:
            raise ValueError(f"layers: {unknown} are not Conv1d/Conv2d/Linear layers of the model; it has "
                             f"{', '.join(layers) or 'none'}")
    chosen = layers if names is None else {name: layers[name] for name in names}
    for layer in chosen.values():
        if mask_of(layer) is None:
            parametrize.register_parametrization(layer, "weight", WeightMask(layer.weight))
    return {name: mask_of(layer) for name, layer in chosen.items()}


def mask_of(layer: nn.Module) -> WeightMask | None:
    """The :class:`WeightMask` on ``layer.weight``, or None."""
    if not parametrize.is_parametrized(layer, "weight"):
        return None
    found = [p for p in layer.parametrizations.weight if isinstance(p, WeightMask)]
    return found[0] if found else None


def masks_of(model: nn.Module) -> dict[str, WeightMask]:
    """Every attached mask in ``model`` by layer name."""
    return {name: mask for name, layer in prunable_layers(model).items() if (mask := mask_of(layer)) is not None}


def dense_weight(layer: nn.Module) -> torch.Tensor:
    """The unmasked weight tensor (the parametrization's ``original`` if masked, else ``layer.weight``)."""
    if parametrize.is_parametrized(layer, "weight"):
        return layer.parametrizations.weight.original
    return layer.weight


def remove_masks(model: nn.Module, names: Iterable[str] | None = None, fold_others: bool = False) -> nn.Module:
    """Fold every mask (or those of the prunable layers ``names``) into its weight (``weight <- weight * mask``) and
    drop the mask; a named layer without a mask is left as it is.

    The analogue of ``torch.ao.pruning``'s ``squash_mask``. Another parametrization of a masked weight (e.g.
    ``torch.nn.utils.parametrizations.weight_norm``) stays on the layer, holding the masked weight: a mask registered
    first is multiplied into the ``original``, one registered after others is removed and the masked weight set back
    through the others' ``right_inverse``. The layer then computes what it computed with the mask, but its pruned
    weights are no longer held at zero. Mutates and returns ``model``; a deep copy of it (or the model it was
    deep-copied from) is not changed. (``parametrize.remove_parametrizations`` deletes the weight's property from
    the layer's parametrized class, which deep copies share, so each layer first gets a class of its own.)

    Args:
        model: the masked model. names: prunable layer names (default: every one).
        fold_others: fold the other parametrizations of a masked weight into a plain parameter too (as
            :func:`squashed_copy` does on a copy); the layers keep no parametrization of their weight then.

    Raises:
        ValueError: naming the layers whose other parametrizations cannot hold their masked weight (no
            ``right_inverse``, or one that does not give it back within float error, such as ``weight_norm`` for an
            output channel whose every weight is pruned: NaN); checked before any layer is changed.
    """
    layers = prunable_layers(model)
    chosen = layers if names is None else {name: layers[name] for name in names if name in layers}
    masked = {name: layer for name, layer in chosen.items() if mask_of(layer) is not None}
    alone = {name: fold_others or all(isinstance(step, WeightMask) for step in layer.parametrizations.weight)
             for name, layer in masked.items()}
    refused = [name for name, layer in masked.items() if not alone[name] and not _holds_masked_weight(layer)]
    if refused:
        kinds = sorted({type(step).__name__ for name in refused for step in masked[name].parametrizations.weight
                        if not isinstance(step, WeightMask)})
        raise ValueError(f"layers {refused}: the other parametrizations of their weights ({', '.join(kinds)}) "
                         "cannot hold the masked weight "
                         "(no right_inverse, or one that gives another weight back: weight_norm gives NaN for an "
                         "output channel whose every weight is pruned); pass fold_others=True to fold them into a "
                         "plain weight too")
    for name, layer in masked.items():
        if alone[name]:
            shared = type(layer)
            layer.__class__ = type(shared.__name__, shared.__bases__,
                                   {key: value for key, value in vars(shared).items()
                                    if key not in ("__dict__", "__weakref__")})
            parametrize.remove_parametrizations(layer, "weight", leave_parametrized=True)
        else:
            _drop_masks(layer)
    return model


@torch.no_grad()
def _drop_masks(layer: nn.Module) -> None:
    """Remove the :class:`WeightMask` parametrizations of ``layer.weight``, leaving its other parametrizations to
    compute the masked weight (:func:`remove_masks`). Mutates ``layer``; raises what ``right_inverse`` raises."""
    steps = layer.parametrizations.weight
    while (mask := mask_of(layer)) is not None:
        masked = layer.weight.detach().clone()
        index = next(i for i, step in enumerate(steps) if step is mask)
        del steps[index]
        if index == 0:
            steps.original.mul_(mask.mask)
        else:
            steps.right_inverse(masked)


def _holds_masked_weight(layer: nn.Module) -> bool:
    """Whether :func:`_drop_masks` leaves ``layer`` computing its masked weight (tried on a deep copy): the same
    zeros and the other entries within a few float roundings."""
    masked = layer.weight.detach()
    trial = copy.deepcopy(layer)
    try:
        _drop_masks(trial)
    except (RuntimeError, ValueError, NotImplementedError):
        return False
    return torch.allclose(trial.weight.detach(), masked, rtol=16 * torch.finfo(masked.dtype).eps, atol=0.0)


@torch.no_grad()
def squashed_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parametrized tensors (masks included, and any other parametrization such as
    ``torch.nn.utils.parametrizations.weight_norm``'s ``original0``/``original1``) are folded into plain parameters.

    ``model`` is left untouched. (``parametrize.remove_parametrizations`` on a deep copy would edit the
    parametrized class that the copy shares with the original, so the copy's modules get their original
    class back one instance at a time instead.)
    """
    folded = copy.deepcopy(model)
    for module in folded.modules():
        if not parametrize.is_parametrized(module):
            continue
        effective = {name: (getattr(module, name).detach().clone(),
                            any(p.requires_grad for p in module.parametrizations[name].parameters(recurse=False)))
                     for name in module.parametrizations}
        module.__class__ = module.__class__.__bases__[0]
        del module._modules["parametrizations"]
        for name, (tensor, requires_grad) in effective.items():
            setattr(module, name, nn.Parameter(tensor, requires_grad=requires_grad))
    return folded


@torch.no_grad()
def layer_sparsity(model: nn.Module) -> dict[str, float]:
    """Fraction of zero entries in each prunable layer's effective weight (paper 004 eq. 6).

    A layer of no weights (e.g. ``nn.Linear(0, n)``) has nothing to prune and reads 0.0; it weighs nothing in
    :func:`weighted_sparsity`.
    """
    return {name: float((layer.weight == 0).sum()) / max(layer.weight.numel(), 1)
            for name, layer in prunable_layers(model).items()}


def weighted_sparsity(sparsity: dict[str, float], sizes: dict[str, int]) -> float:
    """Weighted sparsity ``sum_l size_l * s_l / sum_l size_l`` (paper 004 eq. 7-8).

    Args:
        sparsity: per-layer sparsity in ``[0, 1]``.
        sizes: per-layer weight element counts, same keys.

    Raises:
        ValueError: if keys differ or the total size is zero.
    """
    if set(sparsity) != set(sizes):
        raise ValueError(f"sparsity and sizes name different layers: {sorted(set(sparsity) ^ set(sizes))}")
    total = sum(sizes.values())
    if total == 0:
        raise ValueError("sizes: total weight count is zero")
    return sum(sizes[name] * sparsity[name] for name in sizes) / total


def model_weighted_sparsity(model: nn.Module) -> float:
    """:func:`weighted_sparsity` over all prunable layers of ``model`` (effective, masked weights)."""
    sizes = {name: layer.weight.numel() for name, layer in prunable_layers(model).items()}
    return weighted_sparsity(layer_sparsity(model), sizes)


def pruned_count(sparsity: float, numel: int) -> int:
    """Zeros that reach ``sparsity`` among ``numel`` entries: ``ceil(sparsity * numel)`` (1e-9 tolerance)."""
    return math.ceil(sparsity * numel - 1e-9)


def threshold_mask(importance: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Boolean keep-mask zeroing exactly ``ceil(sparsity * numel)`` entries of lowest importance (the fewest
    that reach ``sparsity``; a 1e-9 tolerance absorbs float error such as ``0.9 * 10``).

    Ties are broken by position (stable sort), so the count is exact whatever the values (paper 004
    eq. 13-14: the threshold that reaches the requested sparsity). Rounding to nearest instead left a
    90 % global magnitude run at 0.899997 weighted sparsity.

    Args:
        importance: any-shape float tensor (e.g. ``|w|`` or ``|w| + alpha*|G|``).
        sparsity: target fraction of zeros in ``[0, 1]``.

    Raises:
        ValueError: if ``sparsity`` is outside ``[0, 1]``.
    """
    if not 0.0 <= sparsity <= 1.0:
        raise ValueError(f"sparsity: {sparsity} outside [0, 1]")
    return lowest_mask(importance, pruned_count(sparsity, importance.numel()))


def lowest_mask(importance: torch.Tensor, pruned: int) -> torch.Tensor:
    """Boolean keep-mask zeroing exactly the ``pruned`` entries of lowest importance, ties broken by position
    (:func:`threshold_mask` for a count: no fraction to round, which on a layer of 10^8 weights put one zero
    too many in 4 % of the counts: ``ceil((k / n) * n - 1e-9) != k`` for 4.1 % of 10^5 random ``k``, ``n = 10^8``).

    The zeros are those a stable sort would put first (NaN ranks above everything, as in ``torch.sort``). Without
    NaN they come from a selection instead of a sort: ``torch.kthvalue`` finds the ``pruned``-th lowest value, every
    entry below it goes, and of the entries equal to it the first by position, as many as the count still needs. On
    AlexNet's 61 M weights the sort took 8.8 s of a magnitude step on the CPU, the selection about 1.4 s.

    Args:
        importance: any-shape float tensor. pruned: zeros wanted, in ``[0, importance.numel()]``.

    Raises:
        ValueError: if ``pruned`` is outside ``[0, importance.numel()]``.
    """
    if not 0 <= pruned <= importance.numel():
        raise ValueError(f"pruned: {pruned} outside [0, {importance.numel()}]")
    flat = importance.reshape(-1)
    keep = torch.ones(flat.numel(), dtype=torch.bool, device=flat.device)
    if pruned == 0:
        return keep.reshape(importance.shape)
    if torch.isnan(flat).any():
        keep[torch.sort(flat, stable=True).indices[:pruned]] = False
        return keep.reshape(importance.shape)
    threshold = torch.kthvalue(flat, pruned).values
    below = flat < threshold
    keep[below] = False
    tied = torch.nonzero(flat == threshold).squeeze(1)
    keep[tied[:pruned - int(below.sum())]] = False
    return keep.reshape(importance.shape)


_BIT_SHIFTS = torch.arange(7, -1, -1, dtype=torch.uint8)
"""Bit positions of eight consecutive mask entries in one byte, most significant first."""


def pack_mask(keep: torch.Tensor) -> torch.Tensor:
    """A keep-mask as bits: 8 entries per byte, row-major (C) order, first entry in the most significant bit.

    Args:
        keep: bool or 0/1 tensor of any shape and device.

    Returns:
        ``uint8`` tensor of shape ``(ceil(numel / 8),)`` on the CPU; the last byte is zero-padded. An eighth of
        a bool mask's bytes, which is what lets a ranked list of 16 solutions hold a large model's masks.
    """
    flat = keep.detach().reshape(-1).to(device="cpu", dtype=torch.uint8)
    flat = torch.nn.functional.pad(flat, (0, -flat.numel() % 8))
    return (flat.view(-1, 8) << _BIT_SHIFTS).sum(dim=1, dtype=torch.uint8)


def unpack_mask(bits: torch.Tensor, shape: Iterable[int]) -> torch.Tensor:
    """Inverse of :func:`pack_mask`: a bool tensor of ``shape`` on the CPU.

    Raises:
        ValueError: ``bits`` is not a 1-D ``uint8`` tensor of exactly ``ceil(prod(shape) / 8)`` bytes.
    """
    shape = tuple(int(size) for size in shape)
    numel = math.prod(shape)
    if bits.dtype != torch.uint8 or bits.dim() != 1 or bits.numel() != -(-numel // 8):
        raise ValueError(f"bits: expected a 1-D uint8 tensor of {-(-numel // 8)} bytes for shape {shape}, got "
                         f"{bits.dtype} of shape {tuple(bits.shape)}")
    flat = (bits.cpu()[:, None] >> _BIT_SHIFTS) & 1
    return flat.reshape(-1)[:numel].bool().reshape(shape)
