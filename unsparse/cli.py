"""Command line (Hydra): ``unsparse`` runs the main job; ``unsparse bench`` the GPU per-layer benchmark.

Hydra lives here and in ``configs/`` only; the library imports without it. Config groups mirror the code's
choices (``data=``, ``model=``, ``prune=``, ``quant=``, ``runtime=``, ``experiment=``) and objects are built
with ``hydra.utils.instantiate`` from their ``_target_``.
"""

from __future__ import annotations

import logging
import re
import shlex
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path
from typing import Any, TypeVar

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import CompactHydraException, InstantiationException
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from unsparse.data import DatasetUnavailableError
from unsparse.job import JobRefusedError, git_commit, refusing, resolve_device
from unsparse.pipeline import TimingSettings, TrainSettings, run_pipeline
from unsparse.settings import check_flag, check_seed
from unsparse.train import CheckpointRefusedError

CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "configs")
log = logging.getLogger("unsparse")
T = TypeVar("T")


class SweepJobRefusedError(CompactHydraException):
    """A job of a sweep refused (its line already printed: :func:`run`): raised to Hydra's launcher, which runs
    the sweep's other jobs, then names the first refused job's overrides, prints this message (no traceback) and
    exits with status 1."""


def check_known_settings(block: Mapping[Any, Any], known: Sequence[str], field: str | None = None) -> None:
    """Refuse a key of the settings ``block`` that is not among ``known`` (``+train.epoch=5``, ``unsparse bench
    +foo=1``: a ``TypeError`` naming no setting where the block is passed on as keyword arguments).

    Raises:
        ValueError: naming ``field`` (where given), the unknown keys and the ``known`` ones.
    """
    unknown = sorted(set(block) - set(known), key=str)
    if unknown:
        named = f"{field}: " if field else ""
        raise ValueError(f"{named}unknown setting(s) {unknown}; known: {', '.join(known)}")


def settings_block(kind: type[T], block: Any, field: str) -> T:
    """``kind(**block)``, a settings dataclass from its config block ``field`` (``train``, ``runtime.timing``).

    Raises:
        ValueError: naming ``field``, for a block that is no mapping (``train=null``) or holds a key that ``kind``
            lacks (:func:`check_known_settings`); and the dataclass's own.
    """
    if not isinstance(block, Mapping):
        raise ValueError(f"{field}: expected a mapping of settings, got {block!r}")
    check_known_settings(block, [setting.name for setting in fields(kind)], field)
    return kind(**block)


def chosen_block(cfg: DictConfig, group: str) -> DictConfig:
    """The composed block of config group ``group`` (``data``, ``model``, ``prune``, ``quant``: one that
    :func:`~hydra.utils.instantiate` builds, with a ``_target_``; ``runtime``: one with a ``backend``).

    Raises:
        ValueError: naming ``group`` and its options in ``configs/<group>/``, where no option is chosen: ``~quant``
            removed the block (an AttributeError from the config), and ``~model`` with ``experiment=smoke`` left
            only the experiment's ``model.width``, which instantiate returned as a plain mapping instead of a model.
    """
    block = cfg.get(group)
    if not isinstance(block, Mapping) or ("backend" if group == "runtime" else "_target_") not in block:
        options = sorted(path.stem for path in (Path(CONFIG_DIR) / group).glob("*.yaml"))
        held = ("no such block" if block is None else
                f"only {OmegaConf.to_container(block) if isinstance(block, DictConfig) else block!r}")
        raise ValueError(f"{group}: no option chosen (the config holds {held}); choose one with {group}=<name>, one "
                         f"of {', '.join(options)}")
    return block


@contextmanager
def refusing_in(group: str) -> Iterator[None]:
    """Refuse what the block's factory of config group ``group`` refuses (``instantiate``: its ``ValueError`` or
    ``TypeError``, which Hydra wraps, or a data set's :class:`~unsparse.data.DatasetUnavailableError`), and a
    ``ValueError`` of a check of the built object's settings, naming the group as the command line does: the message
    gets ``<group>: `` before it (``prune: target: ...``, not a top-level ``target``) unless it starts with
    ``<group>.`` or ``<group>:`` already (``data.source: ...``).

    Raises:
        JobRefusedError: (a ``ValueError``) with that message; for another error that Hydra's ``instantiate`` wraps
            (e.g. a ``_target_`` that cannot be imported), with Hydra's message.
    """
    try:
        yield
    except (InstantiationException, ValueError) as error:
        refused = error.__cause__ if isinstance(error, InstantiationException) else error
        if not isinstance(refused, ValueError | TypeError | DatasetUnavailableError):
            raise JobRefusedError(str(error)) from error
        message = str(refused)
        raise JobRefusedError(message if message.startswith((f"{group}.", f"{group}:")) else f"{group}: {message}"
                              ) from error


