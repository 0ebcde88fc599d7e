"""Loading ``kernels/*.cu`` through CuPy, launch geometry, and torch <-> CuPy hand-over without copies.

Launch geometry lives here and only here (:func:`rows_launch`, :func:`patch_launch`): pure Python, so the
CPU tests check it. CuPy is imported lazily; importing this module needs neither CuPy nor a GPU.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

KERNEL_DIR = Path(__file__).resolve().parents[2] / "kernels"
"""The repository's ``kernels/`` folder, located relative to this package."""

KERNEL_FILE = KERNEL_DIR / "direct_conv.cu"
COMPILE_OPTIONS = ("-std=c++17",)
ROWS_CHUNK = 256
"""Stored entries of one row staged in shared memory at a time by ``direct_rows`` (template JC)."""
PATCH_MAX_CODES = 256
"""Largest ``MB * R * S`` the ``direct_patch`` switch covers (``PATCH_MAX_CODES`` in the .cu file)."""
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


def patch_launch(dtype: torch.dtype, batch: int, out_channels: int, out_hw: tuple[int, int],
                 kernel_size: tuple[int, int], channels_per_block: int, thread_tile: tuple[int, int],
                 block_tile: tuple[int, int], channel_chunk: int, sub_batch: int) -> Launch:
    """Geometry of ``direct_patch``: grid (channel groups, output tiles, sub-batches), fastest over groups.

    Channel groups vary fastest so that the blocks reading one input tile run close together in time
    and find it in L2.

    Args:
        out_hw: (E, F). kernel_size: (R, S).
        channels_per_block: MB output channels per block. thread_tile: (PE, PF) outputs per thread.
        block_tile: (TE, TF) outputs per block, multiples of the thread tile.
        channel_chunk: CC input channels staged in shared memory at once. sub_batch: images per block.

    Raises:
        ValueError: if the block tile is not a multiple of the thread tile, ``MB * R * S`` exceeds
            :data:`PATCH_MAX_CODES`, the block has more than 1024 threads, or the grid is too large.
    """
    (E, F_), (R, S), (PE, PF), (TE, TF) = out_hw, kernel_size, thread_tile, block_tile
    if TE % PE or TF % PF:
        raise ValueError(f"block_tile: {block_tile} is not a multiple of thread_tile {thread_tile}")
    if channels_per_block * R * S > PATCH_MAX_CODES:
        raise ValueError(f"channels_per_block: {channels_per_block} * R * S = {channels_per_block * R * S} "
                         f"exceeds {PATCH_MAX_CODES} switch cases")
    threads = (TE // PE) * (TF // PF)
    if not 1 <= threads <= 1024:
        raise ValueError(f"block_tile: {threads} threads per block")
    if min(batch, out_channels, E, F_, channel_chunk, sub_batch) < 1:
        raise ValueError("patch_launch: every size must be positive")
    grid = (math.ceil(out_channels / channels_per_block), math.ceil(E / TE) * math.ceil(F_ / TF),
            math.ceil(batch / sub_batch))
    _check_grid(grid)
    name = (f"direct_patch<{cuda_type(dtype)},{R},{S},{channels_per_block},{PE},{PF},{TE},{TF},"
            f"{channel_chunk}>")
    return Launch(name, grid, (threads, 1, 1))


def _check_grid(grid: tuple[int, int, int]) -> None:
    if grid[0] >= 2**31 or grid[1] >= 2**16 or grid[2] >= 2**16:
        raise ValueError(f"grid: {grid} exceeds CUDA's grid limits")


@functools.cache
def _source() -> str:
    return KERNEL_FILE.read_text()


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


def as_cupy(tensor: torch.Tensor) -> Any:
    """A CuPy view of a CUDA tensor through DLPack (no copy; shares memory and lifetime)."""
    import cupy

    return cupy.from_dlpack(tensor.detach())


def launch(spec: Launch, args: tuple[Any, ...], device: torch.device) -> None:
    """Run one kernel on torch's current stream of ``device``.

    Args:
        spec: from :func:`rows_launch` or :func:`patch_launch`.
        args: kernel arguments in declaration order: CUDA tensors (passed through DLPack), None for a
            null pointer, ints (passed as int32).

    Raises:
        ValueError: if an int argument does not fit int32.
    """
    import cupy
    import numpy as np

    converted = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            converted.append(as_cupy(arg))
        elif arg is None:
            converted.append(np.uint64(0))
        else:
            if not -(2**31) <= arg < 2**31:
                raise ValueError(f"kernel argument {arg} does not fit int32")
            converted.append(np.int32(arg))
    kernel = get_kernel(spec.name)
    stream = torch.cuda.current_stream(device)
    with cupy.cuda.Device(device.index), cupy.cuda.ExternalStream(stream.cuda_stream, device.index):
        kernel(spec.grid, spec.block, tuple(converted))
