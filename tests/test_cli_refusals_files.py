"""Files the command line reads that are missing or damaged are refused like a bad setting: one line
``unsparse: refused: ...`` naming the setting or the file, exit status 2, no traceback (the command line runs
in-process here)."""

from __future__ import annotations

import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import unsparse.cli
from unsparse.cli import main
from unsparse.train import load_checkpoint, save_checkpoint


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
    assert_one_line(code, err, rf"unsparse: refused: data: Fashion-MNIST file {re.escape(str(tmp_path))}/missing/\S+ "
                               r"not found\. .*data\.root.*")


def test_a_fashion_mnist_file_that_cannot_be_read_is_refused_naming_it_and_data_root(monkeypatch, capsys, tmp_path):
    """A folder in a data file's place (as a file without read permission, which root reads anyway): its OSError came
    as Hydra's three lines, naming neither the setting nor the file."""
    from unsparse.data import FASHION_MNIST_FILES

    for name in FASHION_MNIST_FILES:
        (tmp_path / "root" / f"{name}.gz").mkdir(parents=True)
    monkeypatch.setenv("UNSPARSE_CACHE", str(tmp_path / "cache"))
    code, err = refusal(monkeypatch, capsys, "experiment=smoke", "data=fashion_mnist", "device=cpu",
                        f"data.root={tmp_path / 'root'}", f"hydra.run.dir={tmp_path / 'job'}")
    assert_one_line(code, err, rf"unsparse: refused: data: {re.escape(str(tmp_path))}/root/{FASHION_MNIST_FILES[0]}"
                               r"\.gz: "
                               r"cannot be read \(Is a directory\); set data\.root to a folder holding the four idx "
                               r"files")


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


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of a finished quick job (:data:`DIGITS`): its one checkpoint is the pruner's fine-tuning,
    ``prune/magnitude_finetune.pt``."""
    folder = tmp_path_factory.mktemp("finished")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", ["unsparse", *DIGITS, f"hydra.run.dir={folder}"])
        main()
    return folder


FINE_TUNE = Path("prune") / "magnitude_finetune.pt"


def changed_copy(finished: Path, folder: Path, change: Callable[[dict[str, Any]], None]) -> Path:
    """A copy of the folder ``finished`` in ``folder`` whose fine-tuning checkpoint ``change`` has rewritten; its
    path."""
    shutil.copytree(finished, folder)
    state = load_checkpoint(folder / FINE_TUNE)
    change(state)
    save_checkpoint(folder / FINE_TUNE, state)
    return folder / FINE_TUNE


@pytest.mark.parametrize(("change", "refused"), [
    (lambda state: state.pop("identity"), r"records no 'identity' .*; start the run in a new folder"),
    (lambda state: [entry.pop("elapsed_s") for entry in state["history"]],
     r"records no 'elapsed_s' in its history .*; start the run in a new folder"),
    (lambda state: state.update(loader_rng=torch.empty(0)),
     r"loader_rng: the train loader of the run that wrote it had no generator .*; resume with the same data "
     r"loader, or start in another folder"),
    (lambda state: state.update(history=state["history"] * 2),
     r"holds 2 epochs, more than the 1 asked for; resume with the same settings, or start in another folder"),
    (lambda state: state["model"].update(extra=torch.zeros(1)),
     r"written for another model \(unexpected extra\); resume with the same model, or start in another folder"),
    (lambda state: state["optimizer"].update(param_groups=[]),
     r"its optimizer state does not fit this model \(.*\); delete it to start over"),
], ids=["no identity", "no elapsed_s", "loader", "more epochs", "another model", "optimizer"])
def test_a_checkpoint_the_job_cannot_resume_from_is_refused_in_one_line(monkeypatch, capsys, tmp_path, finished,
                                                                        change, refused):
    """Each came as a ValueError under Hydra's traceback with exit status 1; the job file, which names the job's
    settings and not its checkpoints' content, lets every one of them through."""
    checkpoint = changed_copy(finished, tmp_path / "job", change)
    code, err = refusal(monkeypatch, capsys, *DIGITS, f"hydra.run.dir={tmp_path / 'job'}")
    assert_one_line(code, err, rf"unsparse: refused: {re.escape(str(checkpoint))}: {refused}")


def test_a_pruning_checkpoint_of_other_settings_in_a_folder_without_job_file_is_refused_in_one_line(
        monkeypatch, capsys, tmp_path, finished):
    """A folder of an older version has checkpoints but no ``job.json``: the pruner's own identity check refuses the
    checkpoint, and did so under Hydra's traceback with exit status 1."""
    checkpoint = changed_copy(finished, tmp_path / "job", lambda state: None)
    (tmp_path / "job" / "job.json").unlink()
    code, err = refusal(monkeypatch, capsys, *DIGITS, "prune.fine_tune_epochs=2", f"hydra.run.dir={tmp_path / 'job'}")
    assert_one_line(code, err, rf"unsparse: refused: {re.escape(str(checkpoint))}: written by a run with other "
                               r"settings \(fine_tune_epochs: 1 there, 2 here\); resume with the same settings, or "
                               r"start in another folder")


def test_a_value_error_of_a_bug_keeps_its_traceback(monkeypatch, capsys, tmp_path):
    """Only refusals are one line: any other ValueError is a bug to trace."""
    def bug(**arguments: Any) -> None:
        raise ValueError("a bug")

    monkeypatch.setattr(unsparse.cli, "run_pipeline", bug)
    code, err = refusal(monkeypatch, capsys, *DIGITS, f"hydra.run.dir={tmp_path}")
    assert code == 1 and "Traceback" in err and "ValueError: a bug" in err and "refused" not in err, err


def test_a_job_file_that_is_a_folder_in_a_folder_without_checkpoints_is_refused_in_one_line(monkeypatch, capsys,
                                                                                           tmp_path):
    """With no checkpoint to compare it for, the job writes its job.json, and the write's IsADirectoryError came
    under Hydra's traceback with exit status 1."""
    (tmp_path / "job.json").mkdir()
    code, err = refusal(monkeypatch, capsys, *DIGITS, f"hydra.run.dir={tmp_path}")
    assert_one_line(code, err, rf"unsparse: refused: {re.escape(str(tmp_path / 'job.json'))}: cannot be written "
                               r"\(Is a directory\), where the job records itself; clear the way, or start in another "
                               r"folder")


def test_a_refused_run_in_a_folder_without_job_file_leaves_the_folder_to_its_own_job(monkeypatch, capsys, tmp_path,
                                                                                      finished):
    """A folder with checkpoints but no ``job.json`` (an older version's, or one whose damaged file was deleted) was
    bound to the first run's settings before its checkpoints were read: a run refused at a checkpoint left its
    ``job.json`` and ``.hydra/`` record there, and the folder's own job was then refused by that ``job.json``."""
    folder = tmp_path / "job"
    changed_copy(finished, folder, lambda state: None)
    (folder / "job.json").unlink()
    overrides = (folder / ".hydra" / "overrides.yaml").read_text()
    code, err = refusal(monkeypatch, capsys, *DIGITS, "prune.fine_tune_epochs=2", f"hydra.run.dir={folder}")
    assert code == 2 and "written by a run with other settings" in err, err
    assert not (folder / "job.json").exists() and (folder / ".hydra" / "overrides.yaml").read_text() == overrides
    (folder / "report.json").unlink()
    monkeypatch.setattr(sys, "argv", ["unsparse", *DIGITS, f"hydra.run.dir={folder}"])
    main()
    assert (folder / "job.json").exists() and (folder / "report.json").exists()
