"""File codecs of quantized tensors (see :mod:`unsparse.sparse.codecs`): how a quantized weight is stored.

In memory a quantized weight stays a float32 tensor holding exactly the quantized values (fake
quantization); on save its codec stores the compact form, and on load it rebuilds bitwise the same tensor:

- ``float16``: the tensor in half precision (part ``half``), 2 bytes per value.
- ``fixed_point`` (params ``bits``, ``step``): signed codes of eq. 19 (:mod:`unsparse.quant.fixed_point`),
  two's complement, bit-packed (part ``codes``); value = code · step.
- ``codebook`` (params ``index_bits``, ``centroid_bits``, ``step``) for a UniformCSR ``values`` ``(M, L)``
  tensor: the centroids as fixed-point codes (part ``centroids``, int8 or int16; each distinct stored value once,
  so every centroid is used by a stored entry and none repeats), the bit-packed centroid
  index of every entry (part ``indices``, e.g. two 4-bit indices per byte) and, per row, how many leading
  entries are stored (part ``row_nnz``, bit-packed in :func:`row_count_bits` bits, 1 to 31); the entries after
  them are UniformCSR padding and decode to exactly zero, so padding needs no codebook entry (paper 004 §4,
  Algorithm 3). A stored zero before a row's padding would take one like any value; the quantizers re-pack
  each layer after quantizing (:mod:`unsparse.quant.layerwise`), so they leave none.

The step travels in the JSON metadata as a float that is exactly a float32 value; the encoders refuse any other
step (``SparseFormatError``, a ValueError), as the decoders do, so no file is written that would not load.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from unsparse.messages import quote
from unsparse.quant.fixed_point import check_bits, from_codes, max_code, to_codes
from unsparse.quant.packing import pack_bits, unpack_bits
from unsparse.sparse.codecs import TensorCodec, expect_params, expect_parts, register_codec
from unsparse.sparse.format import SparseFormatError


def _bits(params: dict[str, Any], key: str, low: int, field: str) -> int:
    try:
        return check_bits(params[key], key, low=low)
    except ValueError as error:
        raise SparseFormatError(f"{field}: {error}") from error


def _step(params: dict[str, Any], field: str) -> float:
    """The codec's ``step``: a number > 0 that is exactly a float32 value (as the quantizers write it), so that a
    step that float32 rounds to 0 or to infinity, or a JSON integer too large for a float, cannot pass."""
    step = params["step"]
    try:
        valid = (not isinstance(step, bool) and isinstance(step, int | float) and math.isfinite(step) and step > 0
                 and float(torch.tensor(step, dtype=torch.float32)) == step)
    except OverflowError:
        valid = False
    if not valid:
        raise SparseFormatError(f"{field}: step must be a float32 value > 0, got {quote(step)}")
    return float(step)


def _float32(tensor: torch.Tensor, codec: str) -> torch.Tensor:
    if tensor.dtype != torch.float32:
        raise ValueError(f"{codec} codec: expected a float32 tensor, got {tensor.dtype}")
    return tensor.detach().cpu()


def _grid_codes(tensor: torch.Tensor, step: float, bits: int, codec: str) -> torch.Tensor:
    """Codes of a tensor that must already lie on the ``bits``-bit grid of ``step``.

    Raises:
        ValueError: ``<codec> codec: `` and the counted message of :func:`~unsparse.quant.fixed_point.to_codes` for
            NaN or infinite values, else the tensor is off the grid.
    """
    try:
        codes = to_codes(tensor, step, bits)
    except ValueError as error:
        raise ValueError(f"{codec} codec: {error}") from error
    if not torch.equal(from_codes(codes, step), tensor):
        raise ValueError(f"{codec} codec: the tensor is not on the {bits}-bit grid of step {step!r}; "
                         "quantize it first (its quantizer sets the codec)")
    return codes


def _signed(unsigned: torch.Tensor, bits: int, field: str) -> torch.Tensor:
    """Two's complement ``bits``-bit codes -> signed codes, checked to lie in ``[-q_max, q_max]``."""
    codes = unsigned - ((unsigned >> (bits - 1)) & 1) * (1 << bits)
    if codes.numel() and int(codes.abs().max()) > max_code(bits):
        raise SparseFormatError(f"{field}: code {int(codes.min())} outside [-{max_code(bits)}, {max_code(bits)}]")
    return codes


