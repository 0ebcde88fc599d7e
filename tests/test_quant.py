"""Quantization building blocks: fixed point (eq. 19-21), histogram saturation, bit packing, file codecs."""

from __future__ import annotations

import math

import pytest
import torch

from unsparse.quant import ActivationSpec, KMeansQuantizer, LinearQuantizer
from unsparse.quant.codecs import CodebookCodec, FixedPointCodec, Float16Codec, row_count_bits
from unsparse.quant.fixed_point import fake_quantize, fixed_point_step, from_codes, max_code, to_codes
from unsparse.quant.histogram import MagnitudeHistogram, saturation_level
from unsparse.quant.packing import pack_bits, packed_size, unpack_bits
from unsparse.sparse.format import SparseFormatError


@pytest.mark.parametrize("bits", [2, 4, 8, 16])
@pytest.mark.parametrize("power_of_two", [False, True])
def test_fixed_point_error_is_at_most_half_a_step_inside_the_range(bits, power_of_two):
    torch.manual_seed(bits)
    x = torch.randn(10_000) * 3
    saturation = float(x.abs().max())
    step = fixed_point_step(saturation, bits, power_of_two)
    inside = x.abs() <= max_code(bits) * step
    error = (fake_quantize(x, step, bits) - x).abs()
    assert bool((error[inside] <= step / 2 + x[inside].abs() * torch.finfo(torch.float32).eps).all())
    assert float(fake_quantize(x, step, bits).abs().max()) <= max_code(bits) * step * (1 + 1e-6)
    assert float(fake_quantize(torch.zeros(3), step, bits).abs().max()) == 0.0
    if power_of_two:
        assert math.log2(step).is_integer()
        assert max_code(bits) * step >= saturation / 2  # eq. 21 keeps the integer bits the range needs
    else:
        assert inside.all()  # eq. 20: nothing below the saturation level saturates


def test_values_beyond_the_saturation_level_saturate():
    step = fixed_point_step(1.0, 8)
    assert torch.equal(to_codes(torch.tensor([5.0, -5.0, 1.0]), step, 8), torch.tensor([127, -127, 127]))


def test_codes_rebuild_bitwise_and_the_step_is_a_float32_value():
    step = fixed_point_step(0.7, 8)
    assert float(torch.tensor(step, dtype=torch.float32)) == step
    x = fake_quantize(torch.randn(1000), step, 8)
    assert torch.equal(from_codes(to_codes(x, step, 8), step), x)


@pytest.mark.parametrize("bad", [1, 17, 0, -3, 8.0, True, "8"])
def test_bits_out_of_range_are_refused_everywhere(bad):
    for build in (lambda: LinearQuantizer(bits=bad), lambda: ActivationSpec(format="fixed", bits=bad),
                  lambda: KMeansQuantizer(centroid_bits=bad), lambda: fixed_point_step(1.0, bad)):
        with pytest.raises(ValueError, match="bits"):
            build()


@pytest.mark.parametrize("bad", [1, 0, 70_000, True])
def test_cluster_counts_out_of_range_are_refused(bad):
    with pytest.raises(ValueError, match="clusters"):
        KMeansQuantizer(clusters=bad)


def test_zero_saturation_is_refused():
    with pytest.raises(ValueError, match="saturation"):
        fixed_point_step(0.0, 8)


@pytest.mark.parametrize("quantile", [0.5, 0.9, 0.99, 0.999])
def test_histogram_saturation_picks_the_configured_quantile_of_the_nonzero_magnitudes(quantile):
    torch.manual_seed(0)
    x = torch.randn(200_000).relu() * torch.rand(200_000) * 4  # activation-like: many zeros, long tail
    bins = 1024
    level = saturation_level(x, quantile, bins)
    width = float(x.abs().max()) / bins
    magnitudes = x.abs()[x != 0]
    true = torch.sort(magnitudes).values[math.ceil(quantile * magnitudes.numel()) - 1]  # the quantile, exactly
    assert level - width <= float(true) <= level


def test_histogram_accumulates_batches_and_quantile_one_is_the_maximum():
    histogram = MagnitudeHistogram(4.0, 4)
    histogram.add(torch.tensor([0.5, -0.5, 1.5]))
    histogram.add(torch.tensor([[3.5, 9.0]]))  # beyond the upper bound: counted in the last bin
    assert histogram.counts.tolist() == [2, 1, 0, 2]
    assert histogram.level(0.4) == 1.0 and histogram.level(0.6) == 2.0 and histogram.level(1.0) == 4.0
    assert saturation_level(torch.tensor([0.1, -3.0]), 1.0, 7) == 3.0


