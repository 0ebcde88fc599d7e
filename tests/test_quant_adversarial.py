"""The quantizers' public API under adversarial inputs, each result checked against a small float64 reference."""

from __future__ import annotations

import math

import pytest
import torch

from unsparse import create_model, save_sparse, sparsify
from unsparse.quant import ActivationSpec, KMeansQuantizer, LinearQuantizer
from unsparse.quant.activations import calibrate
from unsparse.quant.fixed_point import fixed_point_step, max_code
from unsparse.quant.histogram import MagnitudeHistogram, saturation_level
from unsparse.runtime import sparse_layers
from unsparse.sparse.format import UniformCSR

FLOAT32_MAX = torch.finfo(torch.float32).max
NO_ACTIVATIONS = ActivationSpec(format="none")


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


@pytest.mark.parametrize("power_of_two", [False, True])
@pytest.mark.parametrize("bits", [2, 8, 16])
@pytest.mark.parametrize("saturation", [3.5e38, 1e39, 1e300])
def test_a_saturation_beyond_float32s_range_is_refused_at_once(saturation, bits, power_of_two):
    """No float32 value lies beyond ``FLOAT32_MAX``, and a level stored in a float32 buffer (activations) becomes
    infinite. Such a level was walked down one float32 at a time when ``x_sat / q_max`` fit float32 (6 s for 3.5e38
    at 16 bits, minutes for 1e39), gave a step that is no power of two under ``power_of_two``, and was refused
    only where ``x_sat / q_max`` did not fit (2 bits)."""
    with pytest.raises(ValueError, match="saturation: expected a finite level > 0 and at most float32's largest"):
        fixed_point_step(saturation, bits, power_of_two)


@pytest.mark.parametrize("bits", [2, 8, 16])
def test_float32s_largest_value_still_gives_the_largest_step_whose_codes_stay_finite(bits):
    """The reference: ``x_sat / q_max`` in float64, then the float32 values below it until ``q_max·Δ`` is finite."""
    step = fixed_point_step(FLOAT32_MAX, bits)
    reference = torch.tensor(FLOAT32_MAX / max_code(bits), dtype=torch.float32)
    while not bool(torch.isfinite(reference * max_code(bits))):
        reference = torch.nextafter(reference, torch.tensor(0.0))
    assert step == float(reference)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64])
def test_kmeans_quantizes_weights_of_any_real_dtype_to_float32_like_the_other_schemes(dtype):
    """``quantize_values`` on float64 or integer weights raised torch's RuntimeError 'Index put requires the source
    and destination dtypes match'; the linear and FP16 schemes return float32 for them."""
    values = torch.tensor([[3, -1, 0, 7], [2, 0, 0, 0]], dtype=dtype)
    quantizer = KMeansQuantizer(clusters=2, n_init=1, activations=NO_ACTIVATIONS, progress=False)
    quantized, params = quantizer.quantize_values(values)
    reference, reference_params = quantizer.quantize_values(values.to(torch.float32))
    assert quantized.dtype == torch.float32 and torch.equal(quantized, reference) and params == reference_params
    assert torch.equal(quantized == 0, values == 0)
    empty, _ = quantizer.quantize_values(torch.zeros(2, 3, dtype=dtype))
    assert empty.dtype == torch.float32 and not bool(empty.any())


@pytest.mark.parametrize("scheme", [
    lambda: LinearQuantizer(activations=NO_ACTIVATIONS, progress=False),
    lambda: KMeansQuantizer(n_init=1, max_iter=20, activations=NO_ACTIVATIONS, progress=False),
])
@pytest.mark.parametrize("all_zero", [False, True])
def test_a_step_the_loader_refuses_is_refused_before_the_file_is_written(tmp_path, scheme, all_zero):
    """The encoders quantized with the step rounded to float32 and wrote the step as given, so a step that is no
    float32 value (from a codec spec edited by hand or a scheme's subclass), or 0 on an all-zero layer, saved and the
    file then failed to load; save_sparse promises the loader's checks before it writes."""
    model = scheme().quantize(sparse_model())
    layer = sparse_layers(model)["0.0"]
    if all_zero:
        layer.set_csr(UniformCSR.from_dense(torch.zeros(layer.weight_shape)))
        layer.unsparse_codecs["values"]["step"] = 0.0
    else:
        layer.unsparse_codecs["values"]["step"] += 1e-12  # rounds to the same float32 step
    path = tmp_path / "m.safetensors"
    with pytest.raises(ValueError, match=r"step must be a float32 value > 0"):
        save_sparse(model, path)
    assert not path.exists()


