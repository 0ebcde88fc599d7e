"""Files the command line reads that are missing or damaged are refused like a bad setting: one line
``unsparse: refused: ...`` naming the setting or the file, exit status 2, no traceback (the command line runs
in-process here)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from unsparse.cli import main
from unsparse.train import save_checkpoint


def refusal(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *words: str) -> tuple[int, str]:
    """Run ``unsparse *words`` and return its exit status and what it printed to stderr (it must exit)."""
    monkeypatch.setattr(sys, "argv", ["unsparse", *words])
    with pytest.raises(SystemExit) as exited:
        main()
    return exited.value.code, capsys.readouterr().err


def assert_one_line(code: int, err: str, pattern: str, status: int = 2) -> None:
    """``err`` is one line that ``pattern`` matches whole, and the exit status ``status``."""
    assert code == status and "Traceback" not in err, err
    assert len(err.splitlines()) == 1 and re.fullmatch(pattern, err.strip()), err


@pytest.mark.parametrize(("source", "reason"), [("missing.txt", "No such file or directory"), (".", "Is a directory")])
def test_a_time_series_source_that_cannot_be_read_is_refused_naming_it(monkeypatch, capsys, tmp_path, source,
                                                                       reason):
    """Hydra's wrapping of the OSError printed three lines naming neither ``data.source`` nor the file."""
    path = tmp_path / source
    code, err = refusal(monkeypatch, capsys, "experiment=smoke", "data=co2", "model=autoencoder1d", "device=cpu",
                        f"data.source={path}", f"hydra.run.dir={tmp_path / 'job'}")
    assert_one_line(code, err, rf"unsparse: refused: data\.source: {re.escape(str(path))}: cannot be read "
                               rf"\({reason}\)")


def test_a_fashion_mnist_root_without_its_files_is_still_refused_naming_it(monkeypatch, capsys, tmp_path):
    code, err = refusal(monkeypatch, capsys, "experiment=smoke", "data=fashion_mnist", "device=cpu",
                        f"data.root={tmp_path / 'missing'}", f"hydra.run.dir={tmp_path / 'job'}")
    assert_one_line(code, err, rf"unsparse: refused: Fashion-MNIST file {re.escape(str(tmp_path))}/missing/\S+ not "
                               r"found\. .*data\.root.*")


DIGITS = ("experiment=smoke", "data=digits", "device=cpu", "progress=false", "train.epochs=0",
          "runtime.timing.repeats=1", "runtime.timing.warmup=0")
"""A quick job: no dense training, so the pruner's fine-tuning is the first checkpoint a job reads."""


def damage(path: Path) -> None:
    """Write a checkpoint cut in half at ``path``, as a full disk or a copy that stopped would leave it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    save_checkpoint(path, {"model": {"weight": torch.zeros(4096)}, "history": []})
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


@pytest.mark.parametrize("checkpoint", ["dense.pt", "prune/magnitude_finetune.pt"])
def test_a_damaged_checkpoint_is_refused_in_one_line(monkeypatch, capsys, tmp_path, checkpoint):
    """load_checkpoint's message was right, but came as a ValueError under Hydra's traceback with exit status 1."""
    damage(tmp_path / checkpoint)
    code, err = refusal(monkeypatch, capsys, *DIGITS, f"hydra.run.dir={tmp_path}")
    assert_one_line(code, err, rf"unsparse: refused: {re.escape(str(tmp_path / checkpoint))}: not a readable "
                               r"checkpoint \(\w+\); it is damaged or not one this program wrote: delete it to start "
                               r"over")
    assert not (tmp_path / "report.json").exists()


def test_a_damaged_checkpoint_in_a_sweep_leaves_its_other_jobs_to_run(monkeypatch, capsys, tmp_path):
    """As a refused setting in a sweep (``tests/test_cli_sweep_refusal.py``): the job with the damaged checkpoint is
    refused in one line, the next one runs, and the sweep ends with status 1."""
    damage(tmp_path / "0" / "dense.pt")
    code, err = refusal(monkeypatch, capsys, "-m", *DIGITS, "seed=0,1", f"hydra.sweep.dir={tmp_path}")
    assert code == 1 and "Traceback" not in err, err
    assert f"unsparse: refused: {tmp_path / '0' / 'dense.pt'}: not a readable checkpoint" in err
    assert not (tmp_path / "0" / "report.json").exists() and (tmp_path / "1" / "report.json").exists()


def test_a_damaged_job_file_is_refused_as_damaged_in_one_line(monkeypatch, capsys, tmp_path):
    """It was refused as written by a run with other settings, its first half against this job's identity."""
    (tmp_path / "job.json").write_text('{"data": {"name": "digits", "test": "360:19d0')
    damage(tmp_path / "dense.pt")
    code, err = refusal(monkeypatch, capsys, *DIGITS, f"hydra.run.dir={tmp_path}")
    assert_one_line(code, err, rf"unsparse: refused: {re.escape(str(tmp_path / 'job.json'))}: not a job record "
                               r"\(not JSON: .*\); it is damaged or not one this program wrote: delete it .*")
