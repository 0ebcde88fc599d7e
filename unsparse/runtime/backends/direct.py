"""The ``direct`` backend: our CuPy direct sparse convolution kernels (``kernels/direct_conv.cu``).

Two kernel variants share the backend and its tuning space (parameter ``variant``):

* ``"rows"``: Escoin §3 / UnSparse-Opt §5 (uniform nnz, sub-batch), any geometry.
* ``"patch"``: register-blocked over output channels and pixels; stride 1, dilation 1, Conv2d.

Everything a kernel reads through an index is built and checked here at plan time (:func:`prepare_rows`,
:func:`prepare_patch`) and cached per UniformCSR object and input size, so no kernel sees an unchecked
index.
"""

from __future__ import annotations

import itertools
import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from unsparse.runtime import cupy_launcher as cl
from unsparse.runtime.backends.base import ConvBackend, register_backend
from unsparse.sparse.format import UniformCSR
from unsparse.sparse.geometry import ConvGeometry

SHARED_LIMIT_BYTES = 48 * 1024
"""Static shared memory a block may use without opting in (CUDA default)."""

ROWS_THREADS = (64, 128, 256)
ROWS_PIXELS = (1, 2)
ROWS_SUB_BATCH = (1, 2, 4, 8)
ROWS_CHANNELS = 8


