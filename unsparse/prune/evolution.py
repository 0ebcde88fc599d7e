"""The evolutionary operators of UnSparse-Opt (paper 004 §3.1, Algorithm 2) on masks and scores, free of the pruner's
state: importance (eq. 12), a layer's mask moved to a number of zeros (eq. 13-16), crossover (eq. 17-18), the
sensitivity of lines 13-14, and the split of a pruning quota over layers under their caps.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from unsparse.prune.masks import lowest_mask


def importance(weight: torch.Tensor, grad_stat: torch.Tensor, alpha: float) -> torch.Tensor:
    """Weight importance ``|w| + alpha * |G|`` (paper 004 eq. 12), same shape and dtype as ``weight``."""
    return weight.abs() + alpha * grad_stat.abs()


def resize_mask(keep: torch.Tensor, score: torch.Tensor, pruned: int, regrow: bool = False) -> torch.Tensor:
    """Boolean keep-mask with exactly ``pruned`` zeros by thresholding ``score`` (paper 004 eq. 13-14).

    Without ``regrow``, growing the sparsity prunes the lowest-``score`` kept entries and leaves the pruned ones
    pruned; lowering it (mutation, eq. 15-16) revives the highest-``score`` pruned entries and leaves the kept ones
    kept. With ``regrow``, the threshold of eq. 13-14 runs over every entry, so in either direction a pruned entry
    whose score beats a kept one's comes back (for scores of pruned entries that mean something: the
    ``after_step`` reading of eq. 9, where a pruned weight is 0 and ranks by ``α |G|``).

    Args:
        keep: current boolean mask (any shape).
        score: importance of the same shape (e.g. :func:`importance`).
        pruned: number of zeros wanted, in ``[0, keep.numel()]``.
        regrow: threshold over all entries instead of moving only one side's.

    Raises:
        ValueError: if ``pruned`` is outside ``[0, keep.numel()]``.
    """
    if not 0 <= pruned <= keep.numel():
        raise ValueError(f"pruned: {pruned} outside [0, {keep.numel()}]")
    if regrow:
        return lowest_mask(score.float(), pruned)
    growing = pruned >= int((~keep).sum())
    ranked = score.float().masked_fill(~keep if growing else keep, -math.inf if growing else math.inf)
    return lowest_mask(ranked, pruned)


def crossover_masks(current: Mapping[str, torch.Tensor], donor: Mapping[str, torch.Tensor],
                    layers: list[str]) -> dict[str, torch.Tensor]:
    """``current`` with the masks of ``layers`` taken from ``donor`` (crossover, paper 004 eq. 17-18).

    Returns a new dict; donor tensors are cloned onto each current mask's device.

    Raises:
        KeyError: a named layer is missing from either side.
        ValueError: a donor mask's shape differs from the current one.
    """
    crossed = dict(current)
    for name in layers:
        if donor[name].shape != current[name].shape:
            raise ValueError(f"crossover: {name} mask shape {tuple(donor[name].shape)} differs from "
                             f"{tuple(current[name].shape)}")
        crossed[name] = donor[name].to(device=current[name].device, dtype=torch.bool, copy=True)
    return crossed


def share(total: int, weights: Mapping[str, float], caps: Mapping[str, int]) -> dict[str, int]:
    """Split ``total`` units over the names of ``caps``, none beyond its cap (water-filling).

    Units go in proportion to ``weights`` (non-negative) among the names not yet at their cap; once every name
    of positive weight is capped, the rest goes in proportion to the remaining room ``caps - given``. Fewer
    than ``total`` units are given only when every cap is reached.

    Returns:
        Units per name, integers in ``[0, caps[name]]``.

    Raises:
        ValueError: on a negative ``total``, weight or cap.
    """
    if total < 0 or any(value < 0 for value in (*weights.values(), *caps.values())):
        raise ValueError("share: total, weights and caps must be non-negative")
    given = dict.fromkeys(caps, 0)
    for by_room in (False, True):
        while (left := total - sum(given.values())) > 0:
            open_ = {name: float(caps[name] - given[name]) if by_room else float(weights.get(name, 0.0))
                     for name in caps if given[name] < caps[name]}
            open_ = {name: weight for name, weight in open_.items() if weight > 0}
            if not open_:
                break
            norm = sum(open_.values())
            for name, weight in open_.items():
                units = min(caps[name] - given[name], max(math.floor(left * weight / norm), 1),
                            total - sum(given.values()))
                given[name] += units
    return given


def relative_change(score: float, previous: float) -> float:
    """Sensitivity of lines 13-14: ``(score - previous) / |previous|`` (``|previous|`` at least 1e-12); ``-inf``
    when ``score`` is not finite (a diverged model is the worst outcome), 0 when only ``previous`` is not (no
    measure to compare with)."""
    if not math.isfinite(score):
        return -math.inf
    if not math.isfinite(previous):
        return 0.0
    return (score - previous) / max(abs(previous), 1e-12)
