"""Checks of a sparse model file's content that its byte layout does not show: the declared tensors against the
architecture's state dict (before any is read), and the decoded values against themselves and the layer metadata
(finite values, BatchNorm variances, distinct columns, row lengths, recorded counts). The writer
(:func:`~unsparse.sparse.save.encode_model`) runs the value checks too, so that it refuses a model whose file
:func:`~unsparse.sparse.load.load_sparse` would refuse.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from unsparse.messages import quote
from unsparse.sparse.format import UniformCSR
from unsparse.sparse.schema import DTYPES, TENSOR_KEYS, SparseFileError, require


def check_entries(entries: dict[str, Any], expected: dict[str, torch.Tensor], coded: set[str]) -> None:
    """The file's declared tensors against the architecture's state dict ``expected`` (meta tensors), before any is
    read, so that a file cannot make the loader allocate more than its architecture holds: the same keys, each entry
    holding exactly ``shape``, ``dtype`` and ``codec``; the same shapes, the same integer dtypes, and one floating
    dtype for every floating tensor (a model computes in one; the architecture's own is float32, a file may hold the
    model in another, e.g. float16); a codec other than ``raw`` only on the keys in ``coded`` (the sparse layers'
    ``values``, which the quantizers encode: a codec's decoder makes temporaries several times its tensor's size,
    and a quantized classifier would load as a model that misdescribes itself)."""
    missing, unexpected = sorted(set(expected) - set(entries)), sorted(set(entries) - set(expected))
    require(not missing and not unexpected, "tensors", f"missing {missing}, unexpected {quote(unexpected)}")
    floating = set()
    for key, reference in expected.items():
        entry = entries[key]
        require(isinstance(entry, dict) and set(entry) == TENSOR_KEYS and isinstance(entry["shape"], list)
                and all(type(size) is int for size in entry["shape"]), key,
                f"bad entry {quote(entry)}: expected {sorted(TENSOR_KEYS)}, the shape a list of integers")
        require(entry["shape"] == list(reference.shape), key,
                f"shape {quote(entry['shape'])}, architecture needs {list(reference.shape)}")
        name = entry["dtype"]
        dtype = DTYPES.get(name) if isinstance(name, str) else None
        require(dtype is not None, key, f"unknown dtype {quote(name)}")
        if reference.dtype.is_floating_point:
            require(dtype.is_floating_point, key, f"dtype {dtype}, architecture needs a floating dtype")
            floating.add(dtype)
        else:
            require(dtype == reference.dtype, key, f"dtype {dtype}, architecture needs {reference.dtype}")
        codec = entry["codec"]
        require(isinstance(codec, dict) and isinstance(codec.get("name"), str), key, f"bad codec {quote(codec)}")
        require(codec["name"] == "raw" or key in coded, key,
                f"codec {quote(codec['name'])}; only a sparse layer's values may carry a codec other than raw")
    require(len(floating) <= 1, "tensors", f"floating tensors in several dtypes {sorted(map(str, floating))}")


def check_counts(name: str, layer_meta: dict[str, Any], csr: UniformCSR) -> None:
    """The layer's recorded ``nnz`` and ``sparsity`` (paper 004 eq. 6) against its decoded values. The metadata is
    what a reader sees without decoding tensors (a header dump, the loaded model's ``unsparse_metadata``); counts
    that disagree with the values describe another model, so the file is refused. (Our own reports count from the
    values.)"""
    field = f"layers.{name}"
    nnz, sparsity = layer_meta.get("nnz"), layer_meta.get("sparsity")
    counted, fraction = csr.nnz, csr.sparsity  # each a pass over the values: once, not again for the messages
    require(type(nnz) is int and nnz == counted, f"{field}.nnz",
            f"recorded {quote(nnz)}, the values hold {counted} nonzeros")
    require(type(sparsity) is float and math.isclose(sparsity, fraction, rel_tol=0.0, abs_tol=1e-12),
            f"{field}.sparsity", f"recorded {quote(sparsity)}, the values give {fraction!r}")


def check_row_length(name: str, csr: UniformCSR) -> None:
    """The layer's row length ``L`` against its values: every row is padded to the largest row's nnz and no further
    (paper 004 UnSparse-Opt §5; DESIGN.md, The format), so ``L`` must equal the most nonzero values of any row. A
    longer ``L`` stores padding the format does not have, which every kernel then multiplies through.

    Raises:
        SparseFileError: naming ``layers.<name>.row_length``.
    """
    widest = int((csr.values != 0).sum(dim=1).max()) if csr.out_channels else 0
    require(csr.row_length == widest, f"layers.{name}.row_length", f"{csr.row_length}, but the fullest row holds "
            f"{widest} nonzeros: rows are padded to the largest row's nnz and no further (UnSparse-Opt §5)")


def check_distinct_columns(name: str, csr: UniformCSR) -> None:
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


def check_values(model: nn.Module, decoded: dict[str, torch.Tensor]) -> None:
    """Values that are numbers but no valid state: non-finite floats, and negative BatchNorm running variances
    (a forward would return NaN)."""
    for key, tensor in decoded.items():
        if tensor.dtype.is_floating_point:
            require(bool(torch.isfinite(tensor).all()), key, "non-finite values")
    for name, module in model.named_modules():
        if isinstance(module, nn.BatchNorm1d | nn.BatchNorm2d | nn.BatchNorm3d) and module.running_var is not None:
            key = f"{name}.running_var"
            require(bool((decoded[key] >= 0).all()), key, "negative running variance")