@pytest.mark.parametrize("call", [lambda: saturation_level(torch.zeros(5), 0.99, 8),
                                  lambda: saturation_level(torch.ones(5), 0.0, 8),
                                  lambda: saturation_level(torch.ones(5), 1.5, 8),
                                  lambda: saturation_level(torch.ones(5), 0.9, 0),
                                  lambda: saturation_level(torch.ones(0), 0.9, 8),
                                  lambda: ActivationSpec(format="int8")])
def test_histogram_and_spec_errors(call):
    with pytest.raises(ValueError):
        call()


@pytest.mark.parametrize("bits", range(1, 33))
def test_bit_packing_round_trip(bits):
    torch.manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (37,))
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_size(37, bits) == math.ceil(37 * bits / 8)
    assert torch.equal(unpack_bits(packed, bits, 37, "x"), codes)


@pytest.mark.parametrize("bits", [1, 3, 7, 13, 16, 17, 31, 32])
def test_bit_packing_round_trips_across_chunks(bits, monkeypatch):
    """Codes are packed and unpacked a chunk at a time (bounded memory); a code may straddle two chunks' bytes."""
    from unsparse.quant import packing

    torch.manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (1001,))
    whole = pack_bits(codes, bits)
    monkeypatch.setattr(packing, "CHUNK_CODES", 5)
    assert torch.equal(pack_bits(codes, bits), whole)
    assert torch.equal(unpack_bits(whole, bits, 1001, "x"), codes)


def test_unpacking_names_the_field_for_a_code_width_beyond_32_bits():
    with pytest.raises(SparseFormatError, match=r"layer.values::row_nnz: bits"):
        unpack_bits(torch.zeros(5, dtype=torch.uint8), 33, 1, "layer.values::row_nnz")


def test_packing_layout_two_4_bit_indices_per_byte_low_nibble_first():
    assert pack_bits(torch.tensor([1, 2, 15]), 4).tolist() == [0x21, 0x0F]
    assert pack_bits(torch.tensor([1, 2, 15], dtype=torch.uint16), 4).tolist() == [0x21, 0x0F]
    assert pack_bits(torch.tensor([200, 7]), 8).tolist() == [200, 7]
    assert pack_bits(torch.tensor([0x1234]), 16).tolist() == [0x34, 0x12]
    assert pack_bits(torch.tensor([0x1_0002, 1]), 17).tolist() == [0x02, 0x00, 0x03, 0x00, 0x00]


@pytest.mark.parametrize(("packed", "match"), [
    (torch.tensor([0x21], dtype=torch.uint8), "bytes"),
    (torch.tensor([0x21, 0x0F], dtype=torch.int16), "uint8"),
    (torch.tensor([0x21, 0xFF], dtype=torch.uint8), "padding bits"),
])
def test_unpacking_rejects_malformed_parts(packed, match):
    with pytest.raises(SparseFormatError, match=match):
        unpack_bits(packed, 4, 3, "layer.values::indices")


def test_packing_rejects_codes_that_do_not_fit():
    with pytest.raises(ValueError, match="codes"):
        pack_bits(torch.tensor([16]), 4)


def grid_values(bits=8, step=0.01, shape=(6, 5)):
    """UniformCSR-like values on a fixed-point grid: stored weights first, zero padding last in each row."""
    torch.manual_seed(1)
    values = from_codes(torch.randint(-max_code(bits), max_code(bits) + 1, shape), step)
    values[values == 0] = step
    values[torch.arange(shape[1]) >= torch.randint(0, shape[1] + 1, (shape[0], 1))] = 0.0
    return values


@pytest.mark.parametrize(("codec", "params"), [
    (Float16Codec(), {"name": "float16"}),
    (FixedPointCodec(), {"name": "fixed_point", "bits": 8, "step": 0.009999999776482582}),
    (CodebookCodec(), {"name": "codebook", "index_bits": 4, "centroid_bits": 8, "step": 0.009999999776482582}),
])
def test_codecs_decode_bitwise_what_they_encode(codec, params):
    step = 0.009999999776482582  # float32(0.01)
    values = grid_values(step=step)
    if codec.name == "codebook":  # at most 16 distinct stored values
        values = from_codes(to_codes(values, step, 8) % 16, step) * (values != 0)
    if codec.name == "float16":
        values = values.half().float()
    parts = codec.encode(values, params)
    decoded = codec.decode(parts, params, tuple(values.shape), "layer.values")
    assert decoded.dtype == torch.float32 and torch.equal(decoded, values)


