"""The sparse model file's schema: what the writer (:mod:`unsparse.sparse.save`) stores and the reader
(:mod:`unsparse.sparse.load`) accepts, and the error that names a field. No pickle.

A file is safetensors tensors plus one JSON metadata block (DESIGN.md, File):
- every state-dict tensor of the sparsified model, under its state-dict key (``<layer>.values``,
  ``<layer>.col_idx``, ``<layer>.bias``, BatchNorm and Linear tensors, ...), or, for a tensor with a codec
  (:mod:`unsparse.sparse.codecs`), the codec's parts under ``<key>::<part>``;
- metadata key ``"unsparse"``: JSON with ``format_version``, ``model`` (registry name and kwargs),
  ``layers`` (per sparse conv: ``weight_shape``, ``geometry``, ``row_length``, ``nnz``, ``sparsity``),
  ``tensors`` (per state-dict key: ``shape``, ``dtype``, ``codec``), ``quantization`` and ``extra``.

Every problem the reader finds raises :class:`SparseFileError` (a ``ValueError``) naming the field
(:func:`require`).
"""

from __future__ import annotations

import torch

from unsparse.messages import shorten
from unsparse.sparse.format import SparseFormatError

FORMAT_VERSION = 1


METADATA_KEY = "unsparse"


STORED_DTYPES: dict[str, torch.dtype] = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
                                         "F64": torch.float64, "I8": torch.int8, "U8": torch.uint8,
                                         "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
                                         "BOOL": torch.bool}
"""The dtypes a file may store, by their safetensors names."""


DTYPES: dict[str, torch.dtype] = {str(dtype).removeprefix("torch."): dtype for dtype in STORED_DTYPES.values()}
"""The same dtypes by the names the metadata's tensor entries use (``"float32"``, ``"int32"``, ...)."""


PART_BYTES_PER_ELEMENT = 8
"""Bytes a tensor's stored parts may hold per element of the tensor (float64, the widest dtype), plus
:data:`PART_BYTES_EXTRA`."""


PART_BYTES_EXTRA = 2**20
"""Bytes a tensor's stored parts may hold beyond :data:`PART_BYTES_PER_ELEMENT` per element: a codebook's
centroids (at most 2^16 of 2 bytes) and packing's rounding."""


MAX_PARTS = 3
"""Stored parts a tensor may have (a codebook's indices, centroids and row counts; a raw tensor has one)."""


METADATA_MAX_CHARACTERS = 4 * 2**20
"""Characters the JSON metadata block may hold (a model of a thousand convolutions needs about a million): parsing
JSON takes up to about 30 times its size in memory."""


HEADER_MAX_BYTES = 3 * METADATA_MAX_CHARACTERS
"""Bytes the safetensors header (JSON: every stored tensor's dtype, shape and offsets, and the metadata block) may
hold; it is parsed in Python before safetensors reads it. The metadata block takes at most two bytes a character
there (the encoder writes ASCII JSON, whose quotes and backslashes the header escapes), which leaves at least
4 MiB for the tensor entries, about 100 bytes each."""


FOREIGN_MESSAGE_MAX_CHARACTERS = 1000
"""Characters kept of an error message that another module raised on the file's values (:func:`foreign`); the
values this module quotes are cut to :data:`~unsparse.messages.QUOTE_MAX_CHARACTERS` each."""


TOP_LEVEL_KEYS = {"format_version", "model", "layers", "tensors", "quantization", "extra"}


LAYER_KEYS = {"weight_shape", "geometry", "row_length", "nnz", "sparsity"}


TENSOR_KEYS = {"shape", "dtype", "codec"}


class SparseFileError(SparseFormatError):
    """A sparse model file is malformed or inconsistent; the message names the field."""


def require(condition: bool, field: str, message: str) -> None:
    """Raise :class:`SparseFileError` ``"<field>: <message>"`` unless ``condition``; ``field`` may be a key the file
    named (a stored tensor's), so it is cut by :func:`~unsparse.messages.shorten`; values ``message`` quotes from
    the file are cut where it is written (:func:`~unsparse.messages.quote`)."""
    if not condition:
        raise SparseFileError(f"{shorten(field)}: {message}")


def foreign(error: Exception) -> str:
    """The message of an error another module raised on the file's values (codecs, quantization state, a module's
    check of its loaded state, JSON parsing), which may quote them: cut to :data:`FOREIGN_MESSAGE_MAX_CHARACTERS`."""
    return shorten(str(error), FOREIGN_MESSAGE_MAX_CHARACTERS)
