"""CUDA source of weight-specialised direct sparse convolution kernels (``kernels/generated_conv.cu``, v27).

The direct kernels of ``kernels/direct_conv.cu`` read each nonzero at run time, so one staged input load feeds one
FMA; that caps them near 15 TFLOP/s FP32 on an H100 (``kernels/NOTES.md``, "Floors"). For inference the pruned
weight is fixed (paper 004 §5 deploys one kernel per layer), so it can be compiled into the kernel: each nonzero
becomes one fused multiply-add with the weight as an immediate operand into one of KT register accumulators, and
one input value feeds every nonzero of the KT output channels at that (input channel, tap). Nothing the kernel
indexes comes from the weight at run time.

This module is pure Python (no CuPy, no GPU): it splits a weight into :class:`Program` s (one per KT output
channels), renders each as CUDA source, and runs a program on the CPU exactly as the kernel's threads index the
padded input (:func:`run_program`), which is what the CPU tests check against ``torch.nn.functional.conv2d``.

Shapes: weight ``(M, C, R, S)`` float32 (FP16 layers pass their float16 weight converted to float32, exactly),
input ``(N, C, H, W)``, zero-padded input ``(N, C, H + 2 pad_h, W + 2 pad_w)``, output ``(N, M, E, F)``, all NCHW;
stride 1, dilation 1, groups 1 (a strided layer arrives as its stride-1 phase split, :mod:`unsparse.sparse.phases`,
with the strided layer's ``(E, F)``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from unsparse.runtime.cupy_launcher import KERNEL_DIR

SKELETON_FILE = KERNEL_DIR / "generated_conv.cu"
"""The kernel around the generated products."""

ENTRY = "generated_conv"
"""The kernel :func:`kernel_source` defines (one program, v27)."""

SHARED_ENTRY = "generated_conv_shared"
"""The kernel :func:`shared_kernel_source` defines (several programs, v31)."""

STORAGE_TYPES = {torch.float32: "float", torch.float16: "__half"}
"""CUDA storage type of the output and the bias per torch dtype; the kernels read a float32 padded input and compute
in float32 for both."""

THREAD_CHOICES = (256, 128, 64)
"""Threads per block :func:`choose_threads` picks from at launch (one output pixel per thread per loop step); the
largest is every kernel's launch bound, which leaves a thread up to 255 registers (64 K per SM over 256 threads), as
a bound of 64 or 128 would."""

LOAD_BATCH = 1
"""Taps per group of loads in a program's body (:func:`products_source`), every kernel's unless a caller says."""

OFFSET_LIMIT = 2**31
"""Offsets into the padded input are int32 immediates: the input plane of one image, C * HP * WP, must stay below."""


@dataclass(frozen=True)
class Tap:
    """One input value a thread loads and the products it feeds.

    Attributes:
        offset: its position in the padded input relative to the thread's output pixel,
            ``(c * HP + r) * WP + s`` (elements).
        products: ``(row within the program, weight)`` pairs, rows ascending, weights nonzero float32 values.
    """

    offset: int
    products: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class Program:
    """The generated kernel of output channels ``first .. first + rows - 1`` of one layer.

    Attributes:
        first: first output channel (k0).
        rows: output channels this program writes (KT; fewer for the last one).
        width: KT of the split (the accumulators each thread keeps).
        channels: C. kernel: (R, S). padding: (pad_h, pad_w). in_hw: (H, W).
        taps: every input value read per output pixel, in the order the kernel reads them.
        out_hw: (E, F), the output plane the kernel computes: the stride-1 layer's whole plane
            (:func:`full_out_hw`), or its top-left corner of a strided layer's size where the program runs the
            layer's phase split (:mod:`unsparse.sparse.phases`, whose stride-1 plane may have a row or column more).
    """

    first: int
    rows: int
    width: int
    channels: int
    kernel: tuple[int, int]
    padding: tuple[int, int]
    in_hw: tuple[int, int]
    taps: tuple[Tap, ...]
    out_hw: tuple[int, int]

    @property
    def padded_hw(self) -> tuple[int, int]:
        """(HP, WP): the zero-padded input plane."""
        return (self.in_hw[0] + 2 * self.padding[0], self.in_hw[1] + 2 * self.padding[1])

    @property
    def products(self) -> int:
        """Multiply-adds per output pixel: the nonzeros of this program's rows."""
        return sum(len(tap.products) for tap in self.taps)


