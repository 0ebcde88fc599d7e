"""The instruction-fetch probe's CPU parts: GPC groups from cluster samples, the SM tables of each mapping, and its
PTX (assembled for sm_90 with the toolkit's ptxas where there is one)."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest


@pytest.fixture
def probe(load_script: Callable[[str], ModuleType]) -> ModuleType:
    return load_script("probe_instruction_fetch")


def test_sms_seen_in_one_cluster_share_a_gpc_transitively(probe: ModuleType) -> None:
    samples = [(0, 0), (2, 0), (2, 1), (4, 1), (1, 2), (3, 2), (5, 3)]
    assert probe.gpc_groups(samples) == [[0, 2, 4], [1, 3], [5]]
    assert probe.gpc_groups([(7, 0), (7, 1)]) == [[7]]


def test_each_mapping_gives_every_sm_a_body_below_g(probe: ModuleType) -> None:
    groups = [[0, 2, 4], [1, 3], [5, 6], [7]]
    same, by_sm, by_gpc = (probe.sm_table(mapping, 2, groups) for mapping in ("same", "smid", "gpc"))
    assert same.shape == (probe.TABLE_SIZE,) and same.dtype == np.uint32 and not same.any()
    assert by_sm[:6].tolist() == [0, 1, 0, 1, 0, 1] and by_sm.max() == 1
    assert by_gpc[:8].tolist() == [0, 1, 0, 1, 0, 0, 0, 1]
    with pytest.raises(ValueError, match="mapping: expected same, smid or gpc, got 'tpc'"):
        probe.sm_table("tpc", 2, groups)


def assemble(source: str, tmp_path: Path) -> None:
    """Assemble PTX for sm_90 with the toolkit's ptxas (skip without one): no error and no spills."""
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        pytest.skip("no ptxas here")
    path = tmp_path / "kernel.ptx"
    path.write_text(source)
    done = subprocess.run([ptxas, "-arch=sm_90", "-v", str(path), "-o", str(tmp_path / "kernel.cubin")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "0 bytes spill stores, 0 bytes spill loads" in done.stderr


def test_the_fetch_kernel_holds_g_distinct_bodies_and_assembles(probe: ModuleType, tmp_path: Path) -> None:
    source = probe.fetch_source(3, body=64)
    products = re.findall(r"fma\.rn\.f32 %a\d+, %a\d+, (0f[0-9A-F]{8}), %b;", source)
    assert len(products) == 3 * 64
    assert len({tuple(products[g * 64:(g + 1) * 64]) for g in range(3)}) == 3
    assert source.count("@%p bra START") == 2 and "min.u32 %sm, %sm, 1023;" in source
    assemble(source, tmp_path)


def test_probe_generated_builds_its_icache_kernel_with_the_same_generator(
        load_script: Callable[[str], ModuleType], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``icache_source`` imports ``ffma_loops_ptx`` from the script beside it, as it does when run from scripts/."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "scripts"))
    source = load_script("probe_generated").icache_source(64)
    assert ".visible .entry icache(.param .u64 out, .param .u32 iterations) {" in source
    assert len(re.findall(r"fma\.rn\.f32", source)) == 64 and "%smid" not in source and "START1" not in source
    assemble(source, tmp_path)


def test_probe_generated_passes_every_argument_of_the_kernels_signature(
        load_script: Callable[[str], ModuleType], monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe launches ``generated_conv`` itself: it must pass as many arguments as the kernel takes, each of the
    parameter's width (a pointer 64 bits, an int 32)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "scripts"))
    skeleton = (Path(__file__).resolve().parent.parent / "kernels" / "generated_conv.cu").read_text()
    signature = re.search(r"LAUNCH_BOUNDS generated_conv\((.*?)\)", skeleton, re.S).group(1)
    parameters = [" ".join(parameter.split()) for parameter in signature.split(",")]
    arguments = load_script("probe_generated").kernel_arguments(object(), object(), 10, 4, 2)
    assert len(arguments) == len(parameters) == 9
    for parameter, argument in zip(parameters, arguments, strict=True):
        if "*" in parameter:
            assert not isinstance(argument, np.int32), parameter
        else:
            assert parameter.startswith("int ") and isinstance(argument, np.int32), parameter
