"""The ``direct`` backend: our CuPy direct sparse convolution kernels (``kernels/direct_conv.cu``).

Three kernel variants share the backend and its tuning space (parameter ``variant``):

* ``"rows"``: Escoin §3 / UnSparse-Opt §5 (uniform nnz, sub-batch), any geometry.
* ``"tile"``: input tiles with halos in shared memory, each warp accumulating several output channels over
  a pixel x image tile; stride 1, dilation 1, Conv2d. float16 inputs, and float32 inputs of ``"paired"``
  settings, are first re-laid as image pairs (on CUDA by the ``pair_images`` kernel, bound at prepare time by
  :func:`bind_pairing` into the layer's :class:`PreparedCall`: a copy timed with the convolution; a strided layer's
  phase images are paired in the same pass as its phase split, :func:`bind_phase_pairing`).
  ``"stage": "vector"`` settings copy each staged row's interior as 16-byte vectors (32-column warp rows, input
  width a multiple of 4; see :func:`~unsparse.runtime.cupy_launcher.vector_staging_reason`).
* ``"pointwise"``: 1x1, stride 1, unpadded Conv2d as a sparse x dense product over the flattened
  ``n * P + p`` columns; ``"stage": "vector"`` settings stage 16-byte vectors where the plane allows
  (:func:`~unsparse.runtime.cupy_launcher.pointwise_vector_reason`); grids too small to fill the GPU (batch 1)
  also get split-K settings (``"splits"``: float32 partial sums per share of the input channels, summed here).

A second backend, ``direct_half2`` (:class:`DirectHalf2Backend`), runs the ``tile`` kernel on float16 with half2
products (``"accumulate": "half2"``: ``HFMA2`` runs of at most
:data:`~unsparse.runtime.cupy_launcher.HALF2_RUN` products, summed in float32). It changes the numerics, so the
comparator leaves it out unless it is named.

Everything a kernel reads through an index is built and checked here at plan time (:func:`prepare_rows`,
:func:`prepare_tile`, which also serves ``pointwise``) and cached per UniformCSR object and input size, so
no kernel sees an unchecked index.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from unsparse.runtime import cupy_launcher as cl
from unsparse.runtime.backends.base import ConvBackend, T, WeightCache, check_bias, register_backend
from unsparse.sparse.format import UniformCSR
from unsparse.sparse.geometry import ConvGeometry
from unsparse.sparse.phases import PhaseSplit, phase_split

ROWS_THREADS = (64, 128, 256)
ROWS_PIXELS = (1, 2)
ROWS_SUB_BATCH = (1, 2, 4, 8)
ROWS_CHANNELS = 8

TILE_TILINGS = (
    cl.TileTiling(wx=32, py=4, nb=2, mw=4, warps=8, cc=8),
    cl.TileTiling(wx=32, py=4, nb=2, mw=8, warps=8, cc=8),
    cl.TileTiling(wx=32, py=8, nb=2, mw=4, warps=8, cc=8),
    cl.TileTiling(wx=32, py=4, nb=4, mw=4, warps=8, cc=8),
    cl.TileTiling(wx=32, py=4, nb=2, mw=4, warps=16, cc=8),
    cl.TileTiling(wx=32, py=4, nb=2, mw=4, warps=32, cc=8),
    cl.TileTiling(wx=16, py=7, nb=2, mw=4, warps=16, cc=4),
    cl.TileTiling(wx=16, py=4, nb=2, mw=8, warps=8, cc=4),
    cl.TileTiling(wx=16, py=7, nb=2, mw=4, warps=8, cc=8),
    cl.TileTiling(wx=16, py=7, nb=2, mw=4, warps=8, cc=4),
    cl.TileTiling(wx=8, py=2, nb=4, mw=4, warps=8, cc=2),
    cl.TileTiling(wx=8, py=2, nb=2, mw=8, warps=4, cc=4),
    cl.TileTiling(wx=32, py=8, nb=1, mw=8, warps=8, cc=8),
    cl.TileTiling(wx=32, py=4, nb=2, mw=4, warps=8, cc=16),
    cl.TileTiling(wx=32, py=4, nb=2, mw=4, warps=16, cc=16),
    cl.TileTiling(wx=32, py=4, nb=2, mw=4, warps=32, cc=16),
    cl.TileTiling(wx=32, py=4, nb=2, mw=4, warps=16, cc=32),
    cl.TileTiling(wx=32, py=4, nb=2, mw=4, warps=32, cc=32),
    cl.TileTiling(wx=32, py=8, nb=2, mw=3, warps=8, cc=8, union=3),
    cl.TileTiling(wx=32, py=7, nb=4, mw=3, warps=8, cc=8, union=3, paired=True),
    cl.TileTiling(wx=32, py=4, nb=2, mw=4, warps=8, cc=8, stage_entries=True, min_blocks=4),
    cl.TileTiling(wx=32, py=4, nb=2, mw=4, warps=16, cc=16, stage_entries=True, min_blocks=2),
    cl.TileTiling(wx=32, py=4, nb=2, mw=4, warps=16, cc=32, stage_entries=True, min_blocks=2),
)
"""``direct_tile`` candidates: 32 to 64 accumulators per thread (64 keeps two 256-thread blocks per SM within the
register file; the paired union tiling's 84 are held to 128 registers, also two blocks), warp tiles 4x32 to 8x8 for
planes from 224x224 down to 7x7, 32 to 128 output channels per block (more channels share each staged chunk); NB = 1
for batch 1 in float32 (float16 pairs images, NB even). CC = 16 halves the barriers per nonzero where a chunk holds
little work (the 2x2 filters of a 3x3 stride-2 layer's phase split, 1x1 layers, and 3x3 layers at high sparsity);
staged chunks beyond 48 KB take dynamic shared memory up to
:data:`~unsparse.runtime.cupy_launcher.TILE_SHARED_LIMIT_BYTES`. At 0.95-0.98 sparsity a cost that does not shrink
with sparsity is about half the time (VGG16 features.5 FP16: about 0.83 ms of 1.60 ms at 0.95 before these), so the
last three per-channel tilings share each chunk among 128 output channels, or stage 32 channels per barrier pair
(fewer barriers and loop set-ups per nonzero), or both; CC = 32 in float16 only, a float32 3x3 chunk of 32 channels
does not fit. Kernel notes v14 and v16 give what each gained. The first union tiling (``union=3``, float32 only,
kernel notes v21) walks union entries of three channels: one staged load feeds three FMAs, which pays where three
rows share many taps. On the H100, in float32 at 0.7, it ran VGG16 features.2-12 (64 to 256 input channels)
1.03-1.12x as fast as the best per-channel tiling, and at 0.9 0.78-0.86x; of the four union tilings first timed, it
was the fastest on every layer. The second, ``paired``, reads the float32 input as image pairs (one 8-byte shared
load per two images, the pairing copy timed with the kernel) and puts 28 staged elements behind each 16-byte entry
(kernel notes v22): on the H100 at 0.7 it ran VGG16 features.10 and .12 1.02x as fast as the union tiling above and
lost on features.0-7 (0.90-0.99x) and at 0.9; a paired PY = 8, NB = 2 tiling (two blocks per SM) lost everywhere.
The last three are earlier winners with ``stage_entries`` (kernel notes v25): each warp copies its entries of the
next chunk into shared memory, so an entry costs one broadcast shared load instead of a global load through L1; their
slots take shared memory in proportion to the weight's longest entry list, so a dense weight may leave them out. Each
names the blocks per SM its unstaged tiling reaches (``min_blocks``, 64 registers), since the staging code otherwise
costs ptxas up to 16 more registers and a block per SM. On the H100 (b128) the 8-warp CC = 8 one ran VGG16
features.0-10 in float32 at 0.8 1.00-1.03x as fast as the best unstaged setting (1.08-1.12x its own unstaged
tiling), the 16-warp CC = 16 one features.2-12 at 0.9 1.03-1.06x, the CC = 32 one half2 products at 0.95 1.02-1.05x;
they lose in float16 at 0.9. The union tiling staged ran 0.97-1.01x as fast as unstaged and is not built."""


POINTWISE_TILINGS = (
    cl.PointwiseTiling(pv=1, mw=8, warps=8, cc=32),
    cl.PointwiseTiling(pv=1, mw=8, warps=16, cc=32),
    cl.PointwiseTiling(pv=1, mw=8, warps=16, cc=16),
    cl.PointwiseTiling(pv=1, mw=16, warps=8, cc=32),
    cl.PointwiseTiling(pv=1, mw=8, warps=32, cc=32),
    cl.PointwiseTiling(pv=2, mw=4, warps=16, cc=16),
    cl.PointwiseTiling(pv=2, mw=8, warps=8, cc=16),
)
"""``direct_pointwise`` candidates: 16 to 64 accumulators per thread, 64 to 256 output channels per block
(every channel of a block reuses each staged element, so more channels cut the staging per FMA and the L2
re-reads of the input), 128 or 256 columns, chunks of 16 or 32 input channels (16 to 32 KB in two float32
buffers)."""


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


def tile_space(batch: int, out_hw: tuple[int, int], kernel_size: tuple[int, int], dtype: torch.dtype,
               prune: bool = True, vector_pad: int | None = None, shared_limit: int = cl.TILE_SHARED_LIMIT_BYTES,
               entry_capacity: Callable[[int, int], int] | None = None) -> list[dict[str, Any]]:
    """``direct_tile`` settings: the :data:`TILE_TILINGS` valid for ``dtype`` and whose shared memory
    (:func:`~unsparse.runtime.cupy_launcher.tile_shared_bytes`) fits in ``shared_limit`` bytes
    (:func:`~unsparse.runtime.cupy_launcher.tile_shared_limit` of the GPU); with ``vector_pad`` (the layer's
    ``pad_w``, where :func:`~unsparse.runtime.cupy_launcher.vector_staging_reason` allows it) also each tiling that
    can stage 16-byte vectors, as ``"stage": "vector"``. ``entry_capacity(chunk, union)``: the weight's longest
    entry list (:func:`longest_list`), which sizes the ``stage_entries`` tilings' slots (``"entries": "shared"``);
    None leaves those tilings out.

    With ``prune``, tilings whose output tile is more than twice the plane in either direction, or whose
    NB exceeds the batch (beyond the images per element), are left out.
    """
    E, F_ = out_hw
    space = []
    for tiling, pad in itertools.product(TILE_TILINGS, [None] if vector_pad is None else [None, vector_pad]):
        if tiling.stage_entries and entry_capacity is None:
            continue
        try:
            layout = cl.tile_layout(dtype, kernel_size, tiling, pad)
        except ValueError:
            continue
        capacity = entry_capacity(tiling.cc, tiling.union) if tiling.stage_entries else 0
        if cl.tile_shared_bytes(layout, tiling, capacity) > shared_limit:
            continue
        te, tf = tiling.tile_hw
        if prune and (te > 2 * E or tf > 2 * F_ or tiling.nb > max(batch, cl.images_per_element(dtype))):
            continue
        space.append({"variant": "tile", "wx": tiling.wx, "py": tiling.py, "nb": tiling.nb, "mw": tiling.mw,
                      "warps": tiling.warps, "cc": tiling.cc, **({} if pad is None else {"stage": "vector"}),
                      **({} if tiling.union == 1 else {"union": tiling.union}),
                      **({"paired": True} if tiling.paired else {}),
                      **({"entries": "shared"} if tiling.stage_entries else {}),
                      **({"min_blocks": tiling.min_blocks} if tiling.min_blocks else {})})
    return space


POINTWISE_SPLITS = (4, 16)
"""Split-K choices of ``direct_pointwise`` (setting ``"splits"``) for grids below :data:`SPLIT_BELOW_BLOCKS`."""
SPLIT_BELOW_BLOCKS = 128
"""Blocks under which a ``direct_pointwise`` grid leaves most of a GPU idle (an H100 has 132 SMs): at batch 1 a
1024 -> 256 layer at 14x14 is 8 blocks, each walking 32 chunks in turn (~0.1 ms on the H100)."""


def pointwise_space(batch: int, out_channels: int, pixels: int, dtype: torch.dtype, prune: bool = True,
                    vector: bool = False, in_channels: int | None = None) -> list[dict[str, Any]]:
    """``direct_pointwise`` settings: the :data:`POINTWISE_TILINGS` whose staged chunks fit, each with
    element-wise staging and, with ``vector`` (the plane passes
    :func:`~unsparse.runtime.cupy_launcher.pointwise_vector_reason`), also as ``"stage": "vector"``. With
    ``in_channels``, a setting whose grid has fewer than :data:`SPLIT_BELOW_BLOCKS` blocks also comes with each
    split-K choice of :data:`POINTWISE_SPLITS` below its chunk count (``"splits": s``).

    With ``prune``, tilings with more than twice the output channels (beyond 64) or more than twice the
    ``batch * pixels`` columns (beyond 128) are left out.
    """
    space = []
    stages = ["scalar", "vector"] if vector else ["scalar"]
    for tiling, stage in itertools.product(POINTWISE_TILINGS, stages):
        try:
            layout = cl.pointwise_layout(dtype, tiling, stage == "vector")
        except ValueError:
            continue
        if layout.shared_bytes() > cl.SHARED_LIMIT_BYTES:
            continue
        if prune and (tiling.channels > max(2 * out_channels, 64) or tiling.columns > max(2 * batch * pixels, 128)):
            continue
        setting = {"variant": "pointwise", "pv": tiling.pv, "mw": tiling.mw, "warps": tiling.warps,
                   "cc": tiling.cc, **({"stage": "vector"} if stage == "vector" else {})}
        space.append(setting)
        blocks = math.ceil(out_channels / tiling.channels) * math.ceil(batch * pixels / tiling.columns)
        if in_channels is not None and blocks < SPLIT_BELOW_BLOCKS:
            space += [{**setting, "splits": s} for s in POINTWISE_SPLITS if s < math.ceil(in_channels / tiling.cc)]
    return space


def setting_sizes(params: dict[str, Any], names: tuple[str, ...], variant: str) -> list[Any]:
    """``params``' values of ``names`` in order.

    Raises:
        ValueError: naming the sizes a ``variant`` setting lacks.
    """
    missing = [name for name in names if name not in params]
    if missing:
        raise ValueError(f"params: a {variant} setting needs {missing}")
    return [params[name] for name in names]


def pointwise_tiling_of(params: dict[str, Any]) -> cl.PointwiseTiling:
    """The :class:`~unsparse.runtime.cupy_launcher.PointwiseTiling` of a ``pointwise`` setting.

    Raises:
        ValueError: a missing or invalid size.
    """
    return cl.PointwiseTiling(*setting_sizes(params, ("pv", "mw", "warps", "cc"), "pointwise"))


ACCUMULATE = ("float32", "half2")
"""Values of a setting's ``"accumulate"``: float32 products and sums (every variant, the default), or half2
products summed in float16 runs (``tile`` on float16, backend ``direct_half2``)."""


def half_run_of(params: dict[str, Any], dtype: torch.dtype) -> int:
    """The ``HALF_RUN`` template argument of a setting: :data:`~unsparse.runtime.cupy_launcher.HALF2_RUN` for
    ``"accumulate": "half2"``, else 0.

    Raises:
        ValueError: for an ``accumulate`` outside :data:`ACCUMULATE`, or ``half2`` on a variant other than
            ``tile`` or a dtype other than float16.
    """
    accumulate = params.get("accumulate", "float32")
    if accumulate not in ACCUMULATE:
        raise ValueError(f"accumulate: unknown {accumulate!r}, expected one of {ACCUMULATE}")
    if accumulate == "float32":
        return 0
    if params.get("variant") != "tile" or dtype != torch.float16:
        raise ValueError(f"accumulate: half2 needs the tile variant on float16, got {params.get('variant')!r} "
                         f"on {dtype}")
    return cl.HALF2_RUN


def pair_images(x: torch.Tensor) -> torch.Tensor:
    """The image-paired input of ``direct_tile`` on float16 and of its ``paired`` float32 tilings: ``(N, C, H, W)``
    to ``(ceil(N / 2), C, H, W, 2)`` with element ``[i, c, h, w, q] = x[2i + q, c, h, w]`` (a zero image pads an
    odd N), so that one ``__half2`` or ``float2`` holds the same pixel of two images and the kernel stages it
    asynchronously, one element (or one 16-byte vector of 4 or 2 pixels) per ``cp.async``. Returns a fresh
    contiguous (so 16-byte aligned) tensor; ``x`` is not modified."""
    if x.shape[0] % 2:
        x = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
    return x.reshape(x.shape[0] // 2, 2, *x.shape[1:]).permute(0, 2, 3, 4, 1).contiguous()


def stride_one_reason(geometry: ConvGeometry) -> str | None:
    """Why the ``tile`` and ``pointwise`` kernels cannot run a layer, or None: they need an undilated Conv2d
    (strided ones reach them through their phase split); ``rows`` runs the rest."""
    if geometry.spatial_dims != 2 or geometry.dilation != (1, 1):
        return f"tile and pointwise need an undilated Conv2d, got {geometry}"
    return None


def bind_pairing(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 aligned: bool) -> tuple[cl.BoundLaunch, tuple[int, ...]]:
    """The ``pair_images`` kernel for contiguous ``(N, C, H, W)`` inputs of ``shape`` on ``device``: the bound launch
    (per-call arguments: the input, then a fresh output of the returned shape ``(ceil(N / 2), C, H, W, 2)``).
    ``aligned``: whether the inputs' data start on a 16-byte boundary; with whole 16-byte vectors per image the
    kernel then moves vectors (:func:`~unsparse.runtime.cupy_launcher.pairing_launch`)."""
    N, P = shape[0], math.prod(shape[1:])
    spec = cl.pairing_launch(dtype, N, P, cl.pairing_vector(P * dtype.itemsize, aligned))
    return cl.bind(spec, (cl.PER_CALL, cl.PER_CALL, N, P), device), ((N + 1) // 2, *shape[1:], 2)


def bind_phase_pairing(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                       split: PhaseSplit) -> tuple[cl.BoundLaunch, tuple[int, ...]]:
    """The ``phase_pair_images`` kernel for contiguous ``(N, C, H, W)`` inputs of ``shape`` on ``device`` and a phase
    split that reads every phase (:attr:`~unsparse.sparse.phases.PhaseSplit.every_phase`): the bound launch
    (per-call arguments: the input, then a fresh output of the returned shape ``(ceil(N / 2), C * s_h * s_w, HQ, WQ,
    2)``), equal to :func:`pair_images` of ``split.input(x)`` in one pass instead of two.

    Raises:
        ValueError: for a split that skips a phase, or from
            :func:`~unsparse.runtime.cupy_launcher.phase_pairing_launch`.
    """
    if not split.every_phase:
        raise ValueError(f"split: phase_pair_images needs every phase, got {split.phases_h} x {split.phases_w}")
    N, C, H, W = shape
    (hq, wq), (sh, sw) = split.input_size(H, W), split.stride
    spec = cl.phase_pairing_launch(dtype, N, C, (hq, wq), split.stride)
    return (cl.bind(spec, (cl.PER_CALL, cl.PER_CALL, N, C, H, W, sh, sw, hq, wq), device),
            ((N + 1) // 2, C * sh * sw, hq, wq, 2))


def pair_images_on_device(x: torch.Tensor) -> torch.Tensor:
    """:func:`pair_images` of a contiguous ``x``: on CUDA by the ``pair_images`` kernel (about copy speed; torch's
    permuted copy moved float16 at half of it on the H100, kernels/NOTES.md eleventh session), elsewhere by torch.
    Returns a fresh ``(ceil(N / 2), C, H, W, 2)`` tensor; ``x`` is not modified."""
    if x.device.type != "cuda" or x.shape[0] == 0:
        return pair_images(x)
    pairing, shape = bind_pairing(tuple(x.shape), x.dtype, x.device, cl.vector_aligned(x))
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    pairing(cl.current_stream(x.device), x, out)
    return out


def is_pointwise(csr: UniformCSR, geometry: ConvGeometry) -> bool:
    """Whether a layer is a 1x1, stride 1, dilation 1, unpadded Conv2d (the ``pointwise`` variant's domain)."""
    return (geometry.spatial_dims == 2 and csr.kernel_size == (1, 1) and geometry.stride == (1, 1)
            and geometry.dilation == (1, 1) and geometry.padding == (0, 0))


def reads_pairs(params: dict[str, Any], dtype: torch.dtype) -> bool:
    """Whether a ``tile`` setting's kernel reads its input as image pairs: float16 always, float32 where the setting
    is ``"paired"`` (:func:`~unsparse.runtime.cupy_launcher.images_per_element`)."""
    return cl.images_per_element(dtype, bool(params.get("paired", False))) == 2


def tiling_of(params: dict[str, Any]) -> cl.TileTiling:
    """The :class:`~unsparse.runtime.cupy_launcher.TileTiling` of a ``tile`` setting (``"union"`` 1, ``"paired"``
    false, ``"entries"`` ``"global"`` and ``"min_blocks"`` 0 where absent; ``"entries": "shared"`` is
    ``stage_entries``).

    Raises:
        ValueError: a missing or invalid size or ``"min_blocks"``, a ``"paired"`` that is not a bool, or an
            ``"entries"`` other than ``"global"`` and ``"shared"``.
    """
    entries = params.get("entries", "global")
    if entries not in ("global", "shared"):
        raise ValueError(f"entries: unknown {entries!r}, expected 'global' or 'shared'")
    return cl.TileTiling(*setting_sizes(params, ("wx", "py", "nb", "mw", "warps", "cc"), "tile"),
                         params.get("union", 1), params.get("paired", False), entries == "shared",
                         params.get("min_blocks", 0))


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


def prepare_tile(csr: UniformCSR, layout: cl.TileLayout, half2: bool = False, union: int = 1) -> TileArrays:
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
    of a ``stage_entries`` tiling (:func:`~unsparse.runtime.cupy_launcher.tile_shared_bytes`); :func:`check_capacity`
    holds the built arrays to it.

    Raises:
        ValueError: for a ``chunk`` below 1 or a ``union`` that is not one of the kernel's.
    """
    if union not in cl.TILE_UNIONS or type(chunk) is not int or chunk < 1:
        raise ValueError(f"longest_list: chunk {chunk!r} must be a positive integer and union {union} one of "
                         f"{cl.TILE_UNIONS}")
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
                  layout: cl.TileLayout, union: int = 1) -> None:
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
    if union not in cl.TILE_UNIONS:
        raise ValueError(f"union: {union} is not one of {cl.TILE_UNIONS}")
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


@dataclass(frozen=True)
class KernelView:
    """What the ``tile`` and ``pointwise`` kernels see of a layer: a stride-1 layer, either the layer itself or
    its :class:`~unsparse.sparse.phases.PhaseSplit` (strided layers), and how a setting stages it.

    Attributes:
        csr, geometry: the stride-1 layer (for a split: phase channels, ``R' x S'`` filter, top/left padding).
        split: the phase split of a strided layer, None for a stride-1 layer.
        in_hw: ``(H, W)`` of the input the kernel reads (the phase images' size for a split).
        out_hw: ``(E, F)`` of the original layer, the outputs the kernel computes.
        source_aligned: whether the tensor the setting reads first (``x``, or the fresh phase images of a split)
            starts on a 16-byte boundary.
        staging: ``tile``: the ``pad_w`` of 16-byte staging or None (scalar); ``pointwise``: whether it stages
            16-byte vectors.
    """

    csr: UniformCSR
    geometry: ConvGeometry
    split: PhaseSplit | None
    in_hw: tuple[int, int]
    out_hw: tuple[int, int]
    source_aligned: bool
    staging: int | bool | None


def aligned_copy(fresh: torch.Tensor) -> torch.Tensor:
    """``fresh``, a tensor this backend allocated (phase images, image pairs), after checking that its data start on
    a 16-byte boundary, as :meth:`DirectBackend._prepare` assumed when it chose 16-byte staging and pairing copies
    for it (torch's caching allocator aligns to 512 bytes; an allocator that does not would otherwise fault on the
    GPU).

    Raises:
        ValueError: for a misaligned allocation.
    """
    if not cl.vector_aligned(fresh):
        raise ValueError(f"allocation at {fresh.data_ptr():#x} is not 16-byte aligned; the direct kernels' staging "
                         "of fresh copies needs 16-byte aligned allocations")
    return fresh


@dataclass(frozen=True)
class PreparedCall:
    """One setting of :class:`DirectBackend` on one weight and input size, resolved once, so that an eager call
    pays only for what changes per call: the input transform (phase split, image pairing), the output
    allocation and the launches, each bound with its fixed arguments converted
    (:class:`~unsparse.runtime.cupy_launcher.BoundLaunch`).

    Attributes:
        kernel: the convolution kernel, its validated index arrays (and, for ``rows``, the weight values) and
            scalar arguments bound; per call the input, the bias (None for split-K) and the output.
        split: the phase split ``x`` is copied into first (a strided ``tile`` or ``pointwise`` setting), None
            where the kernel or the pairing reads ``x`` itself (a fused phase pairing reads ``x``).
        out_shape: ``(N, M, E, F)``.
        splits: split-K shares of ``pointwise`` (float32 partial sums, summed here), 1 otherwise.
        pairing: where the kernel reads the input as image pairs (float16, or a ``paired`` float32 tiling), the
            bound pairing kernel and the paired shape: ``phase_pair_images`` on ``x`` for a strided setting that
            reads every phase (:func:`bind_phase_pairing`), else ``pair_images`` (:func:`bind_pairing`); None
            otherwise.
    """

    kernel: cl.BoundLaunch
    split: PhaseSplit | None
    out_shape: tuple[int, int, int, int]
    splits: int = 1
    pairing: tuple[cl.BoundLaunch, tuple[int, ...]] | None = None

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Run on ``x`` (contiguous ``(N, C, H, W)`` of the prepared size, dtype and 16-byte alignment) with
        ``bias`` (``(M,)`` of ``x``'s dtype, contiguous, or None); returns a new ``(N, M, E, F)`` tensor of ``x``'s
        dtype."""
        stream = cl.current_stream(x.device)
        source = x if self.split is None else aligned_copy(self.split.input(x))
        if self.pairing is not None:
            pairing, shape = self.pairing
            paired = aligned_copy(torch.empty(shape, dtype=x.dtype, device=x.device))
            pairing(stream, source, paired)
            source = paired
        if self.splits == 1:
            out = torch.empty(self.out_shape, dtype=x.dtype, device=x.device)
            self.kernel(stream, source, bias, out)
            return out
        partial = torch.empty((self.splits, *self.out_shape), dtype=torch.float32, device=x.device)
        self.kernel(stream, source, None, partial)
        summed = partial.sum(0)  # float32 partial sums of each share of the input channels
        return (summed if bias is None else summed.add_(bias.float()[:, None, None])).to(x.dtype)


@register_backend
class DirectBackend(ConvBackend):
    """Direct sparse convolution on CUDA through CuPy; float32 and float16 storage, float32 arithmetic.

    Strided, undilated Conv2d layers can also run on the stride-1 ``tile`` and ``pointwise`` kernels through
    their phase split (:mod:`unsparse.sparse.phases`): the setting is the same dict, and :meth:`conv` copies the
    input into its phase images first, inside the timed call.
    """

    name = "direct"
    device_types = frozenset({"cuda"})

    def __init__(self) -> None:
        self._cache = WeightCache()

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

    def _stride_one(self, x: torch.Tensor, csr: UniformCSR,
                    geometry: ConvGeometry) -> tuple[UniformCSR, ConvGeometry, PhaseSplit | None, tuple[int, int]]:
        """The stride-1 layer the ``tile`` and ``pointwise`` kernels run, with its input size: the layer itself,
        or its phase split (cached per weight and geometry).

        Raises:
            ValueError: for a Conv1d or dilated layer, which only ``rows`` runs.
        """
        reason = stride_one_reason(geometry)
        if reason is not None:
            raise ValueError(f"variant: {reason}")
        if geometry.stride == (1, 1):
            return csr, geometry, None, (x.shape[2], x.shape[3])
        split = self._arrays(csr, ("phases", geometry), lambda: phase_split(csr, geometry))
        return split.csr, split.geometry, split, split.input_size(x.shape[2], x.shape[3])

    def _view(self, x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry, params: dict[str, Any]) -> KernelView:
        """The :class:`KernelView` of a ``tile`` or ``pointwise`` setting on input ``x`` (a phase split's input
        is a fresh, so 16-byte aligned, copy; ``x`` itself may be a misaligned view).

        Raises:
            ValueError: from :meth:`_stride_one`; for ``pointwise`` on a layer that is not 1x1 and unpadded once
                split; from :meth:`_vector_requested`.
        """
        csr1, geometry1, split, in_hw = self._stride_one(x, csr, geometry)
        out_hw = self._out_hw(x, csr, geometry)
        source_aligned = split is not None or cl.vector_aligned(x)  # a split's phases are a fresh copy of x
        if params.get("variant") == "pointwise":
            if not is_pointwise(csr1, geometry1) or in_hw != out_hw:
                raise ValueError(f"variant: pointwise needs a 1x1, unpadded Conv2d, got {csr.kernel_size} {geometry}")
            pixels = in_hw[0] * in_hw[1]
            vector = self._vector_requested(params, lambda: cl.pointwise_vector_reason(x.dtype, pixels))
            return KernelView(csr1, geometry1, split, in_hw, out_hw, source_aligned, vector and source_aligned)
        vector = self._vector_requested(
            params, lambda: cl.vector_staging_reason(in_hw[1], csr1.kernel_size, geometry1.padding))
        aligned = source_aligned or reads_pairs(params, x.dtype)  # the kernel then reads a fresh pairing copy
        return KernelView(csr1, geometry1, split, in_hw, out_hw, source_aligned,
                          geometry1.padding[1] if vector and aligned else None)

    def tuning_space(self, x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry) -> list[dict[str, Any]]:
        """Rows settings always; tile settings for undilated Conv2d (strided ones through their phase split);
        pointwise settings for 1x1 unpadded Conv2d (likewise)."""
        out_hw = self._out_hw(x, csr, geometry)
        space = rows_space(x.shape[0], out_hw[0] * out_hw[1])
        if stride_one_reason(geometry) is not None:
            return space
        csr1, geometry1, _, in_hw = self._stride_one(x, csr, geometry)
        if is_pointwise(csr1, geometry1) and in_hw == out_hw:
            pixels = out_hw[0] * out_hw[1]
            space += pointwise_space(x.shape[0], csr.out_channels, pixels, x.dtype,
                                     vector=cl.pointwise_vector_reason(x.dtype, pixels) is None,
                                     in_channels=csr1.in_channels_per_group)
        return space + self._tile_space(x, csr, geometry)

    def _tile_space(self, x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry) -> list[dict[str, Any]]:
        """The ``tile`` settings of an undilated Conv2d (:func:`tile_space` of its stride-1 view)."""
        csr1, geometry1, _, in_hw = self._stride_one(x, csr, geometry)
        vector = cl.vector_staging_reason(in_hw[1], csr1.kernel_size, geometry1.padding) is None
        return tile_space(x.shape[0], self._out_hw(x, csr, geometry), csr1.kernel_size, x.dtype,
                          vector_pad=geometry1.padding[1] if vector else None,
                          shared_limit=cl.tile_shared_limit(x.device),
                          entry_capacity=lambda chunk, union: self._longest_list(csr1, chunk, union))

    def _longest_list(self, csr: UniformCSR, chunk: int, union: int) -> int:
        """:func:`longest_list` of a stride-1 layer's weight, cached with it."""
        return self._arrays(csr, ("longest", chunk, union), lambda: longest_list(csr, chunk, union))

    def _entry_capacity(self, csr: UniformCSR, tiling: cl.TileTiling) -> int:
        """The slot size of a ``stage_entries`` tiling on a stride-1 layer's weight (its longest list), else 0."""
        return self._longest_list(csr, tiling.cc, tiling.union) if tiling.stage_entries else 0

    def kernel_names(self, x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry,
                     space: list[dict[str, Any]] | None = None) -> list[str]:
        """Template instantiations a list of settings (default: the tuning space) uses, with both
        ``pair_images`` kernels of the dtype, and ``phase_pair_images`` for a strided layer whose split reads every
        phase, where a setting pairs its input."""
        space = space if space is not None else self.tuning_space(x, csr, geometry)
        names = {self._launch(x, csr, geometry, params)[0].name for params in space}
        if any(params.get("variant") == "tile" and reads_pairs(params, x.dtype) for params in space):
            names.update(cl.pairing_launch(x.dtype, 2, 1, vector).name for vector in (False, True))
            split = self._stride_one(x, csr, geometry)[2]
            if split is not None and split.every_phase:
                names.add(cl.phase_pairing_launch(x.dtype, 2, 1, (1, 1), (1, 1)).name)
        return sorted(names)

    def precompile(self, x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry,
                   space: list[dict[str, Any]]) -> None:
        """Compile the instantiations ``space`` needs, concurrently (before timing anything)."""
        cl.precompile(self.kernel_names(x, csr, geometry, space))

    def _launch(self, x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry,
                params: dict[str, Any]) -> tuple[cl.Launch, KernelView | None]:
        """The launch of a setting on input ``x``, with its :class:`KernelView` (None for ``rows``).

        Raises:
            ValueError: for an unknown variant, or from :func:`half_run_of` and :meth:`_view`.
        """
        N = x.shape[0]
        variant = params.get("variant", "rows")
        half_run = half_run_of(params, x.dtype)
        if variant == "rows":
            E, F_ = self._out_hw(x, csr, geometry)
            return cl.rows_launch(x.dtype, N, csr.out_channels, E * F_, params.get("threads", 128),
                                  params.get("pixels", 1), params.get("sub_batch", 1),
                                  params.get("channels", ROWS_CHANNELS)), None
        if variant not in ("tile", "pointwise"):
            raise ValueError(f"variant: unknown {variant!r}, expected 'rows', 'tile' or 'pointwise'")
        view = self._view(x, csr, geometry, params)
        E, F_ = view.out_hw
        if variant == "pointwise":
            tiling = pointwise_tiling_of(params)
            _, splits = cl.split_chunks(view.csr.in_channels_per_group, tiling.cc, params.get("splits", 1))
            return cl.pointwise_launch(x.dtype, N, csr.out_channels, E * F_, tiling, view.staging, splits), view
        tiling = tiling_of(params)
        return cl.tile_launch(x.dtype, N, csr.out_channels, (E, F_), view.csr.kernel_size, tiling, view.staging,
                              half_run, cl.tile_shared_limit(x.device),
                              self._entry_capacity(view.csr, tiling)), view

    @staticmethod
    def _vector_requested(params: dict[str, Any], reason: Callable[[], str | None]) -> bool:
        """Whether a ``tile`` or ``pointwise`` setting asks for 16-byte staging (``"stage": "vector"``);
        ``reason`` says why the layer can never stage vectors (None if it can). A float32 input that is merely
        not 16-byte aligned (a view at an odd offset) then takes the scalar kernel of the same tiling, which
        computes the same result (:meth:`_view`).

        Raises:
            ValueError: for an unknown ``stage``, or ``vector`` on a layer that can never stage vectors.
        """
        stage = params.get("stage", "scalar")
        if stage not in ("scalar", "vector"):
            raise ValueError(f"stage: unknown {stage!r}, expected 'scalar' or 'vector'")
        if stage == "scalar":
            return False
        why = reason()
        if why is not None:
            raise ValueError(f"stage: vector staging impossible here: {why}")
        return True

    def _arrays(self, csr: UniformCSR, key: tuple, build: Callable[[], T]) -> T:
        return self._cache.get(csr, key, build)

    def _prepare(self, x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry,
                 params: dict[str, Any]) -> PreparedCall:
        """Resolve a setting for this input size once: launch, phase split, validated index arrays (shared through
        the per-weight cache) and scalar arguments.

        Raises:
            ValueError: from :meth:`_launch`, or indices that fail validation.
        """
        spec, view = self._launch(x, csr, geometry, params)
        N, C, H, W = x.shape
        M, (E, F_) = csr.out_channels, self._out_hw(x, csr, geometry)
        out_shape = (N, M, E, F_)

        def bound(arrays: tuple[torch.Tensor, ...], scalars: tuple[int, ...]) -> cl.BoundLaunch:
            """The kernel bound with its fixed arguments; per call: input, bias, output."""
            return cl.bind(spec, (cl.PER_CALL, *arrays, cl.PER_CALL, cl.PER_CALL, *scalars), x.device)

        if view is None:
            rows = self._arrays(csr, ("rows", H, W, geometry), lambda: prepare_rows(csr, geometry, (H, W)))
            return PreparedCall(bound((rows.offsets, rows.taps, csr.values.contiguous()),
                                      (N, C, H, W, M, csr.row_length, E, F_, *geometry.stride, *geometry.padding,
                                       params.get("channels", ROWS_CHANNELS))), None, out_shape)
        C, (H, W) = view.csr.in_channels_per_group, view.in_hw
        if params["variant"] == "tile":
            tiling = tiling_of(params)
            layout = cl.tile_layout(x.dtype, view.csr.kernel_size, tiling, view.staging)
            half2 = half_run_of(params, x.dtype) > 0
            tile = self._arrays(view.csr, ("tile", layout, half2, tiling.union),
                                lambda: prepare_tile(view.csr, layout, half2, tiling.union))
            capacity = self._entry_capacity(view.csr, tiling)
            if tiling.stage_entries:
                check_capacity(tile, capacity)
            pairing, split = None, view.split
            if reads_pairs(params, x.dtype):
                if split is not None and split.every_phase:  # one pass from x
                    pairing, split = bind_phase_pairing(tuple(x.shape), x.dtype, x.device, split), None
                else:
                    pairing = bind_pairing((N, C, H, W), x.dtype, x.device, view.source_aligned)
            return PreparedCall(bound((tile.chunk_ptr, tile.entries),
                                      (N, C, H, W, M, E, F_, *view.geometry.padding,
                                       math.ceil(F_ / tiling.tile_hw[1]), math.ceil(M / tiling.channels),
                                       capacity)),
                                split, out_shape, pairing=pairing)
        tiling = pointwise_tiling_of(params)
        layout = cl.pointwise_layout(x.dtype, tiling, view.staging)
        tile = self._arrays(view.csr, ("tile", layout, False, 1), lambda: prepare_tile(view.csr, layout))
        per_split, splits = cl.split_chunks(C, tiling.cc, params.get("splits", 1))
        return PreparedCall(bound((tile.chunk_ptr, tile.entries),
                                  (N, C, H * W, M, math.ceil(M / tiling.channels), per_split)),
                            view.split, out_shape, splits=splits)

    def conv(self, x: torch.Tensor, csr: UniformCSR, bias: torch.Tensor | None, geometry: ConvGeometry,
             **params: Any) -> torch.Tensor:
        """Run one variant; ``params`` is an entry of :meth:`tuning_space` (default: rows, no sub-batch). The
        first call of a setting on an input size prepares it (:meth:`_prepare`, cached per weight); later calls
        only transform the input, allocate the output and launch.

        Raises:
            ValueError: for a variant this layer does not support, indices that fail validation, or a bias that is
                not ``(M,)`` (:func:`~unsparse.runtime.backends.base.check_bias`).
        """
        check_bias(bias, csr)
        x = x.contiguous()
        if csr.out_channels == 0 or x.shape[0] == 0:  # E, F >= 1 (output_size raises otherwise)
            return torch.empty(x.shape[0], csr.out_channels, *self._out_hw(x, csr, geometry), dtype=x.dtype,
                               device=x.device)
        key = ("call", tuple(x.shape), x.dtype, geometry, tuple(sorted(params.items())), cl.vector_aligned(x))
        prepared = self._arrays(csr, key, lambda: self._prepare(x, csr, geometry, params))
        return prepared(x, None if bias is None else bias.to(x.dtype).contiguous())


@register_backend
class DirectHalf2Backend(DirectBackend):
    """The ``tile`` kernel on float16 with half2 products: one ``HFMA2`` multiplies a weight pair ``(w, w)`` by the
    staged pair of images, in runs of at most :data:`~unsparse.runtime.cupy_launcher.HALF2_RUN` products summed in
    float16, each run then added to float32 accumulators (kernels/NOTES.md v17). Issue 6's FP16 target counts the
    FP16 (``HFMA2``) peak, which float32 products cannot reach; the price is a float16 rounding per product, a
    relative error of about 6e-4 on dense rows (the CPU emulation in ``tests/test_runtime_direct.py``; cuDNN FP16
    accumulates in float32, 2e-4 from the output's rounding alone). Opt-in: the comparator leaves it out unless
    named (:data:`~unsparse.runtime.comparator.COMPARED_BY_DEFAULT_EXCLUDES`); the benchmark's precision
    ``fp16_half2`` names it.
    """

    name = "direct_half2"

    def unsupported_reason(self, x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry) -> str | None:
        reason = super().unsupported_reason(x, csr, geometry)
        if reason is not None:
            return reason
        if x.dtype != torch.float16:
            return f"half2 products need float16 storage, not {x.dtype}"
        reason = stride_one_reason(geometry)
        return None if reason is None else f"half2 products run on the tile kernel: {reason}"

    def tuning_space(self, x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry) -> list[dict[str, Any]]:
        """The tile settings of :class:`DirectBackend` with ``"accumulate": "half2"``."""
        return [{**params, "accumulate": "half2"} for params in self._tile_space(x, csr, geometry)]
