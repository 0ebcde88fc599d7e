"""The UniformCSR format, its geometry, the CPU reference convolution and the file format."""

from unsparse.sparse.format import SparseFormatError, UniformCSR
from unsparse.sparse.functional import sparse_conv, sparse_conv1d, sparse_conv2d
from unsparse.sparse.geometry import ConvGeometry

__all__ = ["ConvGeometry", "SparseFormatError", "UniformCSR", "sparse_conv", "sparse_conv1d", "sparse_conv2d"]