def test_codebook_parts_are_packed_indices_codebook_and_row_counts():
    step = 0.5
    values = torch.tensor([[1.0, -0.5, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    parts = CodebookCodec().encode(values, {"index_bits": 4, "centroid_bits": 8, "step": step})
    assert parts["centroids"].tolist() == [-1, 2, 4] and parts["centroids"].dtype == torch.int8
    assert parts["indices"].numel() == packed_size(9, 4) == 5
    assert unpack_bits(parts["row_nnz"], row_count_bits(3), 3, "r").tolist() == [2, 1, 0]
    wide = CodebookCodec().encode(values, {"index_bits": 4, "centroid_bits": 16, "step": step})
    assert wide["centroids"].dtype == torch.int16


@pytest.mark.parametrize(("codec", "params", "values", "match"), [
    (Float16Codec(), {}, torch.tensor([[1e-3]]), "float16"),
    (Float16Codec(), {}, torch.tensor([[1.0]], dtype=torch.float64), "float32"),
    (FixedPointCodec(), {"bits": 8, "step": 0.5}, torch.tensor([[0.3]]), "grid"),
    (CodebookCodec(), {"index_bits": 1, "centroid_bits": 8, "step": 1.0}, torch.tensor([[1.0, 2.0, 3.0]]),
     "distinct"),
    (CodebookCodec(), {"index_bits": 4, "centroid_bits": 8, "step": 1.0}, torch.ones(2, 2, 2), "(M, L)"),
])
def test_codecs_refuse_tensors_that_were_not_quantized_for_them(codec, params, values, match):
    with pytest.raises(ValueError, match=match):
        codec.encode(values, params)


CODEBOOK = {"name": "codebook", "index_bits": 4, "centroid_bits": 8, "step": 0.5}
BASE_VALUES = torch.tensor([[1.0, -0.5, 0.0, 0.0], [2.0, 0.0, 0.0, 0.0]])


def tampered_codebook(change):
    parts = CodebookCodec().encode(BASE_VALUES, CODEBOOK)
    params = dict(CODEBOOK)
    change(parts, params)
    return parts, params


@pytest.mark.parametrize(("change", "match"), [
    (lambda parts, params: params.update(step=-1.0), "step"),
    (lambda parts, params: params.update(step=True), "step"),
    (lambda parts, params: params.update(index_bits=17), "index_bits"),
    (lambda parts, params: params.update(extra=1), "params"),
    (lambda parts, params: parts.pop("row_nnz"), "parts"),
    (lambda parts, params: parts.update(centroids=torch.tensor([-128, 2, 4], dtype=torch.int8)), "centroids"),
    (lambda parts, params: parts.update(centroids=parts["centroids"].to(torch.int16)), "centroids"),
    (lambda parts, params: parts.update(centroids=parts["centroids"][:1]), "indices"),
    (lambda parts, params: parts.update(indices=pack_bits(torch.tensor([0, 1, 5, 0, 0, 0, 0, 0]), 4)), "padding entry"),
    (lambda parts, params: parts.update(row_nnz=pack_bits(torch.tensor([5, 1]), 3)), "row_nnz"),
])
def test_codebook_decode_rejects_tampered_parts_naming_the_field(change, match):
    parts, params = tampered_codebook(change)
    with pytest.raises(SparseFormatError, match=match) as raised:
        CodebookCodec().decode(parts, params, (2, 4), "features.0.0.values")
    assert "features.0.0.values" in str(raised.value)


@pytest.mark.parametrize(("parts", "params", "match"), [
    ({"codes": torch.tensor([0x80], dtype=torch.uint8)}, {"name": "fixed_point", "bits": 8, "step": 1.0}, "code"),
    ({"codes": torch.tensor([1], dtype=torch.uint8)}, {"name": "fixed_point", "bits": 18, "step": 1.0}, "bits"),
    ({"half": torch.ones(2, dtype=torch.float16)}, {"name": "float16"}, "float16"),
])
def test_fixed_point_and_float16_decode_reject_bad_parts(parts, params, match):
    codec = {"fixed_point": FixedPointCodec(), "float16": Float16Codec()}[params["name"]]
    with pytest.raises(SparseFormatError, match=match):
        codec.decode(parts, params, (1, 1), "layer.values")
