"""A sweep (``-m``) whose one job is refused runs its other jobs, and still ends with a failure status."""

from __future__ import annotations

import subprocess
import sys


def test_a_refused_job_leaves_the_sweeps_other_jobs_to_run(tmp_path):
    """``-m prune.target=1.0,0.8``: the refusal of the first job (``SystemExit(2)``, which Hydra's launcher does not
    catch) ended the sweep there, so the valid 0.8 job never ran, while a job failing any other way lets the rest
    run."""
    command = [sys.executable, "-c", "from unsparse.cli import main; main()", "-m", "experiment=smoke", "data=digits",
               "device=cpu", "progress=false", "prune.target=1.0,0.8", "runtime.timing.repeats=1",
               "runtime.timing.warmup=0", f"hydra.sweep.dir={tmp_path}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "unsparse: refused: prune: target: expected a number in [0, 1) (a sparsity), got 1.0" in done.stderr
    assert not (tmp_path / "0" / "report.json").exists() and (tmp_path / "1" / "report.json").exists()


def test_a_refused_bench_job_leaves_the_sweeps_other_jobs_to_run(tmp_path):
    """The same for ``unsparse bench -m``: the second job is reached (here it is refused too, for want of CUDA, or
    it runs on a GPU machine)."""
    command = [sys.executable, "-c", "from unsparse.cli import main; main()", "bench", "-m", "sparsities=[1.0],[0.9]",
               "models=[alexnet]", "batches=[1]", "precisions=[fp32]", "end_to_end=[]", "runs=1",
               f"hydra.sweep.dir={tmp_path}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "unsparse bench: refused: sparsities: expected a number in [0, 1) (a sparsity), got 1.0" in done.stderr
    assert "#1 : sparsities=[0.9]" in done.stdout
