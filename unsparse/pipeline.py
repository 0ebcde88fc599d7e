"""The main job as plain functions: train -> prune -> quantize -> export -> reload -> sparse run -> report.

Hydra only composes the configuration (``unsparse/cli.py``); everything here takes ordinary objects, so the
pipeline runs (and is tested) without Hydra.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from unsparse.atomic import remove_stale_temporaries, write_record
from unsparse.data import Splits
from unsparse.job import (
    WRITTEN_ATOMICALLY,
    claim_output_folder,
    git_commit,
    git_tree_modified,
    job_identity,
    only_job_in,
    record_job,
    refusing,
)
from unsparse.prune.base import Pruner, PruneResult
from unsparse.prune.masks import weighted_sparsity
from unsparse.report import layer_rows, timing_verdicts, write_report
from unsparse.report.document import NOT_PLANNED, layer_goal_text, layers_short_text
from unsparse.report.plots import plot_backend_times, plot_history, plot_layers
from unsparse.runtime.backends import backend_names
from unsparse.runtime.baseline import NAME as BASELINE
from unsparse.runtime.batch_norm_folding import FOLD_POLICIES, fold_batch_norm_, fold_batch_norm_into_epilogues_
from unsparse.runtime.comparator import PlanCheck, check_plan, plan_model, planned_backends, time_against_default
from unsparse.runtime.modules import SparseConv, set_backend, sparse_layers, sparsify
from unsparse.runtime.plan import active_plan
from unsparse.settings import check_flag, check_integer, check_number, check_seed
from unsparse.sparse.functional import dense_fallback_backend
from unsparse.sparse.io import load_sparse, save_sparse
from unsparse.task import Task, check_model_fits, task_of, trivial_score
from unsparse.train import Trainer, deterministic_algorithms

log = logging.getLogger(__name__)


@dataclass
class TrainSettings:
    """Dense training settings (``train:`` in configs/config.yaml). ``deterministic``: train and prune under
    :func:`~unsparse.train.deterministic_algorithms`, so a CUDA run repeats from its seed, as CPU runs already do.

    Raises:
        ValueError: naming the ``train.`` field: ``epochs`` that is no integer >= 0, batch sizes that are no integers
            >= 1, a learning rate that is not positive, momentum outside ``[0, 1)``, negative weight decay (numbers,
            not bools; an infinite learning rate or weight decay, which trained NaN weights, too), or a
            ``deterministic`` that is no bool (checked before any work starts).
    """

    epochs: int = 3
    batch_size: int = 128
    eval_batch_size: int = 1000
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 5e-4
    deterministic: bool = False

    def __post_init__(self) -> None:
        check_integer(self.epochs, "train.epochs", low=0)
        check_integer(self.batch_size, "train.batch_size")
        check_integer(self.eval_batch_size, "train.eval_batch_size")
        for field in ("lr", "weight_decay"):
            check_number(getattr(self, field), f"train.{field}", math.isfinite, "(finite)")
        check_number(self.lr, "train.lr", lambda value: value > 0, "> 0")
        check_number(self.momentum, "train.momentum", lambda value: 0 <= value < 1, "in [0, 1)")
        check_number(self.weight_decay, "train.weight_decay", lambda value: value >= 0, ">= 0")
        check_flag(self.deterministic, "train.deterministic")


@dataclass
class TimingSettings:
    """Per-layer timing in the report (``runtime.timing:``): images per call (``batch_size``; with
    ``runtime.backend=auto`` the test set's batch, ``train.eval_batch_size``, instead, so that the plan's keys are
    the ones the test set looks up), timed runs, warm-up runs, and the backends the comparator times (None: every
    one available on the device except :data:`~unsparse.runtime.comparator.COMPARED_BY_DEFAULT_EXCLUDES`;
    ``direct_half2`` takes float16 inputs only, so the main job's float32 models record it as unsupported, and
    ``generated`` compiles kernels per weight, so it is timed only when named).

    Raises:
        ValueError: naming ``runtime.timing.backends``, for a name that is not a registered backend, ``"auto"``
            (the plan itself), or backends that are no list of names or an empty one; naming the field, for a
            ``batch_size`` or ``repeats`` that is no integer >= 1 or a ``warmup`` that is no integer >= 0.
    """

    batch_size: int = 64
    repeats: int = 20
    warmup: int = 3
    backends: list[str] | None = None

    def __post_init__(self) -> None:
        check_integer(self.batch_size, "runtime.timing.batch_size")
        check_integer(self.repeats, "runtime.timing.repeats")
        check_integer(self.warmup, "runtime.timing.warmup", low=0)
        if self.backends is not None:
            if isinstance(self.backends, str) or not all(isinstance(name, str) for name in self.backends):
                raise ValueError(f"runtime.timing.backends: expected a list of backend names, got {self.backends!r}")
            self.backends = list(self.backends)
            if not self.backends:  # nothing timed: every layer planned on the dense default, the report empty
                raise ValueError("runtime.timing.backends: empty; name the backends to time, or null for every "
                                 "available one")
            if "auto" in self.backends:  # planning would time the plan it makes, without end (RecursionError)
                raise ValueError("runtime.timing.backends: 'auto' is the plan, not a backend to time; name the "
                                 "backends it chooses from, or null for every available one")
            known = [name for name in backend_names() if name != "auto"]
            unknown = sorted(set(self.backends) - set(known))
            if unknown:
                raise ValueError(f"runtime.timing.backends: unknown {unknown}; known: {known}")


PLAN_FILE = "plan.json"
"""The checked plan the job's comparator made (:class:`~unsparse.runtime.plan.Plan`, strict JSON), which
``Plan.load`` reads back to run the exported model on ``auto`` elsewhere on the same GPU and batch size."""


def stored_weighted_sparsity(model: nn.Module) -> float:
    """Weighted sparsity (paper 004 eq. 7-8) of a sparsified model's conv and linear weights as they are stored:
    each SparseConv's zeros from its nnz (quantization may round kept weights to zero), each Linear's zero entries.
    The basis of :func:`~unsparse.prune.masks.model_weighted_sparsity` before sparsifying: the same layers.

    Raises:
        ValueError: a model without conv or linear weights.
    """
    sizes, zeros = {}, {}
    for name, module in model.named_modules():
        if isinstance(module, SparseConv):
            sizes[name] = math.prod(module.weight_shape)
            zeros[name] = sizes[name] - module.csr.nnz
        elif isinstance(module, nn.Linear):
            sizes[name], zeros[name] = module.weight.numel(), int((module.weight == 0).sum())
    return weighted_sparsity({name: zeros[name] / max(size, 1) for name, size in sizes.items()}, sizes)


def pruning_verdict(pruner: Pruner, result: PruneResult) -> dict[str, Any]:
    """What ``pruner`` was asked for and whether ``result`` reached it, as keys of report.json's ``pruning`` record:
    ``target``; ``layer_targets``, each masked layer's own final sparsity where the goal is per layer
    (:meth:`~unsparse.prune.base.Pruner.layer_goals`), else None; ``target_reached``: with ``layer_targets``
    whether every layer reached its own (:meth:`~unsparse.prune.base.PruneResult.layers_short`), else whether the
    masked layers reached the weighted sparsity ``target`` (paper 004 eq. 7-8,
    :meth:`~unsparse.prune.base.PruneResult.target_reached`); ``layers_short``, the layers below their own target
    in model order (empty for a whole-model goal); and ``shortfall_reason``,
    :meth:`~unsparse.prune.base.Pruner.shortfall_reason` where the target was not reached, else None.

    Raises:
        RuntimeError: as :meth:`~unsparse.prune.base.Pruner.layer_goals`, for a pruner not prepared.
    """
    goals = pruner.layer_goals()
    short = [] if goals is None else list(result.layers_short(goals))
    reached = not short if goals is not None else result.target_reached(pruner.target)
    return {"target": pruner.target, "layer_targets": goals, "target_reached": reached, "layers_short": short,
            "shortfall_reason": None if reached else pruner.shortfall_reason()}


def warn_short_of_target(pruning: Mapping[str, Any]) -> None:
    """Log a warning where a ``pruning`` record (:func:`pruning_verdict`'s keys with ``masked_weighted_sparsity``
    and ``layer_sparsity``) did not reach its target: the goal as asked, the layers below their own target
    (:func:`~unsparse.report.document.layers_short_text`) or the weighted sparsity the run stopped at, and the
    ``shortfall_reason`` where known."""
    if pruning["target_reached"]:
        return
    if pruning["layer_targets"] is not None:
        log.warning("pruning did not reach its target, %s: %s",
                    layer_goal_text(pruning["layer_targets"], pruning["target"]), layers_short_text(pruning))
        return
    reason = pruning["shortfall_reason"]
    log.warning("pruning stopped at weighted sparsity %.4f over the pruned layers, below its target %.4f%s",
                pruning["masked_weighted_sparsity"], pruning["target"], f" ({reason})" if reason else "")


def check_fold_policy(fold_batch_norm: object, backend: str) -> None:
    """Raise ``ValueError`` naming ``runtime.fold_batch_norm`` unless it is one of
    :data:`~unsparse.runtime.batch_norm_folding.FOLD_POLICIES`, and for ``"epilogue"`` with a ``backend`` other than
    ``"auto"``."""
    if not isinstance(fold_batch_norm, str) or fold_batch_norm not in FOLD_POLICIES:
        raise ValueError(f"runtime.fold_batch_norm: {fold_batch_norm!r} not among {', '.join(FOLD_POLICIES)} (in "
                         "YAML write 'off' quoted: a bare off reads as false)")
    if fold_batch_norm == "epilogue" and backend != "auto":
        raise ValueError(f"runtime.fold_batch_norm: 'epilogue' folds by the plan, so it needs runtime.backend=auto, "
                         f"not {backend!r}; use 'all' or 'off' with a named backend")


def unplanned_images(test_images: int, batch_size: int, planned_batch: int) -> int:
    """Test images evaluated in batches of ``batch_size`` (the last one partial) whose size is not the plan's
    ``planned_batch``: the plan holds entries for that batch size only, so under ``"auto"`` these run on the dense
    default."""
    full, last = divmod(test_images, batch_size)
    sizes = [batch_size] * full + ([last] if last else [])
    return sum(size for size in sizes if size != planned_batch)


def time_model_on(model: nn.Module, example: torch.Tensor, backend: str, timing_mode: str,
                  timing: TimingSettings) -> dict[str, Any]:
    """Time ``model`` with every layer on ``backend`` (set, and left so) against its dense default, both the same
    way (:func:`~unsparse.runtime.comparator.time_against_default`): ``timing_mode`` (``"graph"`` or ``"eager"``),
    or eagerly for a backend that cannot be recorded as a CUDA graph (``graph_capturable``).

    Returns:
        ``model_runs_on_ms`` and ``model_runs_on_default_ms`` (medians, ms) and ``model_runs_on_timing``.
    """
    from unsparse.runtime.backends import get_backend

    mode = timing_mode if get_backend(backend).graph_capturable else "eager"
    runs_on_ms, default_ms = time_against_default(set_backend(model, backend), example, mode, timing.repeats,
                                                  timing.warmup)
    return {"model_runs_on_ms": runs_on_ms, "model_runs_on_default_ms": default_ms, "model_runs_on_timing": mode}


def compare_layers(model: nn.Module, example: torch.Tensor, timing: TimingSettings, runs_on: str = "auto",
                   plan_path: Path | None = None) -> tuple[list[dict[str, Any]], PlanCheck, dict[str, str]]:
    """Plan ``model`` on ``example`` with the comparator, check the plan end to end, flatten the comparisons
    into report rows and name the backend each layer runs on under ``runs_on``.

    Every available backend (or those ``timing.backends`` names) is timed on every SparseConv with the input
    ``example`` produces there and checked against the float64 reference
    (:func:`unsparse.runtime.comparator.plan_model`); the model's layers are left on ``"auto"`` following the
    new plan. Then the whole planned model is timed against the same model on its dense default, and the plan's
    new entries are set back to that default if it is slower (:func:`~unsparse.runtime.comparator.check_plan`,
    ``timing.repeats`` runs of each): per-layer times need not add up to a model's.

    Args:
        model: holds SparseConv layers on ``example``'s device (mutated: backends set to ``"auto"``); eval mode
            (the planning forward would update BatchNorm statistics otherwise).
        example: a model input batch.
        timing: timed runs and warm-up runs per setting, backends to time.
        runs_on: the backend the model will run on: ``"auto"`` or a registered name.
        plan_path: where to write the checked plan (:meth:`~unsparse.runtime.plan.Plan.save`): this model's
            entries only, while the active plan that ``"auto"`` reads holds every plan the process made (a sweep's
            earlier jobs too).

    Returns:
        The rows, the plan check and the layers' backends. Rows with ``layer``, ``backend``, ``sparse``,
        ``params``, ``status`` (``ok``/``wrong``/``unsupported``/``error``), ``input_shape``, ``time_ms`` (median,
        ms; None if not timed), ``runs``, ``rel_error`` (vs the float64 reference) and ``reason``; layers sharing a
        plan key share their measurements. Besides the backends, each layer has one row per layout of the dense
        convolution alone (backend :data:`unsparse.runtime.baseline.NAME`, params ``{"layout": ...}``), the
        baseline of the speedups.
        The layers' backends: per SparseConv name, the backend it runs on for ``example`` under ``runs_on``; for
        ``"auto"`` the checked plan's entry (:func:`~unsparse.runtime.comparator.planned_backends`; ``"dense
        default (not planned)"`` where it has none), for a named backend that name, or where the backend declines
        the layer (a dtype or geometry it lacks) the dense default it falls back to, with the reason
        (:func:`~unsparse.sparse.functional.sparse_conv`), judged on the layer's input in the planning forward (the
        one forward of ``example`` besides the timed ones).

    Raises:
        KeyError: ``runs_on`` is neither ``"auto"`` nor a registered backend.
    """
    from unsparse.runtime.backends import get_backend

    shapes: dict[str, list[int]] = {}
    names = {layer: name for name, layer in sparse_layers(model).items()}
    chosen = None if runs_on == "auto" else get_backend(runs_on)
    backends = dict.fromkeys(names.values(), runs_on)

    def record_input(layer: SparseConv, args: tuple[torch.Tensor, ...]) -> None:
        x = args[0]
        shapes[names[layer]] = list(x.shape)
        reason = None if chosen is None else chosen.unsupported_reason(layer.conv2d_input(x), layer.csr,
                                                                       layer.geometry)
        if reason is not None:
            backends[names[layer]] = f"{dense_fallback_backend(x.device)} (dense fallback: {reason})"

    hooks = [layer.register_forward_pre_hook(record_input) for layer in names]
    try:
        plan, comparisons = plan_model(model, example, backends=timing.backends, runs=timing.repeats,
                                       warmup=timing.warmup, baseline=True)
    finally:
        for hook in hooks:
            hook.remove()
    check = check_plan(model, example, plan, comparisons, runs=timing.repeats, warmup=timing.warmup)
    if plan_path is not None:
        plan.save(plan_path)
    if chosen is None:
        planned = planned_backends(model, active_plan())
        backends = {name: planned.get(name, NOT_PLANNED) for name in backends}
    by_key = {comparison.key: comparison for comparison in comparisons}
    rows = []
    for name, layer in sparse_layers(model).items():
        comparison = by_key.get(getattr(layer, "plan_key", None))
        if comparison is None:
            continue
        for measurement in comparison.measurements:
            timing = measurement.timing
            rows.append({"layer": name, "backend": measurement.backend,
                         "sparse": get_backend(measurement.backend).sparse, "params": measurement.params,
                         "status": measurement.status, "input_shape": shapes[name],
                         "time_ms": None if timing is None else timing.median_ms,
                         "runs": None if timing is None else timing.runs, "rel_error": measurement.rel_error,
                         "reason": measurement.reason})
        baseline = comparison.baseline
        for layout, error in baseline.rel_error.items():
            timed = baseline.timings.get(layout)
            rows.append({"layer": name, "backend": BASELINE, "sparse": False, "params": {"layout": layout},
                         "status": "ok" if timed else "wrong" if error < math.inf else "error",
                         "input_shape": shapes[name],
                         "time_ms": timed.median_ms if timed else None, "runs": timed.runs if timed else None,
                         "rel_error": error, "reason": baseline.failures.get(layout)})
    return rows, check, backends


def run_pipeline(splits: Splits, model: nn.Module, pruner: Pruner, quantizer: Callable[..., nn.Module],
                 outdir: str | Path, train: TrainSettings, timing: TimingSettings, backend: str = "reference",
                 device: torch.device | None = None, progress: bool = True, seed: int = 0,
                 record: Mapping[str, str] | None = None, fold_batch_norm: str = "off") -> dict[str, Any]:
    """Run the whole job and write ``model.safetensors``, ``report.json``, ``report.md`` and PNGs to ``outdir``.

    Checkpoints (``dense.pt``, ``prune/``) live in ``outdir`` too: running again with the same ``outdir``
    resumes after an interruption (Ctrl-C loses at most the current epoch). ``outdir/job.json`` records the job
    (:func:`~unsparse.job.job_identity`), and a run of another job in the same folder is refused before it reads a
    checkpoint. One folder takes one running job at a time (:func:`~unsparse.job.only_job_in`); once it accepts the
    job, temporary files of the job's files that a killed process left mid-write are removed, logged
    (:func:`~unsparse.atomic.remove_stale_temporaries`).

    Args:
        splits: data (train/val/test tensors).
        model: a fresh model from ``create_model`` (mutated: trained, then masked).
        pruner: e.g. :class:`unsparse.prune.MagnitudePruner`.
        quantizer: ``quantizer(sparse_model, calibration_loader) -> sparse_model`` (identity for none).
        backend: backend the reloaded sparse model runs the test set on; ``"auto"`` follows the comparator's
            plan (made on one evaluation batch), set back to the dense default if the whole planned model is
            slower than that default. Whatever the choice, every available backend is compared per layer on
            ``timing.batch_size`` images (``eval_batch_size`` for ``"auto"``), and the planned model is timed
            against its dense default (:func:`compare_layers`; ``plan_check`` in the report).
        fold_batch_norm: where the reloaded model's eval-mode BatchNorms are folded into its convolutions
            (``runtime.fold_batch_norm``, :data:`~unsparse.runtime.batch_norm_folding.FOLD_POLICIES`): ``"off"``;
            ``"all"``, before the comparisons (:func:`~unsparse.runtime.batch_norm_folding.fold_batch_norm_`);
            ``"epilogue"`` (``backend="auto"`` only), after the plan is checked, into the layers whose planned
            backend adds the bias in its epilogue
            (:func:`~unsparse.runtime.batch_norm_folding.fold_batch_norm_into_epilogues_`). The test set runs on
            the folded model; ``model.safetensors`` holds the unfolded one. The report's ``plan_check`` says which
            layers took a BatchNorm (``batch_norm_folding``).
        record: text files to write into ``outdir`` (relative path -> content, atomically) and log once the folder
            accepts the job (before any work, or, where it holds checkpoints but no ``job.json``, once they have
            loaded), e.g. the command line's composed config: a refused job leaves the folder's record of its own
            job, and the log that a running job writes there, as they were.

    Returns:
        The report dict (also written as ``report.json``).

    Raises:
        ~unsparse.job.JobRefusedError: (a ``ValueError``, before any training) ``outdir`` holds the checkpoints of
            another job (:func:`~unsparse.job.claim_output_folder`) or another running job
            (:func:`~unsparse.job.only_job_in`), the model cannot take the data, or a split's labels are not class
            indices of its outputs (:func:`~unsparse.task.check_model_fits`), or ``backend`` is neither ``"auto"`` nor a
            registered backend that runs on ``device`` (checked before any training: a CUDA backend on the CPU would run
            every layer dense), or the pruner's settings name layers the model does not have
            (:meth:`Pruner.check_layers`, also before training: the folder would otherwise be bound to the typo by
            then), or ``seed`` is outside ``[0, 2^32)`` (:func:`~unsparse.settings.check_seed`: it would repeat another
            seed's run under another job identity), or ``fold_batch_norm`` is no policy, or ``"epilogue"`` with a
            backend other than ``"auto"`` (only a plan says which backend adds the bias where).
    """
    from unsparse.runtime.backends import get_backend

    with refusing():
        if backend != "auto" and backend not in backend_names():
            raise ValueError(f"runtime.backend: unknown {backend!r}; known: {', '.join(backend_names())}")
        device_type, device_types = (device or torch.device("cpu")).type, get_backend(backend).device_types
        if device_type not in device_types:
            raise ValueError(f"runtime.backend: {backend!r} runs on {sorted(device_types)}, the job on "
                             f"{device_type}; choose a backend of that device, or auto")
        check_seed(seed)
        check_fold_policy(fold_batch_norm, backend)
        task = task_of(splits)
        check_model_fits(model, splits)
        pruner.check_layers(model)
    if train.epochs == 0:
        log.warning("train.epochs = 0: the dense model is not trained (its %s is chance level)", task.label)
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    with only_job_in(outdir):
        return _run_in_folder(splits, task, model, pruner, quantizer, outdir, train, timing, backend, device,
                              progress, seed, record, fold_batch_norm)


def _run_in_folder(splits: Splits, task: Task, model: nn.Module, pruner: Pruner, quantizer: Callable[..., nn.Module],
                   outdir: Path, train: TrainSettings, timing: TimingSettings, backend: str,
                   device: torch.device | None, progress: bool, seed: int,
                   record: Mapping[str, str] | None, fold_batch_norm: str) -> dict[str, Any]:
    """:func:`run_pipeline` once its settings are checked, in the folder it holds locked. The folder's ``job.json``
    and the job's ``record`` are written once the folder accepts the job: before any work, or, in a folder with
    checkpoints but no ``job.json`` (:func:`~unsparse.job.claim_output_folder`), once they have loaded (dense
    training and pruning returned), so that a job they refuse leaves the folder as it was."""
    identity = job_identity(splits, model, pruner, train, seed)
    with refusing():
        unchecked = claim_output_folder(outdir, identity)
    stale = remove_stale_temporaries(outdir, WRITTEN_ATOMICALLY)
    if stale:
        log.warning("removed %d temporary files of writes an earlier process did not finish: %s", len(stale),
                    ", ".join(str(path.relative_to(outdir)) for path in stale))
    if not unchecked:
        write_record(outdir, record)
    commit, tree_modified = git_commit(), git_tree_modified()  # the code this process runs, not the tree at its end
    device = device or torch.device("cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(seed)
    loaders = splits.loaders(train.batch_size, train.eval_batch_size, seed)
    trainer = Trainer(loaders, device, loss=task.loss, lr=train.lr, momentum=train.momentum,
                      weight_decay=train.weight_decay, progress=progress)
    with deterministic_algorithms(train.deterministic):
        dense_history = trainer.fit(model, train.epochs, outdir / "dense.pt", desc="dense training")
        accuracy = {"dense": trainer.evaluate(model, "test", "test dense")[task.metric]}
        result = pruner.run(model, trainer, outdir / "prune")
        accuracy["pruned"] = trainer.evaluate(model, "test", "test pruned")[task.metric]
    if unchecked:  # every checkpoint of the folder loaded as this job's
        with refusing():
            record_job(outdir, identity)
        write_record(outdir, record)
    log.info("weighted sparsity %.4f, %s dense %.4g, pruned %.4g", result.weighted_sparsity, task.label,
             accuracy["dense"], accuracy["pruned"])
    fully_pruned = [name for name, sparsity in result.layer_sparsity.items() if sparsity >= 1.0]
    if fully_pruned:
        log.warning("every weight of %s is pruned: the network's signal is cut there (only biases pass)",
                    ", ".join(fully_pruned))
    pruning = {"method": result.method, **pruning_verdict(pruner, result),
               "weighted_sparsity": result.weighted_sparsity,
               "masked_weighted_sparsity": result.masked_weighted_sparsity,
               "layer_sparsity": result.layer_sparsity, "fully_pruned_layers": fully_pruned,
               "wall_time_s": result.wall_time_s, "history": result.history}
    warn_short_of_target(pruning)

    sparse_model = sparsify(model.cpu())
    pruned_nonzeros = sum(layer.csr.nnz for layer in sparse_layers(sparse_model).values())
    sparse_model = quantizer(sparse_model, loaders["val"])
    exported_sparsity = stored_weighted_sparsity(sparse_model)
    path = save_sparse(sparse_model, outdir / "model.safetensors",
                       extra={"data": splits.name, "accuracy": accuracy, "weighted_sparsity": exported_sparsity,
                              "pruned_weighted_sparsity": result.weighted_sparsity})
    loaded = load_sparse(path, device=device)

    rows = layer_rows(loaded, path)
    example = splits.test[0][: train.eval_batch_size if backend == "auto" else timing.batch_size].to(device)
    folded = fold_batch_norm_(loaded) if fold_batch_norm == "all" else []
    timings, check, backends = compare_layers(loaded, example, timing, backend, outdir / PLAN_FILE)
    if fold_batch_norm == "epilogue":
        folded = fold_batch_norm_into_epilogues_(loaded, active_plan())
    runs_on = {"model_runs_on": backend, "layer_backends": backends,
               "batch_norm_folding": {"policy": fold_batch_norm, "folded": folded}}
    if backend == "auto":
        runs_on["unplanned_images"] = unplanned_images(len(splits.test[0]), train.eval_batch_size, len(example))
    elif backend == dense_fallback_backend(example.device):
        set_backend(loaded, backend)  # compare_layers left the layers on "auto", the plan
        runs_on["model_runs_on_is_default"] = True  # timed against itself, the figure would be noise
    else:
        runs_on.update(time_model_on(loaded, example, backend, check.timing, timing))
    accuracy["sparse_run"] = trainer.evaluate(loaded, "test", f"test sparse ({backend})")[task.metric]
    weights = (f"trained on the data set, {train.epochs} epoch{'s' * (train.epochs != 1)} (not synthetic)"
               if train.epochs else
               "NOT trained (train.epochs = 0): the seed's initial weights, pruned")
    report = {
        "run": {"data": splits.name, "model": model.unsparse_spec, "device": str(device), "torch": torch.__version__,
                "weights": weights, "metric": task.metric, "metric_label": task.label,
                "metric_trivial": trivial_score(splits), "commit": commit,
                "tree_modified": tree_modified, "seed": seed, "deterministic": train.deterministic,
                "timing_runs": timing.repeats, "timing_warmup": timing.warmup},
        "accuracy": accuracy,
        "dense_training": dense_history,
        "pruning": pruning,
        "quantization": getattr(loaded, "unsparse_quantization", None),
        "conv_nonzeros": {"pruned": pruned_nonzeros, "exported": sum(row["nnz"] for row in rows)},
        "layers": rows,
        "timings": [entry for entry in timings if entry["time_ms"] is not None],
        "not_timed": [entry for entry in timings if entry["time_ms"] is None],
        "timing_baseline": BASELINE,
        "timing_verdicts": timing_verdicts([entry for entry in timings if entry["time_ms"] is not None], BASELINE),
        "plan_check": {**asdict(check), "images": len(example), **runs_on},
        "file": {"path": path.name, "bytes": path.stat().st_size,
                 "sparse_conv_bytes": sum(row["file_bytes"] for row in rows),
                 "weighted_sparsity": exported_sparsity,
                 "dense_conv_fp32_bytes": sum(row["dense_fp32_bytes"] for row in rows)},
    }
    figures = {"Layers: sparsity and storage": plot_layers(rows, outdir / "layers.png"),
               "Per-layer time by backend": plot_backend_times(report["timings"], outdir / "timings.png")}
    if result.history:
        metric = f"val_{task.metric}" if f"val_{task.metric}" in result.history[0] else task.metric
        figures["Pruning: validation metric and weighted sparsity"] = plot_history(
            result.history, outdir / "pruning.png", metric, f"{result.method} pruning", f"validation {task.label}",
            pruner.history_axis)
    write_report(outdir, report, figures)
    return report
