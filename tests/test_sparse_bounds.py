"""Untrusted sizes through the direct API and the file reader: absurd geometries, meta weights and megabyte values
are refused with a short ValueError naming the field, never an OverflowError, a torch RuntimeError or a wrong answer;
and the reference convolution keeps its gathers within a byte budget without changing a bit of its result."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save

from unsparse import SparseFileError, create_model, load_sparse, save_sparse, sparsify
from unsparse.messages import QUOTE_MAX_CHARACTERS, quote, shorten
from unsparse.sparse import ConvGeometry, UniformCSR, sparse_conv2d
from unsparse.sparse.phases import phase_split
from unsparse.sparse.reference import output_pixel_offsets, reference_sparse_conv


def csr_3x3(channels=3, out=2, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return UniformCSR.from_dense(torch.randn(out, channels, 3, 3, generator=generator, dtype=torch.float64))


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"stride": 2**63}, "stride"),
    ({"padding": 2**70}, "padding"),
    ({"dilation": (1, 2**64)}, "dilation"),
    ({"groups": 2**63}, "groups"),
])
def test_a_geometry_value_beyond_int64_is_refused_naming_it(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}: .* 2\^63 or more"):
        ConvGeometry.of(**kwargs)


@pytest.mark.parametrize("call", [
    lambda: ConvGeometry(padding=2**62).padded_size(4, 4),
    lambda: ConvGeometry(padding=2**62).output_size(4, 4, (3, 3)),
    lambda: sparse_conv2d(torch.randn(1, 3, 8, 8, dtype=torch.float64), csr_3x3(), padding=2**62),
    # each padded size fits int64, the padded input's element count does not (torch: 'Storage size ... overflowed')
    lambda: sparse_conv2d(torch.randn(1, 3, 8, 8, dtype=torch.float64), csr_3x3(), padding=2**40),
])
def test_a_padding_whose_padded_input_overflows_int64_is_refused_naming_it(call):
    with pytest.raises(ValueError, match=r"^padding: "):
        call()


def test_offsets_beyond_int64_are_refused_naming_the_field():
    """Products of sizes each below 2^63 overflowed in torch's scalar conversion (OverflowError)."""
    csr = csr_3x3()
    with pytest.raises(ValueError, match=r"^padded_hw: "):
        ConvGeometry(dilation=2**62).stretched_offsets(csr.col_idx, (3, 3), (10, 10))
    with pytest.raises(ValueError, match=r"^padded_hw: "):  # hp * wp alone overflows; the channel offset needs it
        ConvGeometry().stretched_offsets(csr.col_idx, (3, 3), (2**40, 2**40))
    with pytest.raises(ValueError, match=r"^stride: "):
        output_pixel_offsets(ConvGeometry(stride=2**62), (2, 2), (10, 10), torch.device("cpu"))


def test_a_stride_beyond_the_input_still_gives_torchs_answer():
    """A stride of 2^62 is one torch computes (one output pixel); the offsets are formed without overflowing."""
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    csr = csr_3x3()
    expected = F.conv2d(x, csr.to_dense(), stride=2**62)
    assert torch.allclose(sparse_conv2d(x, csr, stride=2**62), expected, rtol=0, atol=1e-12)
    split = phase_split(csr, ConvGeometry(stride=2**62))  # allocated a table of 2^62 phases
    assert split.input_size(8, 8) == (1, 1)


