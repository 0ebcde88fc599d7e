"""The sparse model file's public entry point (DESIGN.md, File: safetensors tensors plus one JSON metadata block, no
pickle). Each job has its module, and this one names what callers use from them:

- :mod:`unsparse.sparse.schema`: the layout, the limits a file is held to, :class:`SparseFileError`;
- :mod:`unsparse.sparse.save`: writing (:func:`save_sparse`, :func:`encode_model`, :func:`describe_layers`);
- :mod:`unsparse.sparse.safetensors_file`: the untrusted safetensors header and byte layout;
- :mod:`unsparse.sparse.architecture`: the architecture a file names, rebuilt on the ``meta`` device;
- :mod:`unsparse.sparse.checks`: the file's content against the architecture and itself;
- :mod:`unsparse.sparse.load`: reading and validating a file (:func:`load_sparse`);
- :mod:`unsparse.sparse.file_bytes`: what a file spends per stored tensor and per sparse layer.
"""

from unsparse.sparse.architecture import layer_names
from unsparse.sparse.file_bytes import file_tensor_bytes, layer_file_bytes
from unsparse.sparse.load import load_sparse
from unsparse.sparse.save import describe_layers, encode_model, save_sparse
from unsparse.sparse.schema import (
    FORMAT_VERSION,
    HEADER_MAX_BYTES,
    MAX_PARTS,
    METADATA_MAX_CHARACTERS,
    STORED_DTYPES,
    SparseFileError,
)

__all__ = ["FORMAT_VERSION", "HEADER_MAX_BYTES", "MAX_PARTS", "METADATA_MAX_CHARACTERS", "STORED_DTYPES",
           "SparseFileError", "describe_layers", "encode_model", "file_tensor_bytes", "layer_file_bytes",
           "layer_names", "load_sparse", "save_sparse"]
