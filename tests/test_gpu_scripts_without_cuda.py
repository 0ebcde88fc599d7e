"""The GPU-only scripts on a machine without CUDA: one line naming the script and exit status 2, before any work,
instead of torch's driver error as a traceback (a scripts audit's find)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from tests.one_python import outcomes_in_one_python

ROOT = Path(__file__).resolve().parent.parent


GPU_SCRIPTS = {
    "profile_direct.py": ["--shape", "2", "8", "8", "8", "--out-channels", "8", "--params", "{}"],
    "profile_end_to_end.py": ["--out", "OUT"],
    "profile_launch.py": ["--out", "OUT"],
    "time_pairing.py": [],
    "time_side_streams.py": ["--before", "2,1"],
    "time_residual_fusion.py": ["--layers", "layer1.0.conv3", "--out", "OUT"],
    "probe_instruction_fetch.py": ["--out", "OUT"],
    "time_cudnn_layouts.py": ["--models", "alexnet", "--layer-filter", "^none$", "--out", "OUT"],
    "time_dense_baselines.py": ["--out", "OUT"],
}
@pytest.fixture(scope="module")
def gpu_scripts_without_cuda(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, str, Path]]:
    outs = {script: tmp_path_factory.mktemp("gpu_script") / "out" for script in GPU_SCRIPTS}
    commands = [[str(ROOT / "scripts" / script), *[str(outs[script]) if a == "OUT" else a for a in arguments]]
                for script, arguments in GPU_SCRIPTS.items()]
    # as documented (PYTHONPATH=.), every CUDA device hidden; one Python for all (tests/one_python.py)
    outcomes = outcomes_in_one_python(commands, script=True,
                                      env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)})
    return {script: (*outcome, outs[script]) for script, outcome in zip(GPU_SCRIPTS, outcomes, strict=True)}


@pytest.mark.parametrize("script", GPU_SCRIPTS)
def test_a_gpu_script_without_cuda_says_so_in_one_line(gpu_scripts_without_cuda: dict[str, tuple[int, str, Path]],
                                                       script: str) -> None:
    """Run as documented with every CUDA device hidden; nothing is written to ``--out``."""
    status, stderr, out = gpu_scripts_without_cuda[script]
    assert status == 2, stderr
    assert stderr == f"{script}: needs a CUDA GPU, and torch sees none here\n"
    assert not out.exists()


def test_profile_direct_refuses_a_sparsity_outside_0_to_1_while_parsing(load_script: Callable[[str], ModuleType],
                                                                        run_script: Callable[..., tuple[int, str]]
                                                                        ) -> None:
    """Magnitude pruning takes sparsities in [0, 1): another one stopped a GPU run with a traceback (here, before
    the CUDA check), now argparse names the option and the value."""
    code, output = run_script(load_script("profile_direct"), ["--shape", "2", "8", "8", "8", "--out-channels", "8",
                                                             "--params", "{}", "--sparsity", "1"])
    assert code == 2 and "argument --sparsity: expected a sparsity in [0, 1), got '1'" in output
