"""Loading a sparse model file (layout: :mod:`unsparse.sparse.schema`), which is untrusted.

The file is opened and its safetensors header checked first (:mod:`unsparse.sparse.safetensors_file`: a regular file
only, read through one descriptor with ordinary reads, never a memory map), and at first only the header is read
(JSON metadata of at most :data:`~unsparse.sparse.schema.METADATA_MAX_CHARACTERS`, without duplicate keys). The
architecture is built on the ``meta`` device (no memory), with each convolution replaced by a shape-only
:class:`~unsparse.runtime.modules.SparseConv` of the file's row length (:mod:`unsparse.sparse.architecture`), and
every tensor's declared key, shape, dtype and codec (a quantization codec only on a sparse layer's ``values``) is
checked against its state dict, and every stored part's size against what its tensor can need (at most
:data:`~unsparse.sparse.schema.MAX_PARTS` parts), before any tensor is read or decoded, so that a file cannot make the
loader allocate much more than its architecture holds. Each tensor is read once (one allocation per stored tensor: a
few MB for the small models, some hundreds for VGG-16's dense classifier). Then values (finite, BatchNorm variances
not negative), index ranges, distinct columns within each row, and row lengths (each layer's largest row nnz,
UnSparse-Opt §5) are checked (:mod:`unsparse.sparse.checks`), and only then are real tensors assigned. Every problem
raises :class:`~unsparse.sparse.schema.SparseFileError` (a ``ValueError``) naming the field.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from unsparse.messages import quote
from unsparse.runtime.modules import sparse_layers
from unsparse.sparse.architecture import restore_codecs, shell_model
from unsparse.sparse.checks import check_counts, check_distinct_columns, check_row_length, check_values
from unsparse.sparse.codecs import PART_SEPARATOR, get_codec, stored_name
from unsparse.sparse.format import SparseFormatError, UniformCSR
from unsparse.sparse.safetensors_file import OpenFile, open_file
from unsparse.sparse.schema import (
    DTYPES,
    FORMAT_VERSION,
    MAX_PARTS,
    METADATA_KEY,
    METADATA_MAX_CHARACTERS,
    PART_BYTES_EXTRA,
    PART_BYTES_PER_ELEMENT,
    TOP_LEVEL_KEYS,
    SparseFileError,
    foreign,
    require,
)
from unsparse.strict_json import loads_strict


def _read_metadata(opened: OpenFile) -> dict[str, Any]:
    """The ``"unsparse"`` metadata block of an open file (at most
    :data:`~unsparse.sparse.schema.METADATA_MAX_CHARACTERS`), parsed without duplicate keys and checked at the top
    level."""
    raw = opened.metadata.get(METADATA_KEY)
    require(isinstance(raw, str), "metadata", f"no {METADATA_KEY!r} string; not an UnSparse file")
    require(len(raw) <= METADATA_MAX_CHARACTERS, "metadata",
            f"{len(raw)} characters, more than {METADATA_MAX_CHARACTERS}")
    try:  # NaN allowed: a run's metric in extra may be NaN; every checked field refuses it by type or range
        metadata = loads_strict(raw, constants=True)
    except (ValueError, RecursionError) as error:  # ValueError: also an integer beyond Python's digit limit
        raise SparseFileError(f"metadata: invalid JSON ({foreign(error)})") from error
    require(isinstance(metadata, dict), "metadata", "expected a JSON object")
    version = metadata.get("format_version")
    require(type(version) is int and version == FORMAT_VERSION, "format_version",
            f"unsupported version {quote(version)}, expected the integer {FORMAT_VERSION}")
    for key, kind in (("model", dict), ("layers", dict), ("tensors", dict), ("extra", dict)):
        require(isinstance(metadata.get(key), kind), key, f"missing or not a {kind.__name__}")
    require("quantization" in metadata, "quantization", "missing (null for an unquantized model)")
    require(set(metadata) == TOP_LEVEL_KEYS, "metadata",
            f"unexpected keys {quote(sorted(set(metadata) - TOP_LEVEL_KEYS))}")
    return metadata


def _read_parts(opened: OpenFile, entries: dict[str, dict[str, Any]]) -> dict[str, dict[str, torch.Tensor]]:
    """The stored tensors of an open file, grouped by the state-dict key they encode (``<key>::<part>``, or the plain
    key as part ``""``), read (:meth:`~unsparse.sparse.safetensors_file.OpenFile.tensor`) only once every one belongs to
    a declared tensor (``entries``, already checked against the architecture), no tensor has more than
    :data:`~unsparse.sparse.schema.MAX_PARTS` parts, every part has a dtype of
    :data:`~unsparse.sparse.schema.STORED_DTYPES`, and the parts of each tensor hold at most
    :data:`~unsparse.sparse.schema.PART_BYTES_PER_ELEMENT` bytes per element of it plus
    :data:`~unsparse.sparse.schema.PART_BYTES_EXTRA`.

    Raises:
        SparseFileError: naming the stored key or tensor.
    """
    parts_of: dict[str, list[str]] = {}
    for stored_key in opened.stored:
        key, separator, part = stored_key.partition(PART_SEPARATOR)
        # "k::" would be part "" of k, as "k" is: one silently replacing the other
        require(not separator or part != "", stored_key, "empty part name")
        require(key in entries, stored_key, "a stored tensor the metadata does not declare")
        parts_of.setdefault(key, []).append(part)
        require(len(parts_of[key]) <= MAX_PARTS, key, f"more than {MAX_PARTS} stored parts")
    missing = sorted(set(entries) - set(parts_of))
    require(not missing, "tensors", f"declared but not stored: {missing}")
    for key, parts in parts_of.items():
        stored_bytes = sum(opened.stored[stored_name(key, part)].size for part in parts)
        limit = PART_BYTES_PER_ELEMENT * math.prod(entries[key]["shape"]) + PART_BYTES_EXTRA
        require(stored_bytes <= limit, key, f"{stored_bytes} stored bytes; a tensor of shape {entries[key]['shape']} "
                f"needs at most {limit}")
    return {key: {part: opened.tensor(stored_name(key, part)) for part in parts}
            for key, parts in parts_of.items()}


def _decode_tensors(entries: dict[str, dict[str, Any]],
                    parts_by_key: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Every tensor of the file from its stored parts (:func:`_read_parts`; entries already checked by
    :func:`~unsparse.sparse.checks.check_entries`)."""
    decoded = {}
    for key, entry in entries.items():
        codec = entry["codec"]
        try:
            tensor = get_codec(codec["name"], key).decode(parts_by_key[key], codec, tuple(entry["shape"]), key)
        except SparseFormatError as error:
            raise SparseFileError(foreign(error)) from error
        require(tensor.dtype == DTYPES[entry["dtype"]], key,
                f"dtype {tensor.dtype} differs from metadata {entry['dtype']}")
        decoded[key] = tensor
    return decoded


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
    """Read and fully validate a file written by :func:`~unsparse.sparse.save.save_sparse`; rebuild the sparse model.

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
            without exactly a dtype of :data:`~unsparse.sparse.schema.STORED_DTYPES`, a shape and offsets that tile the
            data section: named by its key), a file that changed (size or modification time) or ended while it was read,
            a safetensors header of more than :data:`~unsparse.sparse.schema.HEADER_MAX_BYTES` or with duplicate keys at
            any level, missing metadata, metadata longer than :data:`~unsparse.sparse.schema.METADATA_MAX_CHARACTERS`,
            with duplicate keys, or holding keys the format does not define, unknown format version or model name, a
            tensor stored in more than :data:`~unsparse.sparse.schema.MAX_PARTS` parts, missing/extra/misshapen tensors
            (checked against the architecture before any is read), a codec other than raw on a tensor that is no sparse
            layer's values, stored parts larger than their tensor can need, wrong dtypes or floating tensors of several
            dtypes, column indices outside ``[0, K)`` or named twice in a row, geometry or shape disagreeing with the
            architecture, a layer's recorded ``nnz`` or ``sparsity`` disagreeing with its values, a row length other
            than the largest row's nnz (rows padded further than UnSparse-Opt §5 pads them), non-finite values, negative
            BatchNorm variances, a layer's ``values`` codec, codec parameters or values that contradict the quantization
            description (:func:`~unsparse.quant.state.check_values_codecs`: e.g. a step that is no power of two under
            ``power_of_two``, more nonzero centroids than ``clusters``), or a module's own check of its loaded state
            failing (``check_loaded_state(name)``, e.g. an activation quantizer's saturation).
    """
    from unsparse.quant.state import check_values_codecs
    from unsparse.runtime.backends import get_backend

    get_backend(backend)  # an unknown name fails before the file is read, not at the first forward
    device = _target_device(device)
    with open_file(Path(path)) as opened:
        metadata = _read_metadata(opened)
        model = shell_model(metadata)
        parts_by_key = _read_parts(opened, metadata["tensors"])
    decoded = _decode_tensors(metadata["tensors"], parts_by_key)
    check_values(model, decoded)
    for name, layer in sparse_layers(model).items():
        try:
            csr = UniformCSR(decoded[f"{name}.values"], decoded[f"{name}.col_idx"], layer.weight_shape)
        except SparseFormatError as error:
            raise SparseFileError(f"{name}.{error}") from error
        check_distinct_columns(name, csr)
        check_counts(name, metadata["layers"][name], csr)
        check_row_length(name, csr)
    model.load_state_dict(decoded, strict=True, assign=True)
    restore_codecs(model, metadata["tensors"])
    require(not any(t.is_meta for t in [*model.parameters(), *model.buffers()]), "tensors",
            "the architecture has tensors the file does not provide")
    try:
        check_values_codecs(model)
    except SparseFormatError as error:
        raise SparseFileError(foreign(error)) from error
    for name, module in model.named_modules():
        check = getattr(module, "check_loaded_state", None)
        if callable(check):
            try:
                check(name)
            except SparseFormatError as error:
                raise SparseFileError(foreign(error)) from error
    for layer in sparse_layers(model).values():
        layer.backend = backend
    model.unsparse_spec = metadata["model"]
    model.unsparse_metadata = metadata
    return model.to(device).eval()
