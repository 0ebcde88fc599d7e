"""Every CPU backend against torch.nn.functional.conv2d/conv1d in float64 on fresh random inputs."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from unsparse.sparse import ConvGeometry, UniformCSR, sparse_conv1d, sparse_conv2d
from unsparse.sparse.functional import sparse_conv
from unsparse.sparse.reference import reference_sparse_conv

CPU_BACKENDS = ["reference", "dense_cpu", "im2col_cublas", "im2col_cusparse"]

# (N, C, H, W, M, R, S, stride, padding, dilation)
CASES_2D = [
    (2, 3, 9, 9, 4, 1, 1, 1, 0, 1),
    (3, 5, 13, 11, 7, 3, 3, 1, 1, 1),
    (2, 4, 17, 15, 6, 5, 5, 2, 2, 1),
    (1, 3, 63, 63, 8, 11, 11, 4, 2, 1),
    (2, 6, 12, 10, 5, 2, 5, (2, 1), (0, 2), 1),
    (2, 4, 15, 14, 3, 3, 3, 1, 2, (2, 3)),
    (1, 2, 5, 7, 3, 3, 3, 2, 0, 1),
]


def sparse_weight(shape, sparsity, generator):
    weight = torch.randn(shape, generator=generator, dtype=torch.float64)
    weight[torch.rand(shape, generator=generator) < sparsity] = 0
    weight[0] = 0  # an all-zero output channel
    if shape[0] > 2:
        weight[-1] = torch.randn(shape[1:], generator=generator, dtype=torch.float64)  # a fully dense row
    return weight


def relative_error(output, reference):
    return float((output - reference).norm() / reference.norm())


@pytest.mark.parametrize("case", CASES_2D)
@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.9, 0.99])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_conv2d_matches_torch(case, sparsity, backend):
    N, C, H, W, M, R, S, stride, padding, dilation = case
    generator = torch.Generator().manual_seed(torch.seed() % 2**31)
    weight = sparse_weight((M, C, R, S), sparsity, generator)
    x = torch.randn(N, C, H, W, generator=generator, dtype=torch.float64)
    bias = torch.randn(M, generator=generator, dtype=torch.float64)
    expected = F.conv2d(x, weight, bias, stride, padding, dilation)
    output = sparse_conv2d(x, UniformCSR.from_dense(weight), bias, stride, padding, dilation, backend=backend)
    assert output.shape == expected.shape
    assert relative_error(output, expected) < 1e-12


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize(("kernel", "stride", "padding", "dilation"), [(3, 1, 1, 1), (1, 2, 0, 1), (5, 3, 4, 2)])
def test_conv1d_matches_torch(backend, kernel, stride, padding, dilation):
    generator = torch.Generator().manual_seed(torch.seed() % 2**31)
    weight = sparse_weight((6, 4, kernel), 0.7, generator)
    x = torch.randn(3, 4, 37, generator=generator, dtype=torch.float64)
    bias = torch.randn(6, generator=generator, dtype=torch.float64)
    expected = F.conv1d(x, weight, bias, stride, padding, dilation)
    output = sparse_conv1d(x, UniformCSR.from_dense(weight), bias, stride, padding, dilation, backend=backend)
    assert relative_error(output, expected) < 1e-12


def test_all_zero_weight_gives_bias_only():
    weight = torch.zeros(4, 3, 3, 3, dtype=torch.float64)
    csr = UniformCSR.from_dense(weight)
    assert csr.row_length == 0
    bias = torch.randn(4, dtype=torch.float64)
    output = sparse_conv2d(torch.randn(2, 3, 8, 8, dtype=torch.float64), csr, bias, padding=1)
    assert torch.equal(output, bias[None, :, None, None].expand(2, 4, 8, 8))


def test_half_precision_input_accumulates_in_float32():
    generator = torch.Generator().manual_seed(3)
    weight = sparse_weight((8, 16, 3, 3), 0.5, generator).half()
    x = torch.randn(2, 16, 10, 10, generator=generator).half()
    output = sparse_conv2d(x, UniformCSR.from_dense(weight), padding=1)
    expected = F.conv2d(x.double(), weight.double(), padding=1)
    assert output.dtype == torch.float16
    assert relative_error(output.double(), expected) < 2e-3


def test_groups_fall_back_to_dense_with_a_logged_reason(caplog):
    generator = torch.Generator().manual_seed(4)
    weight = sparse_weight((6, 2, 3, 3), 0.5, generator)
    x = torch.randn(2, 6, 9, 9, generator=generator, dtype=torch.float64)
    with caplog.at_level(logging.WARNING):
        output = sparse_conv2d(x, UniformCSR.from_dense(weight), groups=3, padding=1, backend="reference")
    assert relative_error(output, F.conv2d(x, weight, groups=3, padding=1)) < 1e-12
    assert any("groups=3" in record.getMessage() and "falls back" in record.getMessage()
               for record in caplog.records)
    with pytest.raises(ValueError, match="groups"):
        reference_sparse_conv(x, UniformCSR.from_dense(weight), None, ConvGeometry.of(groups=3))


def test_channel_mismatch_is_rejected():
    csr = UniformCSR.from_dense(torch.randn(4, 3, 3, 3))
    with pytest.raises(ValueError, match="channels"):
        sparse_conv2d(torch.randn(1, 5, 8, 8), csr)


def test_stretched_offsets_address_the_padded_input():
    geometry = ConvGeometry.of(stride=2, padding=1, dilation=(1, 2))
    col_idx = torch.tensor([[0, 5, 17]], dtype=torch.int32)  # (c, r, s) = (0,0,0), (0,1,2), (1,2,2)
    offsets = geometry.stretched_offsets(col_idx, (3, 3), (10, 12))
    assert offsets.tolist() == [[0, 1 * 12 + 2 * 2, 1 * 120 + 2 * 12 + 2 * 2]]
    assert geometry.output_size(8, 10, (3, 3)) == (4, 4)


@pytest.mark.parametrize("backend", ["dense_cpu", "im2col_cublas", "im2col_cusparse", "reference"])
def test_a_layer_changed_in_place_is_not_served_from_a_backend_cache(backend):
    """Backends cache per weight (dense copies, lowered matrices); an in-place ``load_state_dict`` or ``values.mul_``
    keeps the buffers, and the caches must see the change (found by a review helper: dense_cpu and im2col_cublas
    kept computing with the old weight)."""
    from unsparse.runtime import SparseConv
    from unsparse.runtime.modules import sparse_from_conv

    torch.manual_seed(3)
    conv = torch.nn.Conv2d(4, 6, 3, padding=1).requires_grad_(False)
    with torch.no_grad():
        conv.weight[torch.rand(conv.weight.shape) < 0.6] = 0
    layer = sparse_from_conv(conv, backend)
    assert isinstance(layer, SparseConv)
    x = torch.randn(2, 4, 8, 8)
    layer(x)  # fills the backend's caches for this weight
    state = {key: value.clone() for key, value in layer.state_dict().items()}
    state["values"] *= 2
    layer.load_state_dict(state)  # in place: the same buffer objects
    expected = F.conv2d(x.double(), 2 * conv.weight.double(), conv.bias.double(), padding=1)
    assert relative_error(layer(x), expected) < 1e-5
    layer.values.mul_(0.5)
    expected = F.conv2d(x.double(), conv.weight.double(), conv.bias.double(), padding=1)
    assert relative_error(layer(x), expected) < 1e-5


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_weight_changed_in_place_is_not_served_from_a_backend_cache_through_the_functional_api(backend):
    """The caches are keyed by the UniformCSR object, which a caller of ``sparse_conv2d`` edits in place (a helper
    found dense_cpu and im2col_cublas 19.7 off after ``csr.values.mul_(2)``)."""
    torch.manual_seed(4)
    weight = torch.randn(6, 4, 3, 3) * (torch.rand(6, 4, 3, 3) > 0.6)
    csr, x = UniformCSR.from_dense(weight), torch.randn(2, 4, 7, 7)
    sparse_conv2d(x, csr, None, 1, 1, backend=backend)  # fills the caches
    csr.values.mul_(2)
    expected = F.conv2d(x.double(), 2 * weight.double(), padding=1)
    assert relative_error(sparse_conv2d(x, csr, None, 1, 1, backend=backend), expected) < 1e-5


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_column_index_written_out_of_range_in_place_is_refused_before_the_backend_reads_it(backend):
    """The constructor's range check ran before the edit; every call re-checks a weight whose tensors changed."""
    from unsparse.runtime import SparseConv
    from unsparse.sparse.format import SparseFormatError

    csr, x = UniformCSR.from_dense(torch.randn(6, 4, 3, 3)), torch.randn(2, 4, 7, 7)
    layer = SparseConv(csr, None, ConvGeometry.of(padding=1), backend)
    for run in (lambda: sparse_conv2d(x, csr, None, 1, 1, backend=backend), lambda: layer(x)):
        run()
    for tensor in (csr.col_idx, layer.col_idx):
        tensor[0, 0] = 36
    for run in (lambda: sparse_conv2d(x, csr, None, 1, 1, backend=backend), lambda: layer(x)):
        with pytest.raises(SparseFormatError, match=r"col_idx: entries must lie in \[0, 36\)"):
            run()


