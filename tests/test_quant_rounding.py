"""Eq. 19's rounding ``round(x / Δ)`` against an exact rational reference: inputs within an ulp of a tie between
two codes must go to the nearer code (ties to even), whatever rounding the quotient itself would add."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from unsparse.quant.fixed_point import fake_quantize, fixed_point_step, from_codes, max_code, to_codes


def exact_codes(x: torch.Tensor, step: float, bits: int) -> torch.Tensor:
    """``clip(round(x / Δ), -q_max, q_max)`` in exact rational arithmetic (Python's round: half to even)."""
    q_max = max_code(bits)
    return torch.tensor([max(-q_max, min(q_max, round(Fraction(v) / Fraction(step)))) for v in x.tolist()])


def near_ties(step: float, bits: int, count: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Values one ulp (of ``dtype``) either side of, or at, the midpoint between two codes."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(-max_code(bits), max_code(bits), (count,), generator=generator).to(torch.float64)
    middle = ((codes + 0.5) * step).to(dtype)
    direction = (torch.randint(0, 3, (count,), generator=generator) - 1).to(dtype) * torch.finfo(dtype).max
    return torch.where(direction == 0, middle, torch.nextafter(middle, direction))


@pytest.mark.parametrize("bits", [4, 8, 16])
@pytest.mark.parametrize("saturation", [1.0, 3.7, 0.013])
def test_codes_of_float32_values_near_a_tie_are_the_nearest_code(bits, saturation):
    """The quotient x / Δ was rounded to float32 before round(): about 2.5 % of the values within an ulp of a tie
    went to the farther code, more than Δ/2 away."""
    step = fixed_point_step(saturation, bits)
    x = near_ties(step, bits, 1500, torch.float32, seed=bits)
    expected = exact_codes(x, step, bits)
    assert torch.equal(to_codes(x, step, bits), expected)
    assert torch.equal(fake_quantize(x, step, bits), from_codes(expected, step))
    inside = x.abs() <= max_code(bits) * step
    grid_error = (to_codes(x, step, bits).to(torch.float64) * step - x.to(torch.float64)).abs()  # before float32
    assert bool((grid_error[inside] <= step / 2).all())


def test_float64_values_are_rounded_once_not_through_float32():
    """A float64 value (a k-means centroid, an activation of a float64 model) a little above or below a tie was
    first rounded to float32, where it became the tie itself, and then went to the even code, half the time the
    farther one."""
    bits, step = 8, fixed_point_step(1.0, 8, power_of_two=True)  # 2^-7: every tie is a float32 value
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(-max_code(bits), max_code(bits), (1500,), generator=generator).to(torch.float64)
    sign = torch.randint(0, 2, (1500,), generator=generator).to(torch.float64) * 2 - 1
    x = (codes + 0.5) * step * (1 + sign * 2.0**-35)  # below float32's resolution, far above float64's
    expected = exact_codes(x, step, bits)
    assert torch.equal(to_codes(x, step, bits), expected)
    assert torch.equal(fake_quantize(x, step, bits), from_codes(expected, step))
