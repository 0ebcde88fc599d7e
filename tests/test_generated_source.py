"""The weight-specialised kernels' generator (``unsparse.runtime.generated_source``) on the CPU: the programs run as
the kernel indexes the padded input and match ``F.conv2d`` in float64, the CUDA text says exactly what the program
says, bad weights and sizes are refused naming the field, and the source compiles for sm_90 (NVRTC, as CuPy does)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.test_kernels_nvrtc import compile_with_nvrtc, nvrtc_library
from unsparse.runtime import generated_source as gs
from unsparse.sparse import ConvGeometry, UniformCSR
from unsparse.sparse.phases import phase_split


def random_weight(rng: np.random.Generator, shape: tuple[int, int, int, int], density: float) -> np.ndarray:
    """float32 weight with about ``density`` of its entries nonzero, row 0 all zero and row 1 fully dense."""
    weight = (rng.standard_normal(shape) * (rng.random(shape) < density)).astype(np.float32)
    weight[0] = 0.0
    if shape[0] > 1:
        weight[1] = rng.standard_normal(shape[1:]).astype(np.float32) + 3.0
    return weight


def run_layer(weight: np.ndarray, x: np.ndarray, padding: tuple[int, int], rows: int) -> np.ndarray:
    """The layer's output from its programs, run on the CPU one after another as the kernels are launched."""
    padded = np.pad(x, ((0, 0), (0, 0), (padding[0],) * 2, (padding[1],) * 2))
    return np.concatenate([gs.run_program(p, padded) for p in gs.programs(weight, padding, x.shape[2:], rows)],
                          axis=1)


CASES = [  # (M, C, H, W, R, S, padding, density, rows)
    (10, 5, 9, 13, 3, 3, (1, 1), 0.3, 4),
    (7, 3, 6, 5, 3, 3, (0, 0), 0.5, 3),
    (5, 17, 4, 4, 1, 1, (0, 0), 0.4, 8),
    (9, 4, 7, 7, 5, 5, (2, 2), 0.2, 2),
    (6, 2, 3, 3, 3, 3, (2, 2), 0.9, 64),
    (4, 3, 1, 11, 1, 3, (0, 1), 0.5, 3),  # a Conv1d as H = 1
    (3, 2, 5, 6, 2, 3, (1, 0), 0.6, 1),  # even kernel, padding on one axis only
]


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_programs_match_conv2d_in_float64(case: tuple) -> None:
    M, C, H, W, R, S, padding, density, rows = case
    rng = np.random.default_rng(len(CASES) + M * C)
    weight = random_weight(rng, (M, C, R, S), density)
    x = rng.standard_normal((2, C, H, W))
    expected = F.conv2d(torch.from_numpy(x), torch.from_numpy(weight).double(), padding=padding).numpy()
    out = run_layer(weight, x, padding, rows)
    assert out.shape == expected.shape
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-12)


def test_programs_split_the_rows_and_count_the_nonzeros() -> None:
    rng = np.random.default_rng(3)
    weight = random_weight(rng, (10, 4, 3, 3), 0.3)
    programs = gs.programs(weight, (1, 1), (6, 6), 4)
    assert [(p.first, p.rows, p.width) for p in programs] == [(0, 4, 4), (4, 4, 4), (8, 2, 4)]
    assert sum(p.products for p in programs) == np.count_nonzero(weight)
    assert programs[0].out_hw == (6, 6) and programs[0].padded_hw == (8, 8)
    for program in programs:  # one load per (channel, tap) with a nonzero, each in bounds of one padded image
        assert len({tap.offset for tap in program.taps}) == len(program.taps)
        assert all(0 <= tap.offset < 4 * 8 * 8 for tap in program.taps)
        assert all(value != 0.0 for tap in program.taps for _, value in tap.products)


def test_an_all_zero_weight_gives_programs_without_taps() -> None:
    programs = gs.programs(np.zeros((3, 2, 3, 3), np.float32), (1, 1), (4, 4), 2)
    assert [p.taps for p in programs] == [(), ()]
    x = np.random.default_rng(0).standard_normal((1, 2, 4, 4))
    assert not run_layer(np.zeros((3, 2, 3, 3), np.float32), x, (1, 1), 2).any()