def _storage_dtype(bits: int) -> torch.dtype:
    return torch.int8 if bits <= 8 else torch.int16


def _centroid_codes(centroids: torch.Tensor, index_bits: int, centroid_bits: int, field: str) -> torch.Tensor:
    """Validated codebook part: 1-D int8/int16 (by ``centroid_bits``), at most ``2^index_bits`` codes in range."""
    dtype = _storage_dtype(centroid_bits)
    if centroids.dtype != dtype or centroids.dim() != 1 or centroids.numel() > 1 << index_bits:
        raise SparseFormatError(f"{field}: expected at most {1 << index_bits} {dtype} codes, got {centroids.dtype} "
                                f"{tuple(centroids.shape)}")
    codes = centroids.to(torch.int64)
    if codes.numel() and int(codes.abs().max()) > max_code(centroid_bits):
        raise SparseFormatError(f"{field}: codes outside [-{max_code(centroid_bits)}, {max_code(centroid_bits)}]")
    return codes


def _check_codebook_form(centroids: torch.Tensor, used: torch.Tensor, field: str) -> None:
    """The codebook holds each distinct stored value once, as the encoder writes it: no code twice, and each centroid
    named by an entry of ``used`` (the stored entries' indices, all below ``centroids.numel()``). So its size is the
    layer's count of distinct stored values, which a scheme's settings may bound (k-means ``clusters``)."""
    distinct, counts = torch.unique(centroids, return_counts=True)
    if bool((counts > 1).any()):
        raise SparseFormatError(f"{field}: code {int(distinct[counts > 1][0])} appears twice; a codebook holds each "
                                "distinct value once")
    unused = (torch.bincount(used, minlength=centroids.numel()) == 0).nonzero()
    if unused.numel():
        index = int(unused[0])
        raise SparseFormatError(f"{field}: centroid {index} (code {int(centroids[index])}) is used by no stored "
                                "entry; a codebook holds only the stored values")


def row_count_bits(row_length: int) -> int:
    """Bits of one ``row_nnz`` entry of a codebook tensor with rows of ``row_length`` entries: the bits of
    ``row_length`` itself, at least 1 (17 from 65,536 entries on; a row length fits int32 column indices, so at
    most 31)."""
    return max(1, int(row_length).bit_length())


@register_codec
class Float16Codec(TensorCodec):
    """A float32 tensor whose values are exactly representable in float16, stored as float16."""

    name = "float16"

    def encode(self, tensor: torch.Tensor, params: dict[str, Any]) -> dict[str, torch.Tensor]:
        tensor = _float32(tensor, self.name)
        half = tensor.to(torch.float16)
        if not torch.equal(half.to(torch.float32), tensor):
            raise ValueError("float16 codec: the tensor is not exactly representable in float16; quantize it first")
        return {"half": half}

    def decode(self, parts: dict[str, torch.Tensor], params: dict[str, Any], shape: tuple[int, ...],
               field: str) -> torch.Tensor:
        expect_params(params, set(), field)
        expect_parts(parts, {"half"}, field)
        half = parts["half"]
        if half.dtype != torch.float16 or tuple(half.shape) != tuple(shape):
            raise SparseFormatError(f"{field}::half: expected float16 {tuple(shape)}, got {half.dtype} "
                                    f"{tuple(half.shape)}")
        return half.to(torch.float32)


