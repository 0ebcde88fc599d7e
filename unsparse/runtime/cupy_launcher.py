"""Loading ``kernels/*.cu`` through CuPy, launch geometry, and launching on torch tensors without copies.

Launch geometry lives here and only here (:func:`rows_launch`, :func:`tile_launch`, :func:`window_launch`):
pure Python, so the CPU tests check it. CuPy is imported lazily; importing this module needs neither CuPy nor a GPU.

Tensors reach a kernel as their device pointers (zero copy), after a check of device and contiguity, on
torch's current stream. A DLPack hand-over per argument (``cupy.from_dlpack``) cost about 0.3 ms of host
time per launch, which set a 0.32 ms floor under every small layer in the H100 benchmark of 2026-11-23.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from unsparse.runtime.window_dispatch import shape_of

KERNEL_DIR = Path(__file__).resolve().parents[2] / "kernels"
"""The repository's ``kernels/`` folder, located relative to this package."""

KERNEL_FILE = KERNEL_DIR / "direct_conv.cu"
COMPILE_OPTIONS = ("-std=c++17",)
ROWS_CHUNK = 256
"""Stored entries of one row staged in shared memory at a time by ``direct_rows`` (template JC)."""
SHARED_LIMIT_BYTES = 48 * 1024
"""Static shared memory a block may use without opting in (CUDA default)."""
TAP_SHIFT_BITS = 16
"""``direct_rows`` packs a tap's (row shift, column shift) as ``dy << 16 | dx``; both must be < 2**15."""

_CUDA_TYPES = {torch.float32: "float", torch.float16: "__half"}
"""Storage dtypes the kernels are instantiated for; arithmetic is float32 for both."""


def cuda_type(dtype: torch.dtype) -> str:
    """The CUDA C++ type name for a torch dtype.

    Raises:
        ValueError: for dtypes without a kernel instantiation (only float32 and float16 have one).
    """
    if dtype not in _CUDA_TYPES:
        raise ValueError(f"dtype: no direct kernel for {dtype}; supported: {sorted(map(str, _CUDA_TYPES))}")
    return _CUDA_TYPES[dtype]


def supported_dtypes() -> tuple[torch.dtype, ...]:
    """Storage dtypes with a kernel instantiation."""
    return tuple(_CUDA_TYPES)


@dataclass(frozen=True)
class Launch:
    """One kernel launch: CUDA grid and block sizes (x, y, z) and the template instantiation to call."""

    name: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]


def rows_launch(dtype: torch.dtype, batch: int, out_channels: int, out_pixels: int, threads: int,
                pixels_per_thread: int, sub_batch: int, channels_per_block: int) -> Launch:
    """Geometry of ``direct_rows`` (UnSparse-Opt eq. 23: blocks = pixel tiles x channel groups x sub-batches).

    Args:
        batch: N images. out_channels: M. out_pixels: E * F.
        threads: threads per block (a multiple of 32, at most 1024).
        pixels_per_thread: output pixels per thread (PB), strided by ``threads`` for coalescing.
        sub_batch: images per block (SB), each thread keeps SB * PB partial sums.
        channels_per_block: output channels a block walks in turn (MB).

    Raises:
        ValueError: on a non-positive size, a thread count that is not a multiple of 32 in [32, 1024], or a
            grid dimension beyond CUDA's limits (y, z < 65536).
    """
    if min(batch, out_channels, out_pixels, pixels_per_thread, sub_batch, channels_per_block) < 1:
        raise ValueError("rows_launch: every size must be positive")
    if threads % 32 or not 32 <= threads <= 1024:
        raise ValueError(f"threads: {threads} is not a multiple of 32 in [32, 1024]")
    grid = (math.ceil(out_pixels / (threads * pixels_per_thread)), math.ceil(out_channels / channels_per_block),
            math.ceil(batch / sub_batch))
    _check_grid(grid)
    name = f"direct_rows<{cuda_type(dtype)},{pixels_per_thread},{sub_batch},{ROWS_CHUNK}>"
    return Launch(name, grid, (threads, 1, 1))


