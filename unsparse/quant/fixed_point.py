"""Signed linear fixed-point quantization (paper 004 §4, eq. 19-21).

Equations 19-21 are missing from our copy of the paper; this is the standard linear fixed-point form (Lin
et al., ICLR 2016, the paper's ref. [35]) that its text describes, reconstructed:

- eq. 19, the mapping: ``Q(x) = Δ · clip(round(x / Δ), -q_max, q_max)`` with ``q_max = 2^(b-1) - 1`` for
  ``b`` bits, signed and symmetric, so ``0`` maps to exactly ``0``;
- eq. 20, the step: ``Δ = x_sat / q_max`` for a saturation level ``x_sat`` (values beyond ``±x_sat`` are
  saturated); ``x_sat`` is ``max |x|`` for weights and a histogram quantile for activations
  (:mod:`unsparse.quant.histogram`);
- eq. 21, the power-of-two variant ("the scaling factor is essentially just a shift"): ``Δ = 2^-fl`` with
  ``fl = b - 1 - ceil(log2 x_sat)`` fractional bits, i.e. ``b - fl`` integer bits (sign included). Its largest
  value ``q_max·Δ = 2^ceil(log2 x_sat) - Δ`` can lie below ``x_sat`` (by less than ``Δ``; e.g. ``1 - 2^-7`` for
  ``x_sat = 1`` at 8 bits): values in between saturate too, off by at most ``Δ``.

Codes are integers in ``[-q_max, q_max]``; a value is stored as its code and the layer's ``Δ``.
"""

from __future__ import annotations

import math

import torch

from unsparse.messages import quote
from unsparse.quant.finite import check_finite

MIN_BITS = 2
"""Fewest bits of a signed symmetric code (``q_max = 1``: codes -1, 0, 1)."""
MAX_BITS = 16
"""Most bits a code may have (codes are held in int16 at most)."""
FLOAT32_MAX = torch.finfo(torch.float32).max
FLOAT32_SMALLEST_NORMAL = torch.finfo(torch.float32).tiny
SMALLEST_STEP = 2.0**-149
"""The smallest step, float32's smallest subnormal value: every float32 value is a multiple of it."""


def check_bits(bits: int, field: str = "bits", low: int = MIN_BITS, high: int = MAX_BITS) -> int:
    """``bits`` if it is an int in ``[low, high]``.

    Raises:
        ValueError: naming ``field`` otherwise (bools are refused), quoting ``bits`` cut to 200 characters
            (:func:`~unsparse.messages.quote`: it may come from a file).
    """
    if isinstance(bits, bool) or not isinstance(bits, int) or not low <= bits <= high:
        raise ValueError(f"{field}: expected an integer number of bits in [{low}, {high}], got {quote(bits)}")
    return bits


def max_code(bits: int) -> int:
    """``q_max = 2^(bits-1) - 1``, the largest code magnitude of a signed ``bits``-bit code (eq. 19)."""
    return (1 << (check_bits(bits) - 1)) - 1


