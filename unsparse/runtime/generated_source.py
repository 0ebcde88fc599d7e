"""CUDA source of weight-specialised direct sparse convolution kernels (``kernels/generated_conv.cu``).

The direct kernels of ``kernels/direct_conv.cu`` read each nonzero at run time, so one staged input load feeds one
FMA; that caps them near 15 TFLOP/s FP32 on an H100 (``kernels/NOTES.md``, "Floors"). For inference the pruned
weight is fixed (paper 004 §5 deploys one kernel per layer), so it can be compiled into the kernel: each nonzero
becomes one fused multiply-add with the weight as an immediate operand into one of KT register accumulators, and
one input value loaded from shared memory feeds every nonzero of the KT output channels at that (input channel,
tap). Nothing the kernel indexes comes from the weight at run time.

This module is pure Python (no CuPy, no GPU): it splits a weight into :class:`Program` s (one per KT output
channels), renders each as CUDA source, and can run a program on the CPU exactly as the kernel's threads would
(:func:`run_program`), which is what the CPU tests check against ``torch.nn.functional.conv2d``.

Shapes: weight ``(M, C, R, S)`` float32 (FP16 layers pass their float16 weight converted to float32, exactly),
input ``(N, C, H, W)``, output ``(N, M, E, F)``, all NCHW; stride 1, dilation 1, groups 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from unsparse.runtime.cupy_launcher import KERNEL_DIR

SKELETON_FILE = KERNEL_DIR / "generated_conv.cu"
"""The kernel around the generated products."""

STORAGE_TYPES = {torch.float32: "float", torch.float16: "__half"}
"""CUDA storage type per torch dtype; arithmetic is float32 in both."""

TILE_WIDTHS = (32, 28, 16, 14, 8, 7)
"""Output tile widths :func:`choose_tile` considers (one output pixel per thread, a warp along a row)."""

TARGET_THREADS = 256
"""Threads per block :func:`choose_tile` aims at: KT = 64 accumulators take about 128 registers per thread, so two
such blocks fit an SM's 64 K registers."""


@dataclass(frozen=True)
class Tile:
    """How one generated kernel covers a layer.

    Attributes:
        rows: KT, output channels per kernel (register accumulators per thread).
        chunk: CC, input channels staged in shared memory per barrier pair.
        height, width: TH x TW output pixels per block, one per thread.
    """

    rows: int
    chunk: int
    height: int
    width: int

    @property
    def threads(self) -> int:
        """Threads per block (TH * TW)."""
        return self.height * self.width

    def shared_bytes(self, kernel: tuple[int, int]) -> int:
        """Shared memory (bytes) of one staged chunk with its halo, float32."""
        return 4 * self.chunk * (self.height + kernel[0] - 1) * (self.width + kernel[1] - 1)