def parse_products(source: str) -> list[tuple[int, tuple[tuple[int, float], ...]]]:
    """The (offset, products) pairs the CUDA text of ``products`` performs, in order, read back from the text: each
    group's loads name their values ``v<i>``, and each product names the value it multiplies."""
    taps = []
    for group in re.findall(r"\n  \{\n(.*?)\n  \}", source, re.S):
        loads = {int(index): int(offset) for index, offset in
                 re.findall(r"const float v(\d+) = __ldg\(base \+ (\d+)\);", group)}
        products: dict[int, list[tuple[int, float]]] = {index: [] for index in loads}
        for row, index, value, again in re.findall(r"acc\[(\d+)\] = fmaf\(v(\d+), (\S+)f, acc\[(\d+)\]\);", group):
            assert row == again
            products[int(index)].append((int(row), float.fromhex(value)))
        taps += [(loads[index], tuple(products[index])) for index in sorted(loads)]
    return taps


@pytest.mark.parametrize("load_batch", [1, 2, 5, 64])
def test_the_cuda_text_performs_exactly_the_programs_products(load_batch: int) -> None:
    """Whatever the taps per group of loads, each tap is loaded once and feeds exactly its products, in order."""
    rng = np.random.default_rng(5)
    weight = random_weight(rng, (6, 3, 3, 3), 0.4)
    weight[2, 1, 1, 1] = np.float32(1e-40)  # a float32 subnormal survives the literal exactly
    for program in gs.programs(weight, (1, 1), (5, 7), 3):
        source = gs.products_source(program, load_batch=load_batch)
        assert parse_products(source) == [(tap.offset, tap.products) for tap in program.taps]
        assert source.count("fmaf") == program.products and source.count("__ldg") == len(program.taps)
        groups = re.findall(r"\n  \{\n(.*?)\n  \}", source, re.S)
        assert [group.count("__ldg") for group in groups] == [
            min(load_batch, len(program.taps) - start) for start in range(0, len(program.taps), load_batch)]
        for group in groups:  # every load of a group before its first product
            assert group.rfind("__ldg") < group.find("fmaf")
    products = [value for p in gs.programs(weight, (1, 1), (5, 7), 3) for tap in p.taps for _, value in tap.products]
    assert np.float32(1e-40) in np.array(products, dtype=np.float32)


def test_a_load_batch_below_one_is_refused() -> None:
    layer = gs.programs(np.ones((5, 2, 3, 3), np.float32), (1, 1), (4, 4), 2)
    for make in (lambda: gs.products_source(layer[0], load_batch=0),
                 lambda: gs.kernel_source(layer[0], torch.float32, load_batch=0),
                 lambda: gs.shared_kernel_source(layer, 5, torch.float32, load_batch=-1)):
        with pytest.raises(ValueError, match=r"^load_batch:"):
            make()


@pytest.mark.parametrize(("weight", "kwargs", "field"), [
    (np.zeros((2, 2, 3, 3), np.float64), {}, "weight"),
    (np.zeros((2, 2, 3), np.float32), {}, "weight"),
    (np.full((2, 2, 3, 3), np.inf, np.float32), {}, "weight"),
    (np.full((2, 2, 3, 3), np.nan, np.float32), {}, "weight"),
    (np.ones((2, 2, 3, 3), np.float32), {"rows": 0}, "rows"),
    (np.ones((2, 2, 3, 3), np.float32), {"rows": True}, "rows"),
    (np.ones((2, 2, 3, 3), np.float32), {"padding": (-1, 0)}, "padding"),
    (np.ones((2, 2, 3, 3), np.float32), {"in_hw": (1, 5), "padding": (0, 0)}, "in_hw"),
    (np.ones((1, 2, 1, 1), np.float32), {"in_hw": (2**15, 2**15), "padding": (0, 0)}, "in_hw"),
    (np.ones((2, 2, 3, 3), np.float32), {"out_hw": (5, 4)}, "out_hw"),
    (np.ones((2, 2, 3, 3), np.float32), {"out_hw": (4, 0)}, "out_hw"),
    (np.ones((2, 2, 3, 3), np.float32), {"out_hw": (4,)}, "out_hw"),
])
def test_bad_inputs_are_refused_naming_the_field(weight: np.ndarray, kwargs: dict, field: str) -> None:
    arguments = {"padding": (1, 1), "in_hw": (4, 4), "rows": 2, "out_hw": None, **kwargs}
    with pytest.raises(ValueError, match=f"^{field}:"):
        gs.programs(weight, arguments["padding"], arguments["in_hw"], arguments["rows"], arguments["out_hw"])


