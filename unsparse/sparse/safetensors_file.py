"""The safetensors container of a sparse model file, read as untrusted bytes: its header and byte layout.

The path is opened once, and only a regular file is read (through that descriptor, never the path again); a
safetensors header with duplicate keys at any level (or of more than
:data:`~unsparse.sparse.schema.HEADER_MAX_BYTES`) is refused, and the header is checked as safetensors' reader checks
it (dtypes, shapes, offsets that tile the data section). Every byte, the header's included, is read with ordinary
reads into memory the loader owns, each tensor once; safetensors' reader is not used: it memory-maps the file, and a
mapped file cut short while open (rewritten in place by another process) kills the process with SIGBUS, where a short
read is refused. A file whose size or modification time changed while it was read is refused too (its tensors could
come from two versions). What the stored tensors and the metadata block mean is :mod:`unsparse.sparse.load`'s.
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

from unsparse.messages import quote
from unsparse.sparse.format import SIZE_LIMIT, bounded_product
from unsparse.sparse.schema import HEADER_MAX_BYTES, STORED_DTYPES, SparseFileError, foreign, require
from unsparse.strict_json import loads_strict

_OPEN_FLAGS = getattr(os, "O_PATH", os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
"""How a file to load is opened before it is checked: on Linux ``O_PATH`` (opens no device, blocks on no FIFO, reads
nothing), elsewhere read-only without blocking on a FIFO or taking a terminal."""


_DESCRIPTORS = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
"""The folder whose entry ``N`` opens the file that descriptor ``N`` has open (Linux: ``/proc/self/fd``; other
POSIX systems: ``/dev/fd``), whatever its path names by now."""


STORED_KEYS = {"dtype", "shape", "data_offsets"}
"""The keys of a tensor's entry in the safetensors header."""


