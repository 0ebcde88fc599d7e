"""CPU tests of the direct backend: launch geometry, plan-time arrays and their validation, an emulation of
the kernels' index arithmetic against ``F.conv2d``, tuning spaces, and an nvcc compile of the .cu file."""

from __future__ import annotations

import math
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F

from unsparse.runtime import cupy_launcher as cl
from unsparse.runtime.backends.direct import (
    DirectBackend,
    PatchArrays,
    patch_space,
    prepare_patch,
    prepare_rows,
    rows_space,
    validate_patch,
    validate_rows,
)
from unsparse.sparse import ConvGeometry, UniformCSR

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
    spec = cl.rows_launch(torch.float32, N, csr.out_channels, E * F_, threads, pixels, sub_batch, channels)
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
                dy, dx = tap >> cl.TAP_SHIFT_BITS, tap & ((1 << cl.TAP_SHIFT_BITS) - 1)
                inside = live & (iy0 + dy >= 0) & (iy0 + dy < H) & (ix0 + dx >= 0) & (ix0 + dx < W)
                address = torch.where(inside, off + iy0 * W + ix0, 0)
                assert int(address.max()) < C * H * W and int(address.min()) >= 0
                acc += w * torch.where(inside, flat[n0:n0 + images, address], 0)
            for b in range(images):
                out[n0 + b, m, p[live]] = acc[b][live]
    return out.reshape(N, csr.out_channels, E, F_)