def fixed_point_step(saturation: float, bits: int, power_of_two: bool = False) -> float:
    """The step ``Δ`` for saturation level ``x_sat`` (eq. 20, or eq. 21 with ``power_of_two``).

    Args:
        saturation: ``x_sat`` in ``(0, FLOAT32_MAX]`` (no float32 value lies beyond it), same unit as the values.
        bits: ``b`` in ``[2, 16]``.
        power_of_two: round ``Δ`` to ``2^-fl`` with ``fl = b - 1 - ceil(log2 x_sat)`` (a shift).

    Returns:
        ``Δ`` as a Python float that is exactly a float32 value (so the files can carry it in JSON exactly), and
        whose largest multiple ``q_max·Δ`` is finite in float32: where ``x_sat / q_max`` rounds up so far that
        ``q_max·Δ`` would overflow (``x_sat`` near float32's maximum), ``Δ`` is the largest float32 value below
        it that does not (a power-of-two ``Δ`` never needs this). A step below float32's normal range (a layer of
        tiny weights, e.g. ``x_sat = 1e-42``) is rounded up to a multiple of :data:`SMALLEST_STEP`: so it is never
        0, ``q_max·Δ >= x_sat`` (rounding to nearest there could lose a third of the step and saturate the largest
        values far below ``x_sat``), and a power of two stays one; every float32 value is a multiple of
        :data:`SMALLEST_STEP`, so values below ``q_max·SMALLEST_STEP`` quantize exactly.

    Raises:
        ValueError: bits out of range, or ``saturation`` not in ``(0, FLOAT32_MAX]`` (e.g. 0 for an all-zero layer).
    """
    q_max = max_code(bits)
    if not 0 < saturation <= FLOAT32_MAX:  # NaN and infinities fail it too
        raise ValueError(f"saturation: expected a finite level > 0 and at most float32's largest value "
                         f"{FLOAT32_MAX!r}, got {saturation!r}" + (" (every value is zero)" if saturation == 0 else ""))
    step = 2.0 ** (math.ceil(math.log2(saturation)) + 1 - bits) if power_of_two else saturation / q_max
    if step < FLOAT32_SMALLEST_NORMAL:  # at least 1: a float64 step can underflow to 0 (x_sat = 5e-324)
        return max(1, math.ceil(step / SMALLEST_STEP)) * SMALLEST_STEP
    step32 = torch.tensor(step, dtype=torch.float32)
    while not bool(torch.isfinite(step32 * q_max)):
        step32 = torch.nextafter(step32, torch.zeros((), dtype=torch.float32))
    return float(step32)


def _rounded_codes(x: torch.Tensor, step: float, bits: int) -> torch.Tensor:
    """``clip(round(x / Δ), -q_max, q_max)`` (eq. 19) as float32, shape of ``x``; NaN stays NaN, ±inf clip.

    The quotient is taken in float64: for a float32 (or narrower) ``x`` and a float32 ``Δ`` it then lies on the
    same side of every tie as the exact one (a float32 quotient rounded values within an ulp of a tie to the
    farther code), and a float64 ``x`` is rounded once, not first to float32.
    """
    q_max = max_code(bits)
    return torch.round(x.to(torch.float64) / step).clamp(-q_max, q_max).to(torch.float32)


def to_codes(x: torch.Tensor, step: float, bits: int) -> torch.Tensor:
    """Integer codes ``clip(round(x / Δ), -q_max, q_max)`` (eq. 19), int64, shape of ``x``.

    ``round`` is round-half-to-even; ``x`` may be any float dtype. An int64 has no NaN (casting one gave a huge
    code, which a codec then called off the grid), and a code of ±inf would say a saturated value was finite, so
    both are refused; :func:`fake_quantize` keeps NaN and saturates infinities instead.

    Raises:
        ValueError: NaN or infinite values in ``x``, counted (:func:`~unsparse.quant.finite.check_finite`), or
            ``bits`` out of range.
    """
    check_finite(x, "values", "integer codes need")
    return _rounded_codes(x, step, bits).to(torch.int64)


def from_codes(codes: torch.Tensor, step: float) -> torch.Tensor:
    """``codes · Δ`` as float32 (eq. 19's dequantized value); the one place values are rebuilt from codes.

    The quantizers and the file codecs both call this, so a reloaded tensor is bitwise the quantized one.
    """
    return codes.to(torch.float32) * torch.tensor(step, dtype=torch.float32)


def fake_quantize(x: torch.Tensor, step: float, bits: int) -> torch.Tensor:
    """``Q(x)`` of eq. 19 as float32, shape of ``x`` (any float dtype), computed in floating point.

    The code is the nearest one (ties to even), so ``|code·Δ - x| <= Δ/2`` for ``|x| <= q_max·Δ`` (the float32
    product ``code·Δ`` adds at most half an ulp); larger ``|x|`` saturate, ±inf included, and NaN stays NaN
    (an integer code has no NaN). For finite ``x`` the result is bitwise ``from_codes(to_codes(x, Δ, b), Δ)``.
    """
    # + 0.0 turns the -0.0 that round() gives a small negative value into the +0.0 of the integer code 0
    return from_codes(_rounded_codes(x, step, bits) + 0.0, step)