def _check_header(file: BinaryIO, size: int, path: Path) -> tuple[int, Any]:
    """The safetensors header of ``file`` (an open file of ``size`` bytes: an 8-byte little-endian length, then that
    many bytes of JSON), parsed without duplicate keys (JSON readers, safetensors' included, keep the last of them: a
    second ``"unsparse"`` entry in ``__metadata__``, or a second entry of a tensor, would silently replace the first).

    Returns:
        ``(length, header)``: the header's length in bytes (the data section starts at byte ``8 + length``) and its
        parsed JSON, which :func:`_layout` checks.

    Raises:
        SparseFileError: fewer than 8 bytes or a header beyond the file (``file``), a header of more than
            :data:`~unsparse.sparse.schema.HEADER_MAX_BYTES` bytes, or with duplicate keys at any level, naming them
            (``header``), or one that is no UTF-8 JSON (``file``).
    """
    prefix = file.read(8)
    require(len(prefix) == 8, "file", f"{path} is not a valid safetensors file ({size} bytes, fewer than the 8 of "
            "the header length)")
    length = int.from_bytes(prefix, "little")
    require(length <= size - 8, "file", f"{path} is not a valid safetensors file (a header of {length} bytes in a "
            f"file of {size})")
    require(length <= HEADER_MAX_BYTES, "header", f"{length} bytes, more than {HEADER_MAX_BYTES}")
    try:
        return length, loads_strict(file.read(length).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise SparseFileError(f"file: {path} is not a valid safetensors file (header: {foreign(error)})") from error
    except ValueError as error:  # duplicate keys, NaN or Infinity, an integer beyond Python's digit limit
        raise SparseFileError(f"header: {foreign(error)}") from error


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
    safetensors' reader checks them (that reader memory-maps the file: :func:`open_file`): a JSON object whose
    ``__metadata__`` (optional, or null) maps strings to strings, and whose every other entry holds exactly ``dtype``
    (one of :data:`~unsparse.sparse.schema.STORED_DTYPES`), ``shape`` (integers in ``[0, 2^63)``, their product with
    each 0 read as 1 below 2^63, so that torch can shape even an empty tensor so) and ``data_offsets`` (``[start,
    end]``, ``0 <= start <= end``, spanning the tensor's bytes); in offset order, the tensors tile the ``data_bytes`` of
    the data section, without gaps or overlaps.

    Raises:
        SparseFileError: naming the stored key, ``header.__metadata__``, or ``file`` (a header that is no object,
            tensors that end before the data section does).
    """
    require(isinstance(header, dict), "file", f"{path} is not a valid safetensors file (its header is a "
            f"{type(header).__name__}, not an object)")
    metadata = header.get("__metadata__")
    metadata = {} if metadata is None else metadata
    require(isinstance(metadata, dict) and all(isinstance(value, str) for value in metadata.values()),
            "header.__metadata__", f"{quote(metadata)}: expected an object of strings")
    stored = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        require(isinstance(entry, dict) and set(entry) == STORED_KEYS, key,
                f"header entry {quote(entry)}: expected the keys {sorted(STORED_KEYS)}")
        name, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        require(isinstance(name, str) and name in STORED_DTYPES, key,
                f"stored dtype {quote(name)}, expected one of {sorted(STORED_DTYPES)}")
        # every size, and their product with zero sizes read as 1 (which bounds torch's numel and strides: an empty
        # [2^62, 2^62, 0] overflowed int64 in torch's reshape, a RuntimeError), below 2^63
        require(isinstance(shape, list) and all(type(size) is int and 0 <= size < SIZE_LIMIT for size in shape)
                and bounded_product(shape) < SIZE_LIMIT, key,
                f"shape {quote(shape)}: expected a list of integers in [0, 2^63) whose product (a 0 read as "
                "1) is below 2^63")
        require(isinstance(offsets, list) and len(offsets) == 2 and all(type(at) is int for at in offsets)
                and 0 <= offsets[0] <= offsets[1], key,
                f"data_offsets {quote(offsets)}: expected [start, end], integers, 0 <= start <= end")
        dtype = STORED_DTYPES[name]
        size = math.prod(shape) * dtype.itemsize
        require(offsets[1] - offsets[0] == size, key, f"data_offsets {offsets} hold {offsets[1] - offsets[0]} bytes, "
                f"a {name} tensor of shape {quote(shape)} {size}")
        stored[key] = _Stored(dtype, tuple(shape), offsets[0], size)
    end = 0
    for key, tensor in sorted(stored.items(), key=lambda item: (item[1].start, item[1].size)):
        require(tensor.start == end, key, f"data_offsets start at {tensor.start}, where the tensors before it (in "
                f"offset order) end at {end}: the tensors must tile the data section")
        end += tensor.size
    require(end == data_bytes, "file", f"{path} is not a valid safetensors file (its tensors end at byte {end} of a "
            f"data section of {data_bytes})")
    return metadata, stored


@dataclass(frozen=True)
class OpenFile:
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
        require(read == stored.size, "file", f"{self.path} ended before {stored_key}'s {stored.size} bytes (cut short "
                "while open)")
        return data.view(stored.dtype).reshape(stored.shape)


@contextmanager
def open_file(path: Path) -> Iterator[OpenFile]:
    """The safetensors file at ``path``, opened for reading: a regular file only, so that a FIFO cannot block the
    loader and a device (a link to ``/dev/zero``) cannot be read without end, with a header :func:`_check_header`
    and :func:`_layout` accept.

    The path is opened once (:data:`_OPEN_FLAGS`), that open file is checked (``os.fstat``), and the header and the
    tensors (:meth:`OpenFile.tensor`) are read through the descriptor (:data:`_DESCRIPTORS`), not through the path:
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
        require(stat.S_ISREG(info.st_mode), "file", f"{path} is not a regular file")
        try:
            file = stack.enter_context(open(f"{_DESCRIPTORS}/{descriptor}", "rb"))
            length, header = _check_header(file, info.st_size, path)
        except OSError as error:
            raise SparseFileError(f"file: cannot read {path}: {error}") from error
        metadata, stored = _layout(header, info.st_size - 8 - length, path)
        yield OpenFile(file, metadata, stored, 8 + length, path)
        after = os.fstat(descriptor)
        require((after.st_size, after.st_mtime_ns) == (info.st_size, info.st_mtime_ns), "file",
                f"{path} changed while it was read (its size or modification time moved: rewritten in place?)")