def build_job(cfg: DictConfig) -> dict[str, Any]:
    """:func:`~unsparse.pipeline.run_pipeline`'s arguments (all but ``outdir``) from the composed config.

    Settings are checked first (device, training, timing), then torch's generator is seeded with ``cfg.seed``
    before anything is instantiated, so the model's initial weights repeat from the seed: two runs of one config
    train the same dense model (with ``train.deterministic`` on CUDA too). The pruner's layer names are checked
    against the model here too (:meth:`~unsparse.prune.base.Pruner.check_layers`, which ``run_pipeline`` repeats
    for its other callers), so that their refusal names the ``prune`` group as well.

    Raises:
        JobRefusedError: (a ``ValueError``) from :func:`~unsparse.job.resolve_device`, a ``progress`` that is no
            bool, a config group left without an option (:func:`chosen_block`), :class:`TrainSettings`,
            :class:`TimingSettings` (or their config blocks: :func:`settings_block`), a ``seed`` that is no integer
            in ``[0, 2^32)``, the seeds torch's CPU generator tells apart (:func:`~unsparse.settings.check_seed`),
            a factory that refuses its settings (its ``ValueError`` or ``TypeError``, which Hydra wraps, is the
            message, naming the group: :func:`refusing_in`; so is a data set's
            :class:`~unsparse.data.DatasetUnavailableError`, a ``data.root`` without its files), or pruner
            settings that name layers the model lacks.
    """
    with refusing():
        device = resolve_device(cfg.device)
        progress = check_flag(cfg.progress, "progress")  # a string such as "maybe" would be true to bool()
        blocks = {group: chosen_block(cfg, group) for group in ("data", "model", "prune", "quant", "runtime")}
        train = settings_block(TrainSettings, cfg.train, "train")
        timing = settings_block(TimingSettings, blocks["runtime"].timing, "runtime.timing")
        torch.manual_seed(check_seed(cfg.seed))
        built: dict[str, Any] = {}
        for group in ("data", "model", "prune", "quant"):
            with refusing_in(group):
                built[group] = instantiate(blocks[group])
        with refusing_in("prune"):
            built["prune"].check_layers(built["model"])
        return {"splits": built["data"], "model": built["model"], "pruner": built["prune"],
                "quantizer": built["quant"].quantize, "train": train, "timing": timing,
                "backend": blocks["runtime"].backend, "device": device, "progress": progress, "seed": cfg.seed,
                "fold_batch_norm": blocks["runtime"].get("fold_batch_norm", "off")}


def resume_command(task_overrides: list[str], outdir: Path, program: str = "unsparse",
                   folder_key: str = "hydra.run.dir") -> str:
    """The shell command that resumes a job in ``outdir``: ``program`` (the command that started it where that was
    the ``unsparse`` script, e.g. ``.venv/bin/unsparse``, which may not be on the PATH), ``task_overrides`` (the
    command line's words but the folder's: :func:`interrupted_command`), and ``folder_key`` (``hydra.run.dir``;
    ``hydra.sweep.dir`` for a sweep) set to ``outdir`` as a single-quoted Hydra value (quotes escaped, and
    backslashes before a quote or at the end doubled, as Hydra's override grammar reads them), each shell-quoted."""
    folder = re.sub(r"(\\*)('|$)", lambda match: match.group(1) * 2 + ("\\'" if match.group(2) else ""), str(outdir))
    return " ".join(map(shlex.quote, [program, *task_overrides, f"{folder_key}='{folder}'"]))


def interrupted_command(program: str) -> str:
    """What an interrupted job prints to be run again (inside a Hydra job): its command line's words
    (:func:`resume_command`), with the folder set: in a single run ``hydra.run.dir``, the job's output folder; in a
    sweep (``-m``) ``hydra.sweep.dir``, which runs every job again, each resuming from its folder's checkpoints (a
    job's own command would resume that job only and drop the jobs not yet started). The words, not the overrides
    Hydra records, so that flags such as ``--config-dir`` (where an ``experiment=`` may come from) stay."""
    hydra_config = HydraConfig.get()
    folder_key, folder = (("hydra.sweep.dir", hydra_config.sweep.dir) if hydra_config.mode == RunMode.MULTIRUN
                          else ("hydra.run.dir", hydra_config.runtime.output_dir))
    words = [word for word in sys.argv[1:] if not word.lstrip("+~").startswith(f"{folder_key}=")]
    return resume_command(words, Path(folder), program, folder_key)


def job_record(cfg: DictConfig) -> dict[str, str]:
    """The record a job writes into its folder once the folder accepts it (inside a Hydra job): the composed
    config and the command line's overrides as YAML, under the names Hydra itself would give them
    (``.hydra/config.yaml``, ``.hydra/overrides.yaml``). Hydra's own copy, written before the job's checks, is
    turned off in the configs (``hydra.output_subdir: null``), so a refused job leaves no record of itself."""
    overrides = list(HydraConfig.get().overrides.task)
    return {".hydra/config.yaml": OmegaConf.to_yaml(cfg), ".hydra/overrides.yaml": OmegaConf.to_yaml(overrides)}


