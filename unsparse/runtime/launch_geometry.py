"""Launch geometry of the ``kernels/*.cu`` kernels, in one Python place: grid and block sizes, template
instantiation names, shared-memory layouts and limits (:func:`rows_launch`, :func:`tile_launch`,
:func:`pointwise_launch`, :func:`pairing_launch`, :func:`phase_pairing_launch`).

Pure Python, so the CPU tests check it; importing this module needs neither CuPy nor a GPU.
:mod:`unsparse.runtime.cupy_launcher` compiles the instantiations named here and launches them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

ROWS_CHUNK = 256
"""Stored entries of one row staged in shared memory at a time by ``direct_rows`` (template JC)."""
SHARED_LIMIT_BYTES = 48 * 1024
"""Shared memory a block may use without opting in (CUDA default): the limit of ``direct_pointwise``'s static
staging buffers."""
TILE_SHARED_LIMIT_BYTES = 99 * 1024
"""Dynamic shared memory a ``direct_tile`` block may ask for (its two staged chunks, :meth:`TileLayout.shared_bytes`;
beyond :data:`SHARED_LIMIT_BYTES` :func:`~unsparse.runtime.cupy_launcher.bind` opts in): the per-block opt-in limit
of sm_86/sm_89 GPUs, below sm_80's 163 KB and sm_90's 227 KB. On an H100 two such blocks fit one SM's 228 KB."""
TILE_WIDE_SUMS = 64
"""float32 partial sums per thread (:meth:`TileTiling.accumulators`) above which a ``direct_tile`` tiling is "wide":
the kernel holds it to 128 registers and two blocks per SM, so it may have at most :data:`TILE_WIDE_WARPS` warps
(the kernel's ``TILE_WIDE_SUMS`` and its ``static_assert``)."""
TILE_WIDE_WARPS = 8
HALF2_RUN = 16
"""Longest run of products ``direct_tile`` sums in float16 before adding the run to its float32 accumulators, with
half2 products (template ``HALF_RUN``; backend ``direct_half2``). A run of n float16 roundings gives a relative
error of about ``sqrt(n / 2) * 2e-4``; 16 keeps it near 6e-4, below :func:`~unsparse.runtime.comparator.tolerance`'s
float16 bound of 2e-3 even for dense rows (kernels/NOTES.md v17)."""
TAP_SHIFT_BITS = 16
"""``direct_rows`` packs a tap's (row shift, column shift) as ``dy << 16 | dx``; both must be < 2**15."""

VECTOR_BYTES = 16
"""Bytes of one staging vector (a ``cp.async`` or ``uint4`` copy): 16-byte staging moves whole vectors, so it needs
rows of whole vectors and 16-byte aligned data."""

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


def vector_elements(element_bytes: int) -> int:
    """Elements of ``element_bytes`` bytes in one :data:`VECTOR_BYTES` vector: 4 float32, 8 float16, 2 image pairs
    of float32 (8-byte elements)."""
    return VECTOR_BYTES // element_bytes


def vector_aligned(x: torch.Tensor) -> bool:
    """Whether ``x``'s data starts on a :data:`VECTOR_BYTES` boundary (16-byte staging reads it in vectors)."""
    return x.data_ptr() % VECTOR_BYTES == 0


def supported_dtypes() -> tuple[torch.dtype, ...]:
    """Storage dtypes with a kernel instantiation."""
    return tuple(_CUDA_TYPES)


@dataclass(frozen=True)
class Launch:
    """One kernel launch: CUDA grid and block sizes (x, y, z), the template instantiation to call and the dynamic
    shared memory per block (bytes; 0 for kernels with static buffers only)."""

    name: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int = 0


