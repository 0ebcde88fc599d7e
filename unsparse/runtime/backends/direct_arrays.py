"""Plan-time index arrays of the ``direct`` kernels, built from a UniformCSR weight and checked before any kernel
reads through them.

The ``rows`` kernel reads stretched offsets into the unpadded input (Escoin, paper 000 §3.1), ``tile`` and
``pointwise`` offsets into the staged shared-memory chunk. A sparse file is untrusted, so every offset is validated
here against the image or chunk it addresses (:func:`validate_rows`, :func:`validate_tile`): an index out of range
would read arbitrary GPU memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from unsparse.runtime import launch_geometry as lg
from unsparse.sparse.format import UniformCSR
from unsparse.sparse.geometry import ConvGeometry


@dataclass(frozen=True)
class RowArrays:
    """Plan-time arrays of ``direct_rows`` for one weight and input size.

    Attributes:
        offsets: ``(M, L)`` int32, ``c*H*W + r*dil_h*W + s*dil_w`` (Escoin §3.1 stretching, unpadded input).
        taps: ``(M, L)`` int32, ``(r*dil_h) << 16 | (s*dil_w)`` for the in-kernel bounds check.
    """

    offsets: torch.Tensor
    taps: torch.Tensor


@dataclass(frozen=True)
class TileArrays:
    """Plan-time arrays of ``direct_tile`` (and ``direct_pointwise``): entries grouped per (group g of U output
    channels ``g*U .. g*U + U - 1``, staged chunk k); U = 1: the nonzeros of one channel.

    Attributes:
        chunk_ptr: ``(G*K + 1,)`` int32, G = ceil(M / U), K = ceil(C / CC); entries of (g, k) are
            ``[chunk_ptr[g*K+k], chunk_ptr[g*K+k+1])``.
        entries: ``(n, 1 + U)`` int32: the tap's element offset in the staged chunk,
            ``(c - k*CC) * channel_stride + r * padded_width + s``, then per channel of the group the weight's bits
            (zero where the channel lacks the tap): float32, or for half2 products a ``__half2`` holding the
            float16 weight twice. U = 1: n = nnz; U = 3: n = the taps of the union of each group's channels.
    """

    chunk_ptr: torch.Tensor
    entries: torch.Tensor


def prepare_rows(csr: UniformCSR, geometry: ConvGeometry, in_hw: tuple[int, int]) -> RowArrays:
    """Stretch and pack the column indices of ``csr`` for an unpadded ``in_hw`` input, then validate them."""
    H, W = in_hw
    R, S = csr.kernel_size
    k = csr.col_idx.long()
    r, s = (k % (R * S)) // S, k % S
    dy, dx = r * geometry.dilation[0], s * geometry.dilation[1]
    offsets = geometry.stretched_offsets(csr.col_idx, csr.kernel_size, (H, W))
    taps = (dy << lg.TAP_SHIFT_BITS) | dx
    validate_rows(offsets, taps, csr.in_channels_per_group, in_hw)
    return RowArrays(offsets.to(torch.int32).contiguous(), taps.to(torch.int32).contiguous())


def validate_rows(offsets: torch.Tensor, taps: torch.Tensor, channels: int, in_hw: tuple[int, int]) -> None:
    """Check that every address ``direct_rows`` can form lies inside one ``(C, H, W)`` image.

    The kernel loads ``x_image[offset + iy0*W + ix0]`` for an output pixel whose window starts at
    ``(iy0, ix0)`` only when ``0 <= iy0 + dy < H`` and ``0 <= ix0 + dx < W``. That address equals
    ``c*H*W + (iy0+dy)*W + (ix0+dx)``, inside the image, exactly when ``offset - dy*W - dx = c*H*W`` with
    ``0 <= c < C``.

    Args:
        offsets: ``(M, L)`` int64 stretched offsets. taps: ``(M, L)`` int64 packed ``dy << 16 | dx``.

    Raises:
        ValueError: naming ``offsets`` or ``taps`` when a shift does not fit 15 bits, an offset does not
            decompose into a channel start plus its shift, or the image exceeds int32 addressing.
    """
    H, W = in_hw
    if channels * H * W >= 2**31:
        raise ValueError(f"offsets: image of {channels}x{H}x{W} elements exceeds int32 addressing")
    if offsets.shape != taps.shape:
        raise ValueError(f"taps: shape {tuple(taps.shape)} differs from offsets {tuple(offsets.shape)}")
    if offsets.numel() == 0:
        return
    dy, dx = taps >> lg.TAP_SHIFT_BITS, taps & ((1 << lg.TAP_SHIFT_BITS) - 1)
    if int(taps.min()) < 0 or int(dy.max()) >= 2**15 or int(dx.max()) >= 2**15:
        raise ValueError("taps: a shift is negative or does not fit 15 bits")
    start = offsets - dy * W - dx
    channel = torch.div(start, H * W, rounding_mode="floor")
    if bool((start != channel * H * W).any()) or int(channel.min()) < 0 or int(channel.max()) >= channels:
        raise ValueError(f"offsets: entries outside [0, {channels}*{H}*{W}) or inconsistent with taps")


def prepare_tile(csr: UniformCSR, layout: lg.TileLayout, half2: bool = False, union: int = 1) -> TileArrays:
    """Group the nonzeros of ``csr`` per (group of ``union`` output channels, chunk of ``layout.chunk`` input
    channels) as offsets into the staged chunk (Escoin §3.1 weight stretching, here against the shared-memory tile),
    then validate them. ``half2``: weights as ``__half2`` pairs ``(w, w)`` of float16 (the values are rounded to
    float16; the half2 products of ``direct_half2``, which the kernel runs with ``union`` 1 only), else as float32.
    ``union`` > 1: one entry per tap of the union
    of the group's nonzero taps, holding each channel's weight (0 where the channel lacks the tap; kernels/NOTES.md
    v21); channels past ``M`` in the last group hold zeros.

    Stored padding entries (value 0, UnSparse-Opt uniform nnz) are dropped: the loop bound of this variant
    is the per-(group, chunk) entry count. Within a group entries are sorted by offset.
    """
    M, C = csr.out_channels, csr.in_channels_per_group
    R, S = csr.kernel_size
    K = math.ceil(C / layout.chunk)
    G = math.ceil(M / union)
    device = csr.values.device
    rows = torch.arange(M, device=device)[:, None].expand_as(csr.col_idx)
    keep = csr.values != 0
    m, k = rows[keep], csr.col_idx.long()[keep]
    c, r, s = k // (R * S), (k // S) % R, k % S
    chunk = c // layout.chunk
    offsets = (c - chunk * layout.chunk) * layout.channel_stride + r * layout.padded_width + s
    key = ((m // union) * K + chunk) * layout.elements() + offsets
    if union == 1:  # one entry per nonzero, also where a row names a column twice
        taps, order = torch.sort(key, stable=True)
        entry = torch.empty_like(order)
        entry[order] = torch.arange(order.numel(), device=device)
    else:  # one entry per tap of the union; a column named twice in a row adds up
        taps, entry = torch.unique(key, sorted=True, return_inverse=True)
    counts = torch.bincount(torch.div(taps, layout.elements(), rounding_mode="floor"), minlength=G * K)
    chunk_ptr = torch.zeros(G * K + 1, dtype=torch.int64, device=device)
    chunk_ptr[1:] = torch.cumsum(counts, 0)
    weights = torch.zeros(taps.numel(), union, dtype=torch.float64, device=device)
    weights.index_put_((entry, m % union), csr.values[keep].double(), accumulate=True)
    if half2:
        halves = weights.half().view(torch.int16)
        bits = torch.stack([halves, halves], dim=2).view(torch.int32)[..., 0]
    else:
        bits = weights.float().view(torch.int32)
    entries = torch.cat([(taps % layout.elements()).to(torch.int32)[:, None], bits], dim=1).contiguous()
    arrays = TileArrays(chunk_ptr.to(torch.int32), entries)
    validate_tile(arrays, M, C, (R, S), layout, union)
    return arrays


def longest_list(csr: UniformCSR, chunk: int, union: int = 1) -> int:
    """Entries of the longest (group, chunk) list :func:`prepare_tile` builds from ``csr`` for ``chunk`` input
    channels per staged chunk and ``union`` output channels per group (0 for an all-zero weight): one entry per stored
    nonzero for ``union`` 1, one per distinct tap of the group's nonzeros otherwise. It sizes the shared-memory slots
    of a ``stage_entries`` tiling (:func:`~unsparse.runtime.launch_geometry.tile_shared_bytes`); :func:`check_capacity`
    holds the built arrays to it.

    Raises:
        ValueError: for a ``chunk`` below 1 or a ``union`` that is not one of the kernel's.
    """
    if union not in lg.TILE_UNIONS or type(chunk) is not int or chunk < 1:
        raise ValueError(f"longest_list: chunk {chunk!r} must be a positive integer and union {union} one of "
                         f"{lg.TILE_UNIONS}")
    M, taps_per_channel = csr.out_channels, math.prod(csr.kernel_size)
    taps = csr.in_channels_per_group * taps_per_channel
    rows = torch.arange(M, device=csr.values.device)[:, None].expand_as(csr.col_idx)
    keep = csr.values != 0
    key = rows[keep] // union * taps + csr.col_idx.long()[keep]
    if union > 1:
        key = torch.unique(key)
    if key.numel() == 0:
        return 0
    lists = key // taps * math.ceil(csr.in_channels_per_group / chunk) + key % taps // taps_per_channel // chunk
    return int(torch.bincount(lists).max())


def check_capacity(arrays: TileArrays, capacity: int) -> None:
    """Check that no (group, chunk) list of ``arrays`` holds more than ``capacity`` entries, the slot a
    ``stage_entries`` kernel copies each list into: a longer list would overwrite another warp's slots.

    Raises:
        ValueError: naming ``chunk_ptr`` and the longest list.
    """
    ptr = arrays.chunk_ptr.long()
    longest = int((ptr[1:] - ptr[:-1]).max()) if ptr.numel() > 1 else 0
    if longest > capacity:
        raise ValueError(f"chunk_ptr: a list of {longest} entries exceeds the {capacity} entries of its slot")


def validate_tile(arrays: TileArrays, out_channels: int, channels: int, kernel_size: tuple[int, int],
                  layout: lg.TileLayout, union: int = 1) -> None:
    """Check the grouped arrays before ``direct_tile`` reads through them.

    The kernel reads ``tile[offset + (ly + py*WY) * padded_width + left + lx + ie * plane]`` for output rows
    ``ly + py*WY < tile_h - R + 1`` and columns ``lx < tile_w - S + 1``. That index lies inside the staged
    chunk, and in the right input channel, exactly when ``offset = cc * channel_stride + r * padded_width + s``
    with ``r < R``, ``s < S`` and ``cc < CC`` such that ``k * CC + cc < C`` for the entry's chunk k. It reads
    ``1 + union`` ints per entry (weights are only multiplied, so any bits are safe).

    Raises:
        ValueError: naming ``union`` (not one of the kernel's), ``chunk_ptr`` (wrong length, not from 0 to the
            entry count, decreasing) or ``entries`` (shape, or an offset that does not decompose as above).
    """
    R, S = kernel_size
    if union not in lg.TILE_UNIONS:
        raise ValueError(f"union: {union} is not one of {lg.TILE_UNIONS}")
    K = math.ceil(channels / layout.chunk)
    lists = math.ceil(out_channels / union) * K
    ptr, entries = arrays.chunk_ptr.long(), arrays.entries
    if entries.dim() != 2 or entries.shape[1] != 1 + union:
        raise ValueError(f"entries: expected shape (n, {1 + union}), got {tuple(entries.shape)}")
    n = entries.shape[0]
    if ptr.numel() != lists + 1 or int(ptr[0]) != 0 or int(ptr[-1]) != n:
        raise ValueError(f"chunk_ptr: expected {lists + 1} entries from 0 to n={n}")
    if bool((ptr[1:] < ptr[:-1]).any()):
        raise ValueError("chunk_ptr: not non-decreasing")
    if layout.tile_h < R or layout.tile_w < S or layout.padded_width < layout.left + layout.tile_w:
        raise ValueError(f"entries: layout {layout} does not hold a {R}x{S} halo")
    if n == 0:
        return
    offsets = entries[:, 0].long()
    chunk = torch.repeat_interleave(torch.arange(lists, device=ptr.device) % K, ptr[1:] - ptr[:-1])
    cc = torch.div(offsets, layout.channel_stride, rounding_mode="floor")
    rest = offsets - cc * layout.channel_stride
    r = torch.div(rest, layout.padded_width, rounding_mode="floor")
    s = rest - r * layout.padded_width
    bad = (offsets < 0) | (cc >= layout.chunk) | (chunk * layout.chunk + cc >= channels) | (r >= R) | (s >= S)
    if bool(bad.any()):
        raise ValueError(f"entries: offsets outside the staged chunk of {layout} or its channel range")
