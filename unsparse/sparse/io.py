"""The sparse model file: safetensors tensors plus one JSON metadata block (DESIGN.md, File). No pickle.

Layout:
- every state-dict tensor of the sparsified model, under its state-dict key (``<layer>.values``,
  ``<layer>.col_idx``, ``<layer>.bias``, BatchNorm and Linear tensors, ...), or, for a tensor with a codec
  (:mod:`unsparse.sparse.codecs`), the codec's parts under ``<key>::<part>``;
- metadata key ``"unsparse"``: JSON with ``format_version``, ``model`` (registry name and kwargs),
  ``layers`` (per sparse conv: ``weight_shape``, ``geometry``, ``row_length``, ``nnz``, ``sparsity``),
  ``tensors`` (per state-dict key: ``shape``, ``dtype``, ``codec``), ``quantization`` and ``extra``.

Loading treats the file as untrusted: the path is opened once, and only a regular file is read (through that
descriptor, never the path again), a safetensors header with duplicate keys at any level (or of more than
:data:`HEADER_MAX_BYTES`) is refused, the header is checked here as safetensors' reader checks it (dtypes, shapes,
offsets that tile the data section), and at first only the header is read (JSON metadata of at most
:data:`METADATA_MAX_CHARACTERS`, without duplicate keys). The architecture
is built on the ``meta`` device (no memory), with each convolution replaced by a shape-only :class:`SparseConv` of
the file's row length, and every tensor's declared key, shape, dtype and codec (a quantization codec only on a
sparse layer's ``values``) is checked against its state dict, and every stored part's size against what its tensor
can need (at most :data:`MAX_PARTS` parts), before any tensor is read or decoded, so that a file cannot make the
loader allocate much more than its architecture holds. Every byte, the header's included, is read with ordinary
reads into memory the loader owns, each tensor once (one allocation per stored tensor: a few MB for the small
models, some hundreds for VGG-16's dense classifier); safetensors' reader is not used: it memory-maps the file, and
a mapped file cut short while open (rewritten in place by another process) kills the process with SIGBUS, where a
short read is refused. A file whose size or modification time changed while it was read is refused too (its
tensors could come from two versions). Then values (finite, BatchNorm variances not negative), index
ranges, distinct columns within each row, and row lengths (each layer's largest row nnz, UnSparse-Opt §5) are
checked, and only then are real tensors assigned. Every problem raises :class:`SparseFileError` (a ``ValueError``)
naming the field.
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from safetensors.torch import save as safetensors_save
from torch import nn

from unsparse.atomic import atomic_write_bytes
from unsparse.runtime.modules import SparseConv, replace_shared, sparse_layers
from unsparse.sparse.codecs import PART_SEPARATOR, get_codec
from unsparse.sparse.format import (
    INDEX_DTYPE,
    SIZE_LIMIT,
    SparseFormatError,
    UniformCSR,
    bounded_product,
    quote,
    shorten,
)
from unsparse.sparse.geometry import ConvGeometry
from unsparse.strict_json import loads_strict

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
"""Characters kept of an error message that another module raised on the file's values (:func:`_foreign`); the
values this module quotes are cut to :data:`~unsparse.sparse.format.QUOTE_MAX_CHARACTERS` each."""
_OPEN_FLAGS = getattr(os, "O_PATH", os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
"""How a file to load is opened before it is checked: on Linux ``O_PATH`` (opens no device, blocks on no FIFO, reads
nothing), elsewhere read-only without blocking on a FIFO or taking a terminal."""
_DESCRIPTORS = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
"""The folder whose entry ``N`` opens the file that descriptor ``N`` has open (Linux: ``/proc/self/fd``; other
POSIX systems: ``/dev/fd``), whatever its path names by now."""
TOP_LEVEL_KEYS = {"format_version", "model", "layers", "tensors", "quantization", "extra"}
LAYER_KEYS = {"weight_shape", "geometry", "row_length", "nnz", "sparsity"}
TENSOR_KEYS = {"shape", "dtype", "codec"}
STORED_KEYS = {"dtype", "shape", "data_offsets"}
"""The keys of a tensor's entry in the safetensors header."""


class SparseFileError(SparseFormatError):
    """A sparse model file is malformed or inconsistent; the message names the field."""


def _codec_spec(model: nn.Module, key: str) -> dict[str, Any]:
    module_name, _, tensor_name = key.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    return dict(getattr(module, "unsparse_codecs", {}).get(tensor_name, {"name": "raw"}))


