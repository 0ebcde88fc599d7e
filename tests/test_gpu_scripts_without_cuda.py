"""The GPU-only scripts on a machine without CUDA: one line naming the script and exit status 2, before any work,
instead of torch's driver error as a traceback (a scripts audit's find)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(("script", "arguments"), [
    ("profile_direct.py", ["--shape", "2", "8", "8", "8", "--out-channels", "8", "--params", "{}"]),
    ("profile_end_to_end.py", ["--out", "OUT"]),
    ("profile_launch.py", ["--out", "OUT"]),
    ("time_pairing.py", []),
    ("probe_instruction_fetch.py", ["--out", "OUT"]),
    ("time_cudnn_layouts.py", ["--models", "alexnet", "--layer-filter", "^none$", "--out", "OUT"]),
    ("time_dense_baselines.py", ["--out", "OUT"]),
])
def test_a_gpu_script_without_cuda_says_so_in_one_line(tmp_path: Path, script: str, arguments: list[str]) -> None:
    """Run as documented (``PYTHONPATH=.``) with every CUDA device hidden; nothing is written to ``--out``."""
    out = tmp_path / "out"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, str(ROOT / "scripts" / script), *[str(out) if a == "OUT" else a for a in arguments]]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 2, done.stderr
    assert done.stderr == f"{script}: needs a CUDA GPU, and torch sees none here\n"
    assert not out.exists()


def test_profile_direct_refuses_a_sparsity_outside_0_to_1_while_parsing(load_script: Callable[[str], ModuleType],
                                                                        run_script: Callable[..., tuple[int, str]]
                                                                        ) -> None:
    """Magnitude pruning takes sparsities in [0, 1): another one stopped a GPU run with a traceback (here, before
    the CUDA check), now argparse names the option and the value."""
    code, output = run_script(load_script("profile_direct"), ["--shape", "2", "8", "8", "8", "--out-channels", "8",
                                                             "--params", "{}", "--sparsity", "1"])
    assert code == 2 and "argument --sparsity: expected a sparsity in [0, 1), got '1'" in output
