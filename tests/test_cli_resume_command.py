"""The command an interrupted single job prints keeps what chose its config on the command line (``--config-dir``
and the like), not only the overrides Hydra records, so that it resumes the job."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys


def test_an_interrupted_job_prints_its_config_dir(tmp_path):
    """With an experiment from ``--config-dir``, the printed command dropped the flag: Hydra then found no such
    experiment, and the job could not be resumed as printed."""
    extra = tmp_path / "extra"
    (extra / "experiment").mkdir(parents=True)
    (extra / "experiment" / "long.yaml").write_text("# @package _global_\ntrain:\n  epochs: 50\n")
    words = ["--config-dir", str(extra), "data=digits", "device=cpu", "progress=false", "experiment=long",
             "data.limit_train=300"]
    command = [sys.executable, "-c", "from unsparse.cli import main; main()", *words,
               f"hydra.run.dir={tmp_path / 'job'}"]
    environment = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=environment) as job:
        for line in job.stdout:
            if "epoch 1:" in line:
                job.send_signal(signal.SIGINT)
                break
        output = job.communicate(timeout=120)[0]
    assert job.returncode == 130, output[-3000:]
    printed = output.split("written so far run: ")[1].splitlines()[0]
    assert shlex.split(printed) == ["unsparse", *words, f"hydra.run.dir='{tmp_path / 'job'}'"]
