"""Command lines run one after another in one Python, each one's exit status and stderr kept: for tables of refusal
cases, where a process per case spent 4-9 s starting Python, torch and Hydra before the one line being checked."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

DRIVER = """
import contextlib, io, json, runpy, sys
cases = json.loads(sys.argv[1])
outcomes = []
for argv in cases["commands"]:
    sys.argv, stderr = argv, io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            if cases["script"]:
                runpy.run_path(argv[0], run_name="__main__")
            else:
                from unsparse.cli import main
                main()
            status = 0
        except SystemExit as end:
            status = end.code
    outcomes.append([status, stderr.getvalue()])
print(json.dumps(outcomes))
"""


def outcomes_in_one_python(commands: list[list[str]], script: bool = False,
                           env: Mapping[str, str] | None = None) -> list[tuple[int, str]]:
    """Exit status and stderr of each of ``commands`` (``sys.argv`` each: with ``script`` a script's path and its
    arguments, run as ``__main__``; else ``unsparse`` and its arguments, run by ``unsparse.cli.main``), in order, in
    one Python started in the repository with ``env``. A case that returns exits with status 0."""
    done = subprocess.run([sys.executable, "-c", DRIVER, json.dumps({"commands": commands, "script": script})],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr
    return [tuple(outcome) for outcome in json.loads(done.stdout.splitlines()[-1])]
