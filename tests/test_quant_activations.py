"""Activation quantizers on edge inputs: dtypes other than float32, levels at the bounds of float32."""

from __future__ import annotations

import pytest
import torch

from unsparse import create_model, load_sparse, save_sparse, sparsify
from unsparse.quant import LinearQuantizer
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


def test_a_fraction_of_a_subnormal_maximum_is_a_usable_level(tmp_path):
    """With rule fraction_of_max, 0.4 x max |x| for inputs at float32's smallest value (2^-149) rounded to 0 in the
    float32 saturation buffer: quantization succeeded, then the first forward pass failed and the file it wrote was
    refused on load. The level is now at least 2^-149, which quantizes such inputs exactly."""
    torch.manual_seed(0)
    model = sparsify(create_model("vgg_small", width=4).eval())
    images = torch.full((2, 1, 28, 28), 2.0**-149)
    spec = ActivationSpec(format="fixed", rule="fraction_of_max", quantile=0.4, calibration_batches=1)
    LinearQuantizer(activations=spec, progress=False).quantize(model, [(images, torch.zeros(2))])
    quantizer = model.get_submodule("0.0").input_quantizer
    assert float(quantizer.saturation) > 0 and torch.equal(quantizer(images), images)
    model(images)
    loaded = load_sparse(save_sparse(model, tmp_path / "m.safetensors"))
    assert torch.equal(loaded.get_submodule("0.0").input_quantizer.saturation, quantizer.saturation)


@pytest.mark.parametrize("rule", ["fraction_of_max", "quantile"])
def test_calibration_puts_back_each_modules_own_mode(rule):
    """Calibration ran the model in eval mode, then called ``model.train(was_training)``, which set the model's one
    flag on every module: a frozen batch norm (eval mode inside a training model) came back training."""
    from unsparse.quant.activations import calibrate

    torch.manual_seed(0)
    model = sparsify(create_model("vgg_small", width=4)).train()
    frozen = next(module for module in model.modules() if isinstance(module, torch.nn.BatchNorm2d))
    frozen.eval()
    modes = [module.training for module in model.modules()]
    spec = ActivationSpec(format="fixed", rule=rule, calibration_batches=1)
    calibrate(model, [(torch.randn(2, 1, 28, 28), torch.zeros(2))], spec, progress=False)
    assert [module.training for module in model.modules()] == modes and not frozen.training
