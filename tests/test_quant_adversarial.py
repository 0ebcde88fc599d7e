"""The quantizers' public API under adversarial inputs, each result checked against a small float64 reference."""

from __future__ import annotations

import math

import pytest
import torch

from unsparse import create_model, sparsify
from unsparse.quant import ActivationSpec
from unsparse.quant.activations import calibrate


def sparse_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return sparsify(create_model("vgg_small", width=4).eval())


def images(value: float | None = None) -> torch.Tensor:
    """A calibration batch ``(4, 1, 28, 28)``; with ``value``, its first pixel is that value."""
    x = torch.rand(4, 1, 28, 28, generator=torch.Generator().manual_seed(3)) + 0.1
    if value is not None:
        x[0, 0, 0, 0] = value
    return x


@pytest.mark.parametrize("rule", ["quantile", "fraction_of_max"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_calibration_inputs_that_are_not_finite_are_refused_naming_the_layer(rule, value):
    """A NaN pixel made every layer's level the 'all inputs zero' level 1.0 (Python's max skips NaN), with a
    warning that said the inputs were zero; an infinite one failed on a field 'upper' the caller never gave."""
    spec = ActivationSpec(format="fixed", rule=rule)
    with pytest.raises(ValueError, match=r"calibration: the input of layer 0\.0 holds NaN or infinite values"):
        calibrate(sparse_model(), [(images(value), torch.zeros(4))], spec, progress=False)


def test_calibration_levels_of_finite_inputs_are_the_histogram_quantiles():
    """The same check leaves finite data alone: the first layer's level is the reference quantile of its input."""
    x = images()
    spec = ActivationSpec(format="fixed", quantile=0.9, bins=4096)
    level = calibrate(sparse_model(), [(x, torch.zeros(4))], spec, progress=False)["0.0"]
    magnitudes = x.double().abs().reshape(-1).sort().values
    reference = float(magnitudes[math.ceil(0.9 * magnitudes.numel()) - 1])  # smallest t with share(<= t) >= 0.9
    assert level - float(magnitudes[-1]) / 4096 <= reference <= level