def emulate_patch(x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry, channels: int,
                  thread_tile: tuple[int, int], block_tile: tuple[int, int], sub_batch: int) -> torch.Tensor:
    """``direct_patch`` in Python: grid, tile origin, shared tile with zero halo, grouped codes."""
    N, C, H, W = x.shape
    R, S = csr.kernel_size
    E, F_ = geometry.output_size(H, W, csr.kernel_size)
    chunk = 4
    spec = cl.patch_launch(torch.float32, N, csr.out_channels, (E, F_), (R, S), channels, thread_tile,
                           block_tile, chunk, sub_batch)
    arrays = prepare_patch(csr, channels)
    (PE, PF), (TE, TF) = thread_tile, block_tile
    tiles_f = math.ceil(F_ / TF)
    out = torch.full((N, csr.out_channels, E, F_), float("nan"), dtype=x.dtype)
    ph, pw = geometry.padding
    for group, tile_id, bz in [(a, b, c) for a in range(spec.grid[0]) for b in range(spec.grid[1])
                               for c in range(spec.grid[2])]:
        e0, f0 = (tile_id // tiles_f) * TE, (tile_id % tiles_f) * TF
        for n in range(bz * sub_batch, min(N, (bz + 1) * sub_batch)):
            acc = torch.zeros(channels, TE, TF, dtype=x.dtype)
            for c in range(C):
                tile = torch.zeros(TE + R - 1, TF + S - 1, dtype=x.dtype)
                for yy in range(TE + R - 1):
                    for xx in range(TF + S - 1):
                        iy, ix = e0 + yy - ph, f0 + xx - pw
                        if 0 <= iy < H and 0 <= ix < W:
                            tile[yy, xx] = x[n, c, iy, ix]
                key = group * C + c
                for t in range(int(arrays.group_ptr[key]), int(arrays.group_ptr[key + 1])):
                    code, w = int(arrays.codes[t]), float(arrays.weights[t])
                    m_local, r, s = code // (R * S), (code // S) % R, code % S
                    acc[m_local] += w * tile[r:r + TE, s:s + TF]
            for m_local in range(channels):
                m = group * channels + m_local
                if m < csr.out_channels:
                    e1, f1 = min(E, e0 + TE), min(F_, f0 + TF)
                    out[n, m, e0:e1, f0:f1] = acc[m_local, :e1 - e0, :f1 - f0]
    assert TE % PE == 0 and TF % PF == 0
    return out


@pytest.mark.parametrize("case", GEOMETRIES)
@pytest.mark.parametrize(("threads", "pixels", "sub_batch", "channels"), [(64, 1, 1, 8), (32, 2, 2, 3)])
def test_rows_emulation_matches_conv2d(case: tuple, threads: int, pixels: int, sub_batch: int,
                                       channels: int) -> None:
    x, csr, geometry, ref = layer(case, seed=sum(case))
    out = emulate_rows(x, csr, geometry, threads, pixels, sub_batch, channels)
    assert torch.allclose(out, ref, atol=1e-10)


@pytest.mark.parametrize("case", [g for g in GEOMETRIES if g[7] == 1 and g[9] == 1 and g[2] > 1])
def test_patch_emulation_matches_conv2d(case: tuple) -> None:
    x, csr, geometry, ref = layer(case, seed=3)
    out = emulate_patch(x, csr, geometry, 4, (2, 4), (4, 8), 2)
    assert torch.allclose(out, ref, atol=1e-5)  # the patch arrays hold float32 weights


def test_patch_arrays_drop_padding_and_group_by_channel() -> None:
    weight = torch.zeros(3, 2, 1, 2)
    weight[0, 1, 0, 1], weight[2, 0, 0, 0], weight[2, 1, 0, 0] = 1.0, 2.0, 3.0
    arrays = prepare_patch(UniformCSR.from_dense(weight), channels_per_block=2)
    assert arrays.group_ptr.tolist() == [0, 0, 1, 2, 3]  # (g0,c0) (g0,c1) (g1,c0) (g1,c1)
    assert arrays.codes.tolist() == [1, 0, 0] and arrays.weights.tolist() == [1.0, 2.0, 3.0]


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


def test_validation_rejects_bad_patch_arrays() -> None:
    _, csr, _, _ = layer(GEOMETRIES[0])
    good = prepare_patch(csr, 4)
    groups = 2
    with pytest.raises(ValueError, match="codes"):
        validate_patch(PatchArrays(good.group_ptr, good.codes + 36, good.weights), groups, 3, 36)
    broken = good.group_ptr.clone()
    broken[2] = int(broken[3]) + 1
    with pytest.raises(ValueError, match="group_ptr"):
        validate_patch(PatchArrays(broken, good.codes, good.weights), groups, 3, 36)
    with pytest.raises(ValueError, match="group_ptr"):
        validate_patch(PatchArrays(good.group_ptr[:-1], good.codes, good.weights), groups, 3, 36)
    with pytest.raises(ValueError, match="codes"):
        validate_patch(good, groups, 3, cl.PATCH_MAX_CODES + 1)


def test_launch_geometry() -> None:
    spec = cl.rows_launch(torch.float16, 130, 64, 56 * 56, 128, 2, 4, 8)
    assert spec.grid == (math.ceil(3136 / 256), 8, 33) and spec.block == (128, 1, 1)
    assert spec.name == f"direct_rows<__half,2,4,{cl.ROWS_CHUNK}>"
    spec = cl.patch_launch(torch.float32, 128, 100, (28, 28), (3, 3), 16, (2, 4), (16, 32), 8, 4)
    assert spec.grid == (7, 2, 32) and spec.block == (64, 1, 1)
    assert spec.name == "direct_patch<float,3,3,16,2,4,16,32,8>"
    with pytest.raises(ValueError, match="threads"):
        cl.rows_launch(torch.float32, 1, 1, 1, 100, 1, 1, 1)
    with pytest.raises(ValueError, match="grid"):
        cl.rows_launch(torch.float32, 2**17, 1, 1, 64, 1, 1, 1)
    with pytest.raises(ValueError, match="block_tile"):
        cl.patch_launch(torch.float32, 1, 1, (8, 8), (3, 3), 8, (3, 4), (16, 32), 8, 1)
    with pytest.raises(ValueError, match="channels_per_block"):
        cl.patch_launch(torch.float32, 1, 1, (8, 8), (7, 7), 8, (2, 4), (16, 32), 8, 1)
    with pytest.raises(ValueError, match="dtype"):
        cl.cuda_type(torch.bfloat16)


def test_tuning_spaces() -> None:
    rows = rows_space(batch=3, out_pixels=49)
    assert {p["sub_batch"] for p in rows} == {1, 2}
    assert all(p["threads"] * p["pixels"] <= 98 or (p["threads"], p["pixels"]) == (64, 1) for p in rows)
    assert {p["sub_batch"] for p in rows_space(128, 3136)} == {1, 2, 4, 8}
    assert len(rows_space(1, 1, prune=False)) == 6
    assert patch_space(8, (7, 7), (3, 3)) == []
    big = patch_space(8, (56, 56), (3, 3))
    assert big and all(p["channels"] * 9 <= cl.PATCH_MAX_CODES for p in big)
    x = torch.zeros(2, 4, 16, 16)
    csr = UniformCSR.from_dense(torch.randn(8, 4, 3, 3))
    backend = DirectBackend()
    assert not any(p["variant"] == "patch" for p in backend.tuning_space(x, csr, ConvGeometry.of(2, 1)))
    assert any(p["variant"] == "patch" for p in backend.tuning_space(torch.zeros(2, 4, 64, 64), csr,
                                                                     ConvGeometry.of(1, 1)))
    assert "cuda" in backend.unsupported_reason(x, csr, ConvGeometry.of(1, 1))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_kernels_compile_for_sm90(tmp_path) -> None:
    backend = DirectBackend()
    names = set()
    for shape, kernel, geometry in [((128, 64, 56, 56), (3, 3), ConvGeometry.of(1, 1)),
                                    ((128, 256, 14, 14), (1, 1), ConvGeometry.of(1, 0)),
                                    ((32, 48, 28, 28), (5, 5), ConvGeometry.of(1, 2))]:
        for dtype in cl.supported_dtypes():
            x = torch.zeros(shape, dtype=dtype)
            csr = UniformCSR.from_dense(torch.randn(16, shape[1], *kernel, dtype=dtype))
            names.update(backend.kernel_names(x, csr, geometry))
    source = tmp_path / "instances.cu"
    lines = [f'#include "{cl.KERNEL_FILE}"']
    lines += [f"void* kernel_{i} = (void*)&{name};" for i, name in enumerate(sorted(names))]
    source.write_text("\n".join(lines) + "\n")
    result = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90", "-c", str(source), "-o", str(tmp_path / "k.o"),
                             "-Xptxas", "-warn-spills"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    spilled = [line for line in result.stderr.splitlines() if "spilled" in line]
    # 3x3 and 1x1 instantiations (the layers that carry the work) must stay in registers.
    assert not [line for line in spilled if "Li3ELi3E" in line or "Li1ELi1E" in line], spilled
