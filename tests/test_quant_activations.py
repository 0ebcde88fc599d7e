"""Activation quantizers on edge inputs: dtypes other than float32, levels at the bounds of float32."""

from __future__ import annotations

import pytest
import torch

from unsparse.quant.activations import ActivationQuantizer, ActivationSpec
from unsparse.quant.float16 import FLOAT16_MAX


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_fp16_activations_beyond_float16s_range_saturate_to_a_finite_value_in_every_dtype(dtype):
    """A bfloat16 input was clamped to ±65504 in bfloat16, which holds no 65504 and rounded the bound to 65536: the
    value then overflowed to ±inf in float16 instead of saturating, as the module promises."""
    x = torch.tensor([1e6, -1e6, 70000.0, -65536.0, 1.0, -0.5], dtype=dtype)
    out = ActivationQuantizer(ActivationSpec(format="fp16"))(x)
    assert out.dtype == dtype and bool(torch.isfinite(out).all())
    expected = torch.tensor([FLOAT16_MAX, -FLOAT16_MAX, FLOAT16_MAX, -FLOAT16_MAX, 1.0, -0.5]).to(dtype)
    assert torch.equal(out, expected)
