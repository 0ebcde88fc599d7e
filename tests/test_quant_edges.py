"""Quantization edge cases: exact zeros in calibration inputs, non-finite and extreme values, codebook rows of
65,536 entries or more, re-packing after quantization, and settings refused up front naming the field."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch
from torch import nn

from unsparse import create_model, load_sparse, save_sparse, sparsify
from unsparse.quant import FP16Quantizer, KMeansQuantizer, LinearQuantizer
from unsparse.quant.activations import ActivationQuantizer, ActivationSpec, attach_activation_quantizers, calibrate
from unsparse.quant.codecs import CodebookCodec, row_count_bits
from unsparse.quant.fixed_point import fake_quantize, fixed_point_step, from_codes, max_code, to_codes
from unsparse.quant.histogram import MAX_BINS, MagnitudeHistogram, saturation_level
from unsparse.quant.packing import pack_bits
from unsparse.runtime.modules import sparse_from_conv, sparse_layers
from unsparse.sparse.format import SparseFormatError

FLOAT32_MAX = torch.finfo(torch.float32).max
NO_ACTIVATIONS = ActivationSpec(format="none")
SCHEMES = {
    "linear": lambda: LinearQuantizer(bits=8, activations=NO_ACTIVATIONS, progress=False),
    "kmeans": lambda: KMeansQuantizer(n_init=1, max_iter=20, activations=NO_ACTIVATIONS, progress=False),
    "fp16": lambda: FP16Quantizer(activations=NO_ACTIVATIONS, progress=False),
}


def sparse_model(**kwargs) -> nn.Module:
    """An unpruned sparse ``vgg_small`` (width 4 unless given), random weights."""
    torch.manual_seed(0)
    return sparsify(create_model("vgg_small", **{"width": 4, **kwargs}).eval())


def assert_round_trips(model: nn.Module, path) -> nn.Module:
    """Save ``model``, load it back and check every sparse layer's values are bitwise the same; the loaded model."""
    loaded = load_sparse(save_sparse(model, path))
    for name, layer in sparse_layers(model).items():
        assert torch.equal(sparse_layers(loaded)[name].values, layer.values)
    return loaded


def with_zeros(nonzero: torch.Tensor, zero_share: float) -> torch.Tensor:
    """``nonzero`` followed by as many exact zeros as make ``zero_share`` of the result."""
    zeros = round(nonzero.numel() * zero_share / (1 - zero_share))
    return torch.cat([nonzero, torch.zeros(zeros)])


@pytest.mark.parametrize("zero_share", [0.5, 0.9, 0.995])
def test_saturation_level_does_not_depend_on_the_share_of_exact_zeros(zero_share):
    nonzero = torch.rand(2000, generator=torch.Generator().manual_seed(0)) + 1e-3
    assert saturation_level(with_zeros(nonzero, zero_share), 0.99, 1024) == saturation_level(nonzero, 0.99, 1024)


def test_calibration_level_is_the_quantile_of_the_nonzero_inputs_when_most_inputs_are_zero():
    generator = torch.Generator().manual_seed(1)
    x = torch.rand(16, 1, 28, 28, generator=generator) + 1e-3
    x[torch.rand(x.shape, generator=generator) < 0.995] = 0  # a ReLU output with 99.5 % zeros
    model = nn.Sequential(sparse_from_conv(nn.Conv2d(1, 4, 3, padding=1)))
    spec = ActivationSpec(format="fixed", bins=1024, calibration_batches=1)
    level = calibrate(model, [(x, torch.zeros(16))], spec, progress=False)["0"]
    nonzero = torch.sort(x[x != 0]).values
    true = float(nonzero[math.ceil(0.99 * nonzero.numel()) - 1])
    assert level - float(x.max()) / 1024 <= true <= level
    assert float((nonzero > level).float().mean()) <= 0.01  # at most 1 % of the nonzero inputs saturate