@dataclass(frozen=True)
class TileTiling:
    """One ``direct_tile`` instantiation (without dtype and kernel size).

    A warp covers a ``(32 / WX) * PY`` x ``WX`` output tile of ``NB`` images (lane ``(ly, lx)`` owns rows
    ``ly + py * 32 / WX``); each of the ``WARPS`` warps accumulates ``MW`` output channels over it, so a block
    owns ``WARPS * MW`` channels. ``CC`` input channels are staged in shared memory at a time.
    """

    wx: int
    py: int
    nb: int
    mw: int
    warps: int
    cc: int

    @property
    def wy(self) -> int:
        """Warp rows: lanes per output column of the warp tile, ``32 / WX``."""
        return 32 // self.wx

    @property
    def tile_hw(self) -> tuple[int, int]:
        """Output tile (TE, TF) = ``(WY * PY, WX)``."""
        return self.wy * self.py, self.wx

    @property
    def channels(self) -> int:
        """Output channels per block, ``WARPS * MW``."""
        return self.warps * self.mw

    def accumulators(self) -> int:
        """float32 partial sums per thread, ``MW * NB * PY``."""
        return self.mw * self.nb * self.py


@dataclass(frozen=True)
class TileLayout:
    """Shared-memory layout of one staged chunk of ``direct_tile``, element units (one element holds
    ``images_per_element`` images: 1 for float32, 2 (a ``__half2``) for float16).

    Element ``(cc, ie, yy, xx)`` sits at ``cc * channel_stride + ie * plane + yy * padded_width + xx``.
    """

    tile_h: int
    tile_w: int
    padded_width: int
    image_elements: int
    chunk: int
    buffers: int

    def shared_bytes(self) -> int:
        """Static shared memory of the kernel: ``buffers`` staged chunks of 4-byte elements (float32 stages
        asynchronously into two buffers, float16 synchronously into one)."""
        return self.buffers * self.elements() * 4

    @property
    def plane(self) -> int:
        """Elements of one image element's ``tile_h x padded_width`` plane."""
        return self.tile_h * self.padded_width

    @property
    def channel_stride(self) -> int:
        """Elements per staged input channel (all image elements)."""
        return self.image_elements * self.plane

    def elements(self) -> int:
        """Elements of the whole staged chunk (the kernel's shared array)."""
        return self.chunk * self.channel_stride


def images_per_element(dtype: torch.dtype) -> int:
    """Images one shared-memory element of ``direct_tile`` holds: 2 for float16 (``__half2``), else 1."""
    return 2 if dtype == torch.float16 else 1


