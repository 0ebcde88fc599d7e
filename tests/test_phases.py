"""Phase decomposition (``unsparse.sparse.phases``) against ``F.conv2d`` in float64: the stride-1 layer over
the phase images equals the strided layer on fresh random inputs, odd sizes, all-zero and fully dense rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from unsparse.sparse import ConvGeometry, UniformCSR
from unsparse.sparse.phases import phase_split

# (N, C, H, W, M, R, S, stride, padding)
CASES = [
    (2, 3, 12, 12, 5, 3, 3, (2, 2), (1, 1)),  # ResNet 3x3 stride 2
    (2, 4, 13, 11, 6, 3, 3, (2, 2), (1, 1)),  # odd input: zero-padded phases
    (2, 5, 8, 8, 7, 1, 1, (2, 2), (0, 0)),  # ResNet downsample: one phase
    (1, 3, 23, 23, 4, 11, 11, (4, 4), (2, 2)),  # AlexNet stem
    (2, 3, 17, 16, 4, 7, 7, (2, 2), (3, 3)),  # ResNet/GoogLeNet stem
    (2, 3, 10, 9, 4, 3, 5, (2, 3), (0, 2)),  # unequal strides and kernels
    (2, 2, 9, 9, 3, 1, 1, (2, 2), (1, 1)),  # padded 1x1: odd phase only, offset -1
    (1, 2, 7, 12, 3, 2, 4, (3, 1), (2, 1)),  # padding beyond the stride, stride 1 along W
    (2, 3, 6, 6, 3, 3, 3, (1, 1), (1, 1)),  # stride 1: the identity rewrite
    (2, 3, 14, 13, 4, 2, 2, (4, 3), (1, 2)),  # filter smaller than the stride: row phases (0, 3) wrap around
    (2, 2, 1, 1, 3, 3, 3, (2, 2), (1, 1)),  # every phase read, input smaller than the stride
    (2, 3, 3, 2, 4, 3, 3, (5, 4), (1, 1)),  # input smaller than the stride: the last phases read only zeros
    # stride far beyond the input: the input was padded up to the stride, 2^80 pixels (torch's RuntimeError)
    (1, 2, 224, 224, 3, 3, 3, (2**40, 2**40), (1, 1)),
]


def layer(case: tuple, seed: int) -> tuple[torch.Tensor, torch.Tensor, ConvGeometry]:
    """A float64 input and a 70 % sparse weight whose row 0 is all zero and row 1 fully dense."""
    N, C, H, W, M, R, S, stride, padding = case
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(M, C, R, S, generator=gen, dtype=torch.float64)
    weight[torch.rand(weight.shape, generator=gen, dtype=torch.float64) < 0.7] = 0
    weight[0] = 0
    weight[1] = torch.randn(C, R, S, generator=gen, dtype=torch.float64)
    return torch.randn(N, C, H, W, generator=gen, dtype=torch.float64), weight, ConvGeometry.of(stride, padding)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_stride_one_layer_over_phases_equals_strided_conv2d(case: tuple, seed: int) -> None:
    x, weight, geometry = layer(case, seed)
    csr = UniformCSR.from_dense(weight)
    expected = F.conv2d(x, weight, None, geometry.stride, geometry.padding)
    split = phase_split(csr, geometry)
    phases = split.input(x)
    assert phases.shape[2:] == split.input_size(*x.shape[2:]) and phases.is_contiguous()
    assert phases.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()  # fresh, so 16-byte aligned
    full = F.conv2d(phases, split.csr.to_dense(), None, 1, split.geometry.padding)
    E, F_ = expected.shape[2:]
    assert full.shape[2] >= E and full.shape[3] >= F_
    torch.testing.assert_close(full[:, :, :E, :F_], expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", CASES)
def test_split_keeps_values_and_row_length(case: tuple) -> None:
    _, weight, geometry = layer(case, 0)
    csr = UniformCSR.from_dense(weight)
    split = phase_split(csr, geometry)
    assert split.csr.values is csr.values and split.csr.row_length == csr.row_length
    assert split.geometry.stride == (1, 1) and split.geometry.dilation == (1, 1)
    assert int((split.csr.to_dense() != 0).sum()) == int((weight != 0).sum())
    if geometry.stride == (1, 1):
        assert torch.equal(split.csr.col_idx, csr.col_idx) and split.geometry == geometry


def test_sizes_of_the_resnet_layers() -> None:
    three = phase_split(UniformCSR.from_dense(torch.randn(8, 4, 3, 3)), ConvGeometry.of(2, 1))
    assert three.csr.weight_shape == (8, 16, 2, 2) and three.geometry.padding == (1, 1)
    assert three.phases_h == (0, 1) == three.phases_w
    one = phase_split(UniformCSR.from_dense(torch.randn(8, 4, 1, 1)), ConvGeometry.of(2, 0))
    assert one.csr.weight_shape == (8, 4, 1, 1) and one.geometry.padding == (0, 0)
    assert one.phases_h == (0,) == one.phases_w
    image = torch.arange(64.0).reshape(1, 1, 8, 8)
    assert torch.equal(one.input(image), image[:, :, ::2, ::2])


def test_phases_form_one_run_per_axis_except_where_they_wrap_around() -> None:
    """The generated kernels' padding pass gathers phases ``first + i`` (``one_run_per_axis``); the filters smaller
    than the stride whose read phases wrap around the stride (the last three cases) are not."""
    wrapped = {(2, 3, 14, 13, 4, 2, 2, (4, 3), (1, 2)), (2, 3, 3, 2, 4, 3, 3, (5, 4), (1, 1)),
               (1, 2, 224, 224, 3, 3, 3, (2**40, 2**40), (1, 1))}
    for case in CASES:
        weight, geometry = layer(case, seed=0)[1:]
        split = phase_split(UniformCSR.from_dense(weight), geometry)
        assert split.one_run_per_axis == (case not in wrapped), case


def test_dilated_or_one_dimensional_layers_are_refused() -> None:
    csr = UniformCSR.from_dense(torch.randn(2, 2, 3, 3))
    with pytest.raises(ValueError, match="geometry"):
        phase_split(csr, ConvGeometry.of(2, 1, 2))
    with pytest.raises(ValueError, match="geometry"):
        phase_split(UniformCSR.from_dense(torch.randn(2, 2, 3)), ConvGeometry.of(2, 1, spatial_dims=1))