@hydra.main(version_base=None, config_path=CONFIG_DIR, config_name="config")
def run(cfg: DictConfig) -> None:
    """The main job on the composed config; outputs go to Hydra's output directory. The composed config and the
    command line's overrides are saved there (``.hydra/config.yaml``, ``.hydra/overrides.yaml``) only once the
    folder accepts the job, so a refused resume leaves the folder's record of its own job (Hydra's own copy,
    written before the job starts, is turned off: ``hydra.output_subdir: null``); the job logs them then too, so a
    refused job's config does not land in the running job's ``cli.log``. A job refused before any work
    (:class:`~unsparse.job.JobRefusedError`), or at a checkpoint of its folder that it cannot resume from
    (:class:`~unsparse.train.CheckpointRefusedError`: damaged, or written by a run of other settings, another model
    or an older version; before anything is resumed from it), prints one line to stderr and exits with status 2;
    in a sweep (``-m``) the sweep's other jobs run first, and Hydra then ends it with status 1, repeating the first
    refusal (:class:`SweepJobRefusedError`). Another error keeps Hydra's traceback (exit status 1): a bug to trace.
    Ctrl-C ends the job (and a sweep) with exit status 130 and says how to resume (the checkpoints written so far
    stay)."""
    outdir = Path(HydraConfig.get().runtime.output_dir)
    try:
        report = run_pipeline(outdir=outdir, record=job_record(cfg), **build_job(cfg))
    except (JobRefusedError, CheckpointRefusedError) as error:  # one line, not Hydra's traceback: no bug to trace
        print(f"unsparse: refused: {error}", file=sys.stderr)
        if HydraConfig.get().mode == RunMode.MULTIRUN:  # Hydra's launcher would not catch SystemExit: sweep ended
            raise SweepJobRefusedError(f"unsparse: a job of the sweep was refused: {error}") from None
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        program = sys.argv[0] if Path(sys.argv[0]).name == "unsparse" else "unsparse"
        log.error("interrupted in %s; to resume from the checkpoints written so far run: %s", outdir,
                  interrupted_command(program))
        raise SystemExit(130) from None
    accuracy = report["accuracy"]
    log.info("weighted sparsity %.2f%% pruned, %.2f%% as stored | %s dense %.4g, pruned %.4g, sparse run %.4g | "
             "report: %s", 100 * report["pruning"]["weighted_sparsity"], 100 * report["file"]["weighted_sparsity"],
             report["run"]["metric_label"], accuracy["dense"], accuracy["pruned"], accuracy["sparse_run"],
             outdir / "report.md")


@hydra.main(version_base=None, config_path=CONFIG_DIR, config_name="bench")
def bench(cfg: DictConfig) -> None:
    """``unsparse bench``: the GPU per-layer comparison (needs CUDA); outputs in Hydra's output directory, with the
    job's record (:func:`job_record`) once ``run_bench`` accepts the settings. ``quick=true`` sets the settings of
    :data:`~unsparse.runtime.bench.QUICK` that the command line does not (``quick=true models=[alexnet]`` times
    AlexNet only); ``~quick`` removes the setting, which leaves it off, as removing another one leaves
    ``run_bench``'s default. A setting that is neither ``quick`` nor one of ``run_bench``'s (``+foo=1``), a
    ``quick`` that is no bool, settings that ``run_bench`` refuses, and a machine without CUDA, print one line to
    stderr, write nothing and exit with status 2 (in a sweep, as :func:`run` says)."""
    from unsparse.runtime.bench import QUICK, RUN_BENCH_SIGNATURE, BenchRefusedError, run_bench

    settings = OmegaConf.to_container(cfg, resolve=True)
    settings.pop("hydra", None)
    try:
        try:
            check_known_settings(settings, ["quick", *(name for name in RUN_BENCH_SIGNATURE.parameters  # but those
                                                       if name not in ("out_dir", "commit", "record"))])  # passed here
            quick = check_flag(settings.pop("quick", False), "quick")  # "maybe" would be true to if; ~quick: off
        except ValueError as error:
            raise BenchRefusedError(str(error)) from None
        if quick:
            given = {override.key_or_group for override in
                     OverridesParser.create().parse_overrides(list(HydraConfig.get().overrides.task))}
            settings.update({key: value for key, value in QUICK.items() if key not in given})
        run_bench(HydraConfig.get().runtime.output_dir, commit=git_commit(), record=job_record(cfg), **settings)
    except BenchRefusedError as error:  # one line, not Hydra's traceback: nothing ran
        print(f"unsparse bench: refused: {error}", file=sys.stderr)
        if HydraConfig.get().mode == RunMode.MULTIRUN:  # as in run: the sweep's other jobs still run
            raise SweepJobRefusedError(f"unsparse bench: a job of the sweep was refused: {error}") from None
        raise SystemExit(2) from None


def main() -> None:
    """Console-script entry: ``unsparse [overrides]`` (main job) or ``unsparse bench [overrides]``."""
    if len(sys.argv) > 1 and sys.argv[1] == "bench":
        sys.argv.pop(1)
        bench()
    else:
        run()
