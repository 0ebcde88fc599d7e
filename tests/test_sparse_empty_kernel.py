"""A weight with an empty kernel axis (``R = 0`` or ``S = 0``): ``F.conv1d``/``F.conv2d`` refuse it; the sparse
convolution must too, naming the kernel size, on every backend that runs on the CPU."""

from __future__ import annotations

import pytest
import torch

from unsparse.sparse import SparseFormatError, UniformCSR
from unsparse.sparse.functional import sparse_conv1d, sparse_conv2d
from unsparse.sparse.geometry import ConvGeometry


@pytest.mark.parametrize("backend", ["reference", "dense_cpu"])
@pytest.mark.parametrize("shape", [(2, 3, 0, 3), (2, 3, 3, 0), (2, 3, 0, 0)])
def test_an_empty_2d_kernel_is_refused_naming_the_kernel_size(shape, backend):
    """The reference backend returned zeros of a shape no convolution has: (1, 2, 6, 3) from a 5 x 5 input and a
    0 x 3 kernel (the output size formula read the empty kernel as spanning 0 rows)."""
    csr = UniformCSR.from_dense(torch.zeros(shape, dtype=torch.float64))
    x = torch.randn(1, 3, 5, 5, dtype=torch.float64)
    with pytest.raises(SparseFormatError, match=r"^kernel_size: "):
        sparse_conv2d(x, csr, backend=backend)


@pytest.mark.parametrize("backend", ["reference", "dense_cpu"])
def test_an_empty_1d_kernel_is_refused_naming_the_kernel_size(backend):
    csr = UniformCSR.from_dense(torch.zeros(2, 3, 0))
    with pytest.raises(SparseFormatError, match=r"^kernel_size: "):
        sparse_conv1d(torch.randn(1, 3, 5), csr, backend=backend)


def test_output_size_refuses_an_empty_kernel():
    with pytest.raises(SparseFormatError, match=r"^kernel_size: \(0, 3\)"):
        ConvGeometry().output_size(5, 5, (0, 3))
    assert ConvGeometry().output_size(5, 5, (1, 3)) == (5, 3)
