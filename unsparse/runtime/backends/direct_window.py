"""Plan-time arrays of the ``window`` variant of the direct backend (``direct_window`` in
``kernels/direct_conv.cu``): nonzeros grouped per (group of MW output channels, input channel) as jump-table
codes, their validation, and the variant's tuning space.

Escoin (paper 000 §3.1) stretches each nonzero's column index into an input offset; here the offset of tap
``(r, s)`` becomes the compile-time register operands of table entry ``j * R * S + r * S + s``
(``unsparse.runtime.window_dispatch``), so the only index the kernel reads per nonzero is that code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from unsparse.runtime import cupy_launcher as cl
from unsparse.runtime.window_dispatch import WINDOW_SHAPES, WindowShape
from unsparse.sparse.format import UniformCSR

WINDOW_TILINGS = (
    cl.WindowTiling(lx=4, py=4, px=4, mw=4, warps=8, cc=8),
    cl.WindowTiling(lx=4, py=4, px=4, mw=4, warps=16, cc=8),
    cl.WindowTiling(lx=8, py=4, px=4, mw=4, warps=8, cc=8),
    cl.WindowTiling(lx=4, py=2, px=8, mw=4, warps=8, cc=8),
    cl.WindowTiling(lx=4, py=2, px=4, mw=8, warps=8, cc=8),
    cl.WindowTiling(lx=8, py=2, px=4, mw=8, warps=8, cc=8),
)
"""``direct_window`` candidates: 4x4 or 2x8 pixels per lane and 4 output channels per warp (16 FMAs per
nonzero), or 2x4 pixels and 8 channels (8 FMAs per nonzero, more reuse of each window element); 64
accumulators each. Warp tiles 32x16, 16x32, 16x16 and 8x32 pixels; 32 to 64 output channels per block share
each staged chunk of 8 input channels."""


@dataclass(frozen=True)
class WindowArrays:
    """Plan-time arrays of ``direct_window``: nonzeros grouped per (group g of MW output channels, input
    channel c).

    Attributes:
        group_ptr: ``(G*C + 1,)`` int32, G = ceil(M / MW); the list of (g, c) is
            ``entries[group_ptr[g*C+c]:group_ptr[g*C+c+1]]``.
        entries: ``(nnz + G*C, 2)`` int32: the code ``j * R * S + r * S + s`` of weight ``W[g*MW + j, c, r, s]``
            and the float32 bits of the weight; every list ends with the sentinel ``(MW * R * S, 0)``, the
            exit of the kernel's threaded loop (which reads the pair after each nonzero before jumping).
    """

    group_ptr: torch.Tensor
    entries: torch.Tensor


def window_shape(csr: UniformCSR, tiling: cl.WindowTiling) -> WindowShape:
    """The jump-table shape a tiling uses for ``csr``'s kernel size."""
    return WindowShape(*csr.kernel_size, tiling.py, tiling.px, tiling.mw)


def window_space(batch: int, out_hw: tuple[int, int], kernel_size: tuple[int, int], dtype: torch.dtype,
                 prune: bool = True) -> list[dict[str, Any]]:
    """``direct_window`` settings: the :data:`WINDOW_TILINGS` with a jump table for ``kernel_size`` whose
    staged chunks fit in shared memory; empty for kernel sizes without a table and for dtypes other than
    float32.

    With ``prune``, tilings whose output tile is more than twice the plane in either direction are left out.
    """
    E, F_ = out_hw
    space: list[dict[str, Any]] = []
    if dtype != torch.float32:
        return space
    for tiling in WINDOW_TILINGS:
        if WindowShape(*kernel_size, tiling.py, tiling.px, tiling.mw) not in WINDOW_SHAPES:
            continue
        if cl.window_layout(dtype, kernel_size, tiling).shared_bytes() > cl.SHARED_LIMIT_BYTES:
            continue
        te, tf = tiling.tile_hw
        if prune and (te > 2 * E or tf > 2 * F_):
            continue
        space.append({"variant": "window", "lx": tiling.lx, "py": tiling.py, "px": tiling.px, "mw": tiling.mw,
                      "warps": tiling.warps, "cc": tiling.cc})
    return space


def window_tiling_of(params: dict[str, Any]) -> cl.WindowTiling:
    """The :class:`~unsparse.runtime.cupy_launcher.WindowTiling` of a ``window`` setting."""
    return cl.WindowTiling(params["lx"], params["py"], params["px"], params["mw"], params["warps"], params["cc"])