def test_phase_sizes_are_exact_integers_beyond_float_precision():
    split = phase_split(csr_3x3(), ConvGeometry(stride=3))
    assert split.input_size(2**60 + 1, 2**60) == (2**60 // 3 + 1, 2**60 // 3 + 1)


def test_a_weight_shape_torch_cannot_hold_is_refused_by_the_constructor():
    """(1, 0, 2^62, 2) has no entries, so it passed; to_dense then ended in torch's RuntimeError."""
    with pytest.raises(ValueError, match=r"^weight_shape: .* 2\^63 or more"):
        UniformCSR(torch.zeros(1, 0), torch.zeros(1, 0, dtype=torch.int32), (1, 0, 2**62, 2))


def test_from_dense_refuses_a_meta_weight_naming_it():
    with pytest.raises(ValueError, match=r"^weight: a meta tensor .* no values to export"):
        UniformCSR.from_dense(torch.empty(4, 3, 3, 3, device="meta"))


def test_shorten_keeps_short_text_and_cuts_long_text_with_its_length():
    assert shorten("abc") == "abc"
    long = "x" * 5000
    assert shorten(long) == "x" * QUOTE_MAX_CHARACTERS + "... (5000 characters)"
    assert quote("ab") == "'ab'"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("export") / "model.safetensors"
    save_sparse(sparsify(create_model("vgg_small", width=4).eval()), path)
    with safe_open(str(path), "pt") as file:
        tensors = {key: file.get_tensor(key) for key in file.keys()}  # noqa: SIM118 (safe_open is not a dict)
        metadata = json.loads(file.metadata()["unsparse"])
    return tensors, metadata


HUGE = "y" * 2**20


@pytest.mark.parametrize(("mutate", "field"), [
    (lambda m: m.update(format_version=HUGE), "format_version"),
    (lambda m: m.update({HUGE: 1}), "metadata"),
    (lambda m: m["model"].update(name=HUGE), "model"),
    (lambda m: m["model"]["kwargs"].update({HUGE: 1}), "model"),
    (lambda m: m["layers"].update({HUGE: {}}), "layers"),
    (lambda m: next(iter(m["layers"].values())).update(row_length=HUGE), "row_length"),
    (lambda m: next(iter(m["layers"].values())).update(weight_shape=[HUGE]), "weight_shape"),
    (lambda m: next(iter(m["layers"].values())).update(geometry={"stride": HUGE}), "geometry"),
    (lambda m: next(iter(m["tensors"].values())).update(dtype=HUGE), "dtype"),
    (lambda m: next(iter(m["tensors"].values())).update(codec={"name": HUGE}), "codec"),
    (lambda m: m["tensors"].update({HUGE: {}}), "tensors"),
])
def test_errors_quote_at_most_a_short_part_of_a_huge_metadata_value(tmp_path, exported, mutate, field):
    tensors, metadata = exported
    metadata = json.loads(json.dumps(metadata))
    mutate(metadata)
    path = tmp_path / "bad.safetensors"
    path.write_bytes(save(tensors, metadata={"unsparse": json.dumps(metadata)}))
    with pytest.raises(SparseFileError, match=field) as raised:
        load_sparse(path)
    assert len(str(raised.value)) < 2000


def test_a_huge_stored_key_is_cut_in_the_error(tmp_path, exported):
    tensors, metadata = exported
    path = tmp_path / "bad.safetensors"
    path.write_bytes(save({**tensors, HUGE: torch.zeros(1)}, metadata={"unsparse": json.dumps(metadata)}))
    with pytest.raises(SparseFileError, match=r"\(1048576 characters\)") as raised:
        load_sparse(path)
    assert len(str(raised.value)) < 2000


@pytest.mark.parametrize(("shape", "stride", "padding", "dilation"), [
    ((3, 4, 45, 41), 1, 1, 1),   # 45 x 41 outputs: two pixel blocks of whole rows
    ((2, 3, 70, 33), 2, 2, 1),
    ((2, 2, 1, 2500), 1, (0, 3), (1, 2)),  # one output row longer than a block
])
def test_chunked_reference_conv_matches_torch_and_every_budget_gives_the_same_bits(shape, stride, padding, dilation):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, generator=generator, dtype=torch.float64)
    kernel = (1, 3) if shape[2] == 1 else (3, 3)
    weight = torch.randn(5, shape[1], *kernel, generator=generator, dtype=torch.float64)
    weight[torch.rand(weight.shape, generator=generator) < 0.6] = 0
    csr = UniformCSR.from_dense(weight)
    geometry = ConvGeometry.of(stride, padding, dilation)
    bias = torch.randn(5, generator=generator, dtype=torch.float64)
    whole = reference_sparse_conv(x, csr, bias, geometry, images_per_step=64, gather_budget_bytes=2**40)
    expected = F.conv2d(x, weight, bias, stride, padding, dilation)
    assert torch.allclose(whole, expected, rtol=1e-12, atol=1e-12)
    for budget, images in ((1, 64), (2**14, 64), (2**20, 1), (2**20, 2)):
        chunked = reference_sparse_conv(x, csr, bias, geometry, images_per_step=images, gather_budget_bytes=budget)
        assert torch.equal(chunked, whole), (budget, images)


def test_the_gathered_windows_stay_within_the_budget():
    """A VGG16-like layer (the 28x28 one, scaled down): no single allocation of the convolution exceeds the budget
    plus its (much smaller) gather index, where unchunked it held every image's windows at once."""
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(64, 64, 28, 28, generator=generator)
    csr = UniformCSR.from_dense(torch.randn(64, 64, 3, 3, generator=generator))
    budget = 2**24  # one product group's windows (8 images, 14.5 MB) fit
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profile:
        reference_sparse_conv(x, csr, None, ConvGeometry(padding=1), gather_budget_bytes=budget)
    gathers = [event.cpu_memory_usage for event in profile.events() if event.name == "aten::index"]
    assert gathers and max(gathers) <= budget
    windows = 64 * 64 * 9 * 28 * 28 * 4  # every image's windows, 116 MB
    assert windows > 4 * budget


def test_the_budget_must_be_a_positive_integer():
    x = torch.randn(1, 3, 8, 8, dtype=torch.float64)
    for budget in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="gather_budget_bytes"):
            reference_sparse_conv(x, csr_3x3(), None, ConvGeometry(), gather_budget_bytes=budget)
