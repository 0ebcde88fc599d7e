"""The kernels compile under NVRTC, CuPy's runtime compiler, on a machine without a GPU.

``test_kernels_compile_for_sm90`` builds them with nvcc, which finds the C++ standard headers; NVRTC does
not (``<type_traits>`` once passed nvcc here and failed on the H100). This test runs NVRTC itself through
ctypes, from the ``nvidia`` wheels torch installs, on every instantiation the tuning spaces of a few layers
name.
"""

from __future__ import annotations

import ctypes
import glob
import site
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from unsparse.runtime import cupy_launcher as cl
from unsparse.runtime import launch_geometry as lg


def nvrtc_library() -> Path | None:
    """``libnvrtc.so`` from an installed ``nvidia`` wheel, or None."""
    found = [Path(path) for folder in site.getsitepackages()
             for path in glob.glob(f"{folder}/nvidia/*/lib/libnvrtc.so*")
             if ".alt." not in path and "builtins" not in path]
    return found[0] if found else None


def compile_with_nvrtc(library: Path, source: str, names: list[str], options: list[str]) -> tuple[int, str]:
    """NVRTC's status code and log for ``source`` with ``names`` as name expressions."""
    for builtins in sorted(library.parent.glob("libnvrtc-builtins.so*")):
        if ".alt." not in builtins.name:
            ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
    nvrtc = ctypes.CDLL(str(library))
    program = ctypes.c_void_p()
    assert nvrtc.nvrtcCreateProgram(ctypes.byref(program), source.encode(), b"direct_conv.cu", 0, None, None) == 0
    for name in names:
        assert nvrtc.nvrtcAddNameExpression(program, name.encode()) == 0
    encoded = [option.encode() for option in options]
    status = nvrtc.nvrtcCompileProgram(program, len(encoded), (ctypes.c_char_p * len(encoded))(*encoded))
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(program, log)
    nvrtc.nvrtcDestroyProgram(ctypes.byref(program))
    return status, log.value.decode(errors="replace")


@pytest.mark.skipif(nvrtc_library() is None, reason="no NVRTC library in the nvidia wheels")
def test_every_tuned_instantiation_compiles_under_nvrtc(tuned_kernel_names, tuned_kernel_name_chunks) -> None:
    library = nvrtc_library()
    assert any(",1,0,1," in name for name in tuned_kernel_names)  # the 16-byte staging is among them
    assert any(name.endswith(f",1,{lg.HALF2_RUN},1,2,0,0>") for name in tuned_kernel_names)  # and the half2 products
    assert any(name.startswith("direct_tile<float") and name.endswith(",1,0,3,1,0,0>")  # union entries
               for name in tuned_kernel_names)
    assert any(name.startswith("direct_tile<float") and name.endswith(",1,0,3,2,0,0>")  # on paired float32 images
               for name in tuned_kernel_names)
    for ending in (",1,0,1,1,1,4>", ",1,0,1,2,1,4>", f",1,{lg.HALF2_RUN},1,2,1,4>"):  # staged entries
        assert any(name.startswith("direct_tile<") and name.endswith(ending) for name in tuned_kernel_names), ending
    assert any(name.startswith("direct_pointwise<__half") and name.endswith(",float>")  # split-K partial sums
               for name in tuned_kernel_names)
    include = library.parent.parent / "include"
    with ThreadPoolExecutor(len(tuned_kernel_name_chunks)) as pool:  # ctypes lets go of the GIL during each call
        outcomes = list(pool.map(lambda names: compile_with_nvrtc(library, cl.KERNEL_FILE.read_text(), names, [
            *cl.COMPILE_OPTIONS, "-arch=compute_90", f"-I{include}"]), tuned_kernel_name_chunks))
    for status, log in outcomes:
        assert status == 0, log
        assert " error" not in log, log


@pytest.mark.skipif(nvrtc_library() is None, reason="no NVRTC library in the nvidia wheels")
def test_the_wide_tiling_check_is_the_kernels_static_assert() -> None:
    """A wide tiling (more than TILE_WIDE_SUMS sums per thread) with more than TILE_WIDE_WARPS warps is refused by
    tile_launch with a ValueError, and NVRTC refuses the same instantiation; one warp fewer passes both."""
    library = nvrtc_library()
    include = library.parent.parent / "include"
    options = [*cl.COMPILE_OPTIONS, "-arch=compute_90", f"-I{include}"]
    launch = lg.tile_launch(torch.float32, 8, 64, (16, 16), (3, 3),
                            lg.TileTiling(32, 8, 2, 8, lg.TILE_WIDE_WARPS, 1))
    status, log = compile_with_nvrtc(library, cl.KERNEL_FILE.read_text(), [launch.name], options)
    assert status == 0, log
    refused = launch.name.replace(f",8,{lg.TILE_WIDE_WARPS},1,", f",8,{lg.TILE_WIDE_WARPS + 1},1,")
    status, log = compile_with_nvrtc(library, cl.KERNEL_FILE.read_text(), [refused], options)
    assert status != 0 and "wide tiling" in log
    with pytest.raises(ValueError, match=f"at most {lg.TILE_WIDE_WARPS} warps, got {lg.TILE_WIDE_WARPS + 1}"):
        lg.tile_launch(torch.float32, 8, 64, (16, 16), (3, 3), lg.TileTiling(32, 8, 2, 8, lg.TILE_WIDE_WARPS + 1, 1))


@pytest.mark.skipif(nvrtc_library() is None, reason="no NVRTC library in the nvidia wheels")
def test_the_padding_kernel_compiles_under_nvrtc_for_each_storage_type() -> None:
    """``pad_planes``, the generated kernels' padded float32 input, as ``padding_launch`` names it."""
    library = nvrtc_library()
    names = [lg.padding_launch(dtype, 8, (6, 6)).name for dtype in (torch.float32, torch.float16)]
    assert names == [f"pad_planes<float,{lg.PADDING_ROWS}>", f"pad_planes<__half,{lg.PADDING_ROWS}>"]
    include = library.parent.parent / "include"
    status, log = compile_with_nvrtc(library, cl.KERNEL_FILE.read_text(), names,
                                     [*cl.COMPILE_OPTIONS, "-arch=compute_90", f"-I{include}"])
    assert status == 0, log
    assert " error" not in log, log


def test_the_padding_launch_covers_every_padded_row_and_plane() -> None:
    warp_rows = lg.PADDING_ROWS * lg.PADDING_THREADS // 32
    launch = lg.padding_launch(torch.float32, 128 * 64, (226, 226))
    assert launch.grid == (-(-128 * 64 * 226 // warp_rows), 1, 1) and launch.block == (lg.PADDING_THREADS, 1, 1)
    assert lg.padding_launch(torch.float16, 3, (5, 16)).grid == (1, 1, 1)  # 15 rows: one block, warps past the end
    assert lg.padding_launch(torch.float32, 2**31 // 5, (5, 3)).grid[0] * warp_rows >= 2**31 - 5
    with pytest.raises(ValueError, match="reach 2\\*\\*31"):
        lg.padding_launch(torch.float32, 2**31 // 5 + 1, (5, 3))
    with pytest.raises(ValueError, match="planes"):
        lg.padding_launch(torch.float32, 0, (6, 6))
