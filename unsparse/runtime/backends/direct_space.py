"""The ``direct`` backend's tuning space: the kernel settings the comparator times per layer, and how a setting
dict names a kernel's template arguments.

Each variant of :mod:`unsparse.runtime.backends.direct` has a space function (:func:`rows_space`, :func:`tile_space`,
:func:`pointwise_space`) that lists its candidate settings for one layer and input size; the sub-batch of ``rows``
is UnSparse-Opt's tunable parameter (paper 004 §5, eq. 23), the tilings of ``tile`` and ``pointwise`` are ours
(``kernels/NOTES.md``). The ``*_of`` functions read a setting back into the launch geometry of
:mod:`unsparse.runtime.launch_geometry`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import torch

from unsparse.runtime import launch_geometry as lg

ROWS_THREADS = (64, 128, 256)
ROWS_PIXELS = (1, 2)
ROWS_SUB_BATCH = (1, 2, 4, 8)
ROWS_CHANNELS = 8

TILE_TILINGS = (
    lg.TileTiling(wx=32, py=4, nb=2, mw=4, warps=8, cc=8),
    lg.TileTiling(wx=32, py=4, nb=2, mw=8, warps=8, cc=8),
    lg.TileTiling(wx=32, py=8, nb=2, mw=4, warps=8, cc=8),
    lg.TileTiling(wx=32, py=4, nb=4, mw=4, warps=8, cc=8),
    lg.TileTiling(wx=32, py=4, nb=2, mw=4, warps=16, cc=8),
    lg.TileTiling(wx=32, py=4, nb=2, mw=4, warps=32, cc=8),
    lg.TileTiling(wx=16, py=7, nb=2, mw=4, warps=16, cc=4),
    lg.TileTiling(wx=16, py=4, nb=2, mw=8, warps=8, cc=4),
    lg.TileTiling(wx=16, py=7, nb=2, mw=4, warps=8, cc=8),
    lg.TileTiling(wx=16, py=7, nb=2, mw=4, warps=8, cc=4),
    lg.TileTiling(wx=8, py=2, nb=4, mw=4, warps=8, cc=2),
    lg.TileTiling(wx=8, py=2, nb=2, mw=8, warps=4, cc=4),
    lg.TileTiling(wx=32, py=8, nb=1, mw=8, warps=8, cc=8),
    lg.TileTiling(wx=32, py=4, nb=2, mw=4, warps=8, cc=16),
    lg.TileTiling(wx=32, py=4, nb=2, mw=4, warps=16, cc=16),
    lg.TileTiling(wx=32, py=4, nb=2, mw=4, warps=32, cc=16),
    lg.TileTiling(wx=32, py=4, nb=2, mw=4, warps=16, cc=32),
    lg.TileTiling(wx=32, py=4, nb=2, mw=4, warps=32, cc=32),
    lg.TileTiling(wx=32, py=8, nb=2, mw=3, warps=8, cc=8, union=3),
    lg.TileTiling(wx=32, py=7, nb=4, mw=3, warps=8, cc=8, union=3, paired=True),
    lg.TileTiling(wx=32, py=4, nb=2, mw=4, warps=8, cc=8, stage_entries=True, min_blocks=4),
    lg.TileTiling(wx=32, py=4, nb=2, mw=4, warps=16, cc=16, stage_entries=True, min_blocks=2),
    lg.TileTiling(wx=32, py=4, nb=2, mw=4, warps=16, cc=32, stage_entries=True, min_blocks=2),
    lg.TileTiling(wx=8, py=2, nb=4, mw=8, warps=8, cc=4),
    lg.TileTiling(wx=8, py=2, nb=2, mw=8, warps=8, cc=8),
    lg.TileTiling(wx=8, py=2, nb=2, mw=8, warps=8, cc=16),
    lg.TileTiling(wx=8, py=2, nb=2, mw=8, warps=16, cc=16),
    lg.TileTiling(wx=16, py=7, nb=1, mw=4, warps=16, cc=16),
    lg.TileTiling(wx=16, py=7, nb=1, mw=4, warps=32, cc=16),
)
"""``direct_tile`` candidates: 28 to 64 accumulators per thread (64 keeps two 256-thread blocks per SM within the
register file; the paired union tiling's 84 are held to 128 registers, also two blocks), warp tiles 4x32 to 8x8 for
planes from 224x224 down to 7x7, 32 to 128 output channels per block (more channels share each staged chunk); NB = 1 for
batch 1 and the 14x14 tilings below, in float32 (float16 pairs images, NB even). CC = 16 halves the barriers per nonzero
where a chunk holds little work (the 2x2 filters of a 3x3 stride-2 layer's phase split, 1x1 layers, and 3x3 layers at
high sparsity); staged chunks beyond 48 KB take dynamic shared memory up to
:data:`~unsparse.runtime.launch_geometry.TILE_SHARED_LIMIT_BYTES`. At 0.95-0.98 sparsity a cost that does not shrink
with sparsity is about half the time (VGG16 features.5 FP16: about 0.83 ms of 1.60 ms at 0.95 before these), so the
32-warp and the CC = 16 and 32 per-channel tilings of 32-wide tiles share each chunk among 128 output channels, or stage
16 or 32 channels per barrier pair (fewer barriers and loop set-ups per nonzero), or both; CC = 32 in float16 only, a
float32 3x3 chunk of 32 channels does not fit. Kernel notes v14 and v16 give what each gained. The first union tiling
(``union=3``, float32 only, kernel notes v21) walks union entries of three channels: one staged load feeds three FMAs,
which pays where three rows share many taps. On the H100, in float32 at 0.7, it ran VGG16 features.2-12 (64 to 256 input
channels) 1.03-1.12x as fast as the best per-channel tiling, and at 0.9 0.78-0.86x; of the four union tilings first
timed, it was the fastest on every layer. The second, ``paired``, reads the float32 input as image pairs (one 8-byte
shared load per two images, the pairing copy timed with the kernel) and puts 28 staged elements behind each 16-byte
entry (kernel notes v22): on the H100 at 0.7 it ran VGG16 features.10 and .12 1.02x as fast as the union tiling above
and lost on features.0-7 (0.90-0.99x) and at 0.9; a paired PY = 8, NB = 2 tiling (two blocks per SM) lost everywhere.
The three ``stage_entries`` tilings are earlier winners (kernel notes v25): each warp copies its entries of the next
chunk into shared memory, so an entry costs one broadcast shared load instead of a global load through L1; their slots
take shared memory in proportion to the weight's longest entry list, so a dense weight may leave them out. Each names
the blocks per SM its unstaged tiling reaches (``min_blocks``, 64 registers), since the staging code otherwise costs
ptxas up to 16 more registers and a block per SM. On the H100 (b128) the 8-warp CC = 8 one ran VGG16 features.0-10 in
float32 at 0.8 1.00-1.03x as fast as the best unstaged setting (1.08-1.12x its own unstaged tiling), the 16-warp CC = 16
one features.2-12 at 0.9 1.03-1.06x, the CC = 32 one half2 products at 0.95 1.02-1.05x; they lose in float16 at 0.9. The
union tiling staged ran 0.97-1.01x as fast as unstaged and is not built. The four 8-wide tilings after them are for 7x7
planes (ResNet-50's layer4), where the prune leaves only the 8-wide warp tiles: the two earlier 8-wide ones stage 2 or 4
channels per chunk for 32 output channels, so at 0.9 a chunk holds about two nonzeros per row behind each barrier pair
and its staging; these share each chunk among 64 or 128 channels and stage 4 to 16 channels (a float32 chunk of 16
channels takes 61 KB in two buffers with rows padded to 24 elements; kernels/NOTES.md, forty-sixth and forty-eighth
sessions). The 16-warp CC = 16 one (128 channels, two blocks per SM) ran layer4.0.conv2 (stride 2, its phase split) in
0.85 ms and layer4.1.conv2 in 0.53 ms in FP32 at 0.9 on the H200, against 1.29 and 0.67 ms for the 8-warp CC = 8 one
(kernels/NOTES.md, forty-eighth session). The last two are for 14x14 planes: one image per 14x16 tile and 16
channels per chunk (28 sums per thread, 98 KB in two buffers); on the H200 the 16-warp one ran layer3.1.conv2 in FP32
at 0.9 in 0.40 ms against 0.50 for the earlier 14x14 winner (WX 16, PY 7, NB 2, 16 warps, CC 4), in the same process.
The 32-warp one shares each chunk among 128 output channels at one block per SM (63 registers x 1024 threads), the same
32 warps per SM as two 16-warp blocks: it ran the phase split of layer3.0.conv2 (stride 2) in 0.71 ms against 0.78,
layer3.1.conv2 and VGG16 features.24 1-2 % faster (kernels/NOTES.md, forty-ninth session)."""


POINTWISE_TILINGS = (
    lg.PointwiseTiling(pv=1, mw=8, warps=8, cc=32),
    lg.PointwiseTiling(pv=1, mw=8, warps=16, cc=32),
    lg.PointwiseTiling(pv=1, mw=8, warps=16, cc=16),
    lg.PointwiseTiling(pv=1, mw=16, warps=8, cc=32),
    lg.PointwiseTiling(pv=1, mw=8, warps=32, cc=32),
    lg.PointwiseTiling(pv=2, mw=4, warps=16, cc=16),
    lg.PointwiseTiling(pv=2, mw=8, warps=8, cc=16),
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
               prune: bool = True, vector_pad: int | None = None, shared_limit: int = lg.TILE_SHARED_LIMIT_BYTES,
               entry_capacity: Callable[[int, int], int] | None = None) -> list[dict[str, Any]]:
    """``direct_tile`` settings: the :data:`TILE_TILINGS` valid for ``dtype`` and whose shared memory
    (:func:`~unsparse.runtime.launch_geometry.tile_shared_bytes`) fits in ``shared_limit`` bytes
    (:func:`~unsparse.runtime.launch_geometry.tile_shared_limit` of the GPU); with ``vector_pad`` (the layer's
    ``pad_w``, where :func:`~unsparse.runtime.launch_geometry.vector_staging_reason` allows it) also each tiling that
    can stage 16-byte vectors, as ``"stage": "vector"``. ``entry_capacity(chunk, union)``: the weight's longest
    entry list (:func:`~unsparse.runtime.backends.direct_arrays.longest_list`), which sizes the ``stage_entries``
    tilings' slots (``"entries": "shared"``); None leaves those tilings out.

    With ``prune``, tilings whose output tile is more than twice the plane in either direction, or whose
    NB exceeds the batch (beyond the images per element), are left out.
    """
    E, F_ = out_hw
    space = []
    for tiling, pad in itertools.product(TILE_TILINGS, [None] if vector_pad is None else [None, vector_pad]):
        if tiling.stage_entries and entry_capacity is None:
            continue
        try:
            layout = lg.tile_layout(dtype, kernel_size, tiling, pad)
        except ValueError:
            continue
        capacity = entry_capacity(tiling.cc, tiling.union) if tiling.stage_entries else 0
        if lg.tile_shared_bytes(layout, tiling, capacity) > shared_limit:
            continue
        te, tf = tiling.tile_hw
        if prune and (te > 2 * E or tf > 2 * F_ or tiling.nb > max(batch, lg.images_per_element(dtype))):
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
    :func:`~unsparse.runtime.launch_geometry.pointwise_vector_reason`), also as ``"stage": "vector"``. With
    ``in_channels``, a setting whose grid has fewer than :data:`SPLIT_BELOW_BLOCKS` blocks also comes with each
    split-K choice of :data:`POINTWISE_SPLITS` below its chunk count (``"splits": s``).

    With ``prune``, tilings with more than twice the output channels (beyond 64) or more than twice the
    ``batch * pixels`` columns (beyond 128) are left out.
    """
    space = []
    stages = ["scalar", "vector"] if vector else ["scalar"]
    for tiling, stage in itertools.product(POINTWISE_TILINGS, stages):
        try:
            layout = lg.pointwise_layout(dtype, tiling, stage == "vector")
        except ValueError:
            continue
        if layout.shared_bytes() > lg.SHARED_LIMIT_BYTES:
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


def pointwise_tiling_of(params: dict[str, Any]) -> lg.PointwiseTiling:
    """The :class:`~unsparse.runtime.launch_geometry.PointwiseTiling` of a ``pointwise`` setting.

    Raises:
        ValueError: a missing or invalid size.
    """
    return lg.PointwiseTiling(*setting_sizes(params, ("pv", "mw", "warps", "cc"), "pointwise"))


ACCUMULATE = ("float32", "half2")
"""Values of a setting's ``"accumulate"``: float32 products and sums (every variant, the default), or half2
products summed in float16 runs (``tile`` on float16, backend ``direct_half2``)."""


def half_run_of(params: dict[str, Any], dtype: torch.dtype) -> int:
    """The ``HALF_RUN`` template argument of a setting: :data:`~unsparse.runtime.launch_geometry.HALF2_RUN` for
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
    return lg.HALF2_RUN


def reads_pairs(params: dict[str, Any], dtype: torch.dtype) -> bool:
    """Whether a ``tile`` setting's kernel reads its input as image pairs: float16 always, float32 where the setting
    is ``"paired"`` (:func:`~unsparse.runtime.launch_geometry.images_per_element`)."""
    return lg.images_per_element(dtype, bool(params.get("paired", False))) == 2


def tiling_of(params: dict[str, Any]) -> lg.TileTiling:
    """The :class:`~unsparse.runtime.launch_geometry.TileTiling` of a ``tile`` setting (``"union"`` 1, ``"paired"``
    false, ``"entries"`` ``"global"`` and ``"min_blocks"`` 0 where absent; ``"entries": "shared"`` is
    ``stage_entries``).

    Raises:
        ValueError: a missing or invalid size or ``"min_blocks"``, a ``"paired"`` that is not a bool, or an
            ``"entries"`` other than ``"global"`` and ``"shared"``.
    """
    entries = params.get("entries", "global")
    if entries not in ("global", "shared"):
        raise ValueError(f"entries: unknown {entries!r}, expected 'global' or 'shared'")
    return lg.TileTiling(*setting_sizes(params, ("wx", "py", "nb", "mw", "warps", "cc"), "tile"),
                         params.get("union", 1), params.get("paired", False), entries == "shared",
                         params.get("min_blocks", 0))
