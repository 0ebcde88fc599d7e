"""A job's output folder and what a job is: the identity that binds a folder to one job (``job.json``), the lock
that lets one job at a time run there (``.lock``), the refusal of a job before any work (:class:`JobRefusedError`),
and what the job ran on (its device, the commit of its code).

:func:`~unsparse.pipeline.run_pipeline` claims and locks its folder with these; the command line
(``unsparse/cli.py``) and the scripts read the device and commit from here.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from unsparse.atomic import atomic_write_text
from unsparse.strict_json import loads_strict
from unsparse.train import check_resumable, tensor_digest

if TYPE_CHECKING:  # type hints only: unsparse.pipeline imports this module
    from unsparse.data import Splits
    from unsparse.pipeline import TrainSettings
    from unsparse.prune.base import Pruner

log = logging.getLogger(__name__)


JOB_FILE = "job.json"
"""What the run in an output folder is (:func:`job_identity`); each run writes it until the folder holds
checkpoints, and from then on it is compared (:func:`claim_output_folder`); in a folder with checkpoints but no file,
the first run whose checkpoints load writes it."""


CHECKPOINTS = ("dense.pt", "prune")
"""What :func:`~unsparse.pipeline.run_pipeline` checkpoints in an output folder (the dense training, the pruner's
folder)."""

WRITTEN_ATOMICALLY = (JOB_FILE, "dense.pt", "prune/*.pt", "prune/*.jsonl", "model.safetensors", "report.json",
                      "report.md", "*.png", ".hydra/*.yaml")
"""The files (glob patterns) a job writes into its output folder with :func:`~unsparse.atomic.atomic_write`."""

LOCK_FILE = ".lock"
"""The file a running job holds locked in its output folder (:func:`only_job_in`)."""


class JobRefusedError(ValueError):
    """A job refused before any work: settings out of range or of the wrong type, a model that cannot take the data,
    layer names the model lacks, a folder that holds another job or a running one. The command line prints its
    message as one line (exit status 2)."""


@contextmanager
def refusing() -> Iterator[None]:
    """Re-raise a ``ValueError`` of the block as :class:`JobRefusedError` (the block only checks; nothing has run)."""
    try:
        yield
    except ValueError as error:
        raise JobRefusedError(str(error)) from error


@contextmanager
def only_job_in(outdir: Path) -> Iterator[None]:
    """Hold ``outdir/.lock`` locked (``fcntl.flock``, exclusive) inside the ``with`` block: a second job started in
    the same folder is refused instead of writing over the first one's checkpoints. The lock ends with the block or
    with the process, however that ends (Ctrl-C, SIGKILL).

    Raises:
        JobRefusedError: (a ``ValueError``) another process holds the lock.
    """
    lock = os.open(outdir / LOCK_FILE, os.O_RDONLY | os.O_CREAT, 0o666)  # flock needs no write access
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise JobRefusedError(f"{outdir}: another running job holds this folder ({LOCK_FILE}); wait for it to "
                                  "end, or run in another folder") from None
        yield
    finally:
        os.close(lock)


def split_digest(split: tuple[torch.Tensor, torch.Tensor]) -> str:
    """``"<size>:<sha256 prefix>"`` of one ``(images, labels)`` split: the same name and size can hold another subset
    (a limit or split seed of the data loader)."""
    return f"{len(split[1])}:{tensor_digest(split)}"


def job_identity(splits: Splits, model: nn.Module, pruner: Pruner, train: TrainSettings, seed: int) -> str:
    """Everything the checkpoints of an output folder depend on, as sorted JSON: the data set's name and each split's
    size and content (:func:`split_digest`), the model's registry spec, the pruner's settings
    (:meth:`~unsparse.prune.base.Pruner.identity`), the training settings that shape the trained weights
    (:class:`~unsparse.pipeline.TrainSettings`, not ``eval_batch_size`` or ``deterministic``) and the seed.
    Quantization, timing, device and backend are left out: they act after the last checkpoint, so a folder's trained
    and pruned model can be quantized or timed again another way.

    Raises:
        ValueError: a model without ``unsparse_spec`` (not built by ``create_model``).
    """
    spec = getattr(model, "unsparse_spec", None)
    if spec is None:
        raise ValueError("model: no unsparse_spec; build the model with unsparse.models.create_model")
    data = {"name": splits.name, **{split: split_digest(getattr(splits, split)) for split in ("train", "val", "test")}}
    training = {key: value for key, value in asdict(train).items() if key not in ("eval_batch_size", "deterministic")}
    return json.dumps({"data": data, "model": spec, "pruner": json.loads(pruner.identity()), "train": training,
                       "seed": seed}, sort_keys=True, default=str)


def recorded_identity(path: Path) -> str:
    """The job identity (:func:`job_identity`) that the job file ``path`` records, as written.

    Raises:
        ValueError: naming ``path``, where it cannot be read, is no JSON, or holds no JSON object: damaged (cut
            short by a full disk or a copy that stopped) or not written by this program.
    """
    try:
        text = path.read_text(encoding="utf-8")
        recorded = loads_strict(text, constants=True)  # json.dumps, which wrote it, writes NaN as is
    except OSError as error:
        reason = f"cannot be read: {error.strerror or error}"
    except (ValueError, RecursionError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        reason = f"not JSON: {error}"
    else:
        if isinstance(recorded, dict):
            return text.strip()
        reason = f"holds a {type(recorded).__name__}, not a JSON object"
    raise ValueError(f"{path}: not a job record ({reason}); it is damaged or not one this program wrote: delete it "
                     "to resume the folder's checkpoints as this job, unchecked, or start in another folder")


def claim_output_folder(outdir: Path, identity: str) -> bool:
    """Resume in ``outdir`` only the job whose checkpoints are there: where :data:`CHECKPOINTS` exist, ``identity``
    must equal the one :data:`JOB_FILE` recorded (:func:`recorded_identity`, :func:`~unsparse.train.check_resumable`);
    otherwise the file is (re)written (:func:`record_job`), so that a first run that failed before any checkpoint
    does not bind the folder to its settings. Checkpoints without the file (a folder of an older version, or one whose
    damaged file was deleted) are resumed unchecked, with a warning, and the file is not written: a checkpoint may
    still refuse the job, which must leave the folder to the job that wrote it; the caller writes the file once the
    checkpoints have loaded.

    Returns:
        Whether the folder holds checkpoints but no file, so that the caller is to write it.

    Raises:
        ValueError: before any checkpoint is read, naming the file and the settings that differ, or the file, where
            it is no job record (:func:`recorded_identity`) or cannot be (re)written (:func:`record_job`).
    """
    path = outdir / JOB_FILE
    checkpointed = any((outdir / name).exists() for name in CHECKPOINTS)
    if checkpointed and path.exists():
        check_resumable(path, {"identity": recorded_identity(path)}, identity)
        return False
    if checkpointed:
        log.warning("%s holds checkpoints but no %s: resuming them unchecked as this job, which the file records "
                    "once they have loaded", outdir, JOB_FILE)
        return True
    record_job(outdir, identity)
    return False


def record_job(outdir: Path, identity: str) -> None:
    """Write ``identity`` (:func:`job_identity`) as ``outdir``'s :data:`JOB_FILE`, atomically.

    Raises:
        ValueError: naming the file, where it cannot be written (a folder in its place, a folder without write
            permission: the system's reason).
    """
    path = outdir / JOB_FILE
    try:
        atomic_write_text(path, identity + "\n")
    except OSError as error:
        raise ValueError(f"{path}: cannot be written ({error.strerror or error}), where the job records itself; "
                         "clear the way, or start in another folder") from error


def resolve_device(name: str) -> torch.device:
    """``"auto"`` -> CUDA if available else CPU; otherwise ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.

    Raises:
        ValueError: naming ``device``, for another name, or CUDA where torch sees no CUDA device (or not device N).
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device: {name!r} is not a device; expected auto, cpu, cuda or cuda:N") from error
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device: {name!r}; expected auto, cpu, cuda or cuda:N")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():  # 0 devices without CUDA
        raise ValueError(f"device: {name!r} requested, but torch sees {torch.cuda.device_count()} CUDA device(s)")
    return device


def git_commit() -> str | None:
    """The repository's HEAD commit: ``$UNSPARSE_COMMIT`` where set and not empty (a copy of the tree without
    ``.git``, such as a lent GPU machine's), else ``git rev-parse HEAD``, or None outside a git checkout."""
    if commit := os.environ.get("UNSPARSE_COMMIT", "").strip():
        return commit
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def git_tree_modified() -> bool | None:
    """Whether tracked files differ from HEAD (``git status``), so that :func:`git_commit` does not name the code
    that ran; None outside a git checkout or where ``$UNSPARSE_COMMIT`` names the commit (a copied tree)."""
    if os.environ.get("UNSPARSE_COMMIT", "").strip():
        return None
    try:
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                text=True, check=True, cwd=Path(__file__).parent).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return bool(status.strip())
