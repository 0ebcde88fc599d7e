"""Histogram analysis of magnitudes to choose a saturation level (paper 004 §4).

The paper sets the activation saturation threshold to 0.99 after histogram analysis of outliers. We read
it as a quantile: the saturation level ``x_sat`` is where the histogram of the nonzero ``|x|`` (over
calibration data) reaches the configured fraction of its mass, so that fraction of the nonzero values lies
within ``±x_sat`` and the rest saturate. ``quantile = 1`` gives ``max |x|`` (nothing saturates).

Exact zeros are left out: a zero never saturates (it is code 0 on every grid), and counting them would tie the
level to the share of zeros, which after a ReLU is often most of the values: above a share of ``quantile``
zeros the level would fall to the first bin and every nonzero value would saturate.

Bin ``i`` holds the magnitudes in ``(e_{i-1}, e_i]`` for the edges ``e_i = upper·(i+1)/bins`` as float64 computes
them (``e_{bins-1} = upper`` exactly), and the level is such an edge, so a counted magnitude never lies above the
level of its bin (``torch.histc``'s own edges differ from these by an ulp, and it put values one ulp above an edge
in the bin below it).
"""

from __future__ import annotations

import math

import torch

from unsparse.quant.finite import check_finite
from unsparse.settings import check_integer, check_quantile

MAX_BINS = 1 << 16
"""Most histogram bins: 65,536 resolve the level to ``upper / 65536``, finer than the step of 16-bit fixed point
(``x_sat / 32767``), and take 1 MB per layer (counts and edges, float64) during calibration."""


def check_bins(bins: int, field: str = "bins") -> int:
    """``bins`` if it is an integer in ``[1, MAX_BINS]``.

    Raises:
        ValueError: naming ``field`` otherwise.
    """
    return check_integer(bins, field, 1, MAX_BINS)


def _check_finite(x: torch.Tensor) -> None:
    """Refuse magnitudes that are not all finite: the counted message of :func:`~unsparse.quant.finite.check_finite`."""
    check_finite(x, "values", "a saturation level needs")


class MagnitudeHistogram:
    """Counts of the nonzero ``|x|`` in ``bins`` equal bins over ``[0, upper]``, accumulated over batches.

    Args:
        upper: the largest magnitude to expect (e.g. ``max |x|`` from a first pass), finite and > 0; larger
            magnitudes are counted in the last bin.
        bins: number of bins in ``[1, MAX_BINS]``; the chosen level is exact to ``upper / bins``.

    Raises:
        ValueError: ``upper`` not finite and positive, or ``bins`` outside ``[1, MAX_BINS]`` (naming it).
    """

    def __init__(self, upper: float, bins: int) -> None:
        if not math.isfinite(upper) or upper <= 0:
            raise ValueError(f"upper: expected a finite magnitude > 0, got {upper!r} (all values zero?)")
        self.upper, self.bins = float(upper), check_bins(bins)
        self.edges = self.upper * torch.arange(1, bins + 1, dtype=torch.float64) / bins
        self.edges[-1] = self.upper
        self.counts = torch.zeros(bins, dtype=torch.float64)

    def add(self, x: torch.Tensor) -> None:
        """Count the nonzero magnitudes of ``x`` (any shape, float dtype); exact zeros are not counted.

        Raises:
            ValueError: NaN or infinite values in ``x``, counted (``non-finite values (1 NaN, of 4); a saturation
                level needs finite ones``); nothing is counted into the histogram.
        """
        _check_finite(x)
        magnitudes = x.detach().abs().to(torch.float64).reshape(-1)
        magnitudes = magnitudes[magnitudes != 0].clamp(max=self.upper).cpu()
        self.counts += torch.bincount(torch.bucketize(magnitudes, self.edges), minlength=self.bins)

    def level(self, quantile: float) -> float:
        """The saturation level: upper edge of the first bin where the cumulative share reaches ``quantile``.

        The true quantile ``t`` of the counted magnitudes satisfies ``level - upper/bins <= t <= level``.

        Raises:
            ValueError: ``quantile`` outside ``(0, 1]``, or no nonzero magnitude counted.
        """
        quantile = check_quantile(quantile, "quantile")
        total = float(self.counts.sum())
        if total == 0:
            raise ValueError("histogram: no nonzero magnitude counted")
        cumulative = torch.cumsum(self.counts, 0) / total
        index = int(torch.searchsorted(cumulative, torch.tensor([quantile], dtype=torch.float64)).clamp(
            max=self.bins - 1))
        return float(self.edges[index])


def saturation_level(x: torch.Tensor, quantile: float, bins: int) -> float:
    """The histogram saturation level of one tensor's nonzero magnitudes (see :class:`MagnitudeHistogram`).

    Raises:
        ValueError: empty or all-zero ``x``, NaN or infinite values (counted, as :meth:`MagnitudeHistogram.add`
            says), bad ``quantile`` or ``bins`` (see :class:`MagnitudeHistogram`).
    """
    if x.numel() == 0:
        raise ValueError("saturation_level: no values")
    _check_finite(x)
    histogram = MagnitudeHistogram(float(x.detach().abs().max()), bins)
    histogram.add(x)
    return histogram.level(quantile)