@pytest.mark.parametrize("bits", [2, 3, 8, 16])
def test_fake_quantize_is_bitwise_the_integer_code_path_for_finite_inputs(bits):
    generator = torch.Generator().manual_seed(bits)
    for step in (fixed_point_step(1.0, bits), fixed_point_step(3e-5, bits, power_of_two=True), 0.1):
        codes = torch.randint(-2 * max_code(bits), 2 * max_code(bits) + 1, (20_000,), generator=generator)
        ties = (codes.to(torch.float32) + 0.5) * step  # halfway between codes: round half to even
        x = torch.cat([torch.randn(20_000, generator=generator) * step * max_code(bits), ties,
                       torch.rand(1000, generator=generator) * -step / 2,  # small negatives: code 0, not -0.0
                       torch.tensor([0.0, -0.0, FLOAT32_MAX, -FLOAT32_MAX])])
        integer_path = from_codes(to_codes(x, step, bits), step)
        assert torch.equal(fake_quantize(x, step, bits).view(torch.int32), integer_path.view(torch.int32))


def test_fake_quantize_keeps_nan_and_saturates_infinities():
    step = fixed_point_step(4.0, 8)
    out = fake_quantize(torch.tensor([float("nan"), float("inf"), -float("inf"), 0.5]), step, 8)
    assert math.isnan(out[0]) and torch.equal(out[1:3], from_codes(torch.tensor([127, -127]), step))
    quantizer = ActivationQuantizer(ActivationSpec(format="fixed", bits=8))
    quantizer.saturation.fill_(4.0)
    assert math.isnan(quantizer(torch.tensor([float("nan")])))


def test_a_fixed_quantizer_follows_every_change_of_its_saturation_level():
    """The step is read from the level once per value it holds: a later calibration (in place), a loaded state,
    a cast to another dtype and a new buffer tensor must each give the new level's grid, not the first one's."""
    quantizer = ActivationQuantizer(ActivationSpec(format="fixed", bits=4))
    x = torch.linspace(-3, 3, 101)
    with pytest.raises(ValueError, match="saturation"):  # uncalibrated: level 0
        quantizer(x)
    for level in (1.0, 2.0, 0.5):
        quantizer.saturation.fill_(level)
        assert torch.equal(quantizer(x), fake_quantize(x, fixed_point_step(level, 4), 4))
    other = ActivationQuantizer(ActivationSpec(format="fixed", bits=4))
    other.saturation.fill_(3.0)
    quantizer.load_state_dict(other.state_dict())
    assert torch.equal(quantizer(x), fake_quantize(x, fixed_point_step(3.0, 4), 4))
    quantizer.double()  # a new buffer tensor holding the level in float64
    assert torch.equal(quantizer(x.double()), fake_quantize(x, fixed_point_step(3.0, 4), 4).double())
    for level in (1.5, 2.5):  # new tensors, both never written in place
        quantizer.saturation = torch.tensor(level)
        assert torch.equal(quantizer(x), fake_quantize(x, fixed_point_step(level, 4), 4))


@pytest.mark.parametrize("power_of_two", [False, True])
@pytest.mark.parametrize("bits", range(2, 17))
def test_a_step_for_float32s_largest_value_keeps_every_code_finite(bits, power_of_two):
    step = fixed_point_step(FLOAT32_MAX, bits, power_of_two)
    assert float(torch.tensor(step, dtype=torch.float32)) == step
    out = fake_quantize(torch.tensor([FLOAT32_MAX, -FLOAT32_MAX]), step, bits)
    assert bool(torch.isfinite(out).all()) and float(out[0]) >= FLOAT32_MAX * (1 - 2 / max_code(bits))


@pytest.mark.filterwarnings("ignore:Number of distinct clusters")  # the outlier leaves k-means few clusters
@pytest.mark.parametrize("scheme", ["linear", "kmeans"])
def test_a_weight_at_float32s_largest_value_quantizes_to_a_finite_value_and_round_trips(tmp_path, scheme):
    model = sparse_model()
    with torch.no_grad():
        model.get_submodule("0.0").values[0, 0] = FLOAT32_MAX
    SCHEMES[scheme]().quantize(model)
    assert bool(torch.isfinite(model.get_submodule("0.0").values).all())
    assert float(model.get_submodule("0.0").values[0, 0]) >= FLOAT32_MAX * (1 - 2 / 127)
    assert_round_trips(model, tmp_path / "m.safetensors")