def tile_layout(dtype: torch.dtype, kernel_size: tuple[int, int], tiling: TileTiling) -> TileLayout:
    """The staged chunk layout for ``tiling`` (shared by :func:`tile_launch` and the plan-time offsets).

    The padded row width is the smallest ``>= WX + S - 1`` that makes a warp's 32 loads hit 32 distinct
    banks: any width when a warp covers one row (WX = 32), else one congruent to WX modulo 32, so that
    lane ``(ly, lx)`` reads bank ``(ly * WX + lx) mod 32 = lane``.

    Raises:
        ValueError: if WX does not divide 32, NB is not a multiple of the images per element, or a size is
            not positive.
    """
    (R, S) = kernel_size
    if tiling.wx not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"tiling: WX={tiling.wx} does not divide 32")
    if min(R, S, tiling.py, tiling.nb, tiling.mw, tiling.warps, tiling.cc) < 1:
        raise ValueError(f"tiling: every size must be positive, got {tiling} with kernel {kernel_size}")
    ipe = images_per_element(dtype)
    if tiling.nb % ipe:
        raise ValueError(f"tiling: NB={tiling.nb} is not a multiple of {ipe} images per element ({dtype})")
    te, tf = tiling.tile_hw
    width = tf + S - 1
    if tiling.wy > 1:
        width += (tiling.wx - width) % 32
    return TileLayout(te + R - 1, tf + S - 1, width, tiling.nb // ipe, tiling.cc, 2 if ipe == 1 else 1)


def tile_launch(dtype: torch.dtype, batch: int, out_channels: int, out_hw: tuple[int, int],
                kernel_size: tuple[int, int], tiling: TileTiling) -> Launch:
    """Geometry of ``direct_tile``: grid ``(channel groups * output tiles, ceil(N / NB))``, channel groups
    fastest so that the blocks staging one input tile run together and find it in L2.

    Raises:
        ValueError: for an invalid tiling (:func:`tile_layout`), more than 1024 threads, a non-positive
            size, staged chunks beyond :data:`SHARED_LIMIT_BYTES`, or a grid beyond CUDA's limits.
    """
    (E, F_), (R, S) = out_hw, kernel_size
    layout = tile_layout(dtype, kernel_size, tiling)
    if min(batch, out_channels, E, F_) < 1:
        raise ValueError("tile_launch: every size must be positive")
    if tiling.warps * 32 > 1024:
        raise ValueError(f"tiling: {tiling.warps} warps exceed 1024 threads")
    if layout.shared_bytes() > SHARED_LIMIT_BYTES:
        raise ValueError(f"tiling: staged chunks of {layout.shared_bytes()} bytes exceed {SHARED_LIMIT_BYTES}")
    te, tf = tiling.tile_hw
    groups = math.ceil(out_channels / tiling.channels)
    grid = (groups * math.ceil(E / te) * math.ceil(F_ / tf), math.ceil(batch / tiling.nb), 1)
    _check_grid(grid)
    name = (f"direct_tile<{cuda_type(dtype)},{R},{S},{tiling.wx},{tiling.py},{tiling.nb},{tiling.mw},"
            f"{tiling.warps},{tiling.cc},{layout.padded_width}>")
    return Launch(name, grid, (tiling.warps * 32, 1, 1))


@dataclass(frozen=True)
class WindowTiling:
    """One ``direct_window`` instantiation (without dtype and kernel size).

    Lane ``(ly, lx)`` (``ly = lane / LX``) owns the ``PY x PX`` output block at rows ``ly * PY`` and columns
    ``lx * PX`` of a ``(32 / LX) * PY`` x ``LX * PX`` warp tile and accumulates ``MW`` output channels over it;
    the ``WARPS`` warps of a block share the tile with different channels (``WARPS * MW`` per block). ``CC``
    input channels are staged in shared memory at a time. ``(R, S, PY, PX, MW)`` must have a generated jump
    table (:data:`~unsparse.runtime.window_dispatch.WINDOW_SHAPES`).
    """

    lx: int
    py: int
    px: int
    mw: int
    warps: int
    cc: int

    @property
    def tile_hw(self) -> tuple[int, int]:
        """Output tile (TE, TF) = ``(32 / LX * PY, LX * PX)``."""
        return 32 // self.lx * self.py, self.lx * self.px

    @property
    def channels(self) -> int:
        """Output channels per block, ``WARPS * MW``."""
        return self.warps * self.mw


@dataclass(frozen=True)
class WindowLayout:
    """Shared-memory layout of one staged chunk of ``direct_window`` (float32, two buffers).

    Element ``(cc, yy, xx)`` sits at ``cc * plane + yy * pitch + xx``; ``plane = tile_h * pitch``.
    """

    tile_h: int
    tile_w: int
    pitch: int
    chunk: int
    buffers: int

    @property
    def plane(self) -> int:
        """Elements per staged input channel."""
        return self.tile_h * self.pitch

    def shared_bytes(self) -> int:
        """Static shared memory of the kernel in bytes (``buffers`` chunks of float32)."""
        return self.buffers * self.chunk * self.plane * 4


def window_pitch(tiling: WindowTiling, tile_w: int) -> int:
    """The padded row width of ``direct_window``'s staged tile: among the multiples of 4 (16-byte aligned window
    rows) from ``tile_w`` to ``tile_w + 32``, the smallest at which the 8 lanes of each quarter warp read their
    16-byte window vectors from the most distinct bank groups (8: a warp's ``LDS.128`` runs in four
    conflict-free phases; 2x4 and 4x4 lane blocks with LX >= 4 reach it, LX = 2 with PY = 4 cannot)."""
    def groups(pitch: int) -> int:
        return min(len({((lane // tiling.lx) * tiling.py * pitch + (lane % tiling.lx) * tiling.px) // 4 % 8
                        for lane in range(8 * quarter, 8 * quarter + 8)}) for quarter in range(4))

    first = tile_w + (-tile_w) % 4
    return max(range(first, first + 33, 4), key=lambda pitch: (groups(pitch), -pitch))


def window_layout(dtype: torch.dtype, kernel_size: tuple[int, int], tiling: WindowTiling) -> WindowLayout:
    """The staged chunk layout of ``tiling`` (shared by :func:`window_launch` and the tests).

    Raises:
        ValueError: for a dtype other than float32 (float16 instantiations spill: ptxas caps the kernel at 128
            registers), if LX does not divide 32, PX is not a multiple of 4 (16-byte window rows), a size is
            not positive, or no jump table exists for ``(R, S, PY, PX, MW)``.
    """
    if dtype != torch.float32:
        raise ValueError(f"dtype: direct_window is float32 only, got {dtype}")
    if tiling.lx not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"tiling: LX={tiling.lx} does not divide 32")
    if min(tiling.py, tiling.px, tiling.mw, tiling.warps, tiling.cc) < 1 or tiling.px % 4:
        raise ValueError(f"tiling: sizes must be positive and PX a multiple of 4, got {tiling}")
    if not 1 <= tiling.cc < 32:
        raise ValueError(f"tiling: CC={tiling.cc} must be in [1, 31] (one lane per chunk boundary)")
    shape_of(kernel_size, tiling.py, tiling.px, tiling.mw)
    te, tf = tiling.tile_hw
    tile_h, tile_w = te + kernel_size[0] - 1, tf + kernel_size[1] - 1
    return WindowLayout(tile_h, tile_w, window_pitch(tiling, tile_w), tiling.cc, 2)


def window_launch(dtype: torch.dtype, batch: int, out_channels: int, out_hw: tuple[int, int],
                  kernel_size: tuple[int, int], tiling: WindowTiling) -> Launch:
    """Geometry of ``direct_window``: grid ``(channel blocks * output tiles, N)``, channel blocks fastest (the
    blocks staging one input tile run together and find it in L2); a channel block covers ``WARPS`` groups
    of ``MW`` output channels.

    Raises:
        ValueError: for an invalid tiling (:func:`window_layout`), more than 1024 threads, a non-positive size,
            staged chunks beyond :data:`SHARED_LIMIT_BYTES`, or a grid beyond CUDA's limits.
    """
    (E, F_), (R, S) = out_hw, kernel_size
    layout = window_layout(dtype, kernel_size, tiling)
    if min(batch, out_channels, E, F_) < 1:
        raise ValueError("window_launch: every size must be positive")
    if tiling.warps * 32 > 1024:
        raise ValueError(f"tiling: {tiling.warps} warps exceed 1024 threads")
    if layout.shared_bytes() > SHARED_LIMIT_BYTES:
        raise ValueError(f"tiling: staged chunks of {layout.shared_bytes()} bytes exceed {SHARED_LIMIT_BYTES}")
    te, tf = tiling.tile_hw
    grid = (window_channel_blocks(out_channels, tiling) * math.ceil(E / te) * math.ceil(F_ / tf), batch, 1)
    _check_grid(grid)
    name = (f"direct_window<{cuda_type(dtype)},{R},{S},{tiling.py},{tiling.px},{tiling.lx},{tiling.mw},"
            f"{tiling.warps},{tiling.cc},{layout.pitch}>")
    return Launch(name, grid, (tiling.warps * 32, 1, 1))


def window_channel_blocks(out_channels: int, tiling: WindowTiling) -> int:
    """Channel blocks of ``direct_window``: ``ceil(ceil(M / MW) / WARPS)``."""
    return math.ceil(math.ceil(out_channels / tiling.mw) / tiling.warps)


def _check_grid(grid: tuple[int, int, int]) -> None:
    if grid[0] >= 2**31 or grid[1] >= 2**16 or grid[2] >= 2**16:
        raise ValueError(f"grid: {grid} exceeds CUDA's grid limits")


_LOCAL_INCLUDE = re.compile(r'^#include "([A-Za-z0-9_./-]+)"\s*$', re.MULTILINE)


@functools.cache
def _source() -> str:
    """``kernels/direct_conv.cu`` with its quoted includes from ``kernels/`` pasted in, so that CuPy's cache key
    (the source text) changes whenever a header does.

    Raises:
        ValueError: for a quoted include outside ``kernels/``.
    """
    def paste(match: re.Match[str]) -> str:
        path = (KERNEL_DIR / match.group(1)).resolve()
        if path.parent != KERNEL_DIR:
            raise ValueError(f"kernel include {match.group(1)!r} is not a file of {KERNEL_DIR}")
        return path.read_text()

    return _LOCAL_INCLUDE.sub(paste, KERNEL_FILE.read_text())


@functools.cache
def get_kernel(name: str) -> Any:
    """The compiled ``cupy.RawKernel`` for one template instantiation, compiled once per process.

    CuPy also keeps compiled modules in its on-disk cache, so a second process skips NVRTC.

    Raises:
        ImportError: without CuPy.
    """
    import cupy

    module = cupy.RawModule(code=_source(), options=COMPILE_OPTIONS, name_expressions=[name])
    return module.get_function(name)


def precompile(names: list[str], workers: int = 16) -> None:
    """Compile several instantiations concurrently (NVRTC runs outside the GIL); each is then cached."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(get_kernel, names))


def kernel_arguments(args: tuple[Any, ...], device: torch.device) -> tuple[Any, ...]:
    """Kernel arguments as CuPy passes them: tensors as 64-bit device pointers, None as a null pointer, ints
    as int32.

    Raises:
        ValueError: naming the argument, for a tensor on another device or not contiguous (the kernels index
            it densely), or an int that does not fit int32.
    """
    import numpy as np

    converted = []
    for position, arg in enumerate(args):
        if isinstance(arg, torch.Tensor):
            if arg.device != device:
                raise ValueError(f"kernel argument {position}: tensor on {arg.device}, launch on {device}")
            if not arg.is_contiguous():
                raise ValueError(f"kernel argument {position}: tensor is not contiguous")
            converted.append(np.uint64(arg.data_ptr()))
        elif arg is None:
            converted.append(np.uint64(0))
        else:
            if not -(2**31) <= arg < 2**31:
                raise ValueError(f"kernel argument {position}: {arg} does not fit int32")
            converted.append(np.int32(arg))
    return tuple(converted)


@functools.cache
def _external_stream(device_index: int, stream_pointer: int) -> Any:
    import cupy

    return cupy.cuda.ExternalStream(stream_pointer, device_index)


def launch(spec: Launch, args: tuple[Any, ...], device: torch.device) -> None:
    """Run one kernel on torch's current stream of ``device``.

    Args:
        spec: from :func:`rows_launch` or :func:`tile_launch`.
        args: kernel arguments in declaration order (:func:`kernel_arguments`). Tensors must stay alive
            until the kernel has run, as with any asynchronous torch operation on the stream.

    Raises:
        ValueError: from :func:`kernel_arguments`.
    """
    import cupy

    converted = kernel_arguments(args, device)
    kernel = get_kernel(spec.name)
    stream = _external_stream(device.index, torch.cuda.current_stream(device).cuda_stream)
    with cupy.cuda.Device(device.index), stream:
        kernel(spec.grid, spec.block, converted)