def full_out_hw(kernel: tuple[int, int], padding: tuple[int, int], in_hw: tuple[int, int]) -> tuple[int, int]:
    """``(HP - R + 1, WP - S + 1)``: the whole output plane of a stride-1 ``R x S`` layer over an ``in_hw`` input
    zero-padded by ``padding`` on each side."""
    return (in_hw[0] + 2 * padding[0] - kernel[0] + 1, in_hw[1] + 2 * padding[1] - kernel[1] + 1)


def programs(weight: np.ndarray, padding: tuple[int, int], in_hw: tuple[int, int], rows: int,
             out_hw: tuple[int, int] | None = None) -> list[Program]:
    """Split a dense ``(M, C, R, S)`` weight into one :class:`Program` per ``rows`` output channels.

    Args:
        weight: float32, finite (the caller validated it: a sparse file is untrusted).
        padding: (pad_h, pad_w), each at least 0. in_hw: the input plane (H, W); the output must not be empty.
        rows: KT, output channels per program (register accumulators per thread), at least 1.
        out_hw: the output plane to compute, at least 1x1 and within :func:`full_out_hw` (None: all of it); a
            strided layer run through its phase split passes its own ``(E, F)``.

    Raises:
        ValueError: naming the field, for a weight that is not a finite float32 4-D array, a negative padding, an
            empty output, ``rows`` below 1, an input plane of :data:`OFFSET_LIMIT` elements or more, or an
            ``out_hw`` outside the whole plane.
    """
    if not isinstance(weight, np.ndarray) or weight.ndim != 4 or weight.dtype != np.float32:
        raise ValueError("weight: expected a 4-D float32 array (M, C, R, S)")
    if not np.isfinite(weight).all():
        raise ValueError("weight: not finite")
    if type(rows) is not int or rows < 1:
        raise ValueError(f"rows: expected a positive integer, got {rows!r}")
    if min(padding) < 0:
        raise ValueError(f"padding: {padding} is negative")
    out_channels, channels, r_size, s_size = weight.shape
    padded_h, padded_w = in_hw[0] + 2 * padding[0], in_hw[1] + 2 * padding[1]
    if padded_h < r_size or padded_w < s_size:
        raise ValueError(f"in_hw: {in_hw} with padding {padding} is smaller than the kernel {(r_size, s_size)}")
    if channels * padded_h * padded_w >= OFFSET_LIMIT:
        raise ValueError(f"in_hw: C * HP * WP = {channels * padded_h * padded_w} does not fit an int32 offset")
    full = full_out_hw((r_size, s_size), padding, in_hw)
    out_hw = full if out_hw is None else tuple(out_hw)
    if not (len(out_hw) == 2 and 1 <= out_hw[0] <= full[0] and 1 <= out_hw[1] <= full[1]):
        raise ValueError(f"out_hw: {out_hw} is not within the whole output plane {full}")
    result = []
    for first in range(0, out_channels, rows):
        block = weight[first:first + rows]
        taps = []
        for c in range(channels):
            for r in range(r_size):
                for s in range(s_size):
                    column = block[:, c, r, s]
                    nonzero = np.flatnonzero(column)
                    if nonzero.size:
                        taps.append(Tap((c * padded_h + r) * padded_w + s,
                                        tuple((int(k), float(column[k])) for k in nonzero)))
        result.append(Program(first, block.shape[0], rows, channels, (r_size, s_size), padding, tuple(in_hw),
                              tuple(taps), out_hw))
    return result