def require_sizes(owner: str, **sizes: Any) -> None:
    """Each of ``sizes`` a positive Python integer (not a bool, a float or a string): they become template arguments
    and launch geometry, where ``32.0`` or ``True`` would reach NVRTC as text or the driver as a float.

    Raises:
        ValueError: naming ``owner`` and the first size that is not.
    """
    for name, value in sizes.items():
        if type(value) is not int or value < 1:
            raise ValueError(f"{owner}: {name} must be a positive integer, got {value!r}")


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
    require_sizes("rows", threads=threads, pixels=pixels_per_thread, sub_batch=sub_batch, channels=channels_per_block)
    if min(batch, out_channels, out_pixels) < 1:
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
    owns ``WARPS * MW`` channels. ``CC`` input channels are staged in shared memory at a time. ``UNION``: output
    channels per entry (template ``U``, one of :data:`TILE_UNIONS`): 1 walks each channel's nonzeros; 3 walks the
    union of three channels' nonzero taps, one staged load feeding three FMAs (kernels/NOTES.md v21); MW is then a
    multiple of 3, and the dtype float32 (in float16 union entries ran at 0.52-0.67x the speed of per-channel ones on
    the H100 at 0.9-0.95, so they are not built). ``paired``: float32 images staged two per element (a ``float2``
    of images 2i and 2i + 1, from the image-paired input), so one 8-byte shared load feeds the FMAs of both images
    (kernels/NOTES.md v22); NB is then even. float16 elements always pair images (:func:`images_per_element`).
    ``stage_entries``: each warp copies its entries of the next chunk into shared memory with the input chunk, so the
    nonzero loop reads an entry by one broadcast shared load instead of a warp-uniform global load, which costs
    the L1 one wavefront per 4 bytes (template ``SE``; kernels/NOTES.md v25); the slots take
    :func:`tile_shared_bytes`, sized by the weight's longest entry list. ``min_blocks``: the blocks per SM the
    kernel's ``__launch_bounds__`` asks ptxas to fit in registers (template ``MIN_BLOCKS``; 0 names none; a wide
    tiling, :data:`TILE_WIDE_SUMS`, is fixed at two and takes 0 here).
    """

    wx: int
    py: int
    nb: int
    mw: int
    warps: int
    cc: int
    union: int = 1
    paired: bool = False
    stage_entries: bool = False
    min_blocks: int = 0

    def __post_init__(self) -> None:
        """Raises ValueError for a size that is not a positive integer, a ``min_blocks`` that is negative or set on a
        wide tiling, or a ``paired`` or ``stage_entries`` that is not a bool."""
        require_sizes("tiling", wx=self.wx, py=self.py, nb=self.nb, mw=self.mw, warps=self.warps, cc=self.cc,
                      union=self.union)
        if type(self.min_blocks) is not int or self.min_blocks < 0 or (
                self.min_blocks and self.accumulators() > TILE_WIDE_SUMS):
            raise ValueError(f"tiling: min_blocks {self.min_blocks!r} must be an integer >= 0, and 0 for a tiling of "
                             f"more than {TILE_WIDE_SUMS} sums per thread (fixed at two blocks)")
        for name in ("paired", "stage_entries"):
            if type(getattr(self, name)) is not bool:
                raise ValueError(f"tiling: {name} must be a bool, got {getattr(self, name)!r}")

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

    def fuses_epilogue(self, residual: bool = False, half_run: int = 0) -> bool:
        """Whether ``direct_tile`` applies a fused layer's ReLU, and adds its residual where ``residual``, as it
        stores: every tiling but a wide one (:data:`TILE_WIDE_SUMS`), whose kernel stores without them (held to 128
        registers, its extra compare per output made ptxas spill inside the chunk loop, kernels/direct_conv.cu), and
        with a residual none with half2 runs (``half_run`` > 0), whose kernel stores without the residual (its loads
        made ptxas spill in the tilings held to 64 registers); the caller applies them in passes after it."""
        return self.accumulators() <= TILE_WIDE_SUMS and not (residual and half_run > 0)

    def entry_lists(self) -> int:
        """Entry lists (groups of ``union`` output channels) a block walks per chunk, ``WARPS * MW / union``."""
        return self.warps * self.mw // self.union


@dataclass(frozen=True)
class TileLayout:
    """Shared-memory layout of one staged chunk of ``direct_tile``, element units (one element holds
    :func:`images_per_element` images: 1 for float32, 2 for paired float32 (a ``float2``, ``element_bytes`` 8) and
    float16 (a ``__half2``)).

    Element ``(cc, ie, yy, xx)`` sits at ``cc * channel_stride + ie * plane + yy * padded_width + left + xx``.
    ``vector``: rows are staged as 16-byte vectors (``left + pad_w`` a multiple of :attr:`vector_elements`;
    :func:`tile_layout`).
    """

    tile_h: int
    tile_w: int
    padded_width: int
    image_elements: int
    chunk: int
    left: int = 0
    vector: bool = False
    element_bytes: int = 4

    def shared_bytes(self) -> int:
        """Shared memory of the kernel, bytes: two staged chunks (chunk k + 1 streams in by ``cp.async`` while
        chunk k is computed) of ``element_bytes`` elements. ``direct_tile`` takes it as dynamic shared memory
        (:attr:`Launch.shared_bytes`); ``direct_pointwise``'s buffers are static."""
        return 2 * self.elements() * self.element_bytes

    @property
    def vector_elements(self) -> int:
        """Elements of one 16-byte staging vector: 4 of 4 bytes, 2 of 8 bytes."""
        return vector_elements(self.element_bytes)

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