def test_a_smaller_output_plane_is_the_top_left_corner_of_the_whole_one() -> None:
    """``out_hw`` (a strided layer's plane, computed through its phase split) keeps the offsets and the padded plane
    and shrinks only what the kernel computes, E and F in its header."""
    rng = np.random.default_rng(5)
    weight = random_weight(rng, (6, 3, 4, 4), 0.4)
    padded = rng.standard_normal((2, 3, 11, 12))
    whole = gs.programs(weight, (1, 1), (9, 10), 4)
    corner = gs.programs(weight, (1, 1), (9, 10), 4, (5, 7))
    assert [p.taps for p in whole] == [p.taps for p in corner] and corner[0].padded_hw == (11, 12)
    assert whole[0].out_hw == gs.full_out_hw((4, 4), (1, 1), (9, 10)) == (8, 9) and corner[0].out_hw == (5, 7)
    for full, part in zip(whole, corner, strict=True):
        np.testing.assert_array_equal(gs.run_program(part, padded), gs.run_program(full, padded)[:, :, :5, :7])
    assert "#define E 5" in gs.kernel_source(corner[0], torch.float32).split("\n")
    with pytest.raises(ValueError, match=r"^kernel_programs:"):
        gs.shared_kernel_source([whole[0], corner[1]], 6, torch.float32)


def test_kernel_source_refuses_other_dtypes_and_holds_no_launch_size() -> None:
    program = gs.programs(np.ones((2, 2, 3, 3), np.float32), (1, 1), (4, 4), 2)[0]
    with pytest.raises(ValueError, match=r"^dtype:"):
        gs.kernel_source(program, torch.float64)
    source = gs.kernel_source(program, torch.float16)
    for constant in ("#define KT 2", "#define C 2", "#define HP 6", "#define WP 6", "#define E 4", "#define F 4",
                     "#define MAX_THREADS 256", "typedef __half T;"):
        assert constant in source
    # the launch picks its threads per block: the body strides by blockDim.x, bounded by the largest choice
    assert "THREADS" not in source.replace("MAX_THREADS", "") and "blockDim.x" in source
    assert max(gs.THREAD_CHOICES) == 256