def describe_layers(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Per sparse conv of ``model``: weight shape, geometry, L, nnz, sparsity (JSON-ready)."""
    layers = {}
    for name, layer in sparse_layers(model).items():
        csr = layer.csr
        layers[name] = {"weight_shape": list(csr.weight_shape), "geometry": layer.geometry.to_dict(),
                        "row_length": csr.row_length, "nnz": csr.nnz, "sparsity": csr.sparsity}
    return layers


def encode_model(model: nn.Module, extra: dict[str, Any] | None = None) -> bytes:
    """The file's bytes for a sparsified model (see the module docstring).

    Raises:
        ValueError: if the model has no ``unsparse_spec`` (build it with ``create_model``), no sparse layer, a
            convolution :func:`~unsparse.runtime.modules.sparsify` left dense (the loader rebuilds every convolution
            of the architecture as a sparse one, so such a file could not be read back), or layers or tensors that
            differ from the architecture ``unsparse_spec`` names (e.g. a replaced classifier), or values the loader
            refuses (NaN or infinite, a negative BatchNorm variance, a layer whose row length is more than its
            largest row's nnz, e.g. after values were zeroed in place, a row naming a column twice, quantized values
            that contradict the model's quantization description: :func:`~unsparse.quant.state.check_values_codecs`),
            or an ``extra`` that is
            no JSON (a numpy value, nesting deeper than the encoder goes) or whose JSON the loader refuses (keys that
            become one, such as ``1`` and ``"1"``; nesting deeper than the parser reads; more than
            :data:`METADATA_MAX_CHARACTERS` in all), or a safetensors header of more than :data:`HEADER_MAX_BYTES`:
            :func:`load_sparse` would refuse the file, and the same checks run before it is written; a tensor its
            codec cannot encode (values off a fixed-point grid, e.g. edited after quantization) or whose codec is
            unknown, naming the tensor's key (``<layer>.values: ...``).
    """
    from unsparse.quant.state import check_values_codecs, describe_quantization

    spec = getattr(model, "unsparse_spec", None)
    if spec is None:
        raise ValueError("model: no unsparse_spec; build the model with unsparse.models.create_model")
    if not sparse_layers(model):
        raise ValueError("model: no SparseConv layer; call unsparse.sparsify(model) first")
    dense = [name for name, module in model.named_modules() if isinstance(module, nn.Conv1d | nn.Conv2d)]
    if dense:
        raise ValueError(f"model: convolutions left dense ({', '.join(dense)}; see sparsify's log) cannot be "
                         "stored: the file holds every convolution as a UniformCSR")
    tensors: dict[str, torch.Tensor] = {}
    entries: dict[str, dict[str, Any]] = {}
    storages: set[int] = set()  # a layer under several names has its tensors under each: safetensors stores each once
    for key, tensor in model.state_dict().items():
        codec = _codec_spec(model, key)
        encoder = get_codec(codec["name"], key)  # names the key itself
        try:
            parts = encoder.encode(tensor.detach(), codec)
        except ValueError as error:
            raise ValueError(f"{key}: {error}") from error
        for part, data in parts.items():
            data = data.detach().cpu().contiguous()
            storage = data.untyped_storage().data_ptr()
            tensors[f"{key}{PART_SEPARATOR}{part}" if part else key] = data.clone() if storage in storages else data
            storages.add(storage)
        entries[key] = {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."),
                        "codec": codec}
    metadata = {"format_version": FORMAT_VERSION, "model": spec, "layers": describe_layers(model),
                "tensors": entries, "quantization": describe_quantization(model), "extra": extra or {}}
    try:
        _check_values(_shell_model(metadata), model.state_dict())
        for name, layer in sparse_layers(model).items():
            _check_distinct_columns(name, layer.csr)
            _check_row_length(name, layer.csr)
        check_values_codecs(model)
    except SparseFormatError as error:
        raise ValueError(f"model: load_sparse would refuse its file ({error}): it checks the layers and tensors "
                         f"against the architecture unsparse_spec names ({spec}), and their values") from error
    try:  # extra is the caller's: values JSON cannot hold, or nesting deeper than the encoder goes
        text = json.dumps(metadata)
    except (TypeError, ValueError, RecursionError) as error:
        raise ValueError(f"extra: not JSON ({error})") from error
    _require(len(text) <= METADATA_MAX_CHARACTERS, "extra", f"metadata of {len(text)} characters, more than "
             f"{METADATA_MAX_CHARACTERS}")
    try:  # int and str keys of extra can become one JSON key ({1: .., "1": ..}), which the loader refuses
        loads_strict(text, constants=True)
    except (ValueError, RecursionError) as error:  # RecursionError: nested deeper than the parser reads
        raise ValueError(f"extra: not JSON the loader reads back ({error})") from error
    data = safetensors_save(tensors, metadata={METADATA_KEY: text})
    header_bytes = int.from_bytes(data[:8], "little")
    if header_bytes > HEADER_MAX_BYTES:
        raise ValueError(f"model: a safetensors header of {header_bytes} bytes ({len(tensors)} stored tensors), more "
                         f"than the {HEADER_MAX_BYTES} load_sparse reads")
    return data


def save_sparse(model: nn.Module, path: str | Path, extra: dict[str, Any] | None = None) -> Path:
    """Write a sparsified model to ``path`` atomically (an existing file is replaced only by a complete one).

    Args:
        model: output of :func:`unsparse.sparsify` on a model from ``create_model``.
        path: destination, conventionally ``*.safetensors``.
        extra: JSON-serialisable notes stored in the metadata (e.g. accuracy, data set).

    Returns:
        ``path``. Raises ``ValueError`` as :func:`encode_model`.
    """
    return atomic_write_bytes(path, encode_model(model, extra))


def _require(condition: bool, field: str, message: str) -> None:
    """Raise :class:`SparseFileError` ``"<field>: <message>"`` unless ``condition``; ``field`` may be a key the file
    named (a stored tensor's), so it is cut by :func:`~unsparse.sparse.format.shorten`; values ``message`` quotes from
    the file are cut where it is written (:func:`~unsparse.sparse.format.quote`)."""
    if not condition:
        raise SparseFileError(f"{shorten(field)}: {message}")


def _foreign(error: Exception) -> str:
    """The message of an error another module raised on the file's values (codecs, quantization state, a module's
    check of its loaded state, JSON parsing), which may quote them: cut to :data:`FOREIGN_MESSAGE_MAX_CHARACTERS`."""
    return shorten(str(error), FOREIGN_MESSAGE_MAX_CHARACTERS)


def _check_header(file: BinaryIO, size: int, path: Path) -> tuple[int, Any]:
    """The safetensors header of ``file`` (an open file of ``size`` bytes: an 8-byte little-endian length, then that
    many bytes of JSON), parsed without duplicate keys (JSON readers, safetensors' included, keep the last of them: a
    second ``"unsparse"`` entry in ``__metadata__``, or a second entry of a tensor, would silently replace the first).

    Returns:
        ``(length, header)``: the header's length in bytes (the data section starts at byte ``8 + length``) and its
        parsed JSON, which :func:`_layout` checks.

    Raises:
        SparseFileError: fewer than 8 bytes or a header beyond the file (``file``), a header of more than
            :data:`HEADER_MAX_BYTES` bytes, or with duplicate keys at any level, naming them (``header``), or one
            that is no UTF-8 JSON (``file``).
    """
    prefix = file.read(8)
    _require(len(prefix) == 8, "file", f"{path} is not a valid safetensors file ({size} bytes, fewer than the 8 of "
             "the header length)")
    length = int.from_bytes(prefix, "little")
    _require(length <= size - 8, "file", f"{path} is not a valid safetensors file (a header of {length} bytes in a "
             f"file of {size})")
    _require(length <= HEADER_MAX_BYTES, "header", f"{length} bytes, more than {HEADER_MAX_BYTES}")
    try:
        return length, loads_strict(file.read(length).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise SparseFileError(f"file: {path} is not a valid safetensors file (header: {_foreign(error)})") from error
    except ValueError as error:  # duplicate keys, NaN or Infinity, an integer beyond Python's digit limit
        raise SparseFileError(f"header: {_foreign(error)}") from error


@dataclass(frozen=True)
class _Stored:
    """One tensor of a safetensors file as its header describes it: ``dtype`` and ``shape``, and its ``size`` bytes,
    from byte ``start`` of the data section."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    size: int


def _layout(header: Any, data_bytes: int, path: Path) -> tuple[dict[str, str], dict[str, _Stored]]:
    """The metadata block and the stored tensors of a safetensors header (parsed by :func:`_check_header`), checked as
    safetensors' reader checks them (that reader memory-maps the file: :func:`_open_file`): a JSON object whose
    ``__metadata__`` (optional, or null) maps strings to strings, and whose every other entry holds exactly
    ``dtype`` (one of :data:`STORED_DTYPES`), ``shape`` (integers in ``[0, 2^63)``, their product with each 0 read as
    1 below 2^63, so that torch can shape even an empty tensor so) and ``data_offsets``
    (``[start, end]``, ``0 <= start <= end``, spanning the tensor's bytes); in offset order, the tensors tile the
    ``data_bytes`` of the data section, without gaps or overlaps.

    Raises:
        SparseFileError: naming the stored key, ``header.__metadata__``, or ``file`` (a header that is no object,
            tensors that end before the data section does).
    """
    _require(isinstance(header, dict), "file", f"{path} is not a valid safetensors file (its header is a "
             f"{type(header).__name__}, not an object)")
    metadata = header.get("__metadata__")
    metadata = {} if metadata is None else metadata
    _require(isinstance(metadata, dict) and all(isinstance(value, str) for value in metadata.values()),
             "header.__metadata__", f"{quote(metadata)}: expected an object of strings")
    stored = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        _require(isinstance(entry, dict) and set(entry) == STORED_KEYS, key,
                 f"header entry {quote(entry)}: expected the keys {sorted(STORED_KEYS)}")
        name, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        _require(isinstance(name, str) and name in STORED_DTYPES, key,
                 f"stored dtype {quote(name)}, expected one of {sorted(STORED_DTYPES)}")
        # every size, and their product with zero sizes read as 1 (which bounds torch's numel and strides: an empty
        # [2^62, 2^62, 0] overflowed int64 in torch's reshape, a RuntimeError), below 2^63
        _require(isinstance(shape, list) and all(type(size) is int and 0 <= size < SIZE_LIMIT for size in shape)
                 and bounded_product(shape) < SIZE_LIMIT, key,
                 f"shape {quote(shape)}: expected a list of integers in [0, 2^63) whose product (a 0 read as "
                 "1) is below 2^63")
        _require(isinstance(offsets, list) and len(offsets) == 2 and all(type(at) is int for at in offsets)
                 and 0 <= offsets[0] <= offsets[1], key,
                 f"data_offsets {quote(offsets)}: expected [start, end], integers, 0 <= start <= end")
        dtype = STORED_DTYPES[name]
        size = math.prod(shape) * dtype.itemsize
        _require(offsets[1] - offsets[0] == size, key, f"data_offsets {offsets} hold {offsets[1] - offsets[0]} bytes, "
                 f"a {name} tensor of shape {quote(shape)} {size}")
        stored[key] = _Stored(dtype, tuple(shape), offsets[0], size)
    end = 0
    for key, tensor in sorted(stored.items(), key=lambda item: (item[1].start, item[1].size)):
        _require(tensor.start == end, key, f"data_offsets start at {tensor.start}, where the tensors before it (in "
                 f"offset order) end at {end}: the tensors must tile the data section")
        end += tensor.size
    _require(end == data_bytes, "file", f"{path} is not a valid safetensors file (its tensors end at byte {end} of a "
             f"data section of {data_bytes})")
    return metadata, stored


@dataclass(frozen=True)
class _OpenFile:
    """A safetensors file open for loading: ``file``, the open file, whose data section starts at byte
    ``data_start``, and its header's ``metadata`` block and ``stored`` tensors (:func:`_layout`)."""

    file: BinaryIO
    metadata: dict[str, str]
    stored: dict[str, _Stored]
    data_start: int
    path: Path

    def tensor(self, stored_key: str) -> torch.Tensor:
        """The stored tensor ``stored_key``, read with ordinary reads into memory the loader owns: a fresh allocation,
        as big as its stored bytes (decoding a quantized tensor then makes its own temporaries).

        Raises:
            SparseFileError: a file that ends before the tensor's bytes (``file``: cut short while open).
        """
        stored = self.stored[stored_key]
        data = torch.empty(stored.size, dtype=torch.uint8)
        try:
            self.file.seek(self.data_start + stored.start)
            read = self.file.readinto(memoryview(data.numpy()))
        except OSError as error:
            raise SparseFileError(f"file: cannot read {self.path}: {error}") from error
        _require(read == stored.size, "file", f"{self.path} ended before {stored_key}'s {stored.size} bytes (cut short "
                 "while open)")
        return data.view(stored.dtype).reshape(stored.shape)


@contextmanager
def _open_file(path: Path) -> Iterator[_OpenFile]:
    """The safetensors file at ``path``, opened for reading: a regular file only, so that a FIFO cannot block the
    loader and a device (a link to ``/dev/zero``) cannot be read without end, with a header :func:`_check_header`
    and :func:`_layout` accept.

    The path is opened once (:data:`_OPEN_FLAGS`), that open file is checked (``os.fstat``), and the header and the
    tensors (:meth:`_OpenFile.tensor`) are read through the descriptor (:data:`_DESCRIPTORS`), not through the path:
    a file that takes the path after the check is not the one read. Every byte is read with ordinary reads, none
    through a memory map (safetensors' ``safe_open`` maps the file: one cut short by another process while mapped
    kills the reader with SIGBUS at its first access past the new end, where a read returns fewer bytes, refused).
    A file whose size or modification time changed by the end of the ``with`` block (rewritten in place while it
    was read: the tensors read could mix two files) is refused; a rewrite that keeps the size within the file
    system's timestamp granularity (a clock tick, some ms) of the open is not seen.

    Raises:
        SparseFileError: unreadable, not a regular file, a header :func:`_check_header` or :func:`_layout` refuses,
            or a file that changed while it was read (on leaving the ``with`` block without an error).
    """
    try:
        descriptor = os.open(path, _OPEN_FLAGS)
    except OSError as error:
        raise SparseFileError(f"file: cannot read {path}: {error}") from error
    with ExitStack() as stack:
        stack.callback(os.close, descriptor)
        info = os.fstat(descriptor)
        _require(stat.S_ISREG(info.st_mode), "file", f"{path} is not a regular file")
        try:
            file = stack.enter_context(open(f"{_DESCRIPTORS}/{descriptor}", "rb"))
            length, header = _check_header(file, info.st_size, path)
        except OSError as error:
            raise SparseFileError(f"file: cannot read {path}: {error}") from error
        metadata, stored = _layout(header, info.st_size - 8 - length, path)
        yield _OpenFile(file, metadata, stored, 8 + length, path)
        after = os.fstat(descriptor)
        _require((after.st_size, after.st_mtime_ns) == (info.st_size, info.st_mtime_ns), "file",
                 f"{path} changed while it was read (its size or modification time moved: rewritten in place?)")


def _read_metadata(opened: _OpenFile) -> dict[str, Any]:
    """The ``"unsparse"`` metadata block of an open file (at most :data:`METADATA_MAX_CHARACTERS`), parsed without
    duplicate keys and checked at the top level."""
    raw = opened.metadata.get(METADATA_KEY)
    _require(isinstance(raw, str), "metadata", f"no {METADATA_KEY!r} string; not an UnSparse file")
    _require(len(raw) <= METADATA_MAX_CHARACTERS, "metadata",
             f"{len(raw)} characters, more than {METADATA_MAX_CHARACTERS}")
    try:  # NaN allowed: a run's metric in extra may be NaN; every checked field refuses it by type or range
        metadata = loads_strict(raw, constants=True)
    except (ValueError, RecursionError) as error:  # ValueError: also an integer beyond Python's digit limit
        raise SparseFileError(f"metadata: invalid JSON ({_foreign(error)})") from error
    _require(isinstance(metadata, dict), "metadata", "expected a JSON object")
    version = metadata.get("format_version")
    _require(type(version) is int and version == FORMAT_VERSION, "format_version",
             f"unsupported version {quote(version)}, expected the integer {FORMAT_VERSION}")
    for key, kind in (("model", dict), ("layers", dict), ("tensors", dict), ("extra", dict)):
        _require(isinstance(metadata.get(key), kind), key, f"missing or not a {kind.__name__}")
    _require("quantization" in metadata, "quantization", "missing (null for an unquantized model)")
    _require(set(metadata) == TOP_LEVEL_KEYS, "metadata",
             f"unexpected keys {quote(sorted(set(metadata) - TOP_LEVEL_KEYS))}")
    return metadata


def _read_parts(opened: _OpenFile, entries: dict[str, dict[str, Any]]) -> dict[str, dict[str, torch.Tensor]]:
    """The stored tensors of an open file, grouped by the state-dict key they encode (``<key>::<part>``, or the
    plain key as part ``""``), read (:meth:`_OpenFile.tensor`) only once every one belongs to a declared tensor
    (``entries``, already checked against the architecture), no tensor has more than :data:`MAX_PARTS` parts, every
    part has a dtype of :data:`STORED_DTYPES`, and the parts of each tensor hold at most
    :data:`PART_BYTES_PER_ELEMENT` bytes per element of it plus :data:`PART_BYTES_EXTRA`.

    Raises:
        SparseFileError: naming the stored key or tensor.
    """
    parts_of: dict[str, list[str]] = {}
    for stored_key in opened.stored:
        key, separator, part = stored_key.partition(PART_SEPARATOR)
        # "k::" would be part "" of k, as "k" is: one silently replacing the other
        _require(not separator or part != "", stored_key, "empty part name")
        _require(key in entries, stored_key, "a stored tensor the metadata does not declare")
        parts_of.setdefault(key, []).append(part)
        _require(len(parts_of[key]) <= MAX_PARTS, key, f"more than {MAX_PARTS} stored parts")
    missing = sorted(set(entries) - set(parts_of))
    _require(not missing, "tensors", f"declared but not stored: {missing}")
    for key, parts in parts_of.items():
        stored_bytes = sum(opened.stored[f"{key}{PART_SEPARATOR}{part}" if part else key].size for part in parts)
        limit = PART_BYTES_PER_ELEMENT * math.prod(entries[key]["shape"]) + PART_BYTES_EXTRA
        _require(stored_bytes <= limit, key, f"{stored_bytes} stored bytes; a tensor of shape {entries[key]['shape']} "
                 f"needs at most {limit}")
    return {key: {part: opened.tensor(f"{key}{PART_SEPARATOR}{part}" if part else key) for part in parts}
            for key, parts in parts_of.items()}


def _build_architecture(spec: dict[str, Any]) -> nn.Module:
    from unsparse.models import create_model

    name, kwargs = spec.get("name"), spec.get("kwargs")
    _require(set(spec) == {"name", "kwargs"} and isinstance(name, str) and isinstance(kwargs, dict), "model",
             f"bad model spec {quote(spec)}: expected a name and kwargs")
    try:
        with torch.device("meta"):
            model = create_model(name, **kwargs)
    except (TypeError, ValueError, RuntimeError, OverflowError) as error:  # e.g. a negative, zero or huge width
        raise SparseFileError(f"model: cannot build {quote(name)} with {quote(kwargs)}: {_foreign(error)}") from error
    return model


def _shell_model(metadata: dict[str, Any]) -> nn.Module:
    """The architecture ``metadata["model"]`` names, on the ``meta`` device, each convolution replaced by its
    :func:`_sparse_shell` and the quantization modules restored; the declared tensors (``metadata["tensors"]``) are
    checked against its state dict (:func:`_check_entries`) before anything is decoded. A convolution the
    architecture holds under several names becomes one shell shared by all of them, as
    :func:`~unsparse.runtime.modules.sparsify` shares its SparseConv (the layer is described under its first name,
    its tensors are stored under every name).

    Raises:
        SparseFileError: naming the field that differs from the architecture.
    """
    from unsparse.quant.state import restore_quantization

    model = _build_architecture(metadata["model"])
    replace_shared(model, (nn.Conv1d, nn.Conv2d),
                   lambda name, conv: _sparse_shell(name, conv, metadata["layers"].get(name)))
    _require(set(metadata["layers"]) == set(sparse_layers(model)), "layers",
             f"names differ from the architecture's convolutions: "
             f"{quote(sorted(set(metadata['layers']) ^ set(sparse_layers(model))))}")
    try:
        restore_quantization(model, metadata.get("quantization"))
    except SparseFormatError as error:
        raise SparseFileError(_foreign(error)) from error
    # a shared layer's values are stored under each of its names
    coded = {f"{alias}.values" for aliases in layer_names(model).values() for alias in aliases}
    _check_entries(metadata["tensors"], model.state_dict(), coded)
    return model


def _sparse_shell(name: str, conv: nn.Module, layer_meta: Any) -> SparseConv:
    """The :class:`SparseConv` that takes ``conv``'s place, on the ``meta`` device (shapes only, no data): the
    file's geometry and weight shape, both checked against the architecture's ``conv``, and its declared row
    length ``L`` (``0 <= L <= K``), so that the model's state dict names every tensor the file must hold, with
    its exact shape, before any of them is decoded."""
    field = f"layers.{name}"
    _require(isinstance(layer_meta, dict), field, "missing from the file")
    _require(set(layer_meta) == LAYER_KEYS, field, f"keys {quote(sorted(layer_meta))}, expected {sorted(LAYER_KEYS)}")
    try:
        geometry = ConvGeometry.from_dict(layer_meta.get("geometry"))
    except SparseFormatError as error:
        raise SparseFileError(f"{field}.{_foreign(error)}") from error
    try:  # the architecture's own conv: torch checked its groups when it was built, not if an attribute changed since
        architecture = ConvGeometry.from_module(conv)
    except SparseFormatError as error:
        raise SparseFileError(f"{field}: the architecture's convolution: {error}") from error
    _require(geometry == architecture, f"{field}.geometry",
             f"{geometry} differs from the architecture's {architecture}")
    weight_shape = tuple(conv.weight.shape)
    recorded = layer_meta["weight_shape"]
    _require(isinstance(recorded, list) and all(type(size) is int for size in recorded)
             and recorded == list(weight_shape), f"{field}.weight_shape",
             f"{quote(layer_meta.get('weight_shape'))} differs from the architecture's {list(weight_shape)}")
    columns, row_length = math.prod(weight_shape[1:]), layer_meta.get("row_length")
    _require(isinstance(row_length, int) and not isinstance(row_length, bool) and 0 <= row_length <= columns,
             f"{field}.row_length", f"expected an integer in [0, K = {columns}], got {quote(row_length)}")
    shape = (weight_shape[0], row_length)
    csr = UniformCSR(torch.empty(shape, dtype=conv.weight.dtype, device="meta"),
                     torch.empty(shape, dtype=INDEX_DTYPE, device="meta"), weight_shape)
    return SparseConv(csr, conv.bias, geometry)


def _check_entries(entries: dict[str, Any], expected: dict[str, torch.Tensor], coded: set[str]) -> None:
    """The file's declared tensors against the architecture's state dict ``expected`` (meta tensors), before any is
    read, so that a file cannot make the loader allocate more than its architecture holds: the same keys, each entry
    holding exactly ``shape``, ``dtype`` and ``codec``; the same shapes, the same integer dtypes, and one floating
    dtype for every floating tensor (a model computes in one; the architecture's own is float32, a file may hold the
    model in another, e.g. float16); a codec other than ``raw`` only on the keys in ``coded`` (the sparse layers'
    ``values``, which the quantizers encode: a codec's decoder makes temporaries several times its tensor's size,
    and a quantized classifier would load as a model that misdescribes itself)."""
    missing, unexpected = sorted(set(expected) - set(entries)), sorted(set(entries) - set(expected))
    _require(not missing and not unexpected, "tensors", f"missing {missing}, unexpected {quote(unexpected)}")
    floating = set()
    for key, reference in expected.items():
        entry = entries[key]
        _require(isinstance(entry, dict) and set(entry) == TENSOR_KEYS and isinstance(entry["shape"], list)
                 and all(type(size) is int for size in entry["shape"]), key,
                 f"bad entry {quote(entry)}: expected {sorted(TENSOR_KEYS)}, the shape a list of integers")
        _require(entry["shape"] == list(reference.shape), key,
                 f"shape {quote(entry['shape'])}, architecture needs {list(reference.shape)}")
        name = entry["dtype"]
        dtype = DTYPES.get(name) if isinstance(name, str) else None
        _require(dtype is not None, key, f"unknown dtype {quote(name)}")
        if reference.dtype.is_floating_point:
            _require(dtype.is_floating_point, key, f"dtype {dtype}, architecture needs a floating dtype")
            floating.add(dtype)
        else:
            _require(dtype == reference.dtype, key, f"dtype {dtype}, architecture needs {reference.dtype}")
        codec = entry["codec"]
        _require(isinstance(codec, dict) and isinstance(codec.get("name"), str), key, f"bad codec {quote(codec)}")
        _require(codec["name"] == "raw" or key in coded, key,
                 f"codec {quote(codec['name'])}; only a sparse layer's values may carry a codec other than raw")
    _require(len(floating) <= 1, "tensors", f"floating tensors in several dtypes {sorted(map(str, floating))}")


def _check_counts(name: str, layer_meta: dict[str, Any], csr: UniformCSR) -> None:
    """The layer's recorded ``nnz`` and ``sparsity`` (paper 004 eq. 6) against its decoded values. The metadata is
    what a reader sees without decoding tensors (a header dump, the loaded model's ``unsparse_metadata``); counts
    that disagree with the values describe another model, so the file is refused. (Our own reports count from the
    values.)"""
    field = f"layers.{name}"
    nnz, sparsity = layer_meta.get("nnz"), layer_meta.get("sparsity")
    counted, fraction = csr.nnz, csr.sparsity  # each a pass over the values: once, not again for the messages
    _require(type(nnz) is int and nnz == counted, f"{field}.nnz",
             f"recorded {quote(nnz)}, the values hold {counted} nonzeros")
    _require(type(sparsity) is float and math.isclose(sparsity, fraction, rel_tol=0.0, abs_tol=1e-12),
             f"{field}.sparsity", f"recorded {quote(sparsity)}, the values give {fraction!r}")


def _check_row_length(name: str, csr: UniformCSR) -> None:
    """The layer's row length ``L`` against its values: every row is padded to the largest row's nnz and no further
    (paper 004 UnSparse-Opt §5; DESIGN.md, The format), so ``L`` must equal the most nonzero values of any row. A
    longer ``L`` stores padding the format does not have, which every kernel then multiplies through.

    Raises:
        SparseFileError: naming ``layers.<name>.row_length``.
    """
    widest = int((csr.values != 0).sum(dim=1).max()) if csr.out_channels else 0
    _require(csr.row_length == widest, f"layers.{name}.row_length", f"{csr.row_length}, but the fullest row holds "
             f"{widest} nonzeros: rows are padded to the largest row's nnz and no further (UnSparse-Opt §5)")


def _check_distinct_columns(name: str, csr: UniformCSR) -> None:
    """No row of the layer names a column twice (format.py: padding takes columns its row does not use, so
    :meth:`UniformCSR.to_dense` inverts :meth:`UniformCSR.from_dense`). A row that repeats one sums its entries into
    one weight, so two finite entries can make an infinite weight that the check of the stored values does not see,
    and the recorded nnz, sparsity and row length count entries the dense weight does not have.

    Raises:
        SparseFileError: naming ``<name>.col_idx``, the first such row and its repeated column.
    """
    if csr.row_length < 2:
        return
    ordered = torch.sort(csr.col_idx, dim=1).values
    repeated = ordered[:, 1:] == ordered[:, :-1]
    if bool(repeated.any()):
        row = int(repeated.any(dim=1).nonzero()[0])
        column = int(ordered[row, 1:][repeated[row]][0])
        raise SparseFileError(f"{name}.col_idx: row {row} names column {column} more than once (a row's entries, "
                              "padding included, take distinct columns)")


def _decode_tensors(entries: dict[str, dict[str, Any]],
                    parts_by_key: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Every tensor of the file from its stored parts (:func:`_read_parts`; entries already checked by
    :func:`_check_entries`)."""
    decoded = {}
    for key, entry in entries.items():
        codec = entry["codec"]
        try:
            tensor = get_codec(codec["name"], key).decode(parts_by_key[key], codec, tuple(entry["shape"]), key)
        except SparseFormatError as error:
            raise SparseFileError(_foreign(error)) from error
        _require(tensor.dtype == DTYPES[entry["dtype"]], key,
                 f"dtype {tensor.dtype} differs from metadata {entry['dtype']}")
        decoded[key] = tensor
    return decoded


def _check_values(model: nn.Module, decoded: dict[str, torch.Tensor]) -> None:
    """Values that are numbers but no valid state: non-finite floats, and negative BatchNorm running variances
    (a forward would return NaN)."""
    for key, tensor in decoded.items():
        if tensor.dtype.is_floating_point:
            _require(bool(torch.isfinite(tensor).all()), key, "non-finite values")
    for name, module in model.named_modules():
        if isinstance(module, nn.BatchNorm1d | nn.BatchNorm2d | nn.BatchNorm3d) and module.running_var is not None:
            key = f"{name}.running_var"
            _require(bool((decoded[key] >= 0).all()), key, "negative running variance")


def _restore_codecs(model: nn.Module, entries: dict[str, dict[str, Any]]) -> None:
    """Put each non-raw codec spec back on its module (``unsparse_codecs``), so a reloaded model saves alike."""
    for key, entry in entries.items():
        codec = entry["codec"]
        if codec["name"] != "raw":
            module_name, _, tensor_name = key.rpartition(".")
            module = model.get_submodule(module_name) if module_name else model
            module.unsparse_codecs = {**getattr(module, "unsparse_codecs", {}), tensor_name: dict(codec)}


def file_tensor_bytes(path: str | Path) -> dict[str, int]:
    """Bytes each stored tensor (or codec part) occupies in a safetensors file, read from its header only
    (checked as :func:`_layout` checks it: offsets that are integers and tile the data section exactly).

    Returns:
        ``{stored key: bytes}``; keys of codec parts keep their ``::part`` suffix.

    Raises:
        SparseFileError: unreadable file, not a regular file, a malformed header (duplicate keys included), a
            stored dtype outside :data:`STORED_DTYPES`, or a file that changed while its header was read.
    """
    with _open_file(Path(path)) as opened:
        return {key: stored.size for key, stored in opened.stored.items()}


def layer_names(model: nn.Module) -> dict[str, list[str]]:
    """Every name under which ``model`` holds each of its :class:`SparseConv` layers.

    Returns:
        ``{first name: [every name, the first one first]}`` in module order, one entry per distinct layer, keyed as
        :func:`~unsparse.runtime.modules.sparse_layers` and the file's ``layers`` metadata name it. A layer shared
        by several names (``self.alias = self.conv``, or two parents holding it) lists each; its state-dict tensors,
        and so the file's, are stored under every one of them.
    """
    first_names = {layer: name for name, layer in sparse_layers(model).items()}
    names: dict[str, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, SparseConv):
            names.setdefault(first_names[module], []).append(name)
    return names


def layer_file_bytes(model: nn.Module, path: str | Path) -> dict[str, int]:
    """Bytes each sparse convolution of ``model`` takes in the file at ``path`` (read from its header only,
    :func:`file_tensor_bytes`): every stored tensor or codec part of the layer's own state dict, that is its
    ``values`` (or their codec parts), ``col_idx`` and ``bias``, and where the model quantizes activations to fixed
    point (paper 004 §4), its ``input_quantizer.saturation`` (a float32 scalar, 4 bytes).

    A layer shared by several names (:func:`layer_names`) is stored once per name, and all those copies count, in its
    one entry: each stored byte of a sparse layer is counted once, so the entries add up to what the file spends on
    the sparse layers.

    Returns:
        ``{first name: bytes}`` for every distinct :class:`SparseConv` of ``model``, in its order (the keys of
        :func:`~unsparse.runtime.modules.sparse_layers`).

    Raises:
        SparseFileError: as :func:`file_tensor_bytes`.
    """
    stored = file_tensor_bytes(path)
    layers = sparse_layers(model)
    sizes = {}
    for name, aliases in layer_names(model).items():
        keys = {f"{alias}.{key}" for alias in aliases for key in layers[name].state_dict()}
        sizes[name] = sum(size for key, size in stored.items() if key.partition(PART_SEPARATOR)[0] in keys)
    return sizes


def _target_device(device: torch.device | str) -> torch.device:
    """``device`` parsed, and on CUDA only where CUDA is available (else ``ValueError``: found before the file is
    read, not after it was validated)."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device: {device!r} is not a device ({error})") from error
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {device!r}, but CUDA is not available")
    return parsed


def load_sparse(path: str | Path, device: torch.device | str = "cpu", backend: str = "reference") -> nn.Module:
    """Read and fully validate a file written by :func:`save_sparse`; rebuild the sparse model.

    Args:
        path: the ``.safetensors`` file (untrusted).
        device: where the returned model's tensors live.
        backend: backend name given to every SparseConv.

    Returns:
        The model in eval mode, with ``unsparse_spec`` and ``unsparse_metadata`` (the JSON block) attributes.

    Raises:
        KeyError: an unknown ``backend`` name, listing the known ones.
        ValueError: a ``device`` torch cannot parse, or a CUDA device on a machine without one (checked first).
        SparseFileError: (a ``ValueError``) unreadable, non-regular or non-safetensors file (a header entry
            without exactly a dtype of :data:`STORED_DTYPES`, a shape and offsets that tile the data section: named
            by its key), a file that changed (size or modification time) or ended while it was read, a safetensors
            header of more than :data:`HEADER_MAX_BYTES` or with duplicate keys at any level, missing metadata,
            metadata longer than :data:`METADATA_MAX_CHARACTERS`, with duplicate keys, or holding keys the format
            does not define, unknown format version or model name, a tensor stored in more than :data:`MAX_PARTS`
            parts, missing/extra/misshapen tensors (checked against the
            architecture before any is read), a codec other than raw on a tensor that is no sparse layer's
            values, stored parts larger than their tensor can need, wrong dtypes or floating tensors of several
            dtypes, column indices outside
            ``[0, K)`` or named twice in a row, geometry or shape disagreeing with the architecture, a layer's
            recorded ``nnz`` or ``sparsity`` disagreeing with its values, a row length other than the largest row's
            nnz (rows padded
            further than UnSparse-Opt §5 pads them), non-finite values, negative
            BatchNorm variances, a layer's ``values`` codec, codec parameters or values that contradict the
            quantization description (:func:`~unsparse.quant.state.check_values_codecs`: e.g. a step that is no power
            of two under ``power_of_two``, more nonzero centroids than ``clusters``), or a module's own check of
            its loaded state failing (``check_loaded_state(name)``, e.g. an activation quantizer's saturation).
    """
    from unsparse.quant.state import check_values_codecs
    from unsparse.runtime.backends import get_backend

    get_backend(backend)  # an unknown name fails before the file is read, not at the first forward
    device = _target_device(device)
    with _open_file(Path(path)) as opened:
        metadata = _read_metadata(opened)
        model = _shell_model(metadata)
        parts_by_key = _read_parts(opened, metadata["tensors"])
    decoded = _decode_tensors(metadata["tensors"], parts_by_key)
    _check_values(model, decoded)
    for name, layer in sparse_layers(model).items():
        try:
            csr = UniformCSR(decoded[f"{name}.values"], decoded[f"{name}.col_idx"], layer.weight_shape)
        except SparseFormatError as error:
            raise SparseFileError(f"{name}.{error}") from error
        _check_distinct_columns(name, csr)
        _check_counts(name, metadata["layers"][name], csr)
        _check_row_length(name, csr)
    model.load_state_dict(decoded, strict=True, assign=True)
    _restore_codecs(model, metadata["tensors"])
    _require(not any(t.is_meta for t in [*model.parameters(), *model.buffers()]), "tensors",
             "the architecture has tensors the file does not provide")
    try:
        check_values_codecs(model)
    except SparseFormatError as error:
        raise SparseFileError(_foreign(error)) from error
    for name, module in model.named_modules():
        check = getattr(module, "check_loaded_state", None)
        if callable(check):
            try:
                check(name)
            except SparseFormatError as error:
                raise SparseFileError(_foreign(error)) from error
    for layer in sparse_layers(model).values():
        layer.backend = backend
    model.unsparse_spec = metadata["model"]
    model.unsparse_metadata = metadata
    return model.to(device).eval()