@dataclass(frozen=True)
class PatchTiling:
    """One ``direct_patch`` instantiation: MB channels, (PE, PF) thread tile, (TE, TF) block tile."""

    channels: int
    thread_tile: tuple[int, int]
    block_tile: tuple[int, int]

    def threads(self) -> int:
        """Threads per block, ``(TE / PE) * (TF / PF)``."""
        return (self.block_tile[0] // self.thread_tile[0]) * (self.block_tile[1] // self.thread_tile[1])


PATCH_TILINGS = (
    PatchTiling(4, (2, 4), (16, 32)),
    PatchTiling(8, (2, 4), (16, 32)),
    PatchTiling(8, (2, 4), (32, 32)),
    PatchTiling(16, (2, 4), (16, 32)),
    PatchTiling(8, (4, 4), (32, 32)),
    PatchTiling(16, (2, 2), (16, 16)),
    PatchTiling(32, (2, 4), (16, 32)),
)
PATCH_SUB_BATCH = (1, 4)
PATCH_REGISTER_BUDGET = 190
"""Tilings whose accumulators plus input patch (``MB*PE*PF + (PE+R-1)*(PF+S-1)`` floats) exceed this are left
out: beyond it ptxas spills to local memory (seen for 5x5 with MB=8 and a 4x4 thread tile)."""


def patch_channel_chunk(kernel_size: tuple[int, int], block_tile: tuple[int, int]) -> int:
    """Input channels staged at once (CC): the largest of 16, 8, 4, 2, 1 whose tile fits in shared memory.

    Raises:
        ValueError: if even one channel's tile does not fit.
    """
    (R, S), (TE, TF) = kernel_size, block_tile
    for chunk in (16, 8, 4, 2, 1):
        if chunk * (TE + R - 1) * (TF + S - 1) * 4 <= SHARED_LIMIT_BYTES:
            return chunk
    raise ValueError(f"block_tile: {block_tile} with kernel {kernel_size} does not fit in shared memory")


def rows_space(batch: int, out_pixels: int, prune: bool = True) -> list[dict[str, Any]]:
    """``direct_rows`` settings: sub-batch x threads x pixels per thread (UnSparse-Opt §5, eq. 23).

    With ``prune``, blocks whose pixel tile (threads x pixels) exceeds twice the output plane are left
    out, except the smallest, so a 7x7 plane is not timed with 512-pixel tiles.
    """
    space = []
    for sub_batch, threads, pixels in itertools.product(ROWS_SUB_BATCH, ROWS_THREADS, ROWS_PIXELS):
        if sub_batch > batch and sub_batch != 1:
            continue
        if prune and threads * pixels > max(2 * out_pixels, ROWS_THREADS[0] * ROWS_PIXELS[0]):
            continue
        space.append({"variant": "rows", "sub_batch": sub_batch, "threads": threads, "pixels": pixels,
                      "channels": ROWS_CHANNELS})
    return space


def patch_space(batch: int, out_hw: tuple[int, int], kernel_size: tuple[int, int],
                prune: bool = True) -> list[dict[str, Any]]:
    """``direct_patch`` settings: tilings whose switch covers ``MB * R * S`` codes and whose registers fit
    :data:`PATCH_REGISTER_BUDGET`, x sub-batch.

    With ``prune``, tilings whose block tile is more than twice the output plane in either direction are
    left out.
    """
    R, S = kernel_size
    E, F_ = out_hw
    space = []
    for tiling in PATCH_TILINGS:
        (PE, PF) = tiling.thread_tile
        registers = tiling.channels * PE * PF + (PE + R - 1) * (PF + S - 1)
        if tiling.channels * R * S > cl.PATCH_MAX_CODES or registers > PATCH_REGISTER_BUDGET:
            continue
        TE, TF = tiling.block_tile
        if prune and (TE > 2 * E or TF > 2 * F_):
            continue
        for sub_batch in PATCH_SUB_BATCH:
            if sub_batch > batch and sub_batch != 1:
                continue
            space.append({"variant": "patch", "sub_batch": sub_batch, "channels": tiling.channels,
                          "thread_tile": list(tiling.thread_tile), "block_tile": list(tiling.block_tile)})
    return space


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
class PatchArrays:
    """Plan-time arrays of ``direct_patch``: nonzeros grouped per (channel group g, input channel c).

    Attributes:
        group_ptr: ``(G*C + 1,)`` int32, entries of (g, c) are ``[group_ptr[g*C+c], group_ptr[g*C+c+1])``.
        codes: ``(nnz,)`` int32, ``(m mod MB)*R*S + r*S + s``.
        weights: ``(nnz,)`` float32 values.
    """

    group_ptr: torch.Tensor
    codes: torch.Tensor
    weights: torch.Tensor


def prepare_rows(csr: UniformCSR, geometry: ConvGeometry, in_hw: tuple[int, int]) -> RowArrays:
    """Stretch and pack the column indices of ``csr`` for an unpadded ``in_hw`` input, then validate them."""
    H, W = in_hw
    R, S = csr.kernel_size
    k = csr.col_idx.long()
    r, s = (k % (R * S)) // S, k % S
    dy, dx = r * geometry.dilation[0], s * geometry.dilation[1]
    offsets = geometry.stretched_offsets(csr.col_idx, csr.kernel_size, (H, W))
    taps = (dy << cl.TAP_SHIFT_BITS) | dx
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
    dy, dx = taps >> cl.TAP_SHIFT_BITS, taps & ((1 << cl.TAP_SHIFT_BITS) - 1)
    if int(taps.min()) < 0 or int(dy.max()) >= 2**15 or int(dx.max()) >= 2**15:
        raise ValueError("taps: a shift is negative or does not fit 15 bits")
    start = offsets - dy * W - dx
    channel = torch.div(start, H * W, rounding_mode="floor")
    if bool((start != channel * H * W).any()) or int(channel.min()) < 0 or int(channel.max()) >= channels:
        raise ValueError(f"offsets: entries outside [0, {channels}*{H}*{W}) or inconsistent with taps")


def prepare_patch(csr: UniformCSR, channels_per_block: int) -> PatchArrays:
    """Group the nonzeros of ``csr`` per (block of MB output channels, input channel) and validate them.

    Stored padding entries (value 0, UnSparse-Opt uniform nnz) are dropped: this variant's loop bound is
    the per-(group, channel) nonzero count.
    """
    M, C = csr.out_channels, csr.in_channels_per_group
    R, S = csr.kernel_size
    rows = torch.arange(M, device=csr.values.device)[:, None].expand_as(csr.col_idx)
    keep = csr.values != 0
    m, k = rows[keep], csr.col_idx.long()[keep]
    groups = math.ceil(M / channels_per_block) if M else 0
    key = (m // channels_per_block) * C + k // (R * S)
    codes = (m % channels_per_block) * (R * S) + k % (R * S)
    order = torch.argsort(key * (channels_per_block * R * S) + codes)
    counts = torch.bincount(key, minlength=groups * C)
    group_ptr = torch.zeros(groups * C + 1, dtype=torch.int64, device=csr.values.device)
    group_ptr[1:] = torch.cumsum(counts, 0)
    arrays = PatchArrays(group_ptr.to(torch.int32), codes[order].to(torch.int32).contiguous(),
                         csr.values[keep][order].float().contiguous())
    validate_patch(arrays, groups, C, channels_per_block * R * S)
    return arrays


def validate_patch(arrays: PatchArrays, groups: int, channels: int, code_count: int) -> None:
    """Check the grouped arrays before a kernel reads through them.

    Raises:
        ValueError: naming ``group_ptr`` (wrong length, not non-decreasing, not ending at nnz), ``codes``
            (outside ``[0, code_count)`` or beyond the kernel's switch) or ``weights`` (length).
    """
    ptr, codes = arrays.group_ptr.long(), arrays.codes
    if ptr.numel() != groups * channels + 1 or int(ptr[0]) != 0 or int(ptr[-1]) != codes.numel():
        raise ValueError(f"group_ptr: expected {groups * channels + 1} entries from 0 to nnz={codes.numel()}")
    if bool((ptr[1:] < ptr[:-1]).any()):
        raise ValueError("group_ptr: not non-decreasing")
    if code_count > cl.PATCH_MAX_CODES:
        raise ValueError(f"codes: {code_count} codes exceed the kernel's {cl.PATCH_MAX_CODES} switch cases")
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= code_count):
        raise ValueError(f"codes: entries outside [0, {code_count})")
    if arrays.weights.numel() != codes.numel():
        raise ValueError("weights: length differs from codes")


@register_backend
class DirectBackend(ConvBackend):
    """Direct sparse convolution on CUDA through CuPy; float32 and float16 storage, float32 arithmetic."""

    name = "direct"
    device_types = frozenset({"cuda"})

    def __init__(self) -> None:
        self._cache: weakref.WeakKeyDictionary[UniformCSR, dict[tuple, Any]] = weakref.WeakKeyDictionary()

    def unsupported_reason(self, x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry) -> str | None:
        reason = super().unsupported_reason(x, csr, geometry)
        if reason is not None:
            return reason
        if x.dtype not in cl.supported_dtypes():
            return f"direct kernels exist for {[str(d) for d in cl.supported_dtypes()]}, not {x.dtype}"
        if csr.values.dtype != x.dtype:
            return f"weight dtype {csr.values.dtype} differs from input dtype {x.dtype}"
        N, C, H, W = x.shape
        if C * H * W >= 2**31 or N * csr.out_channels * math.prod(self._out_hw(x, csr, geometry)) >= 2**62:
            return "tensor too large for 32-bit image addressing"
        try:
            import cupy  # noqa: F401
        except ImportError:
            return "CuPy is not installed"
        return None

    @staticmethod
    def _out_hw(x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry) -> tuple[int, int]:
        return geometry.output_size(x.shape[2], x.shape[3], csr.kernel_size)

    def tuning_space(self, x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry) -> list[dict[str, Any]]:
        """Rows settings always; patch settings for stride 1, dilation 1 Conv2d."""
        out_hw = self._out_hw(x, csr, geometry)
        space = rows_space(x.shape[0], out_hw[0] * out_hw[1])
        if geometry.spatial_dims == 2 and geometry.stride == (1, 1) and geometry.dilation == (1, 1):
            space += patch_space(x.shape[0], out_hw, csr.kernel_size)
        return space

    def kernel_names(self, x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry,
                     space: list[dict[str, Any]] | None = None) -> list[str]:
        """Template instantiations a list of settings (default: the tuning space) uses."""
        space = space if space is not None else self.tuning_space(x, csr, geometry)
        return sorted({self._launch(x, csr, geometry, params).name for params in space})

    def precompile(self, x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry,
                   space: list[dict[str, Any]]) -> None:
        """Compile the instantiations ``space`` needs, concurrently (before timing anything)."""
        cl.precompile(self.kernel_names(x, csr, geometry, space))

    def _launch(self, x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry,
                params: dict[str, Any]) -> cl.Launch:
        N = x.shape[0]
        E, F_ = self._out_hw(x, csr, geometry)
        if params.get("variant", "rows") == "rows":
            return cl.rows_launch(x.dtype, N, csr.out_channels, E * F_, params.get("threads", 128),
                                  params.get("pixels", 1), params.get("sub_batch", 1),
                                  params.get("channels", ROWS_CHANNELS))
        block_tile = tuple(params["block_tile"])
        return cl.patch_launch(x.dtype, N, csr.out_channels, (E, F_), csr.kernel_size, params["channels"],
                               tuple(params["thread_tile"]), block_tile,
                               patch_channel_chunk(csr.kernel_size, block_tile), params["sub_batch"])

    def _arrays(self, csr: UniformCSR, key: tuple, build: Any) -> Any:
        per_csr = self._cache.setdefault(csr, {})
        if key not in per_csr:
            per_csr[key] = build()
        return per_csr[key]

    def conv(self, x: torch.Tensor, csr: UniformCSR, bias: torch.Tensor | None, geometry: ConvGeometry,
             **params: Any) -> torch.Tensor:
        """Run one variant; ``params`` is an entry of :meth:`tuning_space` (default: rows, no sub-batch).

        Raises:
            ValueError: for a variant this layer does not support, or indices that fail validation.
        """
        x = x.contiguous()
        N, C, H, W = x.shape
        E, F_ = self._out_hw(x, csr, geometry)
        variant = params.get("variant", "rows")
        spec = self._launch(x, csr, geometry, params)
        out = torch.empty(N, csr.out_channels, E, F_, dtype=x.dtype, device=x.device)
        bias = None if bias is None else bias.to(x.dtype).contiguous()
        if csr.out_channels == 0 or N * E * F_ == 0:
            return out
        if variant == "rows":
            arrays = self._arrays(csr, ("rows", H, W, geometry), lambda: prepare_rows(csr, geometry, (H, W)))
            args = (x, arrays.offsets, arrays.taps, csr.values.contiguous(), bias, out, N, C, H, W,
                    csr.out_channels, csr.row_length, E, F_, *geometry.stride, *geometry.padding,
                    params.get("channels", ROWS_CHANNELS))
        elif variant == "patch":
            if geometry.stride != (1, 1) or geometry.dilation != (1, 1) or geometry.spatial_dims != 2:
                raise ValueError(f"variant: patch needs stride 1, dilation 1 Conv2d, got {geometry}")
            arrays = self._arrays(csr, ("patch", params["channels"]),
                                  lambda: prepare_patch(csr, params["channels"]))
            tiles_f = math.ceil(F_ / params["block_tile"][1])
            args = (x, arrays.group_ptr, arrays.codes, arrays.weights, bias, out, N, C, H, W, csr.out_channels,
                    E, F_, *geometry.padding, tiles_f, params["sub_batch"])
        else:
            raise ValueError(f"variant: unknown {variant!r}, expected 'rows' or 'patch'")
        cl.launch(spec, args, x.device)
        return out