def products_source(program: Program, name: str = "products", load_batch: int = LOAD_BATCH) -> str:
    """CUDA text of the device function ``name``, the program's body: per tap one float32 load of ``base[offset]``
    (the padded input is float32 for every storage type, ``kernels/generated_conv.cu``), then one ``fmaf`` per
    product with the weight as an exact hexadecimal float literal.

    ``load_batch`` taps form a group whose loads (``v0`` .. ``v{load_batch - 1}``) come before all of the group's
    products, so that each thread has that many loads in flight. With one load per group, ptxas scheduled some
    programs' loads 11 instructions ahead of their first use at 48 registers and others 68 ahead at 64, and the same
    instruction count ran 2x as long (ResNet-50's layer2.1.conv2 at 0.9, FP32 b128: 82 against 40 us per program;
    ``kernels/NOTES.md``, sixty-second session).

    Raises:
        ValueError: for a ``load_batch`` below 1.
    """
    if load_batch < 1:
        raise ValueError(f"load_batch: must be at least 1, got {load_batch}")
    lines = [f"__device__ __forceinline__ void {name}(const float* __restrict__ base, float* acc) {{"]
    for start in range(0, len(program.taps), load_batch):
        group = program.taps[start:start + load_batch]
        lines.append("  {")
        lines.extend(f"    const float v{index} = __ldg(base + {tap.offset});" for index, tap in enumerate(group))
        lines.extend(f"    acc[{row}] = fmaf(v{index}, {value.hex()}f, acc[{row}]);"
                     for index, tap in enumerate(group) for row, value in tap.products)
        lines.append("  }")
    lines.append("}")
    return "\n".join(lines)


def kernel_source(program: Program, dtype: torch.dtype, min_blocks: int = 0, load_batch: int = LOAD_BATCH) -> str:
    """The whole CUDA source of one program (:data:`ENTRY`): constants, the skeleton and ``products``. It holds no
    batch size and no threads per block (the launch picks those, :func:`choose_threads`), so one compiled kernel
    serves every batch. ``min_blocks``: the blocks of the launch bound's threads each SM should hold, the bound's
    second part, to which ptxas fits the registers per thread, or 0 for none (1 is not none: ResNet-50's stem program
    of 64 rows took 224 registers at 1 and 128 without, ``kernels/generated_conv.cu``). ``load_batch``: taps whose
    loads come together (:func:`products_source`).

    Raises:
        ValueError: for a dtype other than float32 or float16 (naming ``dtype``), a negative ``min_blocks`` or a
            ``load_batch`` below 1.
    """
    body = products_source(program, load_batch=load_batch)
    return "\n".join([*_header(program, dtype, min_blocks), _skeleton(), body])


def shared_kernel_source(kernel_programs: Sequence[Program], out_channels: int, dtype: torch.dtype,
                         min_blocks: int = 0, load_batch: int = LOAD_BATCH) -> str:
    """The CUDA source of :data:`SHARED_ENTRY` (v31): G = ``len(kernel_programs)`` programs of one layer in one
    kernel, each block running the program of the SM it runs on (``kernels/generated_conv.cu``).

    Args:
        kernel_programs: at least two consecutive programs of one layer split (the same KT, C, kernel, padding and
            input plane). out_channels: M, the layer's. min_blocks, load_batch: as :func:`kernel_source`'s.

    Raises:
        ValueError: naming the field, for fewer than two programs or programs of different layers or splits, an
            ``out_channels`` below the last program's rows, or a dtype, ``min_blocks`` or ``load_batch``
            :func:`kernel_source` refuses.
    """
    if len(kernel_programs) < 2:
        raise ValueError(f"kernel_programs: {len(kernel_programs)} programs, a shared kernel holds at least two")
    first = kernel_programs[0]
    layer = (first.width, first.channels, first.kernel, first.padding, first.in_hw, first.out_hw)
    if any((p.width, p.channels, p.kernel, p.padding, p.in_hw, p.out_hw) != layer for p in kernel_programs):
        raise ValueError("kernel_programs: not all of one layer and split")
    if out_channels < max(p.first + p.rows for p in kernel_programs):
        raise ValueError(f"out_channels: {out_channels} is below the programs' last row")
    header = [*_header(first, dtype, min_blocks), f"#define G {len(kernel_programs)}", f"#define M {out_channels}"]
    bodies = [products_source(p, f"products_{index}", load_batch) for index, p in enumerate(kernel_programs)]
    cases = [f"    case {index}: products_{index}(base, acc); return {p.first};"
             for index, p in enumerate(kernel_programs)]
    run = ["__device__ __forceinline__ int run(int program, const float* __restrict__ base, float* acc) {",
           "  switch (program) {", *cases, "  }", "  return 0;", "}"]
    return "\n".join([*header, _skeleton(), *bodies, *run])