def test_min_blocks_is_the_launch_bounds_second_part_and_not_negative() -> None:
    layer = gs.programs(np.ones((5, 2, 3, 3), np.float32), (1, 1), (4, 4), 2)
    assert "#define MIN_BLOCKS 0" in gs.kernel_source(layer[0], torch.float32).split("\n")
    assert "#define MIN_BLOCKS 3" in gs.shared_kernel_source(layer, 5, torch.float16, 3).split("\n")
    for make in (lambda: gs.kernel_source(layer[0], torch.float32, -1),
                 lambda: gs.shared_kernel_source(layer, 5, torch.float32, -1)):
        with pytest.raises(ValueError, match=r"^min_blocks:"):
            make()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_min_blocks_caps_the_registers_of_a_stem_program(tmp_path: Path) -> None:
    """ResNet-50's stem at 0.9 (7x7, stride 2, through its phase split), 64 rows: uncapped, ptxas gives the program
    more registers than three 256-thread blocks per SM leave (85 each); with ``min_blocks`` 3 it fits them, and
    ``min_blocks`` 0 is no bound (the same cubin as the skeleton's bound without a second part)."""
    weight = torch.from_numpy(random_weight(np.random.default_rng(5), (64, 3, 7, 7), 0.1))
    split = phase_split(UniformCSR.from_dense(weight), ConvGeometry.of(2, 3))
    program = gs.programs(split.csr.to_conv2d_weight().numpy(), split.geometry.padding, (112, 112), 64,
                          (112, 112))[0]

    def registers(name: str, text: str) -> int:
        source = tmp_path / f"stem_{name}.cu"
        source.write_text(text)
        result = subprocess.run(["nvcc", "-arch=sm_90", "-cubin", str(source), "-o", str(tmp_path / f"{name}.cubin"),
                                 "-Xptxas", "-v"], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        return int(re.findall(r"Used (\d+) registers", result.stderr)[-1])

    text = gs.kernel_source(program, torch.float32)
    assert registers("0", text) > 65536 // (3 * 256) >= registers("3", gs.kernel_source(program, torch.float32, 3))
    registers("none", text.replace("LAUNCH_BOUNDS generated_conv(", "__launch_bounds__(MAX_THREADS) generated_conv("))
    assert (tmp_path / "0.cubin").read_bytes() == (tmp_path / "none.cubin").read_bytes()


def test_every_storage_type_reads_a_float32_input_and_converts_nothing_per_load() -> None:
    """A float16 layer stores its output and bias as halves but reads the padded input as float32, as a float32 layer
    does: its body is the float32 body (a conversion per load made NVRTC 3-4x slower)."""
    layer = gs.programs(np.ones((5, 2, 3, 3), np.float32), (1, 1), (4, 4), 2)
    for dtype in (torch.float32, torch.float16):
        for source in (gs.kernel_source(layer[0], dtype), gs.shared_kernel_source(layer, 5, dtype)):
            assert "const float* __restrict__ xp" in source and "const T* __restrict__ xp" not in source
            body = source[source.index("void products"):]
            assert "to_float" not in body and "__half" not in body
    assert "typedef __half T;" in gs.kernel_source(layer[0], torch.float16)
    assert gs.products_source(layer[0]) in gs.kernel_source(layer[0], torch.float16)


def test_a_shared_kernel_switches_to_each_body_and_returns_its_first_row() -> None:
    layer = gs.programs(np.ones((5, 2, 3, 3), np.float32), (1, 1), (4, 4), 2)
    source = gs.shared_kernel_source(layer, 5, torch.float32)
    assert "\n#define G 3\n#define M 5\n" in source and "generated_conv_shared" in source
    for index, program in enumerate(layer):
        assert f"__device__ __forceinline__ void products_{index}(" in source
        assert f"case {index}: products_{index}(base, acc); return {program.first};" in source
    assert re.findall(r"case (\d+):", source) == ["0", "1", "2"]
    assert [parse_products(gs.products_source(p, f"products_{i}")) for i, p in enumerate(layer)] == [
        [(tap.offset, tap.products) for tap in p.taps] for p in layer]
    assert "#define G" not in gs.kernel_source(layer[0], torch.float32)


def test_a_shared_kernel_refuses_one_program_mixed_layers_and_a_short_layer() -> None:
    layer = gs.programs(np.ones((5, 2, 3, 3), np.float32), (1, 1), (4, 4), 2)
    other = gs.programs(np.ones((5, 2, 3, 3), np.float32), (1, 1), (4, 5), 2)
    for programs, out_channels, dtype, field in [
            (layer[:1], 5, torch.float32, "kernel_programs"), ([layer[0], other[1]], 5, torch.float32,
                                                               "kernel_programs"),
            (layer, 4, torch.float32, "out_channels"), (layer, 5, torch.float64, "dtype")]:
        with pytest.raises(ValueError, match=f"^{field}:"):
            gs.shared_kernel_source(programs, out_channels, dtype)


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
@pytest.mark.parametrize(("shared", "rows", "load_batch"), [(False, 8, 1), (True, 8, 1), (False, 6, 1), (False, 8, 16),
                                                           (True, 8, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_generated_source_compiles_under_nvrtc_for_sm90(dtype: torch.dtype, shared: bool, rows: int,
                                                       load_batch: int) -> None:
    """Rows 6 are no multiple of four: the pooled epilogue's butterfly pads them to 8 (``KQ``)."""
    rng = np.random.default_rng(7)
    layer = gs.programs(random_weight(rng, (20, 16, 3, 3), 0.2), (1, 1), (9, 9), rows)
    source = (gs.shared_kernel_source(layer, 20, dtype, load_batch=load_batch) if shared else
              gs.kernel_source(layer[0], dtype, load_batch=load_batch))
    library = nvrtc_library()
    include = library.parent.parent / "include"
    status, log = compile_with_nvrtc(library, source, [], ["-std=c++17", "-arch=sm_90", f"-I{include}"])
    assert status == 0, log