def prepare_window(csr: UniformCSR, shape: WindowShape) -> WindowArrays:
    """Group the nonzeros of ``csr`` per (group of ``shape.mw`` output channels, input channel) as jump-table
    codes, then validate them.

    Stored padding entries (value 0, UnSparse-Opt's uniform nnz) are dropped: the kernel's loop bound is the
    per-(group, channel) nonzero count. Within a group entries are sorted by code.

    Raises:
        ValueError: naming ``entries`` for a column index outside ``[0, C*R*S)``, or from
            :func:`validate_window`.
    """
    M, C = csr.out_channels, csr.in_channels_per_group
    R, S = csr.kernel_size
    G = math.ceil(M / shape.mw)
    device = csr.values.device
    rows = torch.arange(M, device=device)[:, None].expand_as(csr.col_idx)
    keep = csr.values != 0
    m, k = rows[keep], csr.col_idx.long()[keep]
    c, tap = k // (R * S), k % (R * S)
    if c.numel() and (int(k.min()) < 0 or int(c.max()) >= C):
        raise ValueError(f"entries: a column index lies outside the {C}x{R}x{S} columns of the weight")
    lists = torch.arange(G * C, device=device)
    key = torch.cat([(m // shape.mw) * C + c, lists])
    code = torch.cat([(m % shape.mw) * (R * S) + tap, torch.full_like(lists, shape.codes)])
    weights = torch.cat([csr.values[keep].float(), torch.zeros(G * C, device=device)])
    order = torch.argsort(key * (shape.codes + 1) + code)
    group_ptr = torch.zeros(G * C + 1, dtype=torch.int64, device=device)
    group_ptr[1:] = torch.cumsum(torch.bincount(key, minlength=G * C), 0)
    entries = torch.stack([code[order].to(torch.int32), weights[order].contiguous().view(torch.int32)], dim=1)
    arrays = WindowArrays(group_ptr.to(torch.int32), entries.contiguous())
    validate_window(arrays, M, C, shape)
    return arrays


def validate_window(arrays: WindowArrays, out_channels: int, channels: int, shape: WindowShape) -> None:
    """Check the grouped arrays before ``direct_window`` jumps through them.

    From ``group_ptr[g*C+c]`` the kernel jumps on codes until it reaches the sentinel ``MW * R * S``,
    reading one pair past each nonzero. So every list must be non-empty and end with the sentinel, hold no
    sentinel before its end, and every other code must lie in ``[0, MW * R * S)`` and name an existing
    output channel ``g * MW + code // (R * S) < M`` (codes beyond the sentinel are also clamped to it in
    the kernel, so no value can jump outside the table).

    Raises:
        ValueError: naming ``group_ptr`` (wrong length, not from 0 to the entry count, an empty list) or
            ``entries`` (dtype or shape, a list without its sentinel, a code out of range or naming a channel
            beyond M).
    """
    G = math.ceil(out_channels / shape.mw)
    ptr, entries = arrays.group_ptr.long(), arrays.entries
    if entries.dim() != 2 or entries.shape[1] != 2 or entries.dtype != torch.int32:
        raise ValueError(f"entries: expected int32 of shape (nnz + G*C, 2), got {entries.dtype} "
                         f"{tuple(entries.shape)}")
    if ptr.numel() != G * channels + 1 or int(ptr[0]) != 0 or int(ptr[-1]) != entries.shape[0]:
        raise ValueError(f"group_ptr: expected {G * channels + 1} entries from 0 to {entries.shape[0]}")
    if bool((ptr[1:] <= ptr[:-1]).any()):
        raise ValueError("group_ptr: not increasing (every list holds at least its sentinel)")
    codes = entries[:, 0].long()
    last = torch.zeros(entries.shape[0], dtype=torch.bool, device=codes.device)
    last[ptr[1:] - 1] = True
    if bool((codes[last] != shape.codes).any()):
        raise ValueError(f"entries: a list does not end with the sentinel code {shape.codes}")
    group = torch.repeat_interleave(torch.arange(G * channels, device=ptr.device) // channels, ptr[1:] - ptr[:-1])
    channel = group * shape.mw + torch.div(codes, shape.r * shape.s, rounding_mode="floor")
    bad = ~last & ((codes < 0) | (codes >= shape.codes) | (channel >= out_channels))
    if bool(bad.any()):
        raise ValueError(f"entries: codes outside [0, {shape.codes}) or naming an output channel >= "
                         f"{out_channels}")
