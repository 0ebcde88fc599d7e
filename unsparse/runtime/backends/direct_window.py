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
    cl.WindowTiling(lx=4, py=2, px=4, mw=8, warps=8, cc=8),
    cl.WindowTiling(lx=4, py=2, px=4, mw=8, warps=4, cc=8),
    cl.WindowTiling(lx=4, py=2, px=4, mw=8, warps=16, cc=8),
    cl.WindowTiling(lx=4, py=2, px=4, mw=4, warps=8, cc=8),
    cl.WindowTiling(lx=8, py=2, px=4, mw=8, warps=8, cc=8),
    cl.WindowTiling(lx=2, py=2, px=4, mw=8, warps=8, cc=8),
)
"""``direct_window`` candidates: 2x4 pixels per lane; 8 output channels per warp (64 accumulators, the most
reuse of each window) or 4 (32, more blocks per SM); warp tiles 16x16, 8x32 and 32x8; 32 to 128 output
channels per block sharing each staged chunk of 8 input channels."""


@dataclass(frozen=True)
class WindowArrays:
    """Plan-time arrays of ``direct_window``: nonzeros grouped per (group g of MW output channels, input
    channel c).

    Attributes:
        group_ptr: ``(G*C + 1,)`` int32, G = ceil(M / MW); entries of (g, c) are
            ``[group_ptr[g*C+c], group_ptr[g*C+c+1])``.
        entries: ``(nnz + 1, 2)`` int32: the code ``j * R * S + r * S + s`` of weight ``W[g*MW + j, c, r, s]``
            and the float32 bits of the weight; the last row is ``(0, 0)``, read (not used) by the kernel's
            one-ahead prefetch.
    """

    group_ptr: torch.Tensor
    entries: torch.Tensor


def window_shape(csr: UniformCSR, tiling: cl.WindowTiling) -> WindowShape:
    """The jump-table shape a tiling uses for ``csr``'s kernel size."""
    return WindowShape(*csr.kernel_size, tiling.py, tiling.px, tiling.mw)


def window_space(batch: int, out_hw: tuple[int, int], kernel_size: tuple[int, int], dtype: torch.dtype,
                 prune: bool = True) -> list[dict[str, Any]]:
    """``direct_window`` settings: the :data:`WINDOW_TILINGS` with a jump table for ``kernel_size`` whose
    staged chunks fit in shared memory; empty for kernel sizes without a table.

    With ``prune``, tilings whose output tile is more than twice the plane in either direction are left out.
    """
    E, F_ = out_hw
    space = []
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
    rows = torch.arange(M, device=csr.values.device)[:, None].expand_as(csr.col_idx)
    keep = csr.values != 0
    m, k = rows[keep], csr.col_idx.long()[keep]
    c, tap = k // (R * S), k % (R * S)
    if c.numel() and (int(k.min()) < 0 or int(c.max()) >= C):
        raise ValueError(f"entries: a column index lies outside the {C}x{R}x{S} columns of the weight")
    code = (m % shape.mw) * (R * S) + tap
    key = (m // shape.mw) * C + c
    order = torch.argsort(key * shape.codes + code)
    group_ptr = torch.zeros(G * C + 1, dtype=torch.int64, device=csr.values.device)
    group_ptr[1:] = torch.cumsum(torch.bincount(key, minlength=G * C), 0)
    weights = csr.values[keep][order].float().contiguous().view(torch.int32)
    entries = torch.stack([code[order].to(torch.int32), weights], dim=1)
    entries = torch.cat([entries, entries.new_zeros(1, 2)]).contiguous()
    arrays = WindowArrays(group_ptr.to(torch.int32), entries)
    validate_window(arrays, M, C, shape)
    return arrays


def validate_window(arrays: WindowArrays, out_channels: int, channels: int, shape: WindowShape) -> None:
    """Check the grouped arrays before ``direct_window`` jumps through them.

    The kernel jumps to table entry ``code`` of every nonzero in ``[group_ptr[g*C+c], group_ptr[g*C+c+1])``
    and reads one entry past each range. Codes outside ``[0, codes)`` would jump outside the table; a code
    whose channel ``g * MW + code // (R * S)`` is not below M would add into a row that does not exist.

    Raises:
        ValueError: naming ``group_ptr`` (wrong length, not from 0 to nnz, decreasing) or ``entries`` (shape,
            a missing sentinel row, a code out of range or naming a channel beyond M).
    """
    G = math.ceil(out_channels / shape.mw)
    ptr, entries = arrays.group_ptr.long(), arrays.entries
    if entries.dim() != 2 or entries.shape[1] != 2 or entries.dtype != torch.int32:
        raise ValueError(f"entries: expected int32 of shape (nnz + 1, 2), got {entries.dtype} "
                         f"{tuple(entries.shape)}")
    nnz = entries.shape[0] - 1
    if nnz < 0:
        raise ValueError("entries: missing the sentinel row after the last nonzero")
    if ptr.numel() != G * channels + 1 or int(ptr[0]) != 0 or int(ptr[-1]) != nnz:
        raise ValueError(f"group_ptr: expected {G * channels + 1} entries from 0 to nnz={nnz}")
    if bool((ptr[1:] < ptr[:-1]).any()):
        raise ValueError("group_ptr: not non-decreasing")
    if nnz == 0:
        return
    codes = entries[:-1, 0].long()
    group = torch.repeat_interleave(torch.arange(G * channels, device=ptr.device) // channels, ptr[1:] - ptr[:-1])
    channel = group * shape.mw + torch.div(codes, shape.r * shape.s, rounding_mode="floor")
    if bool(((codes < 0) | (codes >= shape.codes) | (channel >= out_channels)).any()):
        raise ValueError(f"entries: codes outside [0, {shape.codes}) or naming an output channel >= "
                         f"{out_channels}")