@pytest.mark.parametrize("bits", [2, 3, 8, 16])
@pytest.mark.parametrize("largest", [1.0, 0.75, 3.0, 2.0**-20])
def test_power_of_two_steps_top_out_just_below_the_next_power_of_two(bits, largest):
    """As the docstrings say (they claimed nothing saturates at ``weight_quantile=1``): eq. 21's grid ends at
    ``2^ceil(log2 max |w|) - Δ``; weights above it saturate, off by at most ``Δ``; the rest by at most ``Δ/2``.
    Reference in float64."""
    weights = torch.tensor([[largest, -largest, largest / 3, 0.0]])
    quantizer = LinearQuantizer(bits=bits, power_of_two=True, activations=NO_ACTIVATIONS, progress=False)
    quantized, params = quantizer.quantize_values(weights)
    step = 2.0 ** (math.ceil(math.log2(largest)) + 1 - bits)
    top = 2.0 ** math.ceil(math.log2(largest)) - step
    assert params["step"] == step
    assert float(quantized.abs().max()) == min(round(largest / step), 2 ** (bits - 1) - 1) * step <= top
    error = (quantized.double() - weights.double()).abs()
    assert bool((error <= step).all()) and bool((error[weights.abs() <= top] <= step / 2).all())
    assert float(quantized[0, 3]) == 0.0


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_histograms_refuse_magnitudes_that_are_not_finite_counting_them(value):
    """``saturation_level`` said 'upper: ... got nan (all values zero?)' for a NaN, naming an argument the caller
    never gave and guessing wrong; ``MagnitudeHistogram.add`` dropped a NaN silently and counted an infinity as
    ``upper``, so the level came from other data than the caller's. The refusal said 'x: NaN or infinite values' at
    first, again naming an argument the caller never sees; it now counts them, as the quantizers do."""
    x = torch.tensor([0.5, value, 0.0, -0.25])
    message = rf"^non-finite values \(1 {'NaN' if math.isnan(value) else 'infinite'}, of 4\); a saturation level needs"
    with pytest.raises(ValueError, match=message):
        saturation_level(x, 0.99, 16)
    histogram = MagnitudeHistogram(1.0, 4)
    with pytest.raises(ValueError, match=message):
        histogram.add(x)
    assert not bool(histogram.counts.any())


def test_histogram_levels_match_a_float64_reference_quantile():
    """The documented bound ``level - upper/bins <= t <= level`` for ``t`` the smallest magnitude with a share of at
    least ``quantile`` of the nonzero magnitudes at or below it; negative-only data, exact zeros left out."""
    generator = torch.Generator().manual_seed(4)
    for _ in range(200):
        x = -torch.rand(int(torch.randint(1, 60, (1,), generator=generator)), generator=generator)
        x[torch.rand(x.shape, generator=generator) < 0.3] = 0
        if not bool(x.any()):
            continue
        quantile, bins = float(torch.rand((), generator=generator)) * 0.99 + 0.01, 64
        magnitudes = x[x != 0].double().abs().sort().values
        reference = float(magnitudes[math.ceil(quantile * magnitudes.numel()) - 1])
        level = saturation_level(x, quantile, bins)
        assert level - float(magnitudes[-1]) / bins <= reference <= level * (1 + 1e-12)


@pytest.mark.filterwarnings("ignore:Number of distinct clusters")
def test_kmeans_is_repeatable_with_a_fixed_seed_and_keeps_zeros_zero():
    """Same seed, same result bitwise; at most ``clusters`` distinct nonzero values; no zero becomes nonzero."""
    generator = torch.Generator().manual_seed(5)
    values = torch.randn(8, 100, generator=generator)
    values[torch.rand(values.shape, generator=generator) < 0.7] = 0
    values[0, :5] = torch.tensor([1e-3, 1e-3, 1e-3, 5.0, -5.0])  # repeats and outliers
    values[1, :3] = 0.5

    def run(seed: int) -> tuple[torch.Tensor, dict]:
        return KMeansQuantizer(clusters=8, random_state=seed, activations=NO_ACTIVATIONS,
                               progress=False).quantize_values(values)

    (first, params), (again, params_again) = run(7), run(7)
    assert torch.equal(first, again) and params == params_again
    assert not bool(first[values == 0].any())
    assert torch.unique(first[first != 0]).numel() <= 8
    assert float(first.abs().max()) == float(first[0, 3:5].abs().max())  # the outliers' centroids end the grid
