"""CPU tests of the direct backend: launch geometry, plan-time arrays and their validation, an emulation of
the kernels' index arithmetic against ``F.conv2d``, tuning spaces, and an nvcc compile of the .cu file."""

from __future__ import annotations

import ctypes
import itertools
import math
import re
import shutil
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from unsparse.runtime import cupy_launcher as cl
from unsparse.runtime import launch_geometry as lg
from unsparse.runtime.backends.direct import (
    DirectBackend,
    DirectHalf2Backend,
    aligned_copy,
    bind_phase_pairing,
    is_pointwise,
    kernel_residual,
    pair_images,
    stride_one_reason,
)
from unsparse.runtime.backends.direct_arrays import (
    TileArrays,
    check_capacity,
    longest_list,
    prepare_rows,
    prepare_tile,
    validate_rows,
    validate_tile,
)
from unsparse.runtime.backends.direct_space import (
    POINTWISE_SPLITS,
    TILE_TILINGS,
    pointwise_space,
    rows_space,
    tile_space,
    tiling_of,
)
from unsparse.sparse import ConvGeometry, UniformCSR
from unsparse.sparse.phases import PhaseSplit, phase_split

# (N, C, H, W, M, R, S, stride, padding, dilation)
GEOMETRIES = [(2, 3, 9, 11, 5, 3, 3, 1, 1, 1), (3, 4, 13, 10, 6, 3, 3, 2, 1, 1), (2, 5, 8, 8, 7, 1, 1, 1, 0, 1),
              (1, 3, 23, 23, 4, 11, 11, 4, 2, 1), (2, 3, 12, 14, 5, 3, 3, 1, 2, 2), (2, 4, 1, 19, 3, 1, 5, 1, 2, 1)]


def layer(case: tuple, sparsity: float = 0.7, seed: int = 0):
    N, C, H, W, M, R, S, stride, padding, dilation = case
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(M, C, R, S, generator=gen, dtype=torch.float64)
    weight[torch.rand(weight.shape, generator=gen, dtype=torch.float64) < sparsity] = 0
    x = torch.randn(N, C, H, W, generator=gen, dtype=torch.float64)
    if H == 1:
        geometry = ConvGeometry.of((1, stride), (0, padding), (1, dilation))
    else:
        geometry = ConvGeometry.of(stride, padding, dilation)
    return x, UniformCSR.from_dense(weight), geometry, F.conv2d(x, weight, None, geometry.stride,
                                                                 geometry.padding, geometry.dilation)


