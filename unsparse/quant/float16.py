"""Rounding to float16 once, from any float dtype (the FP16 weights and activations of paper 004 Table 5)."""

from __future__ import annotations

import torch

FLOAT16_MAX = float(torch.finfo(torch.float16).max)
"""float16's largest value, 65504."""
FLOAT16_OVERFLOW = 65520.0
"""The smallest magnitude that rounds to infinity in float16: halfway from 65504 to 65536, a tie to even upwards."""


def to_float16(x: torch.Tensor) -> torch.Tensor:
    """``x`` (any shape, float dtype) rounded once to the nearest float16 (ties to even), as float16.

    torch converts float64 to float16 through float32, rounding twice: ``1 + 2^-11 + 2^-40`` lies above the tie
    between 1 and ``1 + 2^-10`` but becomes the tie ``1 + 2^-11`` in float32, then 1 (to even). Here a float64 ``x``
    is rounded to float32 *to odd* (toward zero, then the last bit set where that was inexact): with 13 bits more
    than float16, that float32 value rounds to float16 as ``x`` itself does. Other dtypes convert directly
    (float32 to float16 rounds once; bfloat16 widens exactly first).
    """
    if x.dtype != torch.float64:
        return x.to(torch.float16)
    narrow = x.to(torch.float32)
    wide = narrow.to(torch.float64)
    toward_zero = torch.where(wide.abs() > x.abs(), torch.nextafter(narrow, torch.zeros_like(narrow)), narrow)
    odd = (toward_zero.view(torch.int32) | 1).view(torch.float32)
    return torch.where(wide != x, odd, narrow).to(torch.float16)