def choose_tile(out_hw: tuple[int, int], rows: int = 64, chunk: int = 8) -> Tile:
    """The tile for an ``E x F`` output: the width in :data:`TILE_WIDTHS` that wastes the fewest columns of ``F``
    (the widest of those), then the height of at most :data:`TARGET_THREADS` / width rows that wastes the fewest
    rows of ``E`` (the tallest of those)."""
    out_h, out_w = out_hw
    width = min(TILE_WIDTHS, key=lambda w: (_waste(out_w, w), -w))
    height = min(range(1, max(1, TARGET_THREADS // width) + 1), key=lambda h: (_waste(out_h, h), -h))
    return Tile(rows, chunk, height, width)


def _waste(size: int, step: int) -> int:
    """Positions past ``size`` that tiles of ``step`` cover."""
    return math.ceil(size / step) * step - size


@dataclass(frozen=True)
class Tap:
    """One staged input value and the products it feeds.

    Attributes:
        chunk: which staged chunk (input channels ``chunk * CC ..``).
        offset: its position in the chunk's shared window relative to a thread's own origin,
            ``(c_local * WH + r) * WW + s``.
        products: ``(row within the program, weight)`` pairs, rows ascending, weights nonzero float32 values.
    """

    chunk: int
    offset: int
    products: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class Program:
    """The generated kernel of output channels ``first .. first + rows - 1`` of one layer.

    Attributes:
        first: first output channel (k0).
        rows: output channels this program writes (KT, fewer for the last one).
        channels: C. kernel: (R, S). padding: (pad_h, pad_w).
        tile: the launch tile.
        taps: every staged value read, in the order the kernel reads them.
    """

    first: int
    rows: int
    channels: int
    kernel: tuple[int, int]
    padding: tuple[int, int]
    tile: Tile
    taps: tuple[Tap, ...]

    @property
    def products(self) -> int:
        """Number of multiply-adds per output pixel (the nonzeros of this program's rows)."""
        return sum(len(tap.products) for tap in self.taps)


def programs(weight: np.ndarray, padding: tuple[int, int], tile: Tile) -> list[Program]:
    """Split a dense ``(M, C, R, S)`` weight into one :class:`Program` per ``tile.rows`` output channels.

    Args:
        weight: float32, finite (the caller validated it: a sparse file is untrusted).
        padding: (pad_h, pad_w), each 0 .. R-1 / S-1.
        tile: from :func:`choose_tile`.

    Raises:
        ValueError: naming the field, for a weight that is not a finite float32 4-D array, or a padding outside
            0 .. kernel - 1 (the staged window has no room for more).
    """
    if not isinstance(weight, np.ndarray) or weight.ndim != 4 or weight.dtype != np.float32:
        raise ValueError("weight: expected a 4-D float32 array (M, C, R, S)")
    if not np.isfinite(weight).all():
        raise ValueError("weight: not finite")
    out_channels, channels, r_size, s_size = weight.shape
    if not all(0 <= p < k for p, k in zip(padding, (r_size, s_size), strict=True)):
        raise ValueError(f"padding: {padding} outside 0 .. kernel - 1 for kernel {(r_size, s_size)}")
    window_h, window_w = tile.height + r_size - 1, tile.width + s_size - 1
    result = []
    for first in range(0, out_channels, tile.rows):
        block = weight[first:first + tile.rows]
        taps = []
        for c in range(channels):
            for r in range(r_size):
                for s in range(s_size):
                    column = block[:, c, r, s]
                    rows = np.flatnonzero(column)
                    if rows.size:
                        offset = ((c % tile.chunk) * window_h + r) * window_w + s
                        taps.append(Tap(c // tile.chunk, offset,
                                        tuple((int(k), float(column[k])) for k in rows)))
        result.append(Program(first, block.shape[0], channels, (r_size, s_size), padding, tile, tuple(taps)))
    return result


def products_source(program: Program) -> str:
    """CUDA text of ``chunk_products``: a switch over chunks, each case the chunk's taps as straight-line code
    (one shared load, then one ``fmaf`` per product with the weight as an exact hexadecimal float literal)."""
    lines = ["__device__ __forceinline__ void chunk_products(int chunk, const float* window, int base, float* acc) {",
             "  switch (chunk) {"]
    current = None
    for tap in program.taps:
        if tap.chunk != current:
            if current is not None:
                lines.append("    break;")
            lines.append(f"  case {tap.chunk}:")
            current = tap.chunk
        lines.append(f"    {{ const float v = window[base + {tap.offset}];")
        lines.extend(f"      acc[{row}] = fmaf(v, {_literal(value)}, acc[{row}]);" for row, value in tap.products)
        lines.append("    }")
    if current is not None:
        lines.append("    break;")
    lines += ["  default:", "    break;", "  }", "}"]
    return "\n".join(lines)


def _literal(value: float) -> str:
    """An exact float32 C literal (hexadecimal) of a finite value."""
    return f"{value.hex()}f"


def kernel_source(program: Program, dtype: torch.dtype) -> str:
    """The whole CUDA source of one program: constants, ``chunk_products`` and the skeleton.

    Raises:
        ValueError: for a dtype other than float32 or float16 (naming ``dtype``).
    """
    if dtype not in STORAGE_TYPES:
        raise ValueError(f"dtype: {dtype} not supported (float32 or float16)")
    tile = program.tile
    constants = {"KT": tile.rows, "CC": tile.chunk, "TH": tile.height, "TW": tile.width, "R": program.kernel[0],
                 "S": program.kernel[1], "PAD_H": program.padding[0], "PAD_W": program.padding[1]}
    header = [f"#define {name} {value}" for name, value in constants.items()]
    header += ["#include <cuda_fp16.h>", f"typedef {STORAGE_TYPES[dtype]} T;"]
    return "\n".join([*header, products_source(program), SKELETON_FILE.read_text()])


def launch_grid(batch: int, out_hw: tuple[int, int], tile: Tile) -> tuple[int, int, int]:
    """CUDA grid of a program's launch: one block per ``TH x TW`` output tile of each image."""
    return (math.ceil(out_hw[1] / tile.width) * math.ceil(out_hw[0] / tile.height) * batch, 1, 1)


def run_program(program: Program, x: np.ndarray) -> np.ndarray:
    """Run ``program`` on the CPU in float64, thread by thread as the kernel does: stage each chunk's window with its
    zero halo, read each tap at ``base + offset`` and add its products.

    Args:
        x: ``(N, C, H, W)`` input (any float dtype; computed in float64).

    Returns:
        ``(N, rows, E, F)`` float64, this program's output channels without bias.
    """
    tile, (r_size, s_size), (pad_h, pad_w) = program.tile, program.kernel, program.padding
    batch, channels, height, width = x.shape
    out_h, out_w = height + 2 * pad_h - r_size + 1, width + 2 * pad_w - s_size + 1
    window_h, window_w = tile.height + r_size - 1, tile.width + s_size - 1
    tiles_y, tiles_x = math.ceil(out_h / tile.height), math.ceil(out_w / tile.width)
    padded = np.zeros((batch, math.ceil(channels / tile.chunk) * tile.chunk,
                       tiles_y * tile.height + r_size - 1 + pad_h, tiles_x * tile.width + s_size - 1 + pad_w))
    padded[:, :channels, pad_h:pad_h + height, pad_w:pad_w + width] = x
    out = np.zeros((batch, program.rows, tiles_y * tile.height, tiles_x * tile.width))
    for ty in range(tiles_y):
        for tx in range(tiles_x):
            y0, x0 = ty * tile.height, tx * tile.width
            for chunk in range(padded.shape[1] // tile.chunk):
                window = padded[:, chunk * tile.chunk:(chunk + 1) * tile.chunk,
                                y0:y0 + window_h, x0:x0 + window_w].reshape(batch, -1)
                for tap in program.taps:
                    if tap.chunk != chunk:
                        continue
                    values = np.stack([window[:, tap.offset + i * window_w + j]
                                       for i in range(tile.height) for j in range(tile.width)], axis=-1)
                    for row, weight in tap.products:
                        out[:, row, y0:y0 + tile.height, x0:x0 + tile.width] += (
                            weight * values.reshape(batch, tile.height, tile.width))
    return out[:, :, :out_h, :out_w]