def test_a_layer_whose_index_was_written_out_of_range_is_refused_wherever_its_weight_is_read():
    """Not only in a forward: the comparator and timings call the backend directly, and saving reads layer.csr (a
    reread found them reading through the bad index, and save_sparse writing a file the loader refuses)."""
    from unsparse.runtime import SparseConv
    from unsparse.runtime.backends import get_backend
    from unsparse.sparse.format import SparseFormatError
    from unsparse.sparse.io import describe_layers

    csr = UniformCSR.from_dense(torch.randn(6, 4, 3, 3))
    layer, x = SparseConv(csr, None, ConvGeometry.of(padding=1), "dense_cpu"), torch.randn(2, 4, 7, 7)
    held = layer.csr  # the weight object the comparator holds while it times the layer's backends
    with torch.no_grad():
        layer.col_idx[0, 0] = 10**6
    message = r"col_idx: entries must lie in \[0, 36\)"
    with pytest.raises(SparseFormatError, match=message):
        describe_layers(torch.nn.Sequential(layer))  # what save_sparse writes: it reads layer.csr
    with pytest.raises(SparseFormatError, match=message):
        get_backend("dense_cpu").run(x, held, None, layer.geometry)
    assert "weight_shape=(6, 4, 3, 3)" in repr(layer)  # a model that fails its check still prints