TILE_UNIONS = (1, 3)
"""Output channels per ``direct_tile`` entry (:attr:`TileTiling.union`): an entry is ``(offset, U weights)`` in 8 or
16 bytes (:func:`entry_bytes`), one vector load (``TileEntry<U>`` in the kernel)."""


def entry_bytes(union: int) -> int:
    """Bytes of one ``direct_tile`` entry: an int32 offset and ``union`` weights' 32 bits (8 or 16)."""
    return 4 * (1 + union)


def tile_shared_bytes(layout: TileLayout, tiling: TileTiling, entry_capacity: int = 0) -> int:
    """Dynamic shared memory of one ``direct_tile`` block, bytes: the two staged chunks
    (:meth:`TileLayout.shared_bytes`), and for a ``stage_entries`` tiling, from the next 16-byte boundary, two buffers
    of :meth:`TileTiling.entry_lists` slots of ``entry_capacity`` entries (:func:`entry_bytes`) each, the kernel's
    ``ENTRY_OFFSET`` and ``entry_slots``."""
    if not tiling.stage_entries:
        return layout.shared_bytes()
    chunks = -(-layout.shared_bytes() // 16) * 16
    return chunks + 2 * tiling.entry_lists() * entry_capacity * entry_bytes(tiling.union)


def images_per_element(dtype: torch.dtype, paired: bool = False) -> int:
    """Images one element of ``direct_tile`` holds, in shared memory and in its input: 2 for float16 (a
    ``__half2`` of the image-paired input, :func:`~unsparse.runtime.backends.direct.pair_images`) and for a
    ``paired`` float32 tiling (a ``float2``, :attr:`TileTiling.paired`), else 1."""
    return 2 if dtype == torch.float16 or paired else 1


def tile_layout(dtype: torch.dtype, kernel_size: tuple[int, int], tiling: TileTiling,
                vector_pad: int | None = None) -> TileLayout:
    """The staged chunk layout for ``tiling`` (shared by :func:`tile_launch` and the plan-time offsets).

    The padded row width is ``>= WX + S - 1`` and makes a warp's 32 loads hit 32 distinct banks: any width when a warp
    covers one row (WX = 32), else one congruent to WX modulo 2 * WX (an odd multiple m of WX modulo 32), so that lane
    ``(ly, lx)`` reads bank ``(ly * m * WX + lx) mod 32``, and ``ly * m`` runs over the ``32 / WX`` warp rows modulo
    ``32 / WX`` once (8-byte elements: a half-warp's loads, two banks each, also 32 distinct banks). For WX = 8 that is
    24 elements where the congruence modulo 32 took 40: the staged chunks of the 8-wide tiles take 40 % less shared
    memory (kernels/NOTES.md, forty-eighth session). The width is the smallest conflict-free one except for 8-byte
    elements at WX = 16, where a half-warp reads one row and any width would do (no tiling has that: the paired tilings
    are 32 wide).

    With ``vector_pad`` (the layer's left padding ``pad_w``), rows are laid out for 16-byte staging: column
    ``xx`` at ``left + xx`` with ``left = (-pad_w) mod v`` (``v`` = :attr:`TileLayout.vector_elements`, 4 or 2), so
    the interior columns ``pad_w .. pad_w + 31`` (input columns ``f0 .. f0 + 31``) start on a 16-byte boundary, and
    the row width is a multiple of ``v`` (a warp reads one row, so any width is conflict-free). The layer must also pass
    :func:`vector_staging_reason` and the input be 16-byte aligned.

    Raises:
        ValueError: if WX does not divide 32, NB is not a multiple of the images per element, a size is not
            positive, the union is not one of :data:`TILE_UNIONS`, does not divide MW or is above 1 on float16,
            the tiling is ``paired`` on a dtype other than float32, or a wide tiling (:data:`TILE_WIDE_SUMS`) has
            more than :data:`TILE_WIDE_WARPS` warps; with ``vector_pad``: WX != 32 or ``pad_w`` outside
            ``[0, S - 1]``. These are the kernel's ``static_assert`` checks, named before NVRTC compiles anything.
    """
    (R, S) = kernel_size
    if tiling.wx not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"tiling: WX={tiling.wx} does not divide 32")
    if tiling.accumulators() > TILE_WIDE_SUMS and tiling.warps > TILE_WIDE_WARPS:
        raise ValueError(f"tiling: {tiling.accumulators()} sums per thread (MW * NB * PY) above {TILE_WIDE_SUMS} "
                         f"allow at most {TILE_WIDE_WARPS} warps, got {tiling.warps}")
    if tiling.union not in TILE_UNIONS or tiling.mw % tiling.union or (tiling.union > 1 and dtype != torch.float32):
        raise ValueError(f"tiling: union {tiling.union} must be one of {TILE_UNIONS}, divide MW={tiling.mw} and be 1 "
                         f"on {dtype}")
    if tiling.paired and dtype != torch.float32:
        raise ValueError(f"tiling: paired is a float32 choice (float16 elements always pair images), got {dtype}")
    if min(R, S, tiling.py, tiling.nb, tiling.mw, tiling.warps, tiling.cc) < 1:
        raise ValueError(f"tiling: every size must be positive, got {tiling} with kernel {kernel_size}")
    ipe = images_per_element(dtype, tiling.paired)
    if tiling.nb % ipe:
        raise ValueError(f"tiling: NB={tiling.nb} is not a multiple of {ipe} images per element ({dtype})")
    te, tf = tiling.tile_hw
    element_bytes = dtype.itemsize * ipe
    if vector_pad is not None:
        if tiling.wx != 32 or not 0 <= vector_pad <= S - 1:
            raise ValueError(f"tiling: 16-byte staging needs WX=32 and 0 <= pad_w <= S-1, got WX={tiling.wx}, "
                             f"pad_w={vector_pad}, S={S}")
        ve = vector_elements(element_bytes)
        left = -vector_pad % ve
        width = left + tf + S - 1
        return TileLayout(te + R - 1, tf + S - 1, width + -width % ve, tiling.nb // ipe, tiling.cc, left, True,
                          element_bytes)
    width = tf + S - 1
    if tiling.wy > 1:
        width += (tiling.wx - width) % (2 * tiling.wx)
    return TileLayout(te + R - 1, tf + S - 1, width, tiling.nb // ipe, tiling.cc, element_bytes=element_bytes)


def tile_shared_limit(device: torch.device) -> int:
    """Bytes of dynamic shared memory a ``direct_tile`` block may take on ``device``: :data:`TILE_SHARED_LIMIT_BYTES`,
    or the GPU's per-block opt-in limit where that is lower (sm_75: 64 KB); the constant off CUDA (planning and
    CPU tests)."""
    if device.type != "cuda":
        return TILE_SHARED_LIMIT_BYTES
    return min(TILE_SHARED_LIMIT_BYTES, torch.cuda.get_device_properties(device).shared_memory_per_block_optin)


def vector_staging_reason(width: int, kernel_size: tuple[int, int], padding: tuple[int, int]) -> str | None:
    """Why a layer cannot stage 16-byte vectors in ``direct_tile``, or None if it can: input ``width % 4 == 0``
    (a vector is 4 elements, every vector of a row wholly inside or outside the image) and ``pad_w <= S - 1``
    (the interior fits the staged row). The input must also be 16-byte aligned, which only the call can tell
    (the image-paired float16 input always is)."""
    if width % 4:
        return f"input width {width} is not a multiple of 4"
    if not 0 <= padding[1] <= kernel_size[1] - 1:
        return f"pad_w={padding[1]} outside [0, S-1]"
    return None


def tile_launch(dtype: torch.dtype, batch: int, out_channels: int, out_hw: tuple[int, int],
                kernel_size: tuple[int, int], tiling: TileTiling, vector_pad: int | None = None,
                half_run: int = 0, shared_limit: int = TILE_SHARED_LIMIT_BYTES, entry_capacity: int = 0) -> Launch:
    """Geometry of ``direct_tile``: grid ``(channel groups * output tiles, ceil(N / NB))``, channel groups
    fastest so that the blocks staging one input tile run together and find it in L2. ``vector_pad``: the
    16-byte staging layout of :func:`tile_layout` (template arguments LEFT and VEC). ``half_run``: 0 for float32
    products, else the longest run of float16 (``HFMA2``) products summed before each float32 addition
    (template ``HALF_RUN``, :data:`HALF2_RUN`). ``shared_limit``: bytes of shared memory a block may take on the
    GPU that runs it (:func:`tile_shared_limit`). ``entry_capacity``: for a ``stage_entries`` tiling, the entries of
    each list's slot (at least the longest (group, chunk) list of the weight; the kernel's ``entry_capacity``), else 0.

    Raises:
        ValueError: for an invalid tiling (:func:`tile_layout`), more than 1024 threads, a non-positive
            size, shared memory (:func:`tile_shared_bytes`) beyond ``shared_limit`` (bytes), a grid beyond CUDA's
            limits, a negative ``half_run`` or a positive one on a dtype other than float16, or an
            ``entry_capacity`` that is negative, not an integer, or nonzero without ``stage_entries``.
    """
    (E, F_), (R, S) = out_hw, kernel_size
    if half_run < 0 or (half_run and dtype != torch.float16):
        raise ValueError(f"half_run: {half_run} needs float16 storage and a non-negative run, got {dtype}")
    if type(entry_capacity) is not int or entry_capacity < 0 or (entry_capacity and not tiling.stage_entries):
        raise ValueError(f"entry_capacity: {entry_capacity!r} must be an integer >= 0, and 0 unless the tiling "
                         "stages its entries")
    layout = tile_layout(dtype, kernel_size, tiling, vector_pad)
    if min(batch, out_channels, E, F_) < 1:
        raise ValueError("tile_launch: every size must be positive")
    if tiling.warps * 32 > 1024:
        raise ValueError(f"tiling: {tiling.warps} warps exceed 1024 threads")
    shared = tile_shared_bytes(layout, tiling, entry_capacity)
    if shared > shared_limit:
        raise ValueError(f"tiling: staged chunks and entries of {shared} bytes exceed the {shared_limit} bytes of "
                         "shared memory a block may take")
    te, tf = tiling.tile_hw
    groups = math.ceil(out_channels / tiling.channels)
    grid = (groups * math.ceil(E / te) * math.ceil(F_ / tf), math.ceil(batch / tiling.nb), 1)
    _check_grid(grid)
    name = (f"direct_tile<{cuda_type(dtype)},{R},{S},{tiling.wx},{tiling.py},{tiling.nb},{tiling.mw},"
            f"{tiling.warps},{tiling.cc},{layout.padded_width},{layout.left},{int(layout.vector)},{half_run},"
            f"{tiling.union},{images_per_element(dtype, tiling.paired)},{int(tiling.stage_entries)},"
            f"{tiling.min_blocks}>")
    return Launch(name, grid, (tiling.warps * 32, 1, 1), shared)


@dataclass(frozen=True)
class PointwiseTiling:
    """One ``direct_pointwise`` instantiation (without dtype): a block owns ``WARPS * MW`` output channels and
    ``128 * PV`` consecutive flattened columns ``n * P + p``; lane ``l`` owns columns ``4 * l + 128 * v``
    (``v < PV``) of ``MW`` channels; ``CC`` input channels are staged at a time."""

    pv: int
    mw: int
    warps: int
    cc: int

    def __post_init__(self) -> None:
        """Raises ValueError for a size that is not a positive integer."""
        require_sizes("tiling", pv=self.pv, mw=self.mw, warps=self.warps, cc=self.cc)

    @property
    def columns(self) -> int:
        """Flattened columns per block, ``TJ = 128 * PV``."""
        return 128 * self.pv

    @property
    def channels(self) -> int:
        """Output channels per block, ``WARPS * MW``."""
        return self.warps * self.mw

    def accumulators(self) -> int:
        """float32 partial sums per thread, ``MW * 4 * PV``."""
        return self.mw * 4 * self.pv


def pointwise_unit(dtype: torch.dtype, vector: bool) -> int:
    """Columns one staging copy of ``direct_pointwise`` moves: a 16-byte vector (4 float32, 8 float16) or 1."""
    return vector_elements(dtype.itemsize) if vector else 1


def pointwise_layout(dtype: torch.dtype, tiling: PointwiseTiling, vector: bool) -> TileLayout:
    """The staged chunk of ``direct_pointwise`` as a :class:`TileLayout`: ``CC`` rows of ``TJ`` elements of
    the storage dtype (a 1x1 "tile" whose padded width is TJ), two buffers; so input channel ``cc`` of a chunk
    starts at element ``cc * TJ`` and :func:`~unsparse.runtime.backends.direct_arrays.prepare_tile` builds its
    offsets.

    Raises:
        ValueError: for a non-positive size, or a block whose threads do not divide into whole staged rows
            (``WARPS * 32`` must be a multiple of ``TJ / unit``, :func:`pointwise_unit`).
    """
    if min(tiling.pv, tiling.mw, tiling.warps, tiling.cc) < 1:
        raise ValueError(f"tiling: every size must be positive, got {tiling}")
    copies_per_row = tiling.columns // pointwise_unit(dtype, vector)
    if (tiling.warps * 32) % copies_per_row:
        raise ValueError(f"tiling: {tiling.warps * 32} threads do not divide into rows of {copies_per_row} copies")
    element_bytes = dtype.itemsize
    return TileLayout(1, 1, tiling.columns, 1, tiling.cc, vector=vector, element_bytes=element_bytes)


def pointwise_vector_reason(dtype: torch.dtype, pixels: int) -> str | None:
    """Why a 1x1 layer cannot stage 16-byte vectors in ``direct_pointwise``, or None if it can: the plane
    ``P = H * W`` must be a multiple of the vector's columns (4 float32, 8 float16), so that no vector spans
    two images. The input must also be 16-byte aligned, which only the call can tell."""
    unit = pointwise_unit(dtype, True)
    if pixels % unit:
        return f"plane of {pixels} pixels is not a multiple of {unit}"
    return None


def split_chunks(in_channels: int, chunk: int, splits: int) -> tuple[int, int]:
    """Split-K of ``direct_pointwise``: ``(chunks per split, splits launched)`` for ``splits`` requested over
    the ``K = ceil(in_channels / chunk)`` staged chunks; every launched split gets at least one chunk, so fewer
    than ``splits`` may be launched.

    Raises:
        ValueError: for a non-positive size.
    """
    if min(in_channels, chunk, splits) < 1:
        raise ValueError(f"splits: need positive sizes, got {in_channels} channels, chunk {chunk}, {splits} splits")
    chunks = math.ceil(in_channels / chunk)
    per_split = math.ceil(chunks / min(splits, chunks))
    return per_split, math.ceil(chunks / per_split)


def pointwise_launch(dtype: torch.dtype, batch: int, out_channels: int, pixels: int, tiling: PointwiseTiling,
                     vector: bool, splits: int = 1) -> Launch:
    """Geometry of ``direct_pointwise``: grid ``(channel groups * column tiles, splits)`` over the ``N * P``
    flattened columns, channel groups fastest (as :func:`tile_launch`). With ``splits > 1`` (launched splits,
    :func:`split_chunks`) the kernel writes float32 partial sums, one ``(N, M, P)`` slice per split.

    Raises:
        ValueError: for an invalid tiling (:func:`pointwise_layout`), more than 1024 threads, a non-positive
            size, ``batch * pixels >= 2**31`` (the kernel indexes columns in int32), staged chunks beyond
            :data:`SHARED_LIMIT_BYTES`, or a grid beyond CUDA's limits.
    """
    layout = pointwise_layout(dtype, tiling, vector)
    if min(batch, out_channels, pixels, splits) < 1:
        raise ValueError("pointwise_launch: every size must be positive")
    if batch * pixels >= 2**31:
        raise ValueError(f"pointwise_launch: {batch} x {pixels} columns exceed int32 column indexing")
    if tiling.warps * 32 > 1024:
        raise ValueError(f"tiling: {tiling.warps} warps exceed 1024 threads")
    if layout.shared_bytes() > SHARED_LIMIT_BYTES:
        raise ValueError(f"tiling: staged chunks of {layout.shared_bytes()} bytes exceed {SHARED_LIMIT_BYTES}")
    groups = math.ceil(out_channels / tiling.channels)
    grid = (groups * math.ceil(batch * pixels / tiling.columns), splits, 1)
    _check_grid(grid)
    output = "float" if splits > 1 else cuda_type(dtype)
    name = (f"direct_pointwise<{cuda_type(dtype)},{tiling.pv},{tiling.mw},{tiling.warps},{tiling.cc},"
            f"{int(vector)},{output}>")
    return Launch(name, grid, (tiling.warps * 32, 1, 1))


PADDING_THREADS = 256
"""Threads per block of ``pad_planes`` (8 warps)."""

PADDING_ROWS = 4
"""Padded rows each warp of ``pad_planes`` writes: its lanes hold one element of each in flight."""


def padding_launch(dtype: torch.dtype, planes: int, padded_hw: tuple[int, int]) -> Launch:
    """Geometry of ``pad_planes``, the kernel that writes ``planes`` zero-padded float32 planes of a padded size
    ``(HP, WP)``, the ``N * C`` input planes or their ``N * C * P_h * P_w`` phase images for a strided layer:
    :data:`PADDING_THREADS` threads per block, each warp writing :data:`PADDING_ROWS` consecutive rows of the
    ``planes * HP`` padded rows, grid ``ceil(planes * HP / (PADDING_ROWS * PADDING_THREADS / 32))``.

    Raises:
        ValueError: for a non-positive size, a dtype without an instantiation (:func:`cuda_type`), or
            ``planes * HP`` padded rows at or above ``2**31`` (the kernel counts rows in 32 bits).
    """
    require_sizes("padding", planes=planes, rows=padded_hw[0], columns=padded_hw[1])
    rows = planes * padded_hw[0]
    if rows >= 2**31:
        raise ValueError(f"padding: {planes} planes of {padded_hw[0]} padded rows ({rows}) reach 2**31")
    grid = (math.ceil(rows / (PADDING_ROWS * PADDING_THREADS // 32)), 1, 1)
    return Launch(f"pad_planes<{cuda_type(dtype)},{PADDING_ROWS}>", grid, (PADDING_THREADS, 1, 1))


PAIRING_THREADS = 256
"""Threads per block of ``pair_images`` (each moves one 16-byte vector of two images) and of
``phase_pair_images`` (each moves ``s_w`` elements of two images)."""


def pairing_launch(dtype: torch.dtype, batch: int, image_elements: int, vector: bool) -> Launch:
    """Geometry of ``pair_images``, the kernel that re-lays ``(N, P)`` images as ``(ceil(N/2), P, 2)`` pairs
    (``P = C * H * W``): grid ``(ceil(P / (unit * PAIRING_THREADS)), ceil(N / 2))``, ``unit = 16 / itemsize``
    elements per thread (4 float32, 8 float16), :data:`PAIRING_THREADS` threads per block. ``vector``: 16-byte
    loads and stores, which need ``P`` a multiple of ``unit`` and a 16-byte aligned input (:func:`pairing_vector`).

    Raises:
        ValueError: for a non-positive size, ``P >= 2**31``, or a grid beyond CUDA's limits.
    """
    if min(batch, image_elements) < 1:
        raise ValueError("pairing_launch: every size must be positive")
    if image_elements >= 2**31:
        raise ValueError(f"pairing_launch: {image_elements} elements per image exceed int32 indexing")
    unit = vector_elements(dtype.itemsize)
    grid = (math.ceil(image_elements / (unit * PAIRING_THREADS)), math.ceil(batch / 2), 1)
    _check_grid(grid)
    return Launch(f"pair_images<{cuda_type(dtype)},{int(vector)}>", grid, (PAIRING_THREADS, 1, 1))


def phase_pairing_launch(dtype: torch.dtype, batch: int, channels: int, phase_hw: tuple[int, int],
                         stride: tuple[int, int]) -> Launch:
    """Geometry of ``phase_pair_images``, the kernel that writes a strided layer's phase images
    (:meth:`~unsparse.sparse.phases.PhaseSplit.input`, every phase) as image pairs in one pass: ``(N, C, H, W)``
    to ``(ceil(N/2), C * s_h * s_w, HQ, WQ, 2)`` with ``phase_hw = (HQ, WQ)``. One thread per (channel, row, phase
    column) of an image pair's input padded to ``HQ * s_h`` rows, each moving ``s_w`` input columns: grid
    ``(ceil(C * HQ * s_h * WQ / PAIRING_THREADS), ceil(N / 2))``, :data:`PAIRING_THREADS` threads per block.

    Raises:
        ValueError: for a non-positive size, an image of ``2**31`` or more padded elements, or a grid beyond CUDA's
            limits.
    """
    threads = channels * phase_hw[0] * stride[0] * phase_hw[1]
    if min(batch, threads, stride[1]) < 1:
        raise ValueError("phase_pairing_launch: every size must be positive")
    if threads * stride[1] >= 2**31:
        raise ValueError(f"phase_pairing_launch: {threads * stride[1]} padded elements per image exceed int32 "
                         "indexing")
    grid = (math.ceil(threads / PAIRING_THREADS), math.ceil(batch / 2), 1)
    _check_grid(grid)
    return Launch(f"phase_pair_images<{cuda_type(dtype)}>", grid, (PAIRING_THREADS, 1, 1))


def pairing_vector(image_bytes: int, aligned: bool) -> bool:
    """Whether ``pair_images`` can move images of ``image_bytes`` bytes each in 16-byte vectors: a whole number of
    vectors per image, and the input's data ``aligned`` to 16 bytes (:func:`vector_aligned`)."""
    return aligned and image_bytes % VECTOR_BYTES == 0


def _check_grid(grid: tuple[int, int, int]) -> None:
    if grid[0] >= 2**31 or grid[1] >= 2**16 or grid[2] >= 2**16:
        raise ValueError(f"grid: {grid} exceeds CUDA's grid limits")