@register_codec
class FixedPointCodec(TensorCodec):
    """A float32 tensor on a signed ``bits``-bit fixed-point grid: packed two's complement codes (eq. 19)."""

    name = "fixed_point"

    def encode(self, tensor: torch.Tensor, params: dict[str, Any]) -> dict[str, torch.Tensor]:
        bits = check_bits(params["bits"])
        codes = _grid_codes(_float32(tensor, self.name), _step(params, self.name), bits, self.name)
        return {"codes": pack_bits(codes & ((1 << bits) - 1), bits)}

    def decode(self, parts: dict[str, torch.Tensor], params: dict[str, Any], shape: tuple[int, ...],
               field: str) -> torch.Tensor:
        expect_params(params, {"bits", "step"}, field)
        bits, step = _bits(params, "bits", 2, field), _step(params, field)
        expect_parts(parts, {"codes"}, field)
        count = math.prod(shape)
        codes = _signed(unpack_bits(parts["codes"], bits, count, f"{field}::codes"), bits, f"{field}::codes")
        return from_codes(codes, step).reshape(shape)


@register_codec
class CodebookCodec(TensorCodec):
    """UniformCSR ``values`` ``(M, L)`` whose stored entries take at most ``2^index_bits`` distinct values,
    each a ``centroid_bits``-bit fixed-point code times ``step``; trailing zeros of a row are padding."""

    name = "codebook"

    def encode(self, tensor: torch.Tensor, params: dict[str, Any]) -> dict[str, torch.Tensor]:
        tensor = _float32(tensor, self.name)
        if tensor.dim() != 2:
            raise ValueError(f"codebook codec: expected UniformCSR values (M, L), got shape {tuple(tensor.shape)}")
        index_bits, centroid_bits = check_bits(params["index_bits"], "index_bits", low=1), check_bits(
            params["centroid_bits"], "centroid_bits")
        codes = _grid_codes(tensor, _step(params, self.name), centroid_bits, self.name)
        M, L = tensor.shape
        positions = torch.arange(1, L + 1)
        row_nnz = ((tensor != 0) * positions).amax(dim=1) if L else torch.zeros(M, dtype=torch.int64)
        stored = positions[None, :] <= row_nnz[:, None]
        table, inverse = torch.unique(codes[stored], return_inverse=True)
        if table.numel() > 1 << index_bits:
            raise ValueError(f"codebook codec: {table.numel()} distinct values do not fit {index_bits}-bit indices")
        indices = torch.zeros(M, L, dtype=torch.int64)
        indices[stored] = inverse
        return {"indices": pack_bits(indices, index_bits), "centroids": table.to(_storage_dtype(centroid_bits)),
                "row_nnz": pack_bits(row_nnz, row_count_bits(L))}

    def decode(self, parts: dict[str, torch.Tensor], params: dict[str, Any], shape: tuple[int, ...],
               field: str) -> torch.Tensor:
        expect_params(params, {"index_bits", "centroid_bits", "step"}, field)
        index_bits, centroid_bits = _bits(params, "index_bits", 1, field), _bits(params, "centroid_bits", 2, field)
        step = _step(params, field)
        expect_parts(parts, {"indices", "centroids", "row_nnz"}, field)
        if len(shape) != 2:
            raise SparseFormatError(f"{field}: codebook tensors are (M, L), metadata says {quote(tuple(shape))}")
        M, L = shape
        centroids = _centroid_codes(parts["centroids"], index_bits, centroid_bits, f"{field}::centroids")
        row_nnz = unpack_bits(parts["row_nnz"], row_count_bits(L), M, f"{field}::row_nnz")
        if M and int(row_nnz.max()) > L:
            raise SparseFormatError(f"{field}::row_nnz: {int(row_nnz.max())} exceeds the row length {L}")
        indices = unpack_bits(parts["indices"], index_bits, M * L, f"{field}::indices").reshape(M, L)
        stored = torch.arange(1, L + 1)[None, :] <= row_nnz[:, None]
        if bool((indices[stored] >= centroids.numel()).any()) or bool(indices[~stored].any()):
            raise SparseFormatError(f"{field}::indices: a stored entry names no centroid (of "
                                    f"{centroids.numel()}) or a padding entry is not 0")
        _check_codebook_form(centroids, indices[stored], f"{field}::centroids")
        values = torch.zeros(M, L, dtype=torch.float32)
        values[stored] = from_codes(centroids, step)[indices[stored]]
        return values