def _header(program: Program, dtype: torch.dtype, min_blocks: int) -> list[str]:
    """The constants and storage type before the skeleton; the launch bound is :data:`THREAD_CHOICES`' largest
    threads and ``min_blocks`` blocks per SM (0: no second part).

    Raises:
        ValueError: for a dtype other than float32 or float16 (naming ``dtype``), or a negative ``min_blocks``.
    """
    if dtype not in STORAGE_TYPES:
        raise ValueError(f"dtype: {dtype} not supported (float32 or float16)")
    if min_blocks < 0:
        raise ValueError(f"min_blocks: must be at least 0, got {min_blocks}")
    constants = {"KT": program.width, "C": program.channels, "HP": program.padded_hw[0], "WP": program.padded_hw[1],
                 "E": program.out_hw[0], "F": program.out_hw[1], "MAX_THREADS": max(THREAD_CHOICES),
                 "MIN_BLOCKS": min_blocks}
    header = [f"#define {name} {value}" for name, value in constants.items()]
    return [*header, "#include <cuda_fp16.h>", f"typedef {STORAGE_TYPES[dtype]} T;"]


@functools.cache
def _skeleton() -> str:
    """:data:`SKELETON_FILE`'s text, read once per process (every program of every layer and setting includes it)."""
    return SKELETON_FILE.read_text()


def choose_threads(total: int, sms: int) -> int:
    """Threads per block for ``total = N * E * F`` output pixels on ``sms`` SMs: the largest of
    :data:`THREAD_CHOICES` that still gives every SM two blocks, else the smallest (small layers and batch 1 would
    leave SMs idle with 256-thread blocks)."""
    for threads in THREAD_CHOICES:
        if math.ceil(total / threads) >= 2 * sms:
            return threads
    return THREAD_CHOICES[-1]


def resident_blocks(registers: int, threads: int) -> int:
    """Blocks of ``threads`` one SM holds at ``registers`` per thread: 64 K registers, allocated per warp in units
    of 256, at most 2048 threads and 32 blocks (sm_80 and sm_90)."""
    per_warp = math.ceil(registers * 32 / 256) * 256
    return max(1, min(2048 // threads, 32, 65536 // (per_warp * math.ceil(threads / 32))))


def launch_grid(total: int, threads: int, blocks_per_sm: int, sms: int) -> tuple[int, int, int]:
    """CUDA grid for ``total = N * E * F`` output pixels: enough blocks of ``threads`` for every pixel, at most as
    many as stay resident at once (the rest loop)."""
    return (max(1, min(math.ceil(total / threads), blocks_per_sm * sms)), 1, 1)


def run_program(program: Program, padded: np.ndarray) -> np.ndarray:
    """Run ``program`` on the CPU in float64, reading the flattened padded input at ``base + offset`` for every
    output pixel as the kernel's threads do.

    Args:
        padded: ``(N, C, HP, WP)`` zero-padded input (any float dtype; computed in float64).

    Returns:
        ``(N, rows, E, F)`` float64, this program's output channels without bias.

    Raises:
        ValueError: naming ``padded``, for a shape other than the program's.
    """
    batch = padded.shape[0]
    if padded.shape[1:] != (program.channels, *program.padded_hw):
        raise ValueError(f"padded: shape {padded.shape}, program expects (N, {program.channels}, "
                         f"{program.padded_hw[0]}, {program.padded_hw[1]})")
    out_h, out_w = program.out_hw
    flat = padded.astype(np.float64).reshape(-1)
    n, oy, ox = np.meshgrid(np.arange(batch), np.arange(out_h), np.arange(out_w), indexing="ij")
    base = (n * program.channels * program.padded_hw[0] + oy) * program.padded_hw[1] + ox
    out = np.zeros((program.rows, batch, out_h, out_w))
    for tap in program.taps:
        values = flat[base + tap.offset]
        for row, weight in tap.products:
            out[row] += weight * values
    return out.transpose(1, 0, 2, 3)