def emulate_rows(x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry, threads: int, pixels: int,
                 sub_batch: int, channels: int) -> torch.Tensor:
    """``direct_rows`` in Python: same grid, thread-to-pixel map, bounds check and addresses."""
    N, C, H, W = x.shape
    E, F_ = geometry.output_size(H, W, csr.kernel_size)
    spec = lg.rows_launch(torch.float32, N, csr.out_channels, E * F_, threads, pixels, sub_batch, channels)
    arrays = prepare_rows(csr, geometry, (H, W))
    flat = x.reshape(N, -1)
    out = torch.full((N, csr.out_channels, E * F_), float("nan"), dtype=x.dtype)
    gx, gy, gz = spec.grid
    for bx, by, bz in [(a, b, c) for a in range(gx) for b in range(gy) for c in range(gz)]:
        t = torch.arange(threads)[:, None]
        p = (bx * pixels + torch.arange(pixels)[None, :]) * threads + t  # (threads, PB)
        live = p < E * F_
        e, f = torch.where(live, p // F_, 0), torch.where(live, p % F_, 0)
        iy0, ix0 = e * geometry.stride[0] - geometry.padding[0], f * geometry.stride[1] - geometry.padding[1]
        n0 = bz * sub_batch
        images = min(sub_batch, N - n0)
        for m in range(by * channels, min(csr.out_channels, (by + 1) * channels)):
            acc = torch.zeros(images, *p.shape, dtype=x.dtype)
            for j in range(csr.row_length):
                off, tap, w = int(arrays.offsets[m, j]), int(arrays.taps[m, j]), csr.values[m, j]
                dy, dx = tap >> lg.TAP_SHIFT_BITS, tap & ((1 << lg.TAP_SHIFT_BITS) - 1)
                inside = live & (iy0 + dy >= 0) & (iy0 + dy < H) & (ix0 + dx >= 0) & (ix0 + dx < W)
                address = torch.where(inside, off + iy0 * W + ix0, 0)
                assert int(address.max()) < C * H * W and int(address.min()) >= 0
                acc += w * torch.where(inside, flat[n0:n0 + images, address], 0)
            for b in range(images):
                out[n0 + b, m, p[live]] = acc[b][live]
    return out.reshape(N, csr.out_channels, E, F_)


def staged_columns(layout: lg.TileLayout, tiling: lg.TileTiling, pad_w: int) -> list[list[int]]:
    """The columns ``xx`` each copy of one staged row writes, in the kernel's order: scalar staging one column
    per copy; 16-byte staging (``layout.vector``) the WX / v interior vectors of v columns (v = 4 elements of 4
    bytes, 2 of 8), then the halo."""
    if not layout.vector:
        return [[xx] for xx in range(layout.tile_w)]
    halo, ve = layout.tile_w - tiling.wx, layout.vector_elements
    return ([[pad_w + ve * v + i for i in range(ve)] for v in range(tiling.wx // ve)]
            + [[h if h < pad_w else h + tiling.wx] for h in range(halo)])


def emulate_tile(x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry, tiling: lg.TileTiling,
                 dtype: torch.dtype = torch.float32, vector: bool = False,
                 out_hw: tuple[int, int] | None = None, half_run: int = 0) -> torch.Tensor:
    """``direct_tile`` in Python: grid decode, staged chunk in the kernel's flat layout (zero halo, images
    packed per element; with ``vector`` the 16-byte copies, each wholly inside or outside the image and
    16-byte aligned in shared memory), per-(row, chunk) entries, lane-to-output map and every shared-memory
    index checked against the chunk's size. ``out_hw``: the outputs to compute (default: the geometry's).
    ``half_run``: half2 products (weights decoded from the ``__half2`` entries), each product added to a float16
    partial sum with one rounding (``HFMA2``), runs of at most ``half_run`` entries added to the accumulators.
    ``tiling.union`` > 1: the warp walks its rows in groups of U, each entry feeding the group's U channels.
    ``tiling.paired`` (float32): two images per element, as float16 always has. ``tiling.stage_entries``: per chunk
    every warp's lists are first copied into the block's slots (``longest_list`` entries per list, each copy
    checked to stay in its own list's slot), and the entries are then read from the slots."""
    N, C, H, W = x.shape
    R, S = csr.kernel_size
    E, F_ = out_hw or geometry.output_size(H, W, csr.kernel_size)
    pad = geometry.padding[1] if vector else None
    layout = lg.tile_layout(dtype, (R, S), tiling, pad)
    union = tiling.union
    capacity = longest_list(csr, tiling.cc, union) if tiling.stage_entries else 0
    spec = lg.tile_launch(dtype, N, csr.out_channels, (E, F_), (R, S), tiling, pad, half_run, entry_capacity=capacity)
    arrays = prepare_tile(csr, layout, half2=half_run > 0, union=union)
    if tiling.stage_entries:  # the slots start at the first 16-byte boundary after the two chunks
        slot_bytes = 2 * tiling.entry_lists() * capacity * lg.entry_bytes(union)
        assert spec.shared_bytes == -(-layout.shared_bytes() // 16) * 16 + slot_bytes
    ipe = lg.images_per_element(dtype, tiling.paired)
    (te, tf), wy = tiling.tile_hw, tiling.wy
    tiles_f, groups, K = math.ceil(F_ / tf), math.ceil(csr.out_channels / tiling.channels), math.ceil(C / tiling.cc)
    ph, pw = geometry.padding
    lane = torch.arange(32)
    ly, lx = lane // tiling.wx, lane % tiling.wx
    base = ly * layout.padded_width + layout.left + lx
    py = torch.arange(tiling.py)
    out = torch.full((N, csr.out_channels, E, F_), float("nan"), dtype=x.dtype)
    for bx, by in [(a, b) for a in range(spec.grid[0]) for b in range(spec.grid[1])]:
        group, tile_id = bx % groups, bx // groups
        e0, f0, n0 = (tile_id // tiles_f) * te, (tile_id % tiles_f) * tf, by * tiling.nb
        acc = torch.zeros(spec.block[0] // 32, tiling.mw, tiling.nb, tiling.py, 32, dtype=x.dtype)
        for k in range(K):
            chunk = torch.full((layout.elements(), ipe), float("nan"), dtype=x.dtype)  # unstaged reads show
            for cc, ie, yy, columns in [(a, b, c, d) for a in range(tiling.cc) for b in range(layout.image_elements)
                                        for c in range(layout.tile_h) for d in staged_columns(layout, tiling, pw)]:
                c, iy = k * tiling.cc + cc, e0 + yy - ph
                row = cc * layout.channel_stride + ie * layout.plane + yy * layout.padded_width + layout.left
                inside = [c < C and 0 <= iy < H and 0 <= f0 + xx - pw < W for xx in columns]
                assert len(set(inside)) == 1, "a copy straddles the image border"
                aligned = (row + columns[0]) * layout.element_bytes % 16 == 0
                assert len(columns) == 1 or aligned, "a 16-byte copy is not aligned"
                for xx, q in [(a, b) for a in columns for b in range(ipe)]:
                    n = n0 + ie * ipe + q
                    live = inside[0] and n < N
                    chunk[row + xx, q] = x[n, c, iy, f0 + xx - pw] if live else 0.0
            lists_of = {}  # (warp, g) -> (entry source, begin, end)
            slots = torch.full((tiling.entry_lists() * capacity, 1 + union), -1, dtype=torch.int32)
            for warp, g in [(a, b) for a in range(spec.block[0] // 32) for b in range(tiling.mw // union)]:
                m = group * tiling.channels + warp * tiling.mw + g * union
                if m >= csr.out_channels:
                    continue
                assert m % union == 0
                lists = m // union * K + k
                begin, end = int(arrays.chunk_ptr[lists]), int(arrays.chunk_ptr[lists + 1])
                lists_of[warp, g] = (arrays.entries, begin, end)
                if tiling.stage_entries:
                    first = (warp * (tiling.mw // union) + g) * capacity
                    assert end - begin <= capacity, "a list overflows its slot"
                    assert bool((slots[first:first + end - begin] == -1).all()), "two lists share slots"
                    slots[first:first + end - begin] = arrays.entries[begin:end]
                    lists_of[warp, g] = (slots, first, first + end - begin)
            for warp in range(spec.block[0] // 32):
                for g in range(tiling.mw // union):
                    if (warp, g) not in lists_of:
                        break
                    source, begin, end = lists_of[warp, g]
                    for run in range(begin, end, half_run or max(end - begin, 1)):
                        partial = torch.zeros_like(acc[warp, g * union:(g + 1) * union])
                        for t in range(run, min(end, run + (half_run or end))):
                            offset = int(source[t, 0])
                            if half_run:
                                pairs = source[t, 1:].contiguous().view(torch.float16).reshape(union, 2)
                                assert torch.equal(pairs[:, 0], pairs[:, 1]), "a __half2 weight holds w twice"
                                weights = pairs[:, 0].to(x.dtype)
                            else:
                                weights = source[t, 1:].contiguous().view(torch.float32).to(x.dtype)
                            for ie in range(layout.image_elements):
                                rows = (py * wy * layout.padded_width)[:, None]
                                index = offset + base[None, :] + ie * layout.plane + rows
                                assert int(index.min()) >= 0 and int(index.max()) < layout.elements()
                                for u, q in [(a, b) for a in range(union) for b in range(ipe)]:
                                    partial[u, ie * ipe + q] += weights[u] * chunk[index, q]
                                    if half_run:  # one rounding per fused multiply-add
                                        partial[u, ie * ipe + q] = partial[u, ie * ipe + q].half().to(x.dtype)
                        acc[warp, g * union:(g + 1) * union] += partial
        for warp, j, b in [(a, b, c) for a in range(spec.block[0] // 32) for b in range(tiling.mw)
                           for c in range(tiling.nb)]:
            m, n = group * tiling.channels + warp * tiling.mw + j, n0 + b
            if m >= csr.out_channels or n >= N:
                continue
            e, f = e0 + ly[None, :] + py[:, None] * wy, (f0 + lx)[None, :].expand(tiling.py, 32)
            live = (e < E) & (f < F_)
            out[n, m, e[live], f[live]] = acc[warp, j, b][live]
    return out


def emulate_pointwise(x: torch.Tensor, csr: UniformCSR, tiling: lg.PointwiseTiling,
                      dtype: torch.dtype = torch.float32, vector: bool = False, splits: int = 1) -> torch.Tensor:
    """``direct_pointwise`` in Python: grid decode over the flattened ``n * P + p`` columns, each thread's
    fixed staging unit and its rows of every chunk (a 16-byte copy wholly inside one image and aligned in
    shared memory), the per-(row, chunk) entries, the lanes' 4-column groups, every shared-memory index
    checked against the chunk's size, and the output decode; with ``splits``, split-K: each block row walks its
    range of chunks into its own output slice, and the slices are summed."""
    N, C, H, W = x.shape
    P, M = H * W, csr.out_channels
    J = N * P
    layout = lg.pointwise_layout(dtype, tiling, vector)
    per_split, launched = lg.split_chunks(C, tiling.cc, splits)
    spec = lg.pointwise_launch(dtype, N, M, P, tiling, vector, launched)
    arrays = prepare_tile(csr, layout)
    unit, tj, threads = lg.pointwise_unit(dtype, vector), tiling.columns, spec.block[0]
    copies_per_row = tj // unit
    groups, K = math.ceil(M / tiling.channels), math.ceil(C / tiling.cc)
    flat = x.reshape(N, C, P)
    lane_columns = 4 * torch.arange(32)[:, None] + torch.arange(4)[None, :]  # (lane, i)
    out = torch.full((spec.grid[1], N, M, P), float("nan"), dtype=x.dtype)
    for bx, by in [(a, b) for a in range(spec.grid[0]) for b in range(spec.grid[1])]:
        group, j0 = bx % groups, (bx // groups) * tj
        acc = torch.zeros(tiling.warps, tiling.mw, tiling.pv, 32, 4, dtype=x.dtype)
        for k in range(by * per_split, min(K, (by + 1) * per_split)):
            chunk = torch.full((layout.elements(),), float("nan"), dtype=x.dtype)  # unstaged reads show
            for thread in range(threads):
                first = j0 + (thread % copies_per_row) * unit
                for row in range(thread // copies_per_row, tiling.cc, threads // copies_per_row):
                    c = k * tiling.cc + row
                    live = first < J and c < C
                    dst = row * tj + (thread % copies_per_row) * unit
                    assert dst * layout.element_bytes % (16 if vector else layout.element_bytes) == 0
                    assert not (vector and live) or (first + unit - 1) // P == first // P, "a copy spans images"
                    for j in range(first, first + unit):
                        chunk[dst + j - first] = flat[j // P, c, j % P] if live else 0.0
            for warp, row in [(a, b) for a in range(tiling.warps) for b in range(tiling.mw)]:
                m = group * tiling.channels + warp * tiling.mw + row
                if m >= M:
                    break
                for t in range(int(arrays.chunk_ptr[m * K + k]), int(arrays.chunk_ptr[m * K + k + 1])):
                    offset = int(arrays.entries[t, 0])
                    w = float(arrays.entries[t, 1:2].view(torch.float32))
                    for v in range(tiling.pv):
                        index = offset + 128 * v + lane_columns
                        assert int(index.min()) >= 0 and int(index.max()) < layout.elements()
                        acc[warp, row, v] += w * chunk[index]
        for warp, row, v in [(a, b, c) for a in range(tiling.warps) for b in range(tiling.mw)
                             for c in range(tiling.pv)]:
            m = group * tiling.channels + warp * tiling.mw + row
            columns = j0 + 128 * v + lane_columns
            live = columns < J
            if m < M:
                out[by, columns[live] // P, m, columns[live] % P] = acc[warp, row, v][live]
    return out.sum(0).reshape(N, M, H, W)


# (N, C, H, W, M): several column tiles with a partial last one, partial chunks and channel groups
POINTWISE_CASES = [(3, 5, 10, 10, 7), (2, 7, 7, 7, 9), (1, 3, 4, 8, 2), (2, 3, 8, 9, 5)]
POINTWISE_SETTINGS = [(lg.PointwiseTiling(pv=1, mw=2, warps=2, cc=2), torch.float32, True),
                      (lg.PointwiseTiling(pv=2, mw=3, warps=1, cc=3), torch.float16, True),
                      (lg.PointwiseTiling(pv=1, mw=2, warps=4, cc=2), torch.float32, False),
                      (lg.PointwiseTiling(pv=2, mw=1, warps=8, cc=4), torch.float16, False)]


@pytest.mark.parametrize(("case", "tiling", "dtype", "vector"), [
    (case, *setting) for case in POINTWISE_CASES for setting in POINTWISE_SETTINGS
    if not setting[2] or lg.pointwise_vector_reason(setting[1], case[2] * case[3]) is None])
def test_pointwise_emulation_matches_conv2d(case: tuple, tiling: lg.PointwiseTiling, dtype: torch.dtype,
                                            vector: bool) -> None:
    N, C, H, W, M = case
    x, csr, _, ref = layer((N, C, H, W, M, 1, 1, 1, 0, 1), sparsity=0.6, seed=sum(case))
    out = emulate_pointwise(x, csr, tiling, dtype, vector)
    assert torch.allclose(out, ref, atol=1e-5)  # the entries hold float32 weights


@pytest.mark.parametrize("splits", [2, 3, 4, 16])
def test_pointwise_split_k_emulation_matches_conv2d(splits: int) -> None:
    x, csr, _, ref = layer((1, 21, 4, 6, 7, 1, 1, 1, 0, 1), sparsity=0.5, seed=splits)
    tiling = lg.PointwiseTiling(pv=1, mw=2, warps=4, cc=2)  # K = 11 chunks
    out = emulate_pointwise(x, csr, tiling, splits=splits)
    assert torch.allclose(out, ref, atol=1e-5)


def test_split_chunks_cover_every_chunk_once() -> None:
    assert lg.split_chunks(1024, 32, 16) == (2, 16)
    assert lg.split_chunks(96, 32, 16) == (1, 3)  # no more splits than chunks
    assert lg.split_chunks(100, 16, 4) == (2, 4)  # 7 chunks: 2 + 2 + 2 + 1
    assert lg.split_chunks(64, 16, 3) == (2, 2)  # 4 chunks in splits of 2: two launched
    with pytest.raises(ValueError, match="splits"):
        lg.split_chunks(64, 16, 0)
    spec = lg.pointwise_launch(torch.float16, 1, 256, 196, lg.PointwiseTiling(1, 8, 8, 32), True, 16)
    assert spec.grid == (4 * 2, 16, 1) and spec.name == "direct_pointwise<__half,1,8,8,32,1,float>"
    space = pointwise_space(1, 256, 196, torch.float32, vector=True, in_channels=1024)
    assert {p.get("splits", 1) for p in space} == {1, *POINTWISE_SPLITS}
    assert not any("splits" in p for p in pointwise_space(128, 256, 196, torch.float32, in_channels=1024))


def test_pointwise_eligibility_and_launch() -> None:
    assert lg.pointwise_vector_reason(torch.float32, 196) is None
    assert "multiple of 8" in lg.pointwise_vector_reason(torch.float16, 196)
    assert "multiple of 4" in lg.pointwise_vector_reason(torch.float32, 49)
    with pytest.raises(ValueError, match="threads"):
        lg.pointwise_layout(torch.float32, lg.PointwiseTiling(pv=1, mw=8, warps=2, cc=32), vector=False)
    spec = lg.pointwise_launch(torch.float32, 128, 256, 196, lg.PointwiseTiling(1, 8, 16, 32), vector=True)
    assert spec.grid == (2 * 196, 1, 1) and spec.block == (512, 1, 1)
    assert spec.name == "direct_pointwise<float,1,8,16,32,1,float>"
    layout = lg.pointwise_layout(torch.float16, lg.PointwiseTiling(2, 4, 16, 16), vector=True)
    assert (layout.channel_stride, layout.shared_bytes()) == (256, 2 * 16 * 256 * 2)
    backend = DirectBackend()
    csr = UniformCSR.from_dense(torch.randn(8, 4, 1, 1))
    x = torch.zeros(2, 4, 14, 14)
    space = backend.tuning_space(x, csr, ConvGeometry.of(1, 0))
    assert any(p["variant"] == "pointwise" and p.get("stage") == "vector" for p in space)
    assert all(p in pointwise_space(2, 8, 196, torch.float32, prune=False, vector=True)
               for p in space if p["variant"] == "pointwise")
    # Stride 2 runs on the one-phase split (a 7x7 plane: no 16-byte staging); padded 1x1 layers do not.
    strided = [p for p in backend.tuning_space(x, csr, ConvGeometry.of(2, 0)) if p["variant"] == "pointwise"]
    assert strided and all(p in pointwise_space(2, 8, 49, torch.float32, prune=False, in_channels=4)
                           for p in strided)
    for geometry in (ConvGeometry.of(1, 1), ConvGeometry.of(2, 1)):
        assert not any(p["variant"] == "pointwise" for p in backend.tuning_space(x, csr, geometry))
    assert not any(p["variant"] == "pointwise"
                   for p in backend.tuning_space(x, UniformCSR.from_dense(torch.randn(8, 4, 3, 3)),
                                                 ConvGeometry.of(1, 1)))


@pytest.mark.parametrize("case", GEOMETRIES)
@pytest.mark.parametrize(("threads", "pixels", "sub_batch", "channels"), [(64, 1, 1, 8), (32, 2, 2, 3)])
def test_rows_emulation_matches_conv2d(case: tuple, threads: int, pixels: int, sub_batch: int,
                                       channels: int) -> None:
    x, csr, geometry, ref = layer(case, seed=sum(case))
    out = emulate_rows(x, csr, geometry, threads, pixels, sub_batch, channels)
    assert torch.allclose(out, ref, atol=1e-10)


SMALL_TILINGS = [lg.TileTiling(wx=8, py=2, nb=2, mw=2, warps=2, cc=2),
                 lg.TileTiling(wx=4, py=3, nb=1, mw=3, warps=1, cc=3),
                 lg.TileTiling(wx=8, py=2, nb=2, mw=3, warps=2, cc=2, union=3),
                 lg.TileTiling(wx=8, py=2, nb=2, mw=3, warps=2, cc=2, union=3, paired=True),
                 lg.TileTiling(wx=8, py=2, nb=2, mw=2, warps=2, cc=3, stage_entries=True, min_blocks=4),
                 lg.TileTiling(wx=8, py=2, nb=2, mw=3, warps=2, cc=2, union=3, stage_entries=True)]


@pytest.mark.parametrize("case", [g for g in GEOMETRIES if g[7] == 1 and g[9] == 1 and g[2] > 1])
@pytest.mark.parametrize("tiling", SMALL_TILINGS)
def test_tile_emulation_matches_conv2d(case: tuple, tiling: lg.TileTiling) -> None:
    x, csr, geometry, ref = layer(case, seed=3)
    out = emulate_tile(x, csr, geometry, tiling)
    assert torch.allclose(out, ref, atol=1e-5)  # the entries hold float32 weights


@pytest.mark.parametrize("case", [(2, 3, 5, 36, 5, 3, 3, 1, 1, 1), (1, 2, 6, 40, 3, 3, 3, 1, 0, 1),
                                  (2, 3, 7, 16, 4, 5, 5, 1, 2, 1), (2, 5, 3, 8, 6, 1, 1, 1, 0, 1)])
def test_tile_emulation_of_16_byte_staging_matches_conv2d(case: tuple) -> None:
    x, csr, geometry, ref = layer(case, seed=5)
    tiling = lg.TileTiling(wx=32, py=2, nb=2, mw=2, warps=2, cc=2)
    out = emulate_tile(x, csr, geometry, tiling, vector=True)
    assert torch.allclose(out, ref, atol=1e-5)


def test_union_entries_emulate_zero_dense_and_partial_groups() -> None:
    """Union entries (U = 3) on 7 output channels: an all-zero channel and a dense one share a group with a sparse
    one, and the last group holds one channel (two past M); with 16-byte staging."""
    N, C, H, W, M = 3, 5, 6, 36, 7
    gen = torch.Generator().manual_seed(11)
    weight = torch.randn(M, C, 3, 3, generator=gen, dtype=torch.float64)
    weight[torch.rand(weight.shape, generator=gen, dtype=torch.float64) < 0.8] = 0
    weight[0] = 0
    weight[1] = torch.randn(C, 3, 3, generator=gen, dtype=torch.float64)
    x = torch.randn(N, C, H, W, generator=gen, dtype=torch.float64)
    geometry = ConvGeometry.of(1, 1)
    expected = F.conv2d(x, weight, None, 1, 1)
    tiling = lg.TileTiling(wx=32, py=2, nb=2, mw=3, warps=2, cc=2, union=3)
    for paired, vector in itertools.product((False, True), (False, True)):
        out = emulate_tile(x, UniformCSR.from_dense(weight), geometry, replace(tiling, paired=paired), vector=vector)
        assert torch.allclose(out, expected, atol=1e-5), (paired, vector)  # the entries hold float32 weights
    with pytest.raises(ValueError, match="union"):  # float32 only
        lg.tile_layout(torch.float16, (3, 3), tiling)
    assert not any("union" in p for p in tile_space(128, (56, 56), (3, 3), torch.float16, vector_pad=1))
    assert any("union" in p for p in tile_space(128, (56, 56), (3, 3), torch.float32, vector_pad=1))


def test_paired_float32_tiles_stage_two_images_per_element() -> None:
    """A ``paired`` float32 tiling (kernel notes v22): 8-byte elements of two images, 16-byte staging vectors of
    two columns (rows aligned with ``left = -pad_w mod 2``), half the image elements, twice the element bytes, its
    own instantiation; odd batches pad a zero image; float16, which always pairs, refuses the flag."""
    tiling = lg.TileTiling(wx=32, py=7, nb=4, mw=3, warps=8, cc=8, union=3, paired=True)
    layout = lg.tile_layout(torch.float32, (3, 3), tiling, vector_pad=1)
    assert (layout.element_bytes, layout.vector_elements, layout.image_elements) == (8, 2, 2)
    assert (layout.left, layout.padded_width) == (1, 36)  # column 0 of the interior at element 2: byte 16
    spec = lg.tile_launch(torch.float32, 5, 64, (56, 56), (3, 3), tiling, vector_pad=1)
    assert spec.name == "direct_tile<float,3,3,32,7,4,3,8,8,36,1,1,0,3,2,0,0>"
    assert spec.shared_bytes == 2 * 8 * 2 * 9 * 36 * 8 and spec.grid == (3 * 8 * 2, 2, 1)
    with pytest.raises(ValueError, match="paired"):
        lg.tile_layout(torch.float16, (3, 3), replace(tiling, union=1))
    with pytest.raises(ValueError, match="NB"):
        lg.tile_layout(torch.float32, (3, 3), replace(tiling, nb=3))
    x, csr, geometry, ref = layer((5, 6, 9, 16, 7, 3, 3, 1, 1, 1), seed=13)
    small = lg.TileTiling(wx=32, py=3, nb=4, mw=3, warps=2, cc=4, union=3, paired=True)
    assert torch.allclose(emulate_tile(x, csr, geometry, small, vector=True), ref, atol=1e-5)
    paired = [p for p in tile_space(128, (56, 56), (3, 3), torch.float32, vector_pad=1) if p.get("paired")]
    assert paired and all(tiling_of(p).paired and p["nb"] % 2 == 0 for p in paired)
    assert not any("paired" in p for p in tile_space(128, (56, 56), (3, 3), torch.float16, vector_pad=1))


def test_rows_naming_a_column_twice_count_every_entry() -> None:
    """A hand-made matrix whose rows name columns repeatedly: per-channel entries keep each one and union entries
    add them up, so every emulated kernel matches the accumulated dense weight (the GPU test of the same case
    caught v21's first union arrays, which kept one of the repeated weights)."""
    gen = torch.Generator().manual_seed(12)
    M, C, L = 7, 6, 30
    col_idx = torch.randint(0, C * 9, (M, L), generator=gen, dtype=torch.int32)
    col_idx[:, :10] = torch.randint(0, 4, (M, 10), generator=gen, dtype=torch.int32)  # repeats in chunk 0
    csr = UniformCSR(torch.randn(M, L, generator=gen, dtype=torch.float64), col_idx, (M, C, 3, 3))
    x = torch.randn(2, C, 5, 9, generator=gen, dtype=torch.float64)
    expected = F.conv2d(x, csr.to_dense(), None, 1, 1)
    for tiling in SMALL_TILINGS:
        out = emulate_tile(x, csr, ConvGeometry.of(1, 1), tiling)
        assert torch.allclose(out, expected, atol=1e-5)  # the entries hold float32 weights
    pointwise = UniformCSR(csr.values[:, :C].contiguous(), col_idx[:, :C].contiguous(), (M, C, 1, 1))
    out = emulate_pointwise(x, pointwise, lg.PointwiseTiling(pv=1, mw=2, warps=4, cc=2))
    assert torch.allclose(out, F.conv2d(x, pointwise.to_dense()), atol=1e-5)


def test_longest_list_sizes_the_staged_entry_slots() -> None:
    """``longest_list`` equals the longest (group, chunk) list ``prepare_tile`` builds, for per-channel and union
    entries, on rows that repeat columns, an all-zero row and a dense one; ``check_capacity`` refuses a slot one
    entry short; an all-zero weight needs no slot."""
    gen = torch.Generator().manual_seed(21)
    M, C, L = 7, 6, 40
    col_idx = torch.randint(0, C * 9, (M, L), generator=gen, dtype=torch.int32)
    col_idx[:, :12] = torch.randint(0, 5, (M, 12), generator=gen, dtype=torch.int32)  # repeats in chunk 0
    values = torch.randn(M, L, generator=gen, dtype=torch.float64)
    values[2] = 0
    repeated = UniformCSR(values, col_idx, (M, C, 3, 3))
    dense = UniformCSR.from_dense(torch.randn(M, C, 3, 3, generator=gen, dtype=torch.float64))
    for csr, chunk, union in itertools.product((repeated, dense), (1, 2, 4), (1, 3)):
        layout = lg.tile_layout(torch.float32, (3, 3), lg.TileTiling(8, 2, 2, 3, 2, chunk, union=union))
        arrays = prepare_tile(csr, layout, union=union)
        longest = int((arrays.chunk_ptr[1:] - arrays.chunk_ptr[:-1]).max())
        assert longest_list(csr, chunk, union) == longest > 0
        check_capacity(arrays, longest)
        with pytest.raises(ValueError, match="chunk_ptr"):
            check_capacity(arrays, longest - 1)
    assert longest_list(dense, 6, 1) == 54 and longest_list(repeated, 2, 1) > 18  # repeats count once each
    assert longest_list(UniformCSR.from_dense(torch.zeros(4, 3, 3, 3)), 2, 3) == 0
    for chunk, union in ((0, 1), (2, 2), (1.5, 1)):
        with pytest.raises(ValueError, match="longest_list"):
            longest_list(dense, chunk, union)


def test_staged_entry_settings_fit_their_slots() -> None:
    """``stage_entries`` tilings: in the tuning space only where their slots, sized by the weight's longest list,
    fit the shared-memory limit (a dense 3x3 weight leaves the 16- and 32-channel chunks out), as ``"entries":
    "shared"`` with their ``min_blocks``, in their own instantiations; the launch refuses a capacity without them
    and ``tiling_of`` an unknown entry source."""
    tiling = lg.TileTiling(32, 8, 2, 3, 8, 8, union=3, stage_entries=True, min_blocks=3)
    layout = lg.tile_layout(torch.float32, (3, 3), tiling, vector_pad=1)
    spec = lg.tile_launch(torch.float32, 128, 256, (56, 56), (3, 3), tiling, 1, entry_capacity=50)
    assert spec.name.endswith(",0,3,1,1,3>")
    assert spec.shared_bytes == lg.tile_shared_bytes(layout, tiling, 50) == layout.shared_bytes() + 2 * 8 * 50 * 16
    unstaged = replace(tiling, stage_entries=False, min_blocks=0)
    assert lg.tile_shared_bytes(layout, unstaged, 0) == layout.shared_bytes()
    with pytest.raises(ValueError, match="exceed"):
        lg.tile_launch(torch.float32, 128, 256, (56, 56), (3, 3), tiling, 1, entry_capacity=400)
    for capacity, staged in ((3, unstaged), (-1, tiling), (2.0, tiling)):
        with pytest.raises(ValueError, match="entry_capacity"):
            lg.tile_launch(torch.float32, 128, 256, (56, 56), (3, 3), staged, 1, entry_capacity=capacity)
    for min_blocks in (-1, 1.0):
        with pytest.raises(ValueError, match="min_blocks"):
            lg.TileTiling(32, 8, 2, 3, 8, 8, union=3, min_blocks=min_blocks)
    with pytest.raises(ValueError, match="min_blocks"):  # a wide tiling is fixed at two blocks
        lg.TileTiling(32, 7, 4, 3, 8, 8, union=3, paired=True, min_blocks=2)
    with pytest.raises(ValueError, match="stage_entries"):
        lg.TileTiling(32, 8, 2, 3, 8, 8, stage_entries=1)
    assert not any("entries" in p for p in tile_space(128, (56, 56), (3, 3), torch.float32, vector_pad=1))
    sparse = tile_space(128, (56, 56), (3, 3), torch.float16, vector_pad=1, entry_capacity=lambda cc, u: 4)
    staged = [p for p in sparse if p.get("entries") == "shared"]
    assert {(p["cc"], p["min_blocks"]) for p in staged} == {(8, 4), (16, 2), (32, 2)}
    assert all(tiling_of(p).stage_entries and tiling_of(p).min_blocks == p["min_blocks"] for p in staged)
    with pytest.raises(ValueError, match="entries"):
        tiling_of({**staged[0], "entries": "texture"})
    backend = DirectBackend()
    gen = torch.Generator().manual_seed(2)
    for density, chunks in ((1.0, {8}), (0.1, {8, 16})):
        weight = torch.randn(64, 64, 3, 3, generator=gen) * (torch.rand(64, 64, 3, 3, generator=gen) < density)
        space = backend.tuning_space(torch.zeros(2, 64, 56, 56), UniformCSR.from_dense(weight), ConvGeometry.of(1, 1))
        assert {p["cc"] for p in space if p.get("entries") == "shared"} == chunks, density


def test_vector_staging_eligibility() -> None:
    assert lg.vector_staging_reason(56, (3, 3), (1, 1)) is None
    assert "multiple of 4" in lg.vector_staging_reason(14, (3, 3), (1, 1))
    assert "pad_w" in lg.vector_staging_reason(56, (3, 3), (0, 3))
    layout = lg.tile_layout(torch.float32, (3, 3), lg.TileTiling(32, 4, 2, 4, 16, 8), vector_pad=1)
    assert (layout.left, layout.padded_width, layout.vector) == (3, 40, True)
    with pytest.raises(ValueError, match="16-byte"):
        lg.tile_layout(torch.float32, (3, 3), lg.TileTiling(16, 4, 2, 4, 16, 8), vector_pad=1)
    vector = [p for p in tile_space(128, (56, 56), (3, 3), torch.float32, vector_pad=1) if "stage" in p]
    assert vector and all(p["wx"] == 32 and p["stage"] == "vector" for p in vector)
    backend = DirectBackend()
    csr = UniformCSR.from_dense(torch.randn(8, 4, 3, 3))
    narrow = backend.tuning_space(torch.zeros(2, 4, 14, 14), csr, ConvGeometry.of(1, 1))
    assert not any("stage" in p for p in narrow)
    assert any("stage" in p for p in backend.tuning_space(torch.zeros(2, 4, 56, 56), csr, ConvGeometry.of(1, 1)))


STRIDED = [case for case in GEOMETRIES if case[7] > 1 and case[9] == 1] + [(2, 6, 14, 14, 5, 1, 1, 2, 0, 1),
                                                                       (1, 4, 16, 16, 9, 3, 3, 2, 1, 1)]


@pytest.mark.parametrize("case", STRIDED)
def test_strided_layers_emulate_through_their_phase_split(case: tuple) -> None:
    """What ``DirectBackend.conv`` runs for a strided tile or pointwise setting: the kernel on the phase images
    and the split weight, told the strided layer's output size."""
    x, csr, geometry, expected = layer(case, sparsity=0.8)
    view = DirectBackend()._view(x.float(), csr, geometry, {"variant": "tile"})
    assert view.split is not None and view.geometry.stride == (1, 1) and view.out_hw == expected.shape[2:]
    phases = view.split.input(x)
    assert phases.shape[2:] == view.in_hw
    for tiling in SMALL_TILINGS:
        out = emulate_tile(phases, view.csr, view.geometry, tiling, out_hw=view.out_hw)
        assert torch.allclose(out, expected, atol=1e-5)  # the entries hold float32 weights
    if is_pointwise(view.csr, view.geometry):
        out = emulate_pointwise(phases, view.csr, lg.PointwiseTiling(pv=1, mw=2, warps=4, cc=2))
        assert torch.allclose(out, expected, atol=1e-5)


def test_tile_emulation_float16_layout_pairs_images() -> None:
    x, csr, geometry, ref = layer((3, 5, 7, 9, 4, 3, 3, 1, 1, 1), seed=4)
    out = emulate_tile(x, csr, geometry, SMALL_TILINGS[0], dtype=torch.float16)
    assert torch.allclose(out, ref, atol=1e-5)
    x, csr, geometry, ref = layer((3, 3, 5, 36, 5, 3, 3, 1, 1, 1), seed=6)
    out = emulate_tile(x, csr, geometry, lg.TileTiling(wx=32, py=2, nb=2, mw=2, warps=2, cc=2), dtype=torch.float16,
                       vector=True)
    assert torch.allclose(out, ref, atol=1e-5)


def test_tile_emulation_of_half2_runs_matches_conv2d() -> None:
    """Half2 products on float16 values (a 16-channel chunk of a dense 3x3 row holds 144 entries: nine runs
    of 16), against the float64 reference within the comparator's float16 bound, and against the float32
    products' error, which only the output's rounding limits."""
    case = (3, 16, 6, 36, 4, 3, 3, 1, 1, 1)
    x, csr, geometry, _ = layer(case, sparsity=0.0, seed=8)
    x = x.half().double()
    csr = UniformCSR.from_dense(csr.to_dense().half().double())
    weight = csr.to_dense().reshape(4, 16, 3, 3)
    ref = F.conv2d(x, weight, None, geometry.stride, geometry.padding)
    tiling = lg.TileTiling(wx=32, py=2, nb=2, mw=2, warps=2, cc=16)
    runs = emulate_tile(x, csr, geometry, tiling, torch.float16, vector=True, half_run=lg.HALF2_RUN)
    error = float((runs - ref).norm() / ref.norm())
    assert 1e-5 < error < 2e-3  # the float16 roundings show, and stay within the bound
    whole = emulate_tile(x, csr, geometry, tiling, torch.float16, vector=True, half_run=144)  # one run per chunk
    assert float((whole - ref).norm() / ref.norm()) > error
    staged = replace(tiling, stage_entries=True)  # the same runs, each entry read from its slot
    assert torch.equal(emulate_tile(x, csr, geometry, staged, torch.float16, vector=True, half_run=lg.HALF2_RUN), runs)


@pytest.mark.parametrize("batch", [1, 4, 5])
def test_pair_images_interleaves_image_pairs(batch: int) -> None:
    x = torch.randn(batch, 3, 4, 6, dtype=torch.float64)
    paired = pair_images(x)
    assert paired.shape == (math.ceil(batch / 2), 3, 4, 6, 2) and paired.is_contiguous()
    for n in range(2 * paired.shape[0]):
        expected = x[n] if n < batch else torch.zeros_like(x[0])
        assert torch.equal(paired[n // 2, ..., n % 2], expected)


def emulate_pairing(x: torch.Tensor) -> torch.Tensor:
    """The ``pair_images`` kernel in Python: its grid (:func:`~unsparse.runtime.launch_geometry.pairing_launch`),
    each thread's run of ``unit`` elements of both images (the second a zero image past an odd N), interleaved."""
    N, P = x.shape[0], x[0].numel()
    spec = lg.pairing_launch(x.dtype, N, P, vector=False)
    unit, flat = 16 // x.element_size(), x.reshape(N, P)
    out = torch.full((spec.grid[1], P, 2), float("nan"), dtype=x.dtype)
    for bx, i, t in itertools.product(range(spec.grid[0]), range(spec.grid[1]), range(spec.block[0])):
        p = (bx * spec.block[0] + t) * unit
        for j in range(p, min(p + unit, P)):
            out[i, j, 0] = flat[2 * i, j]
            out[i, j, 1] = flat[2 * i + 1, j] if 2 * i + 1 < N else 0.0
    return out.reshape(spec.grid[1], *x.shape[1:], 2)


@pytest.mark.parametrize(("batch", "chw", "dtype"), [(5, (3, 7, 9), torch.float32), (2, (2, 8, 16), torch.float16),
                                                     (1, (1, 40, 40), torch.float16)])
def test_pairing_kernel_emulation_matches_pair_images(batch: int, chw: tuple[int, int, int],
                                                      dtype: torch.dtype) -> None:
    """The pairing kernel's grid and per-thread runs (emulated) give torch's pairing; its launch geometry, the
    16-byte vector condition and the size check. The vector path's byte shuffles are checked on the GPU."""
    x = torch.randn(batch, *chw).to(dtype)
    assert torch.equal(emulate_pairing(x), pair_images(x))
    spec = lg.pairing_launch(dtype, 128, 256 * 56 * 56, vector=True)
    assert spec.name == f"pair_images<{lg.cuda_type(dtype)},1>" and spec.block == (256, 1, 1)
    assert spec.grid == (math.ceil(256 * 56 * 56 / (16 // dtype.itemsize * 256)), 64, 1)
    assert lg.pairing_vector(64, aligned=True) and not lg.pairing_vector(36, aligned=True)
    assert not lg.pairing_vector(64, aligned=False)
    assert not lg.vector_aligned(torch.zeros(9)[1:].view(2, 4))  # 4 bytes past a 16-byte boundary
    with pytest.raises(ValueError, match="positive"):
        lg.pairing_launch(dtype, 0, 10, vector=False)


def emulate_phase_pairing(x: torch.Tensor, split: PhaseSplit) -> torch.Tensor:
    """The ``phase_pair_images`` kernel in Python, line by line and vectorised over each block's threads: its grid
    (:func:`~unsparse.runtime.launch_geometry.phase_pairing_launch`), each thread's (channel, row, phase column), its
    ``s_w`` input columns (zero outside the image or past an odd N) and their target pairs, one per phase plane."""
    N, C, H, W = x.shape
    (HQ, WQ), (SH, SW) = split.input_size(H, W), split.stride
    spec = lg.phase_pairing_launch(x.dtype, N, C, (HQ, WQ), split.stride)
    rows, flat = HQ * SH, x.reshape(-1)
    out = torch.full((spec.grid[1] * C * SH * SW * HQ * WQ, 2), float("nan"), dtype=x.dtype)
    plane, image = H * W, H * W * C
    for bx, i in itertools.product(range(spec.grid[0]), range(spec.grid[1])):
        e = bx * spec.block[0] + torch.arange(spec.block[0])
        e = e[e < C * rows * WQ]
        u, t, c = e % WQ, (e // WQ) % rows, e // (WQ * rows)
        row = 2 * i * image + c * plane + t * W
        target = ((i * C * SH + c * SH + t % SH) * SW * HQ + t // SH) * WQ + u
        for b in range(SW):
            w = SW * u + b
            inside = (t < H) & (w < W)
            first = torch.where(inside, flat[torch.where(inside, row + w, 0)], 0.0)
            live = inside & (2 * i + 1 < N)
            second = torch.where(live, flat[torch.where(live, row + image + w, 0)], 0.0)
            out[target + b * HQ * WQ, 0], out[target + b * HQ * WQ, 1] = first, second
    return out.reshape(spec.grid[1], C * SH * SW, HQ, WQ, 2)


@pytest.mark.parametrize(("shape", "kernel", "stride", "padding"), [
    ((3, 2, 9, 7), 3, 2, 1),  # odd N, H and W: zero image, zero last phase row and column
    ((2, 3, 23, 23), 11, 4, 2),  # AlexNet's stem, scaled down
    ((1, 2, 8, 10), 1, 2, 0),  # a 1x1 stride-2 layer reads one phase: no fused pairing
    ((4, 1, 6, 5), (3, 1), (2, 1), (1, 0)),  # stride along rows only
])
def test_phase_pairing_kernel_emulation_matches_the_phase_split_then_pairing(shape, kernel, stride, padding) -> None:
    """``phase_pair_images`` (emulated) writes what the two-pass path writes, :func:`pair_images` of
    :meth:`PhaseSplit.input`, wherever the split reads every phase; the Python side refuses a split that does
    not, and the launch geometry's size checks."""
    R, S = (kernel, kernel) if isinstance(kernel, int) else kernel
    x = torch.randn(*shape, dtype=torch.float16)
    csr = UniformCSR.from_dense(torch.randn(4, shape[1], R, S))
    split = phase_split(csr, ConvGeometry.of(stride, padding))
    if not split.every_phase:
        with pytest.raises(ValueError, match="every phase"):
            bind_phase_pairing(shape, x.dtype, torch.device("cpu"), split)
        return
    assert torch.equal(emulate_phase_pairing(x, split), pair_images(split.input(x)))
    spec = lg.phase_pairing_launch(torch.float32, 128, 3, (57, 57), (4, 4))
    assert spec.name == "phase_pair_images<float>" and spec.block == (256, 1, 1)
    assert spec.grid == (math.ceil(3 * 228 * 57 / 256), 64, 1)
    with pytest.raises(ValueError, match="positive"):
        lg.phase_pairing_launch(torch.float16, 0, 3, (5, 5), (2, 2))
    with pytest.raises(ValueError, match="int32"):
        lg.phase_pairing_launch(torch.float16, 2, 2**16, (128, 128), (2, 2))


def test_tile_arrays_drop_padding_and_group_by_chunk() -> None:
    weight = torch.zeros(2, 3, 3, 3)
    weight[0, 2, 1, 2], weight[1, 0, 0, 0], weight[1, 1, 2, 1] = 1.0, 2.0, 3.0
    csr = UniformCSR.from_dense(weight)
    assert csr.row_length == 2  # row 0 carries one padding entry
    tiling = lg.TileTiling(wx=32, py=2, nb=2, mw=1, warps=1, cc=2)
    layout = lg.tile_layout(torch.float32, (3, 3), tiling)
    assert (layout.tile_h, layout.tile_w, layout.padded_width, layout.channel_stride) == (4, 34, 34, 272)
    arrays = prepare_tile(csr, layout)
    assert arrays.chunk_ptr.tolist() == [0, 0, 1, 3, 3]  # (m0,k0) (m0,k1) (m1,k0) (m1,k1); CC = 2
    assert arrays.entries[:, 0].tolist() == [0 * 272 + 1 * 34 + 2, 0, 272 + 2 * 34 + 1]
    assert arrays.entries[:, 1].view(torch.float32).tolist() == [1.0, 2.0, 3.0]
    half2 = prepare_tile(UniformCSR.from_dense(weight.half()), layout, half2=True)
    assert torch.equal(half2.entries[:, 0], arrays.entries[:, 0]) and torch.equal(half2.chunk_ptr, arrays.chunk_ptr)
    assert half2.entries[:, 1:].contiguous().view(torch.float16).tolist() == [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]
    empty = prepare_tile(UniformCSR.from_dense(torch.zeros(2, 3, 3, 3).half()), layout, half2=True)
    assert empty.entries.shape == (0, 2) and empty.chunk_ptr.tolist() == [0] * 5


def test_union_arrays_merge_the_taps_of_three_channels() -> None:
    """U = 3: one list per (group of three channels, chunk), one entry per tap any of them has, zero weights where a
    channel lacks it; a fourth channel starts the next group, whose missing channels hold zeros."""
    weight = torch.zeros(4, 3, 3, 3)
    weight[0, 0, 0, 0], weight[2, 0, 0, 0], weight[1, 2, 1, 2] = 1.0, 2.0, 3.0
    weight[3, 1, 2, 1] = 4.0
    tiling = lg.TileTiling(wx=32, py=2, nb=2, mw=3, warps=1, cc=2, union=3)
    layout = lg.tile_layout(torch.float32, (3, 3), tiling)
    arrays = prepare_tile(UniformCSR.from_dense(weight), layout, union=3)
    assert arrays.chunk_ptr.tolist() == [0, 1, 2, 3, 3]  # (g0,k0) (g0,k1) (g1,k0) (g1,k1)
    assert arrays.entries[:, 0].tolist() == [0, 1 * 34 + 2, 272 + 2 * 34 + 1]
    assert arrays.entries[:, 1:].contiguous().view(torch.float32).tolist() == [[1.0, 0.0, 2.0], [0.0, 3.0, 0.0],
                                                                                [4.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match="union"):
        prepare_tile(UniformCSR.from_dense(weight), layout, union=2)
    with pytest.raises(ValueError, match="entries"):  # read as U = 1, the rows are too wide
        validate_tile(arrays, 4, 3, (3, 3), layout)
    with pytest.raises(ValueError, match="chunk_ptr"):  # read as 12 channels, the lists are too few
        validate_tile(arrays, 12, 3, (3, 3), layout, union=3)
    with pytest.raises(ValueError, match="union"):
        lg.tile_layout(torch.float32, (3, 3), lg.TileTiling(wx=32, py=2, nb=2, mw=4, warps=1, cc=2, union=3))


def test_half2_backend_offers_tile_settings_on_float16_only() -> None:
    backend, direct = DirectHalf2Backend(), DirectBackend()
    csr = UniformCSR.from_dense(torch.randn(8, 4, 3, 3).half())
    x = torch.zeros(2, 4, 56, 56, dtype=torch.float16)
    space = backend.tuning_space(x, csr, ConvGeometry.of(2, 1))
    assert space == [{**p, "accumulate": "half2"} for p in direct.tuning_space(x, csr, ConvGeometry.of(2, 1))
                     if p["variant"] == "tile"]
    names = backend.kernel_names(x, csr, ConvGeometry.of(2, 1))
    assert all(f",{lg.HALF2_RUN}," in name for name in names if name.startswith("direct_tile"))
    assert {name for name in names if not name.startswith("direct_tile")} == {
        "pair_images<__half,0>", "pair_images<__half,1>", "phase_pair_images<__half>"}
    one_phase = UniformCSR.from_dense(torch.randn(8, 4, 1, 1).half())  # a 1x1 stride-2 split reads one phase
    assert {name for name in direct.kernel_names(x, one_phase, ConvGeometry.of(2, 0)) if "pair" in name} == {
        "pair_images<__half,0>", "pair_images<__half,1>"}
    assert not any("accumulate" in p for p in direct.tuning_space(x, csr, ConvGeometry.of(1, 1)))
    with pytest.raises(ValueError, match="accumulate"):  # half2 runs on the tile kernel only
        direct._launch(x, csr, ConvGeometry.of(1, 1), {"variant": "rows", "accumulate": "half2"})
    with pytest.raises(ValueError, match="accumulate"):
        direct._launch(x.float(), csr.to(dtype=torch.float32), ConvGeometry.of(1, 1), {**space[0]})
    with pytest.raises(ValueError, match="accumulate"):
        direct._launch(x, csr, ConvGeometry.of(1, 1), {**space[0], "accumulate": "bfloat16"})
    dilated = ConvGeometry.of(1, 2, 2)
    assert stride_one_reason(ConvGeometry.of(2, 1)) is None and "undilated" in stride_one_reason(dilated)
    assert "undilated" in stride_one_reason(ConvGeometry.of(1, 1, 1, 1, 1))  # Conv1d
    with pytest.raises(ValueError, match="variant: tile and pointwise need an undilated Conv2d"):
        direct._launch(x, csr, dilated, space[0])


def _conflict_free(tiling: lg.TileTiling, width: int, element_bytes: int) -> bool:
    """Whether a warp's loads of lanes ``(ly, lx)`` at element ``ly * width + lx`` hit 32 distinct banks in each
    of its shared-memory wavefronts (8-byte elements: a half-warp at a time)."""
    lanes = torch.arange(32)
    element = (lanes // tiling.wx) * width + lanes % tiling.wx
    words = element_bytes // 4
    return all(((part[:, None] * words + torch.arange(words)) % 32).unique().numel() == 32
               for part in element.view(words, 32 // words))


def test_tile_layout_is_bank_conflict_free_at_the_smallest_width() -> None:
    every_width = [lg.TileTiling(wx=wx, py=2, nb=2, mw=3, warps=2, cc=2, union=3, paired=paired)
                   for wx, paired in itertools.product([1, 2, 4, 8, 16, 32], [False, True])]
    checked = set()
    for tiling in [*TILE_TILINGS, *SMALL_TILINGS, *every_width]:
        for kernel, dtype in itertools.product([(1, 1), (2, 2), (3, 3), (5, 5)], [torch.float32, torch.float16]):
            try:
                layout = lg.tile_layout(dtype, kernel, tiling)
            except ValueError:
                continue
            halo_width = tiling.wx + kernel[1] - 1
            assert layout.padded_width >= halo_width
            assert _conflict_free(tiling, layout.padded_width, layout.element_bytes), (tiling, kernel, dtype)
            checked.add((tiling.wx, layout.element_bytes))
            if tiling.wx * layout.element_bytes < 128:  # else a warp's (half-warp's) loads read one row: any width
                assert not any(_conflict_free(tiling, width, layout.element_bytes)
                               for width in range(halo_width, layout.padded_width)), (tiling, kernel, dtype)
    assert checked == set(itertools.product([1, 2, 4, 8, 16, 32], [4, 8]))
    eight_wide = lg.tile_layout(torch.float32, (3, 3), lg.TileTiling(wx=8, py=2, nb=2, mw=8, warps=8, cc=8))
    assert eight_wide.padded_width == 24  # not 40: 24 is 3 x 8, an odd multiple of WX = 8 modulo 32
    half = lg.tile_layout(torch.float16, (3, 3), TILE_TILINGS[0])
    assert half.image_elements == TILE_TILINGS[0].nb // 2
    with pytest.raises(ValueError, match="NB"):
        lg.tile_layout(torch.float16, (3, 3), lg.TileTiling(wx=32, py=4, nb=1, mw=4, warps=8, cc=8))
    with pytest.raises(ValueError, match="WX"):
        lg.tile_layout(torch.float32, (3, 3), lg.TileTiling(wx=12, py=4, nb=1, mw=4, warps=8, cc=8))


@pytest.mark.parametrize("dilation", [(1, 2), (2, 1)])
def test_rows_emulation_matches_conv2d_with_unequal_dilations(dilation: tuple[int, int]) -> None:
    """Every GEOMETRIES case dilates both axes alike, so taking the row dilation for the column shift went unseen
    (a mutation audit's find)."""
    gen = torch.Generator().manual_seed(21)
    weight = torch.randn(5, 3, 3, 3, generator=gen, dtype=torch.float64)
    weight[torch.rand(weight.shape, generator=gen, dtype=torch.float64) < 0.5] = 0
    x, geometry = torch.randn(2, 3, 12, 13, generator=gen, dtype=torch.float64), ConvGeometry.of(1, 1, dilation)
    csr = UniformCSR.from_dense(weight)
    out = emulate_rows(x, csr, geometry, 64, 1, 1, 8)
    assert torch.allclose(out, F.conv2d(x, weight, None, 1, 1, dilation), atol=1e-10)


def test_validation_bounds_each_offset_to_its_image_exactly() -> None:
    """The first address past the image is refused and the last channel's start is accepted (shifting every offset
    by a whole image could not tell ``>`` from ``>=``)."""
    C, H, W = 3, 9, 11
    taps = torch.zeros(1, 1, dtype=torch.int64)
    validate_rows(torch.tensor([[(C - 1) * H * W]]), taps, C, (H, W))
    with pytest.raises(ValueError, match="offsets"):
        validate_rows(torch.tensor([[C * H * W]]), taps, C, (H, W))


def test_validation_rejects_out_of_range_offsets_and_taps() -> None:
    _, csr, geometry, _ = layer(GEOMETRIES[0])
    arrays = prepare_rows(csr, geometry, (9, 11))
    offsets, taps = arrays.offsets.long(), arrays.taps.long()
    with pytest.raises(ValueError, match="offsets"):
        validate_rows(offsets + 3 * 9 * 11, taps, 3, (9, 11))
    with pytest.raises(ValueError, match="offsets"):
        validate_rows(offsets + 1, taps, 3, (9, 11))
    with pytest.raises(ValueError, match="taps"):
        validate_rows(offsets, taps | (1 << 15), 3, (9, 11))
    with pytest.raises(ValueError, match="offsets"):
        validate_rows(offsets, taps, 2**20, (2**6, 2**6))
    validate_rows(offsets, taps, 3, (9, 11))


def test_validation_rejects_bad_tile_arrays() -> None:
    _, csr, _, _ = layer(GEOMETRIES[0])  # C = 3, 3x3
    tiling = lg.TileTiling(wx=8, py=2, nb=2, mw=2, warps=2, cc=2)
    layout = lg.tile_layout(torch.float32, (3, 3), tiling)
    good = prepare_tile(csr, layout)
    M = csr.out_channels

    def entries_with(offsets: torch.Tensor) -> TileArrays:
        return TileArrays(good.chunk_ptr, torch.stack([offsets.to(torch.int32), good.entries[:, 1]], dim=1))

    offsets = good.entries[:, 0].long()
    for forged in [offsets + 2 * layout.channel_stride,  # beyond the staged chunk
                   offsets + 3,  # s beyond S - 1
                   offsets + 3 * layout.padded_width,  # r beyond R - 1
                   offsets - 1_000_000]:
        with pytest.raises(ValueError, match="entries"):
            validate_tile(entries_with(forged), M, 3, (3, 3), layout)
    # The entries of (m, chunk 1) name channel 2; moved to cc = 1 they would name channel 3 >= C.
    ptr = good.chunk_ptr.long()
    m = next(m for m in range(M) if ptr[2 * m + 2] > ptr[2 * m + 1])
    moved = offsets.clone()
    moved[ptr[2 * m + 1]:ptr[2 * m + 2]] += layout.channel_stride
    with pytest.raises(ValueError, match="entries"):
        validate_tile(entries_with(moved), M, 3, (3, 3), layout)
    broken = good.chunk_ptr.clone()
    broken[2] = int(broken[3]) + 1
    with pytest.raises(ValueError, match="chunk_ptr"):
        validate_tile(TileArrays(broken, good.entries), M, 3, (3, 3), layout)
    with pytest.raises(ValueError, match="chunk_ptr"):
        validate_tile(TileArrays(good.chunk_ptr[:-1], good.entries), M, 3, (3, 3), layout)
    with pytest.raises(ValueError, match="entries"):
        validate_tile(TileArrays(good.chunk_ptr, good.entries[:, :1]), M, 3, (3, 3), layout)
    validate_tile(good, M, 3, (3, 3), layout)


def test_launch_geometry() -> None:
    spec = lg.rows_launch(torch.float16, 130, 64, 56 * 56, 128, 2, 4, 8)
    assert spec.grid == (math.ceil(3136 / 256), 8, 33) and spec.block == (128, 1, 1)
    assert spec.name == f"direct_rows<__half,2,4,{lg.ROWS_CHUNK}>"
    tiling = lg.TileTiling(wx=16, py=4, nb=2, mw=8, warps=8, cc=4)
    spec = lg.tile_launch(torch.float32, 127, 200, (28, 28), (3, 3), tiling)
    assert spec.grid == (4 * 4 * 2, 64, 1) and spec.block == (256, 1, 1)
    assert spec.name == "direct_tile<float,3,3,16,4,2,8,8,4,48,0,0,0,1,1,0,0>"
    spec = lg.tile_launch(torch.float32, 127, 200, (56, 56), (3, 3), lg.TileTiling(32, 4, 2, 4, 16, 8), 1)
    assert spec.name == "direct_tile<float,3,3,32,4,2,4,16,8,40,3,1,0,1,1,0,0>"
    assert spec.shared_bytes == 2 * 8 * 6 * 40 * 2 * 4  # two chunks of CC x (NB images x 6 rows x 40 columns)
    wide = lg.tile_launch(torch.float32, 1, 1, (8, 8), (3, 3), lg.TileTiling(16, 4, 2, 8, 8, 8))
    assert wide.shared_bytes == 2 * 8 * 2 * 10 * 48 * 4 > lg.SHARED_LIMIT_BYTES  # 60 KB: dynamic, opted in
    paired = lg.tile_launch(torch.float16, 2, 1, (8, 8), (3, 3), lg.TileTiling(16, 4, 2, 8, 8, 8))
    assert paired.shared_bytes == wide.shared_bytes // 2  # a __half2 element holds two images
    with pytest.raises(ValueError, match="exceed"):  # two float32 buffers of 105 KB
        lg.tile_launch(torch.float32, 1, 1, (8, 8), (3, 3), lg.TileTiling(16, 4, 2, 8, 8, 28))
    with pytest.raises(ValueError, match="exceed the 65536 bytes"):  # 60 KB on a GPU that allows 64 KB: fits
        lg.tile_launch(torch.float32, 1, 1, (8, 8), (3, 3), lg.TileTiling(16, 4, 2, 8, 8, 9), shared_limit=65536)
    assert lg.tile_launch(torch.float32, 1, 1, (8, 8), (3, 3), lg.TileTiling(16, 4, 2, 8, 8, 8),
                          shared_limit=65536).shared_bytes == wide.shared_bytes
    spec = lg.tile_launch(torch.float16, 3, 5, (7, 7), (1, 1), lg.TileTiling(32, 4, 2, 4, 8, 8))
    assert spec.grid == (2, 2, 1) and spec.name == "direct_tile<__half,1,1,32,4,2,4,8,8,32,0,0,0,1,2,0,0>"
    half2 = lg.tile_launch(torch.float16, 3, 5, (7, 7), (1, 1), lg.TileTiling(32, 4, 2, 4, 8, 8), half_run=16)
    assert half2.name == "direct_tile<__half,1,1,32,4,2,4,8,8,32,0,0,16,1,2,0,0>" and half2.grid == spec.grid
    union = lg.tile_launch(torch.float32, 128, 256, (56, 56), (3, 3), lg.TileTiling(32, 4, 2, 6, 8, 8, union=3))
    assert union.name.endswith(",0,3,1,0,0>") and union.grid == (6 * 14 * 2, 64, 1)  # 48 channels per block
    with pytest.raises(ValueError, match="half_run"):
        lg.tile_launch(torch.float32, 3, 5, (7, 7), (1, 1), lg.TileTiling(32, 4, 2, 4, 8, 8), half_run=16)
    with pytest.raises(ValueError, match="threads"):
        lg.rows_launch(torch.float32, 1, 1, 1, 100, 1, 1, 1)
    with pytest.raises(ValueError, match="grid"):
        lg.rows_launch(torch.float32, 2**17, 1, 1, 64, 1, 1, 1)
    with pytest.raises(ValueError, match="tiling"):
        lg.tile_launch(torch.float32, 1, 1, (8, 8), (3, 3), lg.TileTiling(32, 4, 2, 4, 64, 8))
    with pytest.raises(ValueError, match="tiling"):
        lg.tile_launch(torch.float32, 1, 1, (8, 8), (3, 3), lg.TileTiling(32, 8, 4, 4, 8, 16))
    with pytest.raises(ValueError, match="dtype"):
        lg.cuda_type(torch.bfloat16)


def test_kernel_parameters_are_checked_device_pointers_and_int32() -> None:
    x = torch.arange(12.0).reshape(3, 4)
    cpu = torch.device("cpu")
    pointer, null, count = (cl.kernel_parameter(arg, cpu, i) for i, arg in enumerate((x, None, 7)))
    assert pointer.value == x.data_ptr() and null.value == 0 and count.value == 7
    assert (ctypes.sizeof(pointer), ctypes.sizeof(null), ctypes.sizeof(count)) == (8, 8, 4)
    assert cl.kernel_parameter(-(2**31), cpu, 0).value == -(2**31)
    with pytest.raises(ValueError, match="argument 0: tensor is not contiguous"):
        cl.kernel_parameter(x.t(), cpu, 0)
    with pytest.raises(ValueError, match="argument 1: tensor on cpu"):
        cl.kernel_parameter(x, torch.device("cuda", 0), 1)
    with pytest.raises(ValueError, match="argument 0: 2147483648 does not fit int32"):
        cl.kernel_parameter(2**31, cpu, 0)
    with pytest.raises(ValueError, match="argument 2: expected a tensor, None or an integer, got float"):
        cl.kernel_parameter(1.5, cpu, 2)
    assert cl.kernel_parameter(np.int64(5), cpu, 0).value == 5  # numpy integers are integers
    with pytest.raises(ValueError, match="argument 1: expected a tensor or None, got int"):
        cl.KernelParameters((cl.PER_CALL, cl.PER_CALL), cpu).fill((x, 3), cpu)  # a per-call slot is a pointer


def test_kernel_parameters_convert_fixed_arguments_once_and_fill_the_slots() -> None:
    """A bound launch's parameter block, read back through its ``kernelParams`` array as the driver reads it: the
    fixed arguments converted at bind time, each call's pointers set into the
    :data:`~unsparse.runtime.cupy_launcher.PER_CALL` slots in order, and every error naming the kernel position."""
    cpu = torch.device("cpu")
    index, source, out = torch.arange(4, dtype=torch.int32), torch.zeros(2, 3), torch.zeros(5)
    parameters = cl.KernelParameters((cl.PER_CALL, index, cl.PER_CALL, cl.PER_CALL, 7), cpu)
    assert parameters.slots == (0, 2, 3)

    def read() -> list[int]:
        addresses = (ctypes.c_void_p * 5).from_address(parameters.address)
        types = (ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int32)
        return [kind.from_address(address).value for kind, address in zip(types, addresses, strict=True)]

    assert read() == [0, index.data_ptr(), 0, 0, 7]  # converted when bound
    parameters.fill((source, None, out), cpu)
    assert read() == [source.data_ptr(), index.data_ptr(), 0, out.data_ptr(), 7]
    parameters.fill((out, index, source), cpu)  # the next call reuses the block
    assert read() == [out.data_ptr(), index.data_ptr(), index.data_ptr(), source.data_ptr(), 7]
    with pytest.raises(ValueError, match="argument 3: tensor is not contiguous"):
        parameters.fill((source, None, torch.zeros(3, 2).t()), cpu)
    with pytest.raises(ValueError, match="2 per-call values for 3 slots"):
        parameters.fill((source, out), cpu)
    with pytest.raises(ValueError, match="argument 1: tensor on cpu"):
        cl.KernelParameters((cl.PER_CALL, index), torch.device("cuda", 0))
    with pytest.raises(ValueError, match="argument 2: 2147483648 does not fit int32"):
        cl.KernelParameters((cl.PER_CALL, None, 2**31), cpu)


def test_fresh_copies_must_be_16_byte_aligned() -> None:
    fresh = torch.zeros(8)
    assert aligned_copy(fresh) is fresh
    with pytest.raises(ValueError, match="not 16-byte aligned"):
        aligned_copy(torch.zeros(9)[1:])


def test_tuning_spaces() -> None:
    rows = rows_space(batch=3, out_pixels=49)
    assert {p["sub_batch"] for p in rows} == {1, 2}
    assert all(p["threads"] * p["pixels"] <= 98 or (p["threads"], p["pixels"]) == (64, 1) for p in rows)
    assert {p["sub_batch"] for p in rows_space(128, 3136)} == {1, 2, 4, 8}
    assert len(rows_space(1, 1, prune=False)) == 6
    assert all(p["wx"] <= 14 for p in tile_space(8, (7, 7), (3, 3), torch.float32))
    big = tile_space(128, (56, 56), (3, 3), torch.float32, entry_capacity=lambda cc, union: 20)
    # Every tiling's 3x3 chunks fit the tile limit in float32 but the CC = 32 ones (float16 only: half the bytes);
    # NB = 1 and union entries are float32-only (float16 pairs images; union entries lost there, kernel notes v21).
    every = {tiling_of(p) for p in tile_space(128, (56, 56), (3, 3), torch.float32, prune=False,
                                              shared_limit=10 ** 9, entry_capacity=lambda cc, union: 20)}
    assert every == set(TILE_TILINGS)
    assert every - {tiling_of(p) for p in big} == {t for t in TILE_TILINGS if t.cc == 32}
    assert every - {tiling_of(p) for p in tile_space(128, (56, 56), (3, 3), torch.float16,
                                                     entry_capacity=lambda cc, union: 20)} == {
        t for t in TILE_TILINGS if t.nb == 1 or t.union > 1}
    assert len(tile_space(128, (56, 56), (5, 5), torch.float32)) < len(big)
    small = tile_space(128, (56, 56), (3, 3), torch.float32, shared_limit=lg.SHARED_LIMIT_BYTES)
    assert 0 < len(small) < len(big) and all(
        lg.tile_layout(torch.float32, (3, 3), tiling_of(p)).shared_bytes() <= lg.SHARED_LIMIT_BYTES for p in small)
    assert all(p["nb"] % 2 == 0 for p in tile_space(128, (56, 56), (3, 3), torch.float16))
    assert all(p["nb"] <= 2 for p in tile_space(1, (56, 56), (3, 3), torch.float16))
    single = tile_space(1, (56, 56), (3, 3), torch.float32)
    assert single and all(p["nb"] == 1 for p in single)
    x = torch.zeros(2, 4, 16, 16)
    csr = UniformCSR.from_dense(torch.randn(8, 4, 3, 3))
    backend = DirectBackend()
    strided = [p for p in backend.tuning_space(x, csr, ConvGeometry.of(2, 1)) if p["variant"] == "tile"]
    assert strided == tile_space(2, (8, 8), (2, 2), torch.float32)  # the 2x2 phase split; 8-wide phases: scalar
    names = backend.kernel_names(x, csr, ConvGeometry.of(2, 1))
    assert any(name.startswith("direct_tile<float,2,2,") for name in names)
    assert not any(p["variant"] == "tile" for p in backend.tuning_space(x, csr, ConvGeometry.of(1, 1, 2)))
    assert any(p["variant"] == "tile" for p in backend.tuning_space(torch.zeros(2, 4, 64, 64), csr,
                                                                     ConvGeometry.of(1, 1)))
    assert "cuda" in backend.unsupported_reason(x, csr, ConvGeometry.of(1, 1))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_kernels_compile_for_sm90(tmp_path, tuned_kernel_name_chunks) -> None:
    def compile_chunk(index: int, names: list[str]) -> subprocess.CompletedProcess:
        source = tmp_path / f"instances_{index}.cu"
        lines = [f'#include "{cl.KERNEL_FILE}"']
        lines += [f"void* kernel_{i} = (void*)&{name};" for i, name in enumerate(names)]
        source.write_text("\n".join(lines) + "\n")
        return subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90", "-c", str(source), "-o",
                               str(tmp_path / f"k_{index}.o"), "-Xptxas", "-warn-spills"], capture_output=True,
                              text=True)

    with ThreadPoolExecutor(len(tuned_kernel_name_chunks)) as pool:
        results = list(pool.map(compile_chunk, itertools.count(), tuned_kernel_name_chunks))
    assert all(result.returncode == 0 for result in results), "\n".join(result.stderr for result in results)
    spilled = [line for result in results for line in result.stderr.splitlines() if "spilled" in line]
    # 3x3, 2x2 (3x3 stride 2 split into phases) and 1x1 instantiations (the layers that carry the work) must stay
    # in registers.
    assert not [line for line in spilled if any(f"Li{k}ELi{k}E" in line for k in (1, 2, 3))], spilled


def kernel_signatures() -> dict[str, list[bool]]:
    """Per ``__global__`` kernel of ``kernels/direct_conv.cu``, whether each declared parameter is a pointer (the
    others are ``int``): what the launch's parameter block must match, since ``cuLaunchKernel`` checks neither
    count nor types."""
    source = re.sub(r"//[^\n]*", "", cl.KERNEL_FILE.read_text())
    declared = re.findall(r"__global__\s+void\s+(?:__launch_bounds__\((?:[^()]|\([^()]*\))*\)\s*)?(\w+)\s*\(([^)]*)\)",
                          source)
    assert all(("*" in p) or p.split()[0] == "int" for _, params in declared for p in params.split(","))
    return {name: ["*" in p for p in params.split(",")] for name, params in declared}


def record_launches(monkeypatch, on_launch: Callable[[lg.Launch, tuple], None]) -> list[tuple]:
    """Replace the kernel launches by a recorder on the CPU: each launch's arguments are checked against the
    kernel's declared parameters (pointer or int, in order; each one a kernel can take), appended as ``(spec, args)``
    to the returned list, and passed to ``on_launch``, which stands in for the kernel (it may write the outputs)."""
    launches: list[tuple] = []
    signatures = kernel_signatures()

    def bind(spec: lg.Launch, args: tuple, device: torch.device):
        parameters = cl.KernelParameters(args, device)  # the fixed arguments are checked when bound

        def call(stream: object, *values: object) -> None:
            parameters.fill(values, device)
            filled = iter(values)
            launched = tuple(next(filled) if arg is cl.PER_CALL else arg for arg in args)
            pointers = signatures[spec.name.partition("<")[0]]  # the kernel's declared parameters, in order
            assert [arg is None or isinstance(arg, torch.Tensor) for arg in launched] == pointers, spec.name
            for position, arg in enumerate(launched):
                cl.kernel_parameter(arg, device, position)
            launches.append((spec, launched))
            on_launch(spec, launched)
        return call

    monkeypatch.setattr(cl, "bind", bind)
    monkeypatch.setattr(cl, "current_stream", lambda device: None)
    return launches


def test_conv_prepares_each_setting_once_and_passes_what_the_kernels_read(monkeypatch) -> None:
    """``DirectBackend.conv``'s host path on the CPU, with the launch replaced by a recorder: a setting is
    prepared once per input size and reused; a strided tile setting hands the kernel the phase images (image
    pairs in float16, written in one pass by ``phase_pair_images``) and the strided layer's output size; split-K
    partial sums are summed and biased here."""
    def record(spec: lg.Launch, args: tuple) -> None:
        if spec.name.startswith("pair_images"):  # the pairing kernel's result, from torch
            args[1].copy_(pair_images(args[0]))
        elif spec.name.startswith("phase_pair_images"):  # the strided float16 layer below
            N, C, H, W = args[0].shape
            assert args[2:] == (N, C, H, W, *split.stride, *split.input_size(H, W))
            args[1].copy_(emulate_phase_pairing(args[0], split))
        elif isinstance(args[5], torch.Tensor) and args[5].dim() == 5:  # split-K: slice s holds s + 1
            args[5].copy_(torch.arange(1.0, args[5].shape[0] + 1).view(-1, 1, 1, 1, 1).expand_as(args[5]))

    launches = record_launches(monkeypatch, record)
    backend = DirectBackend()
    weight = torch.randn(6, 4, 3, 3)
    weight[torch.rand(weight.shape) < 0.7] = 0
    csr, geometry = UniformCSR.from_dense(weight.half()), ConvGeometry.of(2, 1)
    split = phase_split(csr, geometry)
    params = {"variant": "tile", "wx": 8, "py": 2, "nb": 2, "mw": 4, "warps": 2, "cc": 4}
    x = torch.randn(3, 4, 15, 11).half()  # odd sizes: the phase images' last row and column read zero padding
    prepare = DirectBackend._prepare
    prepared: list[tuple] = []
    monkeypatch.setattr(DirectBackend, "_prepare", lambda self, *a: prepared.append(a[0].shape) or prepare(self, *a))
    for batch in (3, 3, 2):
        out = backend.conv(x[:batch], csr, None, geometry, **params)
        assert out.shape == (batch, 6, 8, 6) and out.dtype == torch.float16
    assert prepared == [(3, 4, 15, 11), (2, 4, 15, 11)]
    assert launches[-2][0].name == "phase_pair_images<__half>"  # float16 reads image pairs of the phases
    assert launches[-2][1][0] is not None and launches[-2][1][0].shape == (2, 4, 15, 11)  # read from x itself
    spec, args = launches[-1]
    assert spec.name.startswith("direct_tile<__half,2,2,")
    assert torch.equal(args[0], pair_images(split.input(x[:2])))  # (1, 16, 8, 6, 2): phases, image pairs
    assert args[6:13] == (2, 16, 8, 6, 6, 8, 6) and args[13:15] == split.geometry.padding
    union = {"variant": "tile", "wx": 32, "py": 2, "nb": 2, "mw": 3, "warps": 2, "cc": 4, "union": 3}
    x32, csr32 = torch.randn(3, 4, 8, 16), UniformCSR.from_dense(weight)
    for paired in (False, True):
        backend.conv(x32, csr32, None, ConvGeometry.of(1, 1), **union, **({"paired": True} if paired else {}))
        spec, args = launches[-1]
        assert spec.name.endswith(f",3,{1 + paired},0,0>") and args[-2:] == (0, 0)  # no entry slots, no ReLU
        assert torch.equal(args[0], pair_images(x32) if paired else x32)  # float32 pairs only where asked
    backend.conv(x32, csr32, None, ConvGeometry.of(1, 1), **union, entries="shared", min_blocks=3)
    spec, args = launches[-1]  # the slots hold the longest list, and the shared memory both buffers of them
    assert spec.name.endswith(",3,1,1,3>") and args[-2] == longest_list(csr32, 4, 3) > 0
    layout = lg.tile_layout(torch.float32, (3, 3), tiling_of({**union, "entries": "shared"}))
    assert spec.shared_bytes == layout.shared_bytes() + 2 * 2 * args[-2] * 16
    backend.conv(x32, csr32, torch.randn(6), ConvGeometry.of(2, 1))  # rows, the default setting
    assert launches[-1][0].name.startswith("direct_rows<float,")
    csr1 = UniformCSR.from_dense(torch.randn(5, 64, 1, 1))
    bias = torch.randn(5)
    setting = {"variant": "pointwise", "pv": 1, "mw": 2, "warps": 4, "cc": 16, "splits": 4}
    out = backend.conv(torch.randn(1, 64, 4, 4), csr1, bias, ConvGeometry.of(1, 0), **setting)
    assert launches[-1][1][3] is None  # the bias is added after the sum, not by each split
    assert torch.allclose(out, (1.0 + 2.0 + 3.0 + 4.0) + bias.view(5, 1, 1).expand(1, 5, 4, 4))


def test_the_dynamic_shared_memory_opt_in_only_grows(monkeypatch) -> None:
    """A staged-entry instantiation is bound with the shared memory of each weight's slots: the opt-in keeps the
    largest size asked for per (instantiation, device), so a launch bound with more is not refused after a smaller
    one (CUDA_ERROR_INVALID_VALUE on the H100 before this)."""
    kernels: dict[str, object] = {}
    monkeypatch.setattr(cl, "get_kernel", lambda name: kernels.setdefault(name, type("Kernel", (), {})()))
    monkeypatch.setattr(cl, "_OPTED_IN", {})
    for shared_bytes in (70_000, 60_000, 80_000, 50_000):
        cl._opt_in("k", shared_bytes, 0)
    assert kernels["k"].max_dynamic_shared_size_bytes == 80_000
    cl._opt_in("k", 55_000, 1)  # another device has its own attribute
    assert cl._OPTED_IN == {("k", 0): 80_000, ("k", 1): 55_000}


def test_tile_shared_limit_follows_the_gpus_opt_in_limit(monkeypatch) -> None:
    assert lg.tile_shared_limit(torch.device("cpu")) == lg.TILE_SHARED_LIMIT_BYTES

    def properties(optin: int):
        return lambda device: type("Properties", (), {"shared_memory_per_block_optin": optin})()

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties(64 * 1024))  # sm_75
    assert lg.tile_shared_limit(torch.device("cuda", 0)) == 64 * 1024
    monkeypatch.setattr(torch.cuda, "get_device_properties", properties(227 * 1024))  # sm_90
    assert lg.tile_shared_limit(torch.device("cuda", 0)) == lg.TILE_SHARED_LIMIT_BYTES
    monkeypatch.setattr(lg, "tile_shared_limit", lambda device: lg.SHARED_LIMIT_BYTES)
    csr = UniformCSR.from_dense(torch.randn(8, 4, 3, 3))
    tiles = [p for p in DirectBackend().tuning_space(torch.zeros(2, 4, 64, 64), csr, ConvGeometry.of(1, 1))
             if p["variant"] == "tile"]
    assert tiles and all(lg.tile_layout(torch.float32, (3, 3), tiling_of(p), 1 if p.get("stage") else None)
                         .shared_bytes() <= lg.SHARED_LIMIT_BYTES for p in tiles)
    assert len(tiles) < len(tile_space(2, (64, 64), (3, 3), torch.float32, vector_pad=1))


@pytest.mark.parametrize(("params", "message"), [
    ({"variant": "tile", "wx": 32.0, "py": 4, "nb": 2, "mw": 4, "warps": 8, "cc": 8}, "tiling: wx must be a positive"),
    ({"variant": "tile", "wx": 32, "py": True, "nb": 2, "mw": 4, "warps": 8, "cc": 8}, "tiling: py must be"),
    ({"variant": "tile", "wx": 32, "py": 4, "nb": 2, "mw": 4, "warps": 8, "cc": 8, "paired": 1},
     "paired must be a bool"),
    ({"variant": "tile", "wx": 32, "py": 4, "mw": 4, "warps": 8, "cc": 8}, r"a tile setting needs \['nb'\]"),
    ({"variant": "pointwise", "pv": 1, "mw": "4", "warps": 8, "cc": 8}, "tiling: mw must be"),
    ({"variant": "rows", "threads": 128.0}, "rows: threads must be a positive integer"),
    ({"variant": "rows", "pixels": 0}, "rows: pixels must be"),
    ({"variant": "tile", "wx": 32, "py": 8, "nb": 2, "mw": 8, "warps": 16, "cc": 1}, "at most 8 warps, got 16"),
])
def test_hand_made_direct_settings_are_refused_before_a_kernel_name_is_built(params, message):
    """Settings passed by hand (``backend_params``) are not checked against the tuning space as plan entries are:
    floats, bools and strings would reach NVRTC as template text or the driver as a float."""
    from unsparse.runtime.backends.direct import DirectBackend

    x = torch.randn(2, 8, 9, 9)
    kernel = 1 if params["variant"] == "pointwise" else 3
    csr = UniformCSR.from_dense(torch.randn(8, 8, kernel, kernel))
    geometry = ConvGeometry.of(1, 0 if params["variant"] == "pointwise" else 1)
    with pytest.raises(ValueError, match=message):
        DirectBackend()._launch(x, csr, geometry, params)


def test_hand_made_tile_settings_are_held_to_the_running_gpus_shared_memory(monkeypatch):
    """The direct backend checks a tile setting's staged chunks against the GPU's own per-block limit
    (:func:`~unsparse.runtime.launch_geometry.tile_shared_limit`), not the fixed 99 KB, before anything launches."""
    from unsparse.runtime.backends.direct import DirectBackend

    params = {"variant": "tile", "wx": 16, "py": 4, "nb": 2, "mw": 8, "warps": 8, "cc": 8}  # 60 KB of chunks
    x, csr = torch.randn(2, 8, 9, 9), UniformCSR.from_dense(torch.randn(8, 8, 3, 3))
    assert DirectBackend()._launch(x, csr, ConvGeometry.of(1, 1), params)[0].shared_bytes == 61440
    monkeypatch.setattr(lg, "tile_shared_limit", lambda device: 48 * 1024)
    with pytest.raises(ValueError, match="61440 bytes exceed the 49152 bytes"):
        DirectBackend()._launch(x, csr, ConvGeometry.of(1, 1), params)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("relu", [False, True])
def test_a_fused_residual_and_relu_run_once_in_the_kernel_or_in_passes_after_it(monkeypatch, relu: bool,
                                                                                 residual: bool) -> None:
    """``conv(relu=..., residual=...)``: the rows, tile and one-split pointwise kernels get ``relu`` 1 and the
    residual, and their output is returned as they wrote it (no second pass); a wide tile tiling, whose kernel stores
    without them, split-K partial sums and, with a residual, a half2 tiling get 0 and no residual, and the add and the
    ReLU follow in passes. Each
    stand-in kernel writes -1 everywhere and ignores the residual (0.5 everywhere), so where the add and the ReLU ran
    shows in the result."""
    def write_minus_one(spec: lg.Launch, args: tuple) -> None:
        if spec.name.startswith("pair_images"):
            args[1].copy_(pair_images(args[0]))
        else:
            args[6 if spec.name.startswith("direct_rows") else 5].fill_(-1.0)

    launches = record_launches(monkeypatch, write_minus_one)
    backend = DirectBackend()
    weight = torch.randn(6, 8, 3, 3)
    weight[torch.rand(weight.shape) < 0.6] = 0
    csr, x = UniformCSR.from_dense(weight), torch.randn(4, 8, 8, 32)
    narrow = {"variant": "tile", "wx": 32, "py": 2, "nb": 2, "mw": 3, "warps": 2, "cc": 4, "union": 3}
    wide = {**narrow, "py": 6, "nb": 4, "paired": True}
    assert tiling_of(narrow).fuses_epilogue() and not tiling_of(wide).fuses_epilogue()
    pointwise = UniformCSR.from_dense(torch.randn(6, 64, 1, 1))
    one_split = {"variant": "pointwise", "pv": 1, "mw": 2, "warps": 4, "cc": 16}
    half2 = {"variant": "tile", "wx": 32, "py": 2, "nb": 2, "mw": 2, "warps": 2, "cc": 4, "accumulate": "half2"}
    cases = [(csr, x, ConvGeometry.of(1, 1), {}, True), (csr, x, ConvGeometry.of(1, 1), narrow, True),
             (csr, x, ConvGeometry.of(1, 1), wide, False),
             (pointwise, torch.randn(1, 64, 4, 4), ConvGeometry.of(1, 0), one_split, True),
             (pointwise, torch.randn(1, 64, 4, 4), ConvGeometry.of(1, 0), {**one_split, "splits": 4}, False),
             (UniformCSR.from_dense(weight.half()), x.half(), ConvGeometry.of(1, 1), half2, not residual)]
    for weight_csr, inputs, geometry, setting, in_kernel in cases:
        shape = (inputs.shape[0], 6, *inputs.shape[2:])
        identity = torch.full(shape, 0.5, dtype=inputs.dtype) if residual else None
        chosen = DirectHalf2Backend() if "accumulate" in setting else backend
        out = chosen.conv(inputs, weight_csr, None, geometry, relu=relu, residual=identity, **setting)
        spec, args = launches[-1]
        assert args[-1] == int(relu and in_kernel), spec.name
        handed = args[5 if spec.name.startswith("direct_rows") else 4]
        assert handed is (identity if in_kernel else None), spec.name  # contiguous and aligned: not copied
        written = -4.0 if setting.get("splits") else -1.0  # split-K: the sum of four slices of -1
        after = written + 0.5 if residual else written
        expected = written if in_kernel else max(after, 0.0) if relu else after  # in the kernel: its output untouched
        assert torch.equal(out, torch.full_like(out, expected)), spec.name


def test_an_empty_batch_checks_its_residual_too() -> None:
    """No kernel runs for an empty batch, but a residual of the wrong shape is refused as for any batch."""
    csr = UniformCSR.from_dense(torch.randn(4, 3, 3, 3))
    x = torch.randn(0, 3, 6, 6)
    out = DirectBackend().conv(x, csr, None, ConvGeometry.of(1, 1), relu=True, residual=torch.randn(0, 4, 6, 6))
    assert out.shape == (0, 4, 6, 6)
    with pytest.raises(ValueError, match="residual: expected"):
        DirectBackend().conv(x, csr, None, ConvGeometry.of(1, 1), relu=True, residual=torch.randn(5, 3))
    with_residual = DirectBackend().conv_call(x, csr, None, ConvGeometry.of(1, 1), relu=True, residual=True)
    with pytest.raises(TypeError, match="residual=True takes 1 residual, got 0"):  # as a non-empty batch's call
        with_residual(x)
    with pytest.raises(TypeError, match="residual=False takes 0 residual, got 1"):
        DirectBackend().conv_call(x, csr, None, ConvGeometry.of(1, 1))(x, torch.randn(0, 4, 6, 6))


def test_the_kernels_read_a_residual_of_the_outputs_shape_contiguous_and_aligned() -> None:
    """``kernel_residual``: a residual of another shape, dtype or device is refused naming the field (the kernels
    read one element per output); a channels-last or misaligned one is copied into a contiguous, 16-byte aligned
    tensor of the same values; a contiguous aligned one is handed over as it is."""
    x, shape = torch.randn(2, 3, 5, 5), (2, 4, 5, 5)
    residual = torch.randn(shape)
    assert kernel_residual(residual, shape, x) is residual
    channels_last = residual.contiguous(memory_format=torch.channels_last)
    copied = kernel_residual(channels_last, shape, x)
    assert copied.is_contiguous() and torch.equal(copied, residual)
    misaligned = torch.randn(residual.numel() + 1)[1:].view(shape)
    assert not lg.vector_aligned(misaligned)
    copied = kernel_residual(misaligned, shape, x)
    assert lg.vector_aligned(copied) and torch.equal(copied, misaligned)
    for bad in (torch.randn(2, 4, 5, 4), residual.double(), torch.randn(1, 4, 5, 5), 1.0):
        with pytest.raises(ValueError, match=r"residual: expected \(2, 4, 5, 5\) torch.float32"):
            kernel_residual(bad, shape, x)
