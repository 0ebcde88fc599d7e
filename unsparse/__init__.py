"""UnSparse: unstructured pruning to GPU deployment for convolutional networks.

Public API (DESIGN.md): ``UniformCSR``, ``sparse_conv2d`` (in :mod:`unsparse.sparse`), ``sparsify``,
``save_sparse``, ``load_sparse``, ``create_model``.
"""

from unsparse.models import create_model, list_models
from unsparse.runtime.modules import sparsify
from unsparse.sparse import ConvGeometry, SparseFormatError, UniformCSR, sparse_conv1d, sparse_conv2d
from unsparse.sparse.io import SparseFileError, load_sparse, save_sparse

__all__ = ["ConvGeometry", "SparseFileError", "SparseFormatError", "UniformCSR", "create_model", "list_models",
           "load_sparse", "save_sparse", "sparse_conv1d", "sparse_conv2d", "sparsify"]
