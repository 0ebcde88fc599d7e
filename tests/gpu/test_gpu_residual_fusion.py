"""A convolution fused with a residual add and the ReLU after it, on the GPU: ``cudnn`` in one call
(``torch.cudnn_convolution_add_relu``, or its logged fallback), ``direct`` in its kernels' epilogue (every setting:
``tests/gpu/test_gpu_backends.py``), ``generated`` in its kernels' epilogue (its settings of several programs, streams,
graphs and chunks: ``tests/gpu/test_gpu_generated.py``), the lowering backends with the add and the ReLU in passes
after their GEMMs, and the dense baseline's module, each against torch's float64 convolution plus the residual on the
CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from unsparse.runtime.backends import get_backend
from unsparse.runtime.comparator import relative_error, tolerance
from unsparse.runtime.dense_fusion import ConvBiasReLU
from unsparse.runtime.layout import layout_of
from unsparse.runtime.precision import precision_mode
from unsparse.sparse.format import UniformCSR
from unsparse.sparse.geometry import ConvGeometry

CUDA = torch.device("cuda")
LAYERS = {"3x3": (3, 16, 14, 14, 24, 3, 1, 1), "1x1": (4, 32, 9, 9, 64, 1, 1, 0),
          "1x1_stride2": (2, 24, 13, 13, 40, 1, 2, 0)}
"""name: (N, C, H, W, M, kernel, stride, padding): a 3x3 block conv, a bottleneck's 1x1 ``conv3`` on an odd plane,
a strided 1x1 (the downsample's shape)."""


def residual_case(name: str, dtype: torch.dtype, seed: int):
    """A layer about 80 % sparse in ``dtype`` on the GPU, a residual of its output's shape, and the float64 reference
    ``relu(conv2d(x, w) + bias + residual)`` of the rounded values."""
    N, C, H, W, M, kernel, stride, padding = LAYERS[name]
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(M, C, kernel, kernel, generator=gen, dtype=torch.float64)
    weight *= torch.rand(weight.shape, generator=gen, dtype=torch.float64) < 0.2
    x, bias = torch.randn(N, C, H, W, generator=gen, dtype=torch.float64), torch.randn(M, generator=gen)
    geometry = ConvGeometry.of(stride, padding)
    conv = F.conv2d(x.to(dtype).double(), weight.to(dtype).double(), bias.to(dtype).double(), stride, padding)
    residual = torch.randn(conv.shape, generator=gen, dtype=torch.float64).to(dtype)
    reference = torch.relu(conv + residual.double())
    return (x.to(CUDA, dtype), UniformCSR.from_dense(weight.to(dtype)).to(CUDA), bias.to(CUDA, dtype), geometry,
            residual.to(CUDA), reference)


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", sorted(LAYERS))
@pytest.mark.parametrize("backend", ["cudnn", "direct", "generated", "im2col_cublas"])
def test_a_backend_adds_the_residual_before_the_relu(backend: str, name: str, dtype: torch.dtype,
                                                      memory_format: torch.memory_format) -> None:
    x, csr, bias, geometry, residual, reference = residual_case(name, dtype, seed=len(name))
    x, residual = x.contiguous(memory_format=memory_format), residual.contiguous(memory_format=memory_format)
    chosen = get_backend(backend)
    with precision_mode(False):
        for params in chosen.settings(x, csr, geometry, relu=True)[:4]:  # cudnn: both layouts, both epilogues
            out = chosen.run(x, csr, bias, geometry, relu=True, residual=residual, **params)
            torch.cuda.synchronize()
            assert layout_of(out) == layout_of(x), params  # in x's layout (a lowering backend's NCHW is a view)
            assert relative_error(out.cpu(), reference) <= tolerance(dtype), params


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_dense_baseline_module_fuses_the_residual_on_the_gpu(dtype: torch.dtype) -> None:
    x, csr, bias, _, residual, reference = residual_case("1x1", dtype, seed=3)
    conv = nn.Conv2d(csr.in_channels_per_group, csr.out_channels, 1).to(CUDA, dtype)
    with torch.no_grad():
        conv.weight.copy_(csr.to_dense())
        conv.bias.copy_(bias)
        for memory_format in (torch.contiguous_format, torch.channels_last):
            for passes in (False, True):
                module = ConvBiasReLU(conv)
                module.passes = passes
                with precision_mode(False):
                    out = module(x.contiguous(memory_format=memory_format), residual)
                assert relative_error(out.cpu(), reference) <= tolerance(dtype), (memory_format, passes)
        shift = torch.randn(1, csr.out_channels, 1, 1, device=CUDA, dtype=dtype)  # broadcasts: not cuDNN's fused add
        with precision_mode(False):
            out = ConvBiasReLU(conv)(x, shift)
        conv64 = F.conv2d(x.double().cpu(), csr.to_dense().double().cpu(), bias.double().cpu())
        expected = torch.relu(conv64 + shift.double().cpu())
        assert relative_error(out.cpu(), expected) <= tolerance(dtype)