def test_codebook_rows_of_65536_entries_or_more_encode_and_decode():
    L = (1 << 16) + 2  # row counts up to L need 17 bits
    values = torch.zeros(3, L)
    values[0, :] = 0.5
    values[1, : L - 1] = -1.0
    params = {"name": "codebook", "index_bits": 4, "centroid_bits": 8, "step": 0.5}
    parts = CodebookCodec().encode(values, params)
    assert row_count_bits(L) == 17
    assert torch.equal(CodebookCodec().decode(parts, params, (3, L), "big.values"), values)
    parts["row_nnz"] = pack_bits(torch.tensor([L + 1, 0, 0]), 17)
    with pytest.raises(SparseFormatError, match=r"big.values::row_nnz: .*exceeds the row length"):
        CodebookCodec().decode(parts, params, (3, L), "big.values")


def test_kmeans_quantized_layers_with_rows_of_65536_entries_or_more_save_and_load(tmp_path):
    model = SCHEMES["kmeans"]().quantize(sparse_model(in_channels=7282, width=1))  # first conv: K = 7282 * 9
    assert model.get_submodule("0.0").csr.row_length >= 1 << 16
    assert_round_trips(model, tmp_path / "m.safetensors")


@pytest.mark.parametrize("scheme", SCHEMES)
def test_weights_that_quantize_to_zero_leave_the_stored_entries(tmp_path, scheme):
    model = sparse_model()
    with torch.no_grad():
        values = model.get_submodule("3.0").values
        values[values != 0] = 1e-9  # below every scheme's grid: quantizes to zero
        values[0, 0] = 1.0  # sets the step (linear, k-means); the one weight left
    column = int(model.get_submodule("3.0").col_idx[0, 0])
    SCHEMES[scheme]().quantize(model)
    csr = model.get_submodule("3.0").csr
    assert csr.row_length == 1 and csr.nnz == 1  # L is the largest nnz of any row again
    assert int(csr.col_idx[0, 0]) == column and float(csr.values[0, 0]) == pytest.approx(1.0, rel=1e-2)
    for layer in sparse_layers(model).values():
        assert layer.csr.row_length == int((layer.values != 0).sum(dim=1).max())
    loaded = assert_round_trips(model, tmp_path / "m.safetensors")
    assert loaded.unsparse_metadata["layers"]["3.0"]["row_length"] == 1


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_are_refused_naming_the_layer(scheme, value):
    model = sparse_model()
    with torch.no_grad():
        model.get_submodule("3.0").values[0, 0] = value
    before = {name: layer.values.clone() for name, layer in sparse_layers(model).items()}
    with pytest.raises(ValueError, match=r"^3\.0\.values: non-finite weights"):
        SCHEMES[scheme]().quantize(model)
    for name, layer in sparse_layers(model).items():  # the model is left as it was
        assert torch.equal(layer.values.nan_to_num(), before[name].nan_to_num())
    assert not hasattr(model, "unsparse_quantization")


def test_a_schemes_own_errors_name_the_layer():
    model = sparse_model()
    with torch.no_grad():
        model.get_submodule("3.0").values[0, 0] = 70000.0  # beyond float16's range
    with pytest.raises(ValueError, match=r"^3\.0\.values: weights exceed float16"):
        FP16Quantizer(activations=NO_ACTIVATIONS, progress=False).quantize(model)


def test_a_schemes_errors_of_other_kinds_name_the_layer_in_a_note():
    """An error that is no ValueError (e.g. torch's RuntimeError when memory runs out) keeps its type and message
    and gains a note naming the layer: with 50 layers the traceback alone did not say which one failed."""
    quantizer = SCHEMES["fp16"]()

    def out_of_memory(values):
        raise RuntimeError("DefaultCPUAllocator: not enough memory")

    quantizer.quantize_values = out_of_memory
    with pytest.raises(RuntimeError) as info:
        quantizer.quantize(sparse_model())
    assert str(info.value) == "DefaultCPUAllocator: not enough memory"
    assert info.value.__notes__ == ["while quantizing layer 0.0.values"]


