"""scripts/load_distance.py: the load-to-use distance and registers of the generated kernels, from their SASS."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

from unsparse.runtime import generated_source as gs

SASS = """
        /*0100*/                   LDG.E.CONSTANT R4, desc[UR6][R2.64+0x10] ;
        /*0110*/                   LDG.E.CONSTANT R5, desc[UR6][R2.64+0x14] ;
        /*0120*/                   FFMA R8, R5.reuse, 0.5, R8 ;
        /*0130*/              @!P0 FFMA R9, R9, 2, R9 ;
        /*0140*/                   FFMA R10, R4, -1, R10 ;
        /*0150*/                   LDG.E.CONSTANT R6, desc[UR6][R2.64+0x18] ;
        /*0160*/                   MOV R6, RZ ;
        /*0170*/                   LDG.E R7, desc[UR6][R14.64] ;
        /*0180*/                   FADD R8, R8, R7 ;
        /*0190*/                   STG.E desc[UR6][R12.64], R8 ;
        /*01a0*/                   EXIT ;
"""


def test_each_load_counts_the_instructions_until_its_register_is_read(load_script: Callable[[str], ModuleType]
                                                                      ) -> None:
    """R4 is first read four instructions on, R5 one (``.reuse`` is the same register), and R6 is overwritten
    before any read, so it has no distance; a predicate does not hide an instruction's operands. R7, an epilogue's
    load read by an addition, counts only where additions are asked for."""
    script = load_script("load_distance")
    instructions = script.sass_instructions(SASS)
    assert instructions[3] == "FFMA R9, R9, 2, R9" and len(instructions) == 11
    assert script.load_distances(instructions) == [4, 1]
    assert script.load_distances(instructions, ("FFMA", "FADD")) == [4, 1, 1]
    assert script.ptxas_registers("ptxas info    : Used 48 registers, used 0 barriers") == 48
    with pytest.raises(ValueError, match="no 'Used N registers' line"):
        script.ptxas_registers("ptxas info    : Compiling entry function")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_a_grouped_body_compiles_to_loads_further_ahead(load_script: Callable[[str], ModuleType],
                                                        tmp_path: Path) -> None:
    """A program whose every tap feeds one product: ungrouped, ptxas may place each load next to its FMA; grouped by
    16, sixteen loads come before the first product, so the loads' median distance is not smaller."""
    script = load_script("load_distance")
    cuobjdump = script.find_cuobjdump()
    if cuobjdump is None:
        pytest.skip("no cuobjdump on the PATH or in Triton's wheel")
    rng = np.random.default_rng(0)
    weight = np.zeros((4, 16, 3, 3), np.float32)
    weight[rng.integers(0, 4, 16 * 9), np.repeat(np.arange(16), 9), np.tile(np.repeat(np.arange(3), 3), 16),
           np.tile(np.arange(3), 48)] = 1.0 + rng.random(16 * 9).astype(np.float32)
    program = gs.programs(weight, (1, 1), (12, 12), 4)[0]
    figures = [script.compile_program(gs.kernel_source(program, torch.float32, load_batch=batch), tmp_path,
                                      f"b{batch}", shutil.which("nvcc"), cuobjdump) for batch in (1, 16)]
    for measured in figures:
        assert measured["registers"] > 0 and measured["ffma"] >= program.products
        assert measured["ldg"] >= len(program.taps) and measured["distance_median"] is not None
    assert figures[1]["distance_median"] >= figures[0]["distance_median"]
