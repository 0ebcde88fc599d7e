"""The weight-specialised kernels' generator (``unsparse.runtime.generated_source``) on the CPU: the programs run as
the kernel indexes the padded input and match ``F.conv2d`` in float64, the CUDA text says exactly what the program
says, bad weights and sizes are refused naming the field, and the source compiles for sm_90 (NVRTC, as CuPy does)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.test_kernels_nvrtc import compile_with_nvrtc, nvrtc_library
from unsparse.runtime import generated_source as gs


def random_weight(rng: np.random.Generator, shape: tuple[int, int, int, int], density: float) -> np.ndarray:
    """float32 weight with about ``density`` of its entries nonzero, row 0 all zero and row 1 fully dense."""
    weight = (rng.standard_normal(shape) * (rng.random(shape) < density)).astype(np.float32)
    weight[0] = 0.0
    if shape[0] > 1:
        weight[1] = rng.standard_normal(shape[1:]).astype(np.float32) + 3.0
    return weight


def run_layer(weight: np.ndarray, x: np.ndarray, padding: tuple[int, int], rows: int, pixels: int = 1) -> np.ndarray:
    """The layer's output from its programs, run on the CPU one after another as the kernels are launched, on the
    input padded as the backend pads it (zeros up to the row pitch on the right)."""
    pitch = gs.row_pitch(x.shape[3], padding[1], weight.shape[3], pixels)
    padded = np.pad(x, ((0, 0), (0, 0), (padding[0],) * 2, (padding[1], pitch - x.shape[3] - padding[1])))
    layer_programs = gs.programs(weight, padding, x.shape[2:], rows, pixels)
    return np.concatenate([gs.run_program(p, padded) for p in layer_programs], axis=1)


CASES = [  # (M, C, H, W, R, S, padding, density, rows)
    (10, 5, 9, 13, 3, 3, (1, 1), 0.3, 4),  # F = 13: the last pair of a row holds a pixel past F
    (7, 3, 6, 5, 3, 3, (0, 0), 0.5, 3),
    (5, 17, 4, 4, 1, 1, (0, 0), 0.4, 8),
    (9, 4, 7, 7, 5, 5, (2, 2), 0.2, 2),
    (6, 2, 3, 3, 3, 3, (2, 2), 0.9, 64),
    (4, 3, 1, 11, 1, 3, (0, 1), 0.5, 3),  # a Conv1d as H = 1
    (3, 2, 5, 6, 2, 3, (1, 0), 0.6, 1),  # even kernel, padding on one axis only
    (4, 3, 5, 7, 3, 2, (1, 0), 0.5, 2),  # even S: S + 1 values per row is odd, the last pair reads one more
    (3, 2, 4, 1, 3, 1, (1, 0), 0.7, 2),  # W = F = 1: one pixel per row, its pair's second pixel is past F
]


@pytest.mark.parametrize("pixels", gs.PIXEL_CHOICES)
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_programs_match_conv2d_in_float64(case: tuple, pixels: int) -> None:
    M, C, H, W, R, S, padding, density, rows = case
    rng = np.random.default_rng(len(CASES) + M * C)
    weight = random_weight(rng, (M, C, R, S), density)
    x = rng.standard_normal((2, C, H, W))
    expected = F.conv2d(torch.from_numpy(x), torch.from_numpy(weight).double(), padding=padding).numpy()
    out = run_layer(weight, x, padding, rows, pixels)
    assert out.shape == expected.shape
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-12)


def test_programs_split_the_rows_and_count_the_nonzeros() -> None:
    rng = np.random.default_rng(3)
    weight = random_weight(rng, (10, 4, 3, 3), 0.3)
    programs = gs.programs(weight, (1, 1), (6, 6), 4)
    assert [(p.first, p.rows, p.width) for p in programs] == [(0, 4, 4), (4, 4, 4), (8, 2, 4)]
    assert sum(p.products for p in programs) == np.count_nonzero(weight)
    assert programs[0].out_hw == (6, 6) and programs[0].padded_hw == (8, 8) and programs[0].groups == 36
    for program in programs:  # one load per (channel, tap) with a nonzero, each in bounds of one padded image
        assert len({tap.offset for tap in program.taps}) == len(program.taps)
        assert all(0 <= tap.offset < 4 * 8 * 8 for tap in program.taps)
        assert all(value != 0.0 for tap in program.taps for _, value in tap.products)


def test_an_all_zero_weight_gives_programs_without_taps() -> None:
    programs = gs.programs(np.zeros((3, 2, 3, 3), np.float32), (1, 1), (4, 4), 2)
    assert [p.taps for p in programs] == [(), ()]
    x = np.random.default_rng(0).standard_normal((1, 2, 4, 4))
    assert not run_layer(np.zeros((3, 2, 3, 3), np.float32), x, (1, 1), 2).any()


def parse_products(source: str) -> list[tuple[int, int, int, float]]:
    """The (pixel, row, address read, weight) of every multiply-add the CUDA text of ``products`` performs, read
    back from the text: addresses relative to ``base``, a pair's ``.y`` one past its load's, with accumulators
    checked to be the same on both sides of the ``fmaf``."""
    performed = []
    for block in re.findall(r"\{(.*?)\n  \}", source, re.S):
        loads = {name: int(offset) for name, offset in
                 re.findall(r"const float2? (v\d*) = load2?\(base \+ (\d+)\);", block)}
        assert len(loads) == block.count("load")
        for pixel, row, name, part, value, pixel_again, row_again in re.findall(
                r"acc\[(\d+)\]\[(\d+)\] = fmaf\((v\d*)(\.[xy])?, (\S+)f, acc\[(\d+)\]\[(\d+)\]\);", block):
            assert (pixel, row) == (pixel_again, row_again)
            performed.append((int(pixel), int(row), loads[name] + (part == ".y"), float.fromhex(value)))
    return performed


@pytest.mark.parametrize("pixels", gs.PIXEL_CHOICES)
def test_the_cuda_text_performs_exactly_the_programs_products(pixels: int) -> None:
    """Pixel q of tap ``offset`` reads ``base + offset + q``; pair loads start at even offsets in the tap's row and
    their second value stays inside the padded row for every pixel group of the row."""
    rng = np.random.default_rng(5)
    weight = random_weight(rng, (6, 3, 3, 3), 0.4)
    weight[2, 1, 1, 1] = np.float32(1e-40)  # a float32 subnormal survives the literal exactly
    for program in gs.programs(weight, (1, 1), (5, 7), 3, pixels):
        source = gs.products_source(program)
        expected = [(q, row, tap.offset + q, value) for tap in program.taps for row, value in tap.products
                    for q in range(pixels)]
        assert sorted(parse_products(source)) == sorted(expected)
        assert source.count("fmaf") == program.products * pixels
        pitch = program.padded_hw[1]
        last_group = 2 * (program.groups // program.out_hw[0] - 1) if pixels == 2 else program.out_hw[1] - 1
        for offset in map(int, re.findall(r"load2?\(base \+ (\d+)\)", source)):
            assert offset % pixels == 0 and pitch % pixels == 0
            assert last_group + offset % pitch + pixels - 1 < pitch
    products = [value for p in gs.programs(weight, (1, 1), (5, 7), 3) for tap in p.taps for _, value in tap.products]
    assert np.float32(1e-40) in np.array(products, dtype=np.float32)


def test_pairs_share_loads_between_taps_and_pixels() -> None:
    """A dense 3x3 row of taps needs 4 values for two pixels: two pair loads, not six single ones."""
    weight = np.ones((2, 1, 3, 3), np.float32)
    program = gs.programs(weight, (1, 1), (4, 6), 2, pixels=2)[0]
    source = gs.products_source(program)
    assert source.count("load2(") == 3 * 2 and source.count("fmaf") == 2 * 2 * 9
    assert gs.products_source(gs.programs(weight, (1, 1), (4, 6), 2)[0]).count("load(") == 9


@pytest.mark.parametrize(("in_w", "pad_w", "kernel_w", "pitch"), [
    (56, 1, 3, 58), (7, 1, 3, 10), (13, 1, 3, 16), (14, 0, 1, 14), (7, 0, 1, 8), (6, 0, 2, 8), (1, 0, 1, 2)])
def test_row_pitch_of_pairs_is_even_and_covers_the_last_pair(in_w: int, pad_w: int, kernel_w: int,
                                                             pitch: int) -> None:
    assert gs.row_pitch(in_w, pad_w, kernel_w, 2) == pitch
    assert gs.row_pitch(in_w, pad_w, kernel_w, 1) == in_w + 2 * pad_w


@pytest.mark.parametrize(("weight", "kwargs", "field"), [
    (np.zeros((2, 2, 3, 3), np.float64), {}, "weight"),
    (np.zeros((2, 2, 3), np.float32), {}, "weight"),
    (np.full((2, 2, 3, 3), np.inf, np.float32), {}, "weight"),
    (np.full((2, 2, 3, 3), np.nan, np.float32), {}, "weight"),
    (np.ones((2, 2, 3, 3), np.float32), {"rows": 0}, "rows"),
    (np.ones((2, 2, 3, 3), np.float32), {"rows": True}, "rows"),
    (np.ones((2, 2, 3, 3), np.float32), {"pixels": 3}, "pixels"),
    (np.ones((2, 2, 3, 3), np.float32), {"pixels": True}, "pixels"),
    (np.ones((2, 2, 3, 3), np.float32), {"padding": (-1, 0)}, "padding"),
    (np.ones((2, 2, 3, 3), np.float32), {"in_hw": (1, 5), "padding": (0, 0)}, "in_hw"),
    (np.ones((1, 2, 1, 1), np.float32), {"in_hw": (2**15, 2**15), "padding": (0, 0)}, "in_hw"),
])
def test_bad_inputs_are_refused_naming_the_field(weight: np.ndarray, kwargs: dict, field: str) -> None:
    arguments = {"padding": (1, 1), "in_hw": (4, 4), "rows": 2, "pixels": 1, **kwargs}
    with pytest.raises(ValueError, match=f"^{field}:"):
        gs.programs(weight, arguments["padding"], arguments["in_hw"], arguments["rows"], arguments["pixels"])


def test_kernel_source_refuses_other_dtypes_and_thread_counts() -> None:
    program = gs.programs(np.ones((2, 2, 3, 3), np.float32), (1, 1), (4, 4), 2)[0]
    with pytest.raises(ValueError, match=r"^dtype:"):
        gs.kernel_source(program, torch.float64, 256)
    with pytest.raises(ValueError, match=r"^threads:"):
        gs.kernel_source(program, torch.float32, 96)
    source = gs.kernel_source(program, torch.float16, 128)
    for constant in ("#define KT 2", "#define PIXELS 1", "#define C 2", "#define HP 6", "#define WP 6", "#define E 4",
                     "#define F 4", "#define THREADS 128", "typedef __half T;"):
        assert constant in source
    paired = gs.programs(np.ones((2, 2, 3, 3), np.float32), (1, 1), (4, 5), 2, pixels=2)[0]
    assert "#define PIXELS 2" in gs.kernel_source(paired, torch.float32, 64)
    assert "#define WP 8" in gs.kernel_source(paired, torch.float32, 64)


def test_launch_sizes() -> None:
    assert gs.choose_threads(128 * 56 * 56, 132) == 256
    assert gs.choose_threads(128 * 14 * 14, 132) == 64  # 25 088 pixels: 98 blocks of 256, 196 of 128, 392 of 64
    assert gs.choose_threads(7 * 7, 132) == 64
    assert gs.resident_blocks(32, 256) == 8  # 2048 threads
    assert gs.resident_blocks(64, 256) == 4
    assert gs.resident_blocks(100, 256) == 2  # 104 registers allocated per thread
    assert gs.resident_blocks(255, 1024) == 1
    assert gs.launch_grid(10_000, 256, 8, 132) == (40, 1, 1)
    assert gs.launch_grid(10**7, 256, 8, 132) == (1056, 1, 1)


@pytest.mark.skipif(nvrtc_library() is None, reason="no NVRTC library in the nvidia wheels")
@pytest.mark.parametrize("pixels", gs.PIXEL_CHOICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_generated_source_compiles_under_nvrtc_for_sm90(dtype: torch.dtype, pixels: int) -> None:
    rng = np.random.default_rng(7)
    program = gs.programs(random_weight(rng, (8, 16, 3, 3), 0.2), (1, 1), (9, 9), 8, pixels)[0]
    library = nvrtc_library()
    include = library.parent.parent / "include"
    status, log = compile_with_nvrtc(library, gs.kernel_source(program, dtype, 64), [],
                                     ["-std=c++17", "-arch=sm_90", f"-I{include}"])
    assert status == 0, log
