"""CPU tests of the direct backend's ``window`` variant: the generated jump tables (parsed back from their
PTX), the grouped arrays and their validation, launch geometry and an emulation of ``direct_window``'s
index arithmetic against ``F.conv2d``."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

from unsparse.runtime import cupy_launcher as cl
from unsparse.runtime.backends.direct import DirectBackend
from unsparse.runtime.backends.direct_window import (
    WINDOW_TILINGS,
    WindowArrays,
    prepare_window,
    validate_window,
    window_shape,
    window_space,
)
from unsparse.runtime.window_dispatch import HEADER_PATH, WINDOW_SHAPES, WindowShape, header, ptx_loop
from unsparse.sparse import ConvGeometry, UniformCSR


def table_of(shape: WindowShape) -> list[list[tuple[int, int]]]:
    """Per code, the (accumulator, window element) pairs the generated threaded PTX adds into, read back from
    the ``fma.rn.f32 %acc, weight, %window, %acc`` lines of each table entry (operands numbered as GCC asm
    does: accumulators, then window elements, then the list pointer). Also checks that every entry loads the
    next pair and jumps on its clamped code, and that the sentinel code is the exit."""
    lines = ptx_loop(shape)
    first_window = shape.accumulators()
    wh, ww = shape.window_hw
    labels = [f"$Lc{k}" for k in range(shape.codes)] + ["$Lexit"]
    assert f"$Ltab: .branchtargets {', '.join(labels)};" in lines and lines[-1] == "$Lexit:"
    assert f"mov.b64 cursor, %{first_window + wh * ww};" in lines
    jump = [f"min.u32 code, code, {shape.codes};", "brx.idx code, $Ltab;"]
    starts = [i for i, line in enumerate(lines) if re.fullmatch(r"\$Lc\d+:", line)]
    assert lines[starts[0] - 2:starts[0]] == jump
    table: dict[int, list[tuple[int, int]]] = {}
    for begin, end in zip(starts, [*starts[1:], len(lines) - 1], strict=True):
        body = lines[begin + 1:end]
        assert body[:2] == ["ld.global.nc.v2.b32 {next_code, next_weight}, [cursor+8];", "add.s64 cursor, cursor, 8;"]
        assert body[-4:] == ["mov.b32 code, next_code;", "mov.b32 weight, next_weight;", *jump]
        pairs = []
        for line in body[2:-4]:
            acc, window, acc_in = re.fullmatch(r"fma\.rn\.f32 %(\d+), weight, %(\d+), %(\d+);", line).groups()
            assert acc == acc_in and first_window <= int(window) < first_window + wh * ww
            pairs.append((int(acc), int(window) - first_window))
        table[int(lines[begin][3:-1])] = pairs
    assert sorted(table) == list(range(shape.codes))
    return [table[k] for k in range(shape.codes)]


def test_committed_header_is_the_generated_one() -> None:
    assert HEADER_PATH.read_text() == header()
    source = cl._source()
    assert '#include "window_dispatch.cuh"' not in source
    assert all(f"struct WindowDispatch<{s.r}, {s.s}, {s.py}, {s.px}, {s.mw}>" in source for s in WINDOW_SHAPES)


@pytest.mark.parametrize("shape", WINDOW_SHAPES)
def test_jump_table_adds_each_tap_to_its_channel(shape: WindowShape) -> None:
    """Code j*R*S + r*S + s must add window[py + r][px + s] into acc[j][py][px] for every (py, px), once."""
    _, ww = shape.window_hw
    for k, pairs in enumerate(table_of(shape)):
        j, r, s = k // (shape.r * shape.s), k // shape.s % shape.r, k % shape.s
        expected = sorted(((j * shape.py + py) * shape.px + px, (py + r) * ww + px + s)
                          for py in range(shape.py) for px in range(shape.px))
        assert sorted(pairs) == expected


def emulate_window(x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry, tiling: cl.WindowTiling,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``direct_window`` in Python: grid decode, staged chunk in the kernel's flat layout (zero halo), the
    chunk boundaries, window loads from shared memory (indices checked against the chunk) and the threaded
    loop: from a list's start, the FMAs of the generated PTX table entry each (clamped) code selects, up to
    the sentinel."""
    N, C, H, W = x.shape
    R, S = csr.kernel_size
    E, F_ = geometry.output_size(H, W, csr.kernel_size)
    layout = cl.window_layout(dtype, (R, S), tiling)
    spec = cl.window_launch(dtype, N, csr.out_channels, (E, F_), (R, S), tiling)
    shape = window_shape(csr, tiling)
    arrays = prepare_window(csr, shape)
    table = table_of(shape)
    wh, ww = shape.window_hw
    (te, tf), warps = tiling.tile_hw, spec.block[0] // 32
    tiles_f, K = math.ceil(F_ / tf), math.ceil(C / tiling.cc)
    blocks = cl.window_channel_blocks(csr.out_channels, tiling)
    ph, pw = geometry.padding
    lane = torch.arange(32)
    ly, lx = lane // tiling.lx, lane % tiling.lx
    window_base = ly * tiling.py * layout.pitch + lx * tiling.px
    out = torch.full((N, csr.out_channels, E, F_), float("nan"), dtype=x.dtype)
    for bx, n in [(a, b) for a in range(spec.grid[0]) for b in range(spec.grid[1])]:
        block_channels, tile_id = bx % blocks, bx // blocks
        e0, f0 = (tile_id // tiles_f) * te, (tile_id % tiles_f) * tf
        acc = torch.zeros(warps, shape.accumulators(), 32, dtype=x.dtype)
        for k in range(K):
            chunk = torch.zeros(layout.chunk * layout.plane, dtype=x.dtype)
            for cc, yy, xx in [(a, b, c) for a in range(tiling.cc) for b in range(layout.tile_h)
                               for c in range(layout.tile_w)]:
                c, iy, ix = k * tiling.cc + cc, e0 + yy - ph, f0 + xx - pw
                if c < C and 0 <= iy < H and 0 <= ix < W:
                    chunk[cc * layout.plane + yy * layout.pitch + xx] = x[n, c, iy, ix]
            for warp in range(warps):
                group = block_channels * tiling.warps + warp
                if group * tiling.mw >= csr.out_channels:
                    continue
                bounds = [int(arrays.group_ptr[group * C + min(k * tiling.cc + i, C)]) for i in range(tiling.cc + 1)]
                for cc in range(min(tiling.cc, C - k * tiling.cc)):
                    if bounds[cc + 1] - bounds[cc] == 1:
                        continue
                    rows = [cc * layout.plane + window_base + i * layout.pitch for i in range(wh)]
                    index = torch.stack([row + q for row in rows for q in range(ww)])  # (WH*WW, 32)
                    assert int(index.min()) >= 0 and int(index.max()) < layout.chunk * layout.plane
                    assert all(int(row.min()) % 4 == 0 for row in rows)  # 16-byte window loads
                    window = chunk[index]
                    t = bounds[cc]
                    while (code := min(int(arrays.entries[t, 0]), shape.codes)) != shape.codes:
                        w = float(arrays.entries[t, 1:2].view(torch.float32))
                        for a, v in table[code]:
                            acc[warp, a] += w * window[v]
                        t += 1
                    assert t == bounds[cc + 1] - 1
        for warp, j in [(a, b) for a in range(warps) for b in range(tiling.mw)]:
            m = (block_channels * tiling.warps + warp) * tiling.mw + j
            if m >= csr.out_channels:
                continue
            for py, px in [(a, b) for a in range(tiling.py) for b in range(tiling.px)]:
                e, f = e0 + ly * tiling.py + py, f0 + lx * tiling.px + px
                live = (e < E) & (f < F_)
                out[n, m, e[live], f[live]] = acc[warp, (j * tiling.py + py) * tiling.px + px][live]
    return out


SMALL_TILINGS = [cl.WindowTiling(lx=4, py=2, px=4, mw=4, warps=2, cc=3),
                 cl.WindowTiling(lx=8, py=2, px=4, mw=8, warps=1, cc=2),
                 cl.WindowTiling(lx=2, py=4, px=4, mw=4, warps=1, cc=5),
                 cl.WindowTiling(lx=8, py=2, px=8, mw=4, warps=2, cc=4)]


def window_layer(N: int, C: int, H: int, W: int, M: int, padding: int, sparsity: float, seed: int):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(M, C, 3, 3, generator=gen, dtype=torch.float64)
    weight[torch.rand(weight.shape, generator=gen, dtype=torch.float64) < sparsity] = 0
    weight[0] = 0  # an all-zero row
    weight[1] = torch.randn(C, 3, 3, generator=gen, dtype=torch.float64)  # a fully dense row
    weight[:, 1] = 0  # an input channel no row uses
    x = torch.randn(N, C, H, W, generator=gen, dtype=torch.float64)
    return x, UniformCSR.from_dense(weight), ConvGeometry.of(1, padding), F.conv2d(x, weight, None, 1, padding)


@pytest.mark.parametrize("tiling", SMALL_TILINGS)
@pytest.mark.parametrize(("case", "padding"), [((2, 7, 9, 11, 5), 1), ((1, 4, 13, 10, 9), 0),
                                               ((1, 3, 5, 6, 10), 2)])
def test_window_emulation_matches_conv2d(tiling: cl.WindowTiling, case: tuple, padding: int) -> None:
    x, csr, geometry, ref = window_layer(*case, padding=padding, sparsity=0.7, seed=sum(case))
    out = emulate_window(x, csr, geometry, tiling)
    assert torch.allclose(out, ref, atol=1e-5)  # the entries hold float32 weights


def test_window_arrays_drop_padding_and_end_lists_with_sentinels() -> None:
    weight = torch.zeros(5, 2, 3, 3)
    weight[4, 1, 2, 0] = 2.0  # group 1 (MW = 4), channel 1, j = 0, code r*3 + s = 6
    weight[1, 0, 0, 1] = -1.0  # group 0, channel 0, j = 1, code 9 + 1
    weight[1, 0, 1, 1] = 3.0  # code 9 + 4
    csr = UniformCSR.from_dense(weight)
    arrays = prepare_window(csr, WindowShape(3, 3, 2, 4, 4))
    assert arrays.group_ptr.tolist() == [0, 3, 4, 5, 7]
    assert arrays.entries[:, 0].tolist() == [10, 13, 36, 36, 36, 6, 36]
    assert arrays.entries[:, 1].view(torch.float32).tolist() == [-1.0, 3.0, 0.0, 0.0, 0.0, 2.0, 0.0]


def test_validation_rejects_bad_window_arrays() -> None:
    _, csr, _, _ = window_layer(1, 3, 6, 6, 6, 1, 0.5, seed=1)
    shape = WindowShape(3, 3, 2, 4, 4)
    good = prepare_window(csr, shape)
    validate_window(good, 6, 3, shape)

    def with_code(row: int, code: int) -> WindowArrays:
        entries = good.entries.clone()
        entries[row, 0] = code
        return WindowArrays(good.group_ptr, entries)

    with pytest.raises(ValueError, match="entries: codes outside"):
        validate_window(with_code(0, shape.codes), 6, 3, shape)  # a sentinel before the end of its list
    with pytest.raises(ValueError, match="entries: codes outside"):
        validate_window(with_code(0, -1), 6, 3, shape)
    with pytest.raises(ValueError, match="sentinel"):
        validate_window(with_code(int(good.group_ptr[1]) - 1, 3), 6, 3, shape)  # a list without its sentinel
    first_of_group_1 = int(good.group_ptr[3])  # group 1 holds channels 4..7, of which 6 and 7 do not exist
    with pytest.raises(ValueError, match="output channel >= 6"):
        validate_window(with_code(first_of_group_1, 2 * 9), 6, 3, shape)
    with pytest.raises(ValueError, match="group_ptr: expected"):
        validate_window(WindowArrays(good.group_ptr, good.entries[:-1]), 6, 3, shape)
    with pytest.raises(ValueError, match="group_ptr: expected"):
        validate_window(WindowArrays(good.group_ptr[:-1], good.entries), 6, 3, shape)
    broken = good.group_ptr.clone()
    broken[1] = int(good.group_ptr[2])  # an empty list
    with pytest.raises(ValueError, match="not increasing"):
        validate_window(WindowArrays(broken, good.entries), 6, 3, shape)
    forged = UniformCSR(csr.values, csr.col_idx, csr.weight_shape)
    object.__setattr__(forged, "col_idx", csr.col_idx + 10_000)
    with pytest.raises(ValueError, match="entries: a column index"):
        prepare_window(forged, shape)
    with pytest.raises(ValueError, match="int32"):
        validate_window(WindowArrays(good.group_ptr, good.entries.long()), 6, 3, shape)


def test_window_layout_is_bank_conflict_free_and_aligned() -> None:
    for tiling in WINDOW_TILINGS + tuple(SMALL_TILINGS):
        layout = cl.window_layout(torch.float32, (3, 3), tiling)
        assert layout.pitch >= layout.tile_w and layout.pitch % 4 == 0
        if tiling.px != 4 or tiling.lx < 4:
            continue  # 8 pixels per lane or 2 lanes per row: some 2-way conflicts are unavoidable
        for quarter in range(4):
            lanes = torch.arange(8 * quarter, 8 * quarter + 8)
            start = (lanes // tiling.lx) * tiling.py * layout.pitch + (lanes % tiling.lx) * tiling.px
            assert len(set((start // 4 % 8).tolist())) == 8, (tiling, layout)
    assert cl.window_layout(torch.float32, (3, 3), WINDOW_TILINGS[0]) == cl.WindowLayout(34, 18, 20, 8, 2)
    with pytest.raises(ValueError, match="float32 only"):
        cl.window_layout(torch.float16, (3, 3), WINDOW_TILINGS[0])
    assert window_space(128, (56, 56), (3, 3), torch.float16) == []
    with pytest.raises(ValueError, match="no jump table"):
        cl.window_layout(torch.float32, (5, 5), WINDOW_TILINGS[0])
    with pytest.raises(ValueError, match="PX a multiple of 4"):
        cl.window_layout(torch.float32, (3, 3), cl.WindowTiling(lx=4, py=2, px=2, mw=8, warps=8, cc=8))
    with pytest.raises(ValueError, match="CC=32"):
        cl.window_layout(torch.float32, (3, 3), cl.WindowTiling(lx=4, py=2, px=4, mw=8, warps=8, cc=32))


def test_window_launch_geometry_and_space() -> None:
    spec = cl.window_launch(torch.float32, 128, 256, (56, 56), (3, 3), WINDOW_TILINGS[0])
    assert spec.grid == (8 * 2 * 4, 128, 1) and spec.block == (256, 1, 1)
    assert spec.name == "direct_window<float,3,3,4,4,4,4,8,8,20>"
    spec = cl.window_launch(torch.float32, 3, 70, (9, 40), (3, 3), cl.WindowTiling(8, 2, 4, 4, 4, 8))
    assert spec.grid == (5 * 2 * 2, 3, 1) and spec.name.startswith("direct_window<float,3,3,2,4,8,4,4,8,")
    with pytest.raises(ValueError, match="warps exceed"):
        cl.window_launch(torch.float32, 1, 8, (8, 8), (3, 3), cl.WindowTiling(4, 2, 4, 8, 64, 8))
    assert len(window_space(128, (56, 56), (3, 3), torch.float32)) == len(WINDOW_TILINGS)
    small = window_space(2, (14, 14), (3, 3), torch.float32)
    assert small and all(p["lx"] * p["px"] <= 28 and 32 // p["lx"] * p["py"] <= 28 for p in small)
    assert window_space(2, (7, 7), (3, 3), torch.float32) == []
    assert window_space(128, (56, 56), (1, 1), torch.float32) == []
    backend = DirectBackend()
    csr = UniformCSR.from_dense(torch.randn(8, 4, 3, 3))
    assert any(p["variant"] == "window" for p in backend.tuning_space(torch.zeros(2, 4, 32, 32), csr,
                                                                       ConvGeometry.of(1, 1)))
    assert not any(p["variant"] == "window" for p in backend.tuning_space(torch.zeros(2, 4, 32, 32), csr,
                                                                           ConvGeometry.of(2, 1)))