def test_a_weight_unpickled_from_before_revalidate_existed_runs():
    csr = UniformCSR.from_dense(torch.randn(6, 4, 3, 3))
    object.__delattr__(csr, "_validated_versions")  # what torch.load gives for an object pickled by that version
    output = sparse_conv2d(torch.randn(1, 4, 5, 5), csr, None, 1, 1, backend="dense_cpu")
    assert output.shape == (1, 6, 5, 5)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_an_empty_batch_gives_an_empty_output(backend):
    csr = UniformCSR.from_dense(torch.randn(6, 4, 3, 3))
    output = sparse_conv2d(torch.randn(0, 4, 9, 9), csr, torch.randn(6), 1, 1, backend=backend)
    assert output.shape == (0, 6, 9, 9)


def test_a_weight_without_output_channels_packs_to_an_empty_csr():
    csr = UniformCSR.from_dense(torch.randn(0, 4, 3, 3))
    assert csr.values.shape == (0, 0) and csr.to_dense().shape == (0, 4, 3, 3)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("groups", [1, 2])
def test_an_input_smaller_than_the_kernel_raises_the_same_error_on_every_backend(backend, groups):
    """Grouped layers fall back to the dense backend, which let torch's RuntimeError through."""
    from unsparse.sparse.format import SparseFormatError

    csr = UniformCSR.from_dense(torch.randn(4, 4 // groups, 5, 5))
    with pytest.raises(SparseFormatError, match="smaller than dilated kernel"):
        sparse_conv2d(torch.randn(1, 4, 3, 3), csr, None, 1, 0, 1, groups, backend=backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_unbatched_inputs_run_as_torch_runs_them(backend):
    """nn.Conv1d/nn.Conv2d and F.conv1d/F.conv2d accept (C, L) / (C, H, W); so do the drop-ins and SparseConv."""
    from torch import nn

    from unsparse.runtime import sparsify

    generator = torch.Generator().manual_seed(torch.seed() % 2**31)
    weight = sparse_weight((5, 3, 3, 3), 0.6, generator)
    x = torch.randn(3, 9, 8, generator=generator, dtype=torch.float64)
    expected = F.conv2d(x, weight, None, 1, 1)
    output = sparse_conv2d(x, UniformCSR.from_dense(weight), None, 1, 1, backend=backend)
    assert output.shape == expected.shape == (5, 9, 8)
    assert relative_error(output, expected) < 1e-12
    weight_1d = sparse_weight((4, 3, 3), 0.6, generator)
    signal = torch.randn(3, 11, generator=generator, dtype=torch.float64)
    output = sparse_conv1d(signal, UniformCSR.from_dense(weight_1d), None, 2, 1, backend=backend)
    assert relative_error(output, F.conv1d(signal, weight_1d, None, 2, 1)) < 1e-12
    assert output.shape == (4, 6)

    model = nn.Sequential(nn.Conv1d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv1d(4, 2, 1)).double()
    model_2d = nn.Sequential(nn.Conv2d(3, 5, 3, stride=2), nn.ReLU(), nn.Conv2d(5, 2, 1)).double()
    with torch.no_grad():
        assert relative_error(sparsify(model, backend)(signal), model(signal)) < 1e-12
        sparse_2d = sparsify(model_2d, backend)
        assert sparse_2d(x).shape == model_2d(x).shape
        assert relative_error(sparse_2d(x), model_2d(x)) < 1e-12
        with pytest.raises(ValueError, match=r"expected \(N, C, H, W\) or unbatched \(C, H, W\), got shape \(9, 8\)"):
            sparse_2d(x[0])
        with pytest.raises(ValueError, match=r"x: expected \(N, C, L\) or unbatched \(C, L\), got shape \(11,\)"):
            sparsify(model, backend)(signal[0])
        image = torch.randn(9, 8, 3, generator=generator, dtype=torch.float64).permute(2, 0, 1)  # an HWC image
        output = sparse_2d(image)
        assert output.is_contiguous() and output.stride() == model_2d(image).stride()
        assert relative_error(output, model_2d(image)) < 1e-12


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_every_cpu_backend_runs_under_bfloat16_autocast(backend):
    """CPU autocast picks bfloat16, for which torch has no CPU sparse CSR product (im2col_cusparse crashed)."""
    generator = torch.Generator().manual_seed(torch.seed() % 2**31)
    weight = sparse_weight((6, 4, 3, 3), 0.7, generator)
    x = torch.randn(2, 4, 10, 9, generator=generator, dtype=torch.float64)
    expected = F.conv2d(x, weight, None, 1, 1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        output = sparse_conv2d(x.float(), UniformCSR.from_dense(weight.float()), None, 1, 1, backend=backend)
    assert relative_error(output.double(), expected) < 2e-2


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize(("padding", "dilation"), [("same", 1), ("same", (2, 3)), ("valid", 1), ("valid", 2)])
def test_string_padding_matches_torch(backend, padding, dilation):
    """The drop-ins take F.conv1d/F.conv2d's 'same' and 'valid' (they failed with int('s'))."""
    generator = torch.Generator().manual_seed(torch.seed() % 2**31)
    weight = sparse_weight((5, 3, 3, 5), 0.6, generator)
    x = torch.randn(2, 3, 13, 14, generator=generator, dtype=torch.float64)
    expected = F.conv2d(x, weight, None, 1, padding, dilation)
    output = sparse_conv2d(x, UniformCSR.from_dense(weight), None, 1, padding, dilation, backend=backend)
    assert output.shape == expected.shape and relative_error(output, expected) < 1e-12
    weight_1d = sparse_weight((4, 3, 5), 0.6, generator)
    signal = torch.randn(2, 3, 17, generator=generator, dtype=torch.float64)
    dilation_1d = dilation if isinstance(dilation, int) else dilation[0]
    expected = F.conv1d(signal, weight_1d, None, 1, padding, dilation_1d)
    output = sparse_conv1d(signal, UniformCSR.from_dense(weight_1d), None, 1, padding, dilation_1d, backend=backend)
    assert output.shape == expected.shape and relative_error(output, expected) < 1e-12


def test_valid_padding_needs_no_kernel_size():
    assert ConvGeometry.of(2, "valid").padding == (0, 0)
    assert ConvGeometry.of(2, "valid", spatial_dims=1).padding == (0, 0)
    with pytest.raises(ValueError, match="'same' needs the kernel size"):
        ConvGeometry.of(1, "same")


@pytest.mark.parametrize(("padding", "stride", "kernel", "message"), [
    ("same", 2, 3, "stride 1 only"), ("same", 1, 4, "pads one side more"), ("full", 1, 3, "expected 'valid', 'same'"),
])
def test_string_padding_torch_refuses_or_that_would_be_asymmetric_is_refused_by_name(padding, stride, kernel, message):
    weight = torch.randn(2, 3, kernel, kernel, dtype=torch.float64)
    with pytest.raises(ValueError, match=rf"padding: .*{message}"):
        sparse_conv2d(torch.randn(1, 3, 9, 9, dtype=torch.float64), UniformCSR.from_dense(weight), None, stride,
                      padding)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize(("stride", "padding", "dilation"), [((2,), (1,), (1,)), ([3], 1, (2,)), (1, "same", (2,))])
def test_one_element_tuples_read_as_torch_reads_them(backend, stride, padding, dilation):
    """F.conv1d/F.conv2d take ``stride=(2,)`` for every dimension (sparse_conv2d refused it: a helper's find)."""
    generator = torch.Generator().manual_seed(torch.seed() % 2**31)
    weight = sparse_weight((5, 3, 3, 5), 0.6, generator)
    x = torch.randn(2, 3, 13, 14, generator=generator, dtype=torch.float64)
    expected = F.conv2d(x, weight, None, stride, padding, dilation)
    output = sparse_conv2d(x, UniformCSR.from_dense(weight), None, stride, padding, dilation, backend=backend)
    assert output.shape == expected.shape and relative_error(output, expected) < 1e-12
    weight_1d, signal = sparse_weight((4, 3, 5), 0.6, generator), torch.randn(2, 3, 17, generator=generator,
                                                                              dtype=torch.float64)
    expected = F.conv1d(signal, weight_1d, None, stride, padding, dilation)
    output = sparse_conv1d(signal, UniformCSR.from_dense(weight_1d), None, stride, padding, dilation, backend=backend)
    assert output.shape == expected.shape and relative_error(output, expected) < 1e-12


@pytest.mark.parametrize(("value", "spatial_dims"), [((1.5, 1), 2), (2.0, 2), ((1, 2, 3), 2), ((2, 3), 1), ("2", 2),
                                                    (True, 2), ((True, 1), 2), (torch.tensor(True), 2)])
def test_a_stride_that_is_no_integer_or_too_long_is_refused_not_truncated(value, spatial_dims):
    with pytest.raises(ValueError, match=r"stride: expected an integer"):
        ConvGeometry.of(value, spatial_dims=spatial_dims)


@pytest.mark.parametrize("fields", [{"stride": (0, 1)}, {"dilation": (1, 0)}, {"padding": (0, -1)}, {"groups": 0},
                                    {"spatial_dims": 3}, {"spatial_dims": 1, "padding": (2, 1)},
                                    {"spatial_dims": 1, "stride": (2, 1)}, {"spatial_dims": 1, "dilation": (3, 1)}])
def test_a_geometry_out_of_range_is_refused(fields):
    """A negative padding was never tested: without its check the reference conv cropped the input silently (a
    mutation audit's find). A Conv1d geometry with padding along H gave its (N, C, L) input a 4-D output (an
    audit's find)."""
    with pytest.raises(ValueError, match=r"geometry: invalid|spatial_dims|geometry: a Conv1d"):
        ConvGeometry(**fields)
    data = {**ConvGeometry().to_dict(), **{key: list(value) if isinstance(value, tuple) else value
                                           for key, value in fields.items()}}
    with pytest.raises(ValueError, match=r"geometry: invalid|spatial_dims|geometry: a Conv1d"):
        ConvGeometry.from_dict(data)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int64, torch.bool])
@pytest.mark.parametrize("backend", ["reference", "dense_cpu"])
def test_an_integer_input_is_refused_not_computed_in_integers(dtype, backend):
    """The backends cast the weight to the input's dtype: a uint8 input of 100s against weights 0.5, 1.5, 2.5 gave
    44 (weights cut to integers, sums wrapped) where F.conv2d refuses (an audit's find)."""
    weight = torch.tensor([[[[0.5, 1.5], [2.5, 0.0]]]])
    with pytest.raises(ValueError, match=r"x: expected a floating-point tensor"):
        sparse_conv(torch.full((1, 1, 2, 2), 100).to(dtype), UniformCSR.from_dense(weight), None, ConvGeometry(),
                    backend=backend)


def test_numpy_and_torch_integers_become_python_ints_in_a_geometry():
    """A geometry goes into file metadata as JSON; a numpy groups value kept as numpy could not be written."""
    import numpy as np

    geometry = ConvGeometry.of(np.int64(2), torch.tensor(1), groups=np.int64(2))
    assert geometry == ConvGeometry.of(2, 1, groups=2)
    assert all(type(value) is int for value in (*geometry.stride, *geometry.padding, geometry.groups))


@pytest.mark.parametrize("groups", [2.0, "2", True])
def test_groups_that_are_no_integer_are_refused_by_name(groups):
    """groups=2.0 passed, was logged as "not supported by sparse backends" and failed in torch (a reread's find)."""
    with pytest.raises(ValueError, match="groups: expected an integer"):
        ConvGeometry.of(groups=groups)
