"""Bit packing of small unsigned integers into a uint8 stream (quantization codes in the file).

Code ``i`` of a ``b``-bit stream occupies stream bits ``[i·b, (i+1)·b)``, least significant bit first, and
stream bit ``j`` is bit ``j % 8`` of byte ``j // 8``. So two 4-bit indices share a byte (the first in the
low nibble), 8-bit codes are one byte each and 16-bit codes are little-endian byte pairs. The last byte's
unused high bits are zero.
"""

from __future__ import annotations

import torch

from unsparse.sparse.format import SparseFormatError

MAX_PACKED_BITS = 16


def packed_size(count: int, bits: int) -> int:
    """Bytes of ``count`` codes of ``bits`` bits: ``ceil(count·bits / 8)``."""
    return (count * bits + 7) // 8


def _check(bits: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= MAX_PACKED_BITS:
        raise ValueError(f"bits: expected an integer in [1, {MAX_PACKED_BITS}], got {bits!r}")


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned codes into bytes.

    Args:
        codes: integer tensor (any shape, flattened in row-major order), every entry in ``[0, 2^bits)``.
        bits: code width in ``[1, 16]``.

    Returns:
        ``(packed_size(codes.numel(), bits),)`` uint8 tensor on the CPU.

    Raises:
        ValueError: bits out of range, a float tensor, or a code outside ``[0, 2^bits)``.
    """
    _check(bits)
    if codes.dtype.is_floating_point or codes.dtype == torch.bool:
        raise ValueError(f"codes: expected an integer tensor, got {codes.dtype}")
    flat = codes.detach().reshape(-1).to(torch.int64).cpu()
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= 1 << bits):
        raise ValueError(f"codes: entries must lie in [0, {1 << bits}), found [{int(flat.min())}, {int(flat.max())}]")
    stream = ((flat[:, None] >> torch.arange(bits)) & 1).reshape(-1)
    stream = torch.cat([stream, stream.new_zeros(-stream.numel() % 8)])
    return (stream.reshape(-1, 8) << torch.arange(8)).sum(dim=1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, count: int, field: str) -> torch.Tensor:
    """Inverse of :func:`pack_bits` for untrusted bytes.

    Args:
        packed: the stored part; must be a 1-D uint8 tensor of ``packed_size(count, bits)`` bytes.
        bits: code width in ``[1, 16]``.
        count: number of codes expected.
        field: names the part in errors.

    Returns:
        ``(count,)`` int64 codes in ``[0, 2^bits)``.

    Raises:
        SparseFormatError: wrong dtype, rank or length, or nonzero padding bits in the last byte.
    """
    _check(bits)
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise SparseFormatError(f"{field}: expected a 1-D uint8 tensor, got {packed.dtype} {tuple(packed.shape)}")
    if packed.numel() != packed_size(count, bits):
        raise SparseFormatError(f"{field}: {packed.numel()} bytes, {count} codes of {bits} bits need "
                                f"{packed_size(count, bits)}")
    stream = ((packed.to(torch.int64)[:, None] >> torch.arange(8)) & 1).reshape(-1)
    if bool(stream[count * bits:].any()):
        raise SparseFormatError(f"{field}: nonzero padding bits after the last code")
    weights = 1 << torch.arange(bits)
    return (stream[:count * bits].reshape(count, bits) * weights).sum(dim=1)
