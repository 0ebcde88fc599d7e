"""Bit packing of small unsigned integers into a uint8 stream (quantization codes in the file).

Code ``i`` of a ``b``-bit stream occupies stream bits ``[i·b, (i+1)·b)``, least significant bit first, and
stream bit ``j`` is bit ``j % 8`` of byte ``j // 8``. So two 4-bit indices share a byte (the first in the
low nibble), 8-bit codes are one byte each and 16-bit codes are little-endian byte pairs. The last byte's
unused high bits are zero. Codes are 1 to 32 bits wide (quantization codes take at most 16; the codebook's row
counts take as many as the row length needs).
"""

from __future__ import annotations

import torch

from unsparse.sparse.format import SparseFormatError

MAX_PACKED_BITS = 32


def packed_size(count: int, bits: int) -> int:
    """Bytes of ``count`` codes of ``bits`` bits: ``ceil(count·bits / 8)``."""
    return (count * bits + 7) // 8


def _check(bits: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= MAX_PACKED_BITS:
        raise ValueError(f"bits: expected an integer in [1, {MAX_PACKED_BITS}], got {bits!r}")


CHUNK_CODES = 1 << 20
"""Codes :func:`pack_bits` and :func:`unpack_bits` convert at a time: their temporaries stay near 40 MB whatever the
tensor's size (a stream of bits per code would take 8 bytes per bit, about 60 times a 4-bit file's size)."""


def _code_bytes(start: int, stop: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For codes ``start .. stop - 1`` of a ``bits``-bit stream: the byte holding each code's first bit, and that
    bit's position in it (0-7). A code then lies in that byte and the next ``_span(bits) - 1``."""
    first_bit = torch.arange(start, stop, dtype=torch.int64) * bits
    return first_bit >> 3, first_bit & 7


def _span(bits: int) -> int:
    """Bytes a ``bits``-bit code may touch: its first bit is at position 0-7 of its first byte (5 for 32 bits)."""
    return (7 + bits + 7) // 8


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned codes into bytes.

    Args:
        codes: integer tensor (any shape, flattened in row-major order), every entry in ``[0, 2^bits)``.
        bits: code width in ``[1, 32]``.

    Returns:
        ``(packed_size(codes.numel(), bits),)`` uint8 tensor on the CPU.

    Raises:
        ValueError: bits out of range, a float tensor, or a code outside ``[0, 2^bits)``.
    """
    _check(bits)
    if codes.dtype.is_floating_point or codes.dtype == torch.bool:
        raise ValueError(f"codes: expected an integer tensor, got {codes.dtype}")
    flat = codes.detach().reshape(-1).cpu().to(torch.int64)  # any integer dtype (uint16 has no min/max)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= 1 << bits):
        raise ValueError(f"codes: entries must lie in [0, {1 << bits}), found [{int(flat.min())}, {int(flat.max())}]")
    size = packed_size(flat.numel(), bits)
    span = _span(bits)
    packed = torch.zeros(size + span - 1, dtype=torch.uint8)  # spare bytes for the last code's reach
    for start in range(0, flat.numel(), CHUNK_CODES):
        stop = min(flat.numel(), start + CHUNK_CODES)
        byte, offset = _code_bytes(start, stop, bits)
        shifted = flat[start:stop] << offset
        for k in range(span):  # codes own disjoint bits, so adding their bytes is OR-ing them
            packed.index_add_(0, byte + k, ((shifted >> (8 * k)) & 0xFF).to(torch.uint8))
    return packed[:size].clone()


def unpack_bits(packed: torch.Tensor, bits: int, count: int, field: str) -> torch.Tensor:
    """Inverse of :func:`pack_bits` for untrusted bytes.

    Args:
        packed: the stored part; must be a 1-D uint8 tensor of ``packed_size(count, bits)`` bytes.
        bits: code width in ``[1, 32]``.
        count: number of codes expected.
        field: names the part in errors.

    Returns:
        ``(count,)`` int64 codes in ``[0, 2^bits)``.

    Raises:
        SparseFormatError: bits out of range, wrong dtype, rank or length, or nonzero padding bits in the last
            byte.
    """
    try:
        _check(bits)
    except ValueError as error:
        raise SparseFormatError(f"{field}: {error}") from error
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise SparseFormatError(f"{field}: expected a 1-D uint8 tensor, got {packed.dtype} {tuple(packed.shape)}")
    if packed.numel() != packed_size(count, bits):
        raise SparseFormatError(f"{field}: {packed.numel()} bytes, {count} codes of {bits} bits need "
                                f"{packed_size(count, bits)}")
    used = count * bits % 8
    if used and int(packed[-1]) >> used:
        raise SparseFormatError(f"{field}: nonzero padding bits after the last code")
    span = _span(bits)
    padded = torch.cat([packed, packed.new_zeros(span - 1)])
    codes = torch.empty(count, dtype=torch.int64)
    for start in range(0, count, CHUNK_CODES):
        stop = min(count, start + CHUNK_CODES)
        byte, offset = _code_bytes(start, stop, bits)
        word = sum(padded[byte + k].to(torch.int64) << (8 * k) for k in range(span))
        codes[start:stop] = (word >> offset) & ((1 << bits) - 1)
    return codes