@pytest.mark.parametrize(("build", "field"), [
    (lambda: LinearQuantizer(weight_quantile=1.5), "weight_quantile"),
    (lambda: LinearQuantizer(weight_quantile=True), "weight_quantile"),
    (lambda: ActivationSpec(format="fixed", quantile=0), r"activations\.quantile"),
    (lambda: LinearQuantizer(power_of_two="false"), "power_of_two"),
    (lambda: LinearQuantizer(power_of_two=1), "power_of_two"),
    (lambda: LinearQuantizer(bins=True), "bins"),
    (lambda: KMeansQuantizer(n_init=0), "n_init"),
    (lambda: KMeansQuantizer(n_init=2.0), "n_init"),
    (lambda: KMeansQuantizer(max_iter=0), "max_iter"),
    (lambda: KMeansQuantizer(init="kmeans"), "init"),
    (lambda: KMeansQuantizer(random_state=-1), "random_state"),
    (lambda: KMeansQuantizer(random_state=1 << 32), "random_state"),
    (lambda: KMeansQuantizer(random_state=None), "random_state"),
    (lambda: KMeansQuantizer(clusters=True), "clusters"),
    (lambda: FP16Quantizer(activations="fp16"), "activations"),
    (lambda: LinearQuantizer(activations={"format": "fixed"}), "activations"),
    (lambda: KMeansQuantizer(activations="none"), "activations"),
])
def test_bad_settings_are_refused_up_front_naming_the_field(build, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        build()


@pytest.mark.parametrize("clusters", [2, 3, 5, 17])
def test_kmeans_with_a_cluster_count_that_is_no_power_of_two_saves_and_loads(tmp_path, clusters):
    """Only 16 clusters were tested, where rounding log2 down or up agree (a mutation audit's find)."""
    quantizer = KMeansQuantizer(clusters=clusters, n_init=1, max_iter=20, activations=NO_ACTIVATIONS, progress=False)
    assert quantizer.index_bits == math.ceil(math.log2(clusters))
    model = quantizer.quantize(sparse_model())
    assert max(int(torch.unique(layer.values[layer.values != 0]).numel()) for layer in
               sparse_layers(model).values()) == clusters
    assert_round_trips(model, tmp_path / "m.safetensors")


def test_kmeans_keeps_exactly_as_many_distinct_weights_as_clusters():
    """With as many distinct weights as clusters the centroids are those weights, exactly (not k-means' estimate)."""
    weights = torch.arange(1, 17, dtype=torch.float64).repeat(3) / 7
    centroids, labels = KMeansQuantizer(clusters=16).cluster(weights)
    assert torch.equal(centroids[labels], weights)


def test_a_histogram_level_holds_every_magnitude_it_counted():
    """torch.histc placed a magnitude one ulp above a bin's upper edge ``upper·(i+1)/bins`` in that bin (its own edges
    differ from the level's by an ulp), so the level could lie below a value counted inside it; and the last edge
    ``upper·bins/bins`` could miss ``upper`` itself (the maximum then saturated at quantile 1)."""
    generator = torch.Generator().manual_seed(0)
    for bins in (3, 7, 10, 18, 43):
        for upper in (torch.rand(20, dtype=torch.float64, generator=generator) + 0.1).tolist():
            edges = upper * torch.arange(1, bins, dtype=torch.float64) / bins
            x = torch.cat([edges, torch.nextafter(edges, torch.full_like(edges, 2.0)),
                           torch.nextafter(edges, torch.zeros_like(edges)), torch.tensor([upper], dtype=torch.float64)])
            histogram = MagnitudeHistogram(upper, bins)
            histogram.add(x)
            cumulative = torch.cumsum(histogram.counts, 0) / x.numel()
            for share in cumulative[cumulative > 0].unique().tolist():
                assert float((x <= histogram.level(share)).double().mean()) >= share
            assert histogram.level(1.0) == upper


@pytest.mark.parametrize(("build", "field"), [
    (lambda: MagnitudeHistogram(1.0, MAX_BINS + 1), "bins"),
    (lambda: saturation_level(torch.ones(3), 0.9, 10**12), "bins"),
    (lambda: LinearQuantizer(bins=MAX_BINS + 1), "bins"),
    (lambda: ActivationSpec(format="fixed", bins=10**12), r"activations\.bins"),
    (lambda: ActivationSpec(format="fixed", calibration_batches=10**30), r"activations\.calibration_batches"),
])
def test_histogram_bins_and_calibration_batches_are_bounded(build, field):
    """A huge ``bins`` allocated ``8·bins`` bytes per layer (10^12: 8 TB); 10^30 calibration batches passed the
    check and then failed inside itertools.islice, naming nothing."""
    with pytest.raises(ValueError, match=f"^{field}: expected an integer in \\[1, "):
        build()


def test_the_largest_bin_count_still_works():
    assert saturation_level(torch.tensor([1.0, 2.0, 4.0]), 1.0, MAX_BINS) == 4.0


def float16_reference(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded once to the nearest float16 (numpy's conversion from float64 rounds once), as float64."""
    return torch.from_numpy(x.numpy().astype(np.float16).astype(np.float64))


def double_rounding_cases() -> torch.Tensor:
    """float64 values just above a float16 halfway point, by less than float32 keeps (float64 -> float32 -> float16
    lands on the tie and rounds to even: down), random values and subnormals, both signs."""
    generator = torch.Generator().manual_seed(0)
    halfway = torch.tensor([1 + 2**-11, 2**-25, 3 * 2**-25, 65504 + 8, 1000.5, 2**-14 + 2**-25], dtype=torch.float64)
    above = halfway * (1 + 2**-40)
    scaled = torch.randn(5000, dtype=torch.float64, generator=generator) * 2.0 ** torch.randint(
        -30, 16, (5000,), generator=generator)
    values = torch.cat([above, halfway, scaled, torch.tensor([0.0, 1e-300, 1e300, 65519.9, 65520.0])])
    return torch.cat([values, -values])


def test_fp16_activations_of_float64_inputs_round_once():
    """torch's float64 -> float16 conversion goes through float32 and rounds twice: 1 + 2^-11 + 2^-40 gave 1.0."""
    x = double_rounding_cases()
    x = x[x.abs() < 65504]  # in float16's range (beyond it: saturation, tested below)
    quantizer = ActivationQuantizer(ActivationSpec(format="fp16"))
    assert float(quantizer(torch.tensor([1 + 2**-11 + 2**-40], dtype=torch.float64))) == 1 + 2**-10
    out = quantizer(x)
    assert out.dtype == torch.float64 and torch.equal(out, float16_reference(x))
    assert torch.equal(quantizer(x.float()), float16_reference(x.float().double()).float())


def test_fp16_weights_given_as_float64_round_once():
    x = double_rounding_cases()
    x = x[x.abs() < 65504].reshape(2, -1)
    quantized, _ = FP16Quantizer(progress=False).quantize_values(x)
    assert quantized.dtype == torch.float32 and torch.equal(quantized.double(), float16_reference(x))


def test_fp16_activations_beyond_float16s_range_saturate_with_a_warning(caplog):
    """They overflowed to infinity silently; the fixed format saturates at its level, and so does fp16 now, at
    float16's largest value, saying so once per layer."""
    model = nn.Sequential(sparse_from_conv(nn.Conv2d(1, 2, 1)))
    quantizer = attach_activation_quantizers(model, ActivationSpec(format="fp16"))["0"]
    x = torch.tensor([70000.0, -1e6, 65519.0, float("inf"), -float("inf"), float("nan"), 1.5])
    with caplog.at_level(logging.WARNING, logger="unsparse.quant.activations"):
        out = quantizer(x)
        quantizer(x)
    assert torch.equal(out[:5], torch.tensor([65504.0, -65504.0, 65504.0, 65504.0, -65504.0]))
    assert math.isnan(out[5]) and float(out[6]) == 1.5
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 1 and "0.input_quantizer" in messages[0] and "65504" in messages[0]
    assert "4 values" in messages[0]  # 65519 rounds to 65504 anyway: not beyond the range



def test_fp16_activations_off_the_cpu_saturate_without_reading_the_values_back():
    """Counting the saturated values read a number back to the host at every layer: on CUDA that synchronised each
    forward, and a CUDA-graph capture of an FP16-quantized model failed (cudaErrorStreamCaptureInvalidated; the
    plan check's graph timing then fell back to eager, and the failed capture left torch's CUDA generator
    unusable). A ``meta`` tensor stands in for such a device here: its values cannot be read at all."""
    model = nn.Sequential(sparse_from_conv(nn.Conv2d(1, 2, 1)))
    quantizer = attach_activation_quantizers(model, ActivationSpec(format="fp16"))["0"]
    out = quantizer(torch.full((2, 1, 3, 3), 70000.0, device="meta"))
    assert out.device.type == "meta" and out.shape == (2, 1, 3, 3) and out.dtype == torch.float32


@pytest.mark.parametrize("power_of_two", [False, True])
@pytest.mark.parametrize("bits", [2, 8, 16])
def test_a_step_below_float32s_normal_range_keeps_the_saturation_level_on_the_grid(bits, power_of_two):
    """A step below 2^-149 rounded to 0 and was refused; one just above rounded to nearest lost up to a third of
    itself (q_max·Δ fell below x_sat, so the largest values saturated far below it)."""
    tiny = 2.0**-149
    for saturation in (5e-324, 1e-46, 1e-44, 1.4 * max_code(bits) * tiny, 1e-40, 1e-39):
        step = fixed_point_step(saturation, bits, power_of_two)
        assert step > 0 and float(torch.tensor(step, dtype=torch.float32)) == step
        assert max_code(bits) * step >= saturation or power_of_two
        if power_of_two:
            assert math.frexp(step)[0] == 0.5


@pytest.mark.parametrize("scheme", ["linear16", "linear16_pow2", "kmeans"])
def test_layers_of_subnormal_weights_quantize_and_round_trip(tmp_path, scheme):
    """A layer of weights near 1e-42 (float32 subnormals) was refused: its 16-bit step rounded to 0 in float32.
    The smallest float32 step holds every subnormal exactly, so the quantization is exact."""
    build = {"linear16": lambda: LinearQuantizer(bits=16, activations=NO_ACTIVATIONS, progress=False),
             "linear16_pow2": lambda: LinearQuantizer(bits=16, power_of_two=True, activations=NO_ACTIVATIONS,
                                                      progress=False),
             "kmeans": lambda: KMeansQuantizer(clusters=2, centroid_bits=16, n_init=1, activations=NO_ACTIVATIONS,
                                               progress=False)}[scheme]
    model = sparse_model()
    with torch.no_grad():
        values = model.get_submodule("3.0").values
        values[values != 0] = torch.where(values[values != 0] > 0, 1e-42, -3e-43)
    expected = values.clone()
    build().quantize(model)
    assert torch.equal(model.get_submodule("3.0").values, expected)
    assert_round_trips(model, tmp_path / "m.safetensors")


def test_tiny_activations_calibrate_quantize_and_load(tmp_path):
    """Calibration inputs near 1e-44 gave a saturation level whose step rounded to 0: the quantizer failed on its
    first forward pass, and the file it wrote was refused on load."""
    model = sparse_model()
    images = torch.full((2, 1, 28, 28), 1e-44)
    quantizer = LinearQuantizer(activations=ActivationSpec(format="fixed", calibration_batches=1), progress=False)
    quantizer.quantize(model, [(images, torch.zeros(2))])
    first = model.get_submodule("0.0").input_quantizer
    assert float(first.saturation) > 0 and torch.equal(first(images), images)
    loaded = assert_round_trips(model, tmp_path / "m.safetensors")
    assert torch.equal(loaded.get_submodule("0.0").input_quantizer.saturation, first.saturation)
