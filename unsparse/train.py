"""Training and evaluation loops, with per-epoch checkpoints that resume exactly.

A checkpoint is written atomically after every epoch (model, optimizer, scheduler, RNG states, history), so
Ctrl-C loses at most the epoch in progress; ``fit`` called again with the same checkpoint path continues
where it stopped. Checkpoints hold only tensors and plain containers and load with ``weights_only=True``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parameter import is_lazy
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from unsparse.atomic import atomic_write
from unsparse.modes import eval_mode, module_modes, restore_modes
from unsparse.settings import check_integer

log = logging.getLogger(__name__)

LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "cross_entropy": F.cross_entropy,
    "mse": F.mse_loss,
}

CUBLAS_WORKSPACE_CONFIG = ":4096:8"
"""cuBLAS workspace setting that makes its CUDA >= 10.2 kernels deterministic (``CUBLAS_WORKSPACE_CONFIG``; torch's
reproducibility notes); :func:`deterministic_algorithms` sets it where the environment has none."""


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool = True) -> Iterator[None]:
    """Within the block, torch runs only deterministic algorithms (``torch.use_deterministic_algorithms``, cuDNN
    deterministic and not benchmarking, cuBLAS with a fixed workspace), so a CUDA training run repeats bit for bit
    from its seed and a resumed run equals an uninterrupted one, as on the CPU. On exit the previous settings come
    back, also after an exception: torch's flags, cuDNN's, and ``CUBLAS_WORKSPACE_CONFIG`` (unset again where it
    was unset). ``enabled=False`` changes nothing (so callers can pass a flag through).

    Raises:
        RuntimeError: from torch, inside the block, for an operation without a deterministic implementation.
    """
    if not enabled:
        yield
        return
    mode = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    cudnn_deterministic, cudnn_benchmark = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    try:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
        yield
    finally:
        torch.use_deterministic_algorithms(mode, warn_only=warn_only)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn_deterministic, cudnn_benchmark
        if workspace is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = workspace


class CheckpointRefusedError(ValueError):
    """This run cannot resume from that checkpoint: a run of other settings, another model or another kind of train
    loader wrote it, an older version that recorded less, or it holds more epochs than asked for. Nothing is resumed
    from it, so the command line refuses the job with its message in one line (exit status 2), as it refuses a
    folder of another job; the message names the checkpoint and says what to do."""


class DamagedCheckpointError(CheckpointRefusedError):
    """A checkpoint that cannot be read as one (:func:`load_checkpoint`): damaged (truncated, empty), not written by
    this program, or incomplete; deleting it starts its stage over."""


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> None:
    """Atomically write ``state`` (tensors, numbers, strings, lists, dicts) with ``torch.save``, streamed straight
    into the temporary file (:func:`~unsparse.atomic.atomic_write`), not through a copy in memory."""
    atomic_write(path, lambda file: torch.save(state, file))


def random_states() -> dict[str, Any]:
    """The random number generators a resumed run must continue: torch's CPU generator and, once the process has
    used CUDA, every CUDA device's (dropout on the GPU draws from those; a CPU run does not start CUDA for this)."""
    return {"rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []}


def restore_random_states(state: dict[str, Any]) -> None:
    """Put back what :func:`random_states` recorded in a checkpoint ``state``. A checkpoint of a run that never used
    CUDA (or an older one) has no CUDA states; where the machine has another number of GPUs than the run had, the
    first ``min(saved, present)`` devices get theirs back, with a warning: a run on another device may then
    differ from the uninterrupted one."""
    torch.set_rng_state(state["rng"])
    cuda = state.get("cuda_rng") or []
    if not cuda:
        return
    present = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if present != len(cuda):
        log.warning("checkpoint has CUDA random states of %d devices, this machine %d", len(cuda), present)
    for index, generator_state in enumerate(cuda[:present]):
        torch.cuda.set_rng_state(generator_state, index)


def load_checkpoint(path: str | Path, required: Iterable[str] = ()) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint` (``weights_only=True``: no code is unpickled), its
    tensors on the CPU.

    Args:
        path: the checkpoint file. required: keys the checkpoint must hold.

    Returns:
        The saved ``state`` dict.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        MemoryError: from torch, where the checkpoint does not fit into memory.
        DamagedCheckpointError: (a ``ValueError``) naming ``path``, where it is not a readable checkpoint
            (truncated, empty, a folder, not torch's format, or holding objects other than tensors and plain
            containers), is not a dict, or lacks a key of ``required``.
    """
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (FileNotFoundError, MemoryError):
        raise
    except Exception as error:  # torch reports a damaged file as OSError, EOFError, RuntimeError, UnpicklingError...
        raise DamagedCheckpointError(f"{path}: not a readable checkpoint ({type(error).__name__}); it is damaged or "
                                     "not one this program wrote: delete it to start over") from None
    if not isinstance(state, dict):
        raise DamagedCheckpointError(f"{path}: not a checkpoint (holds a {type(state).__name__}, not a dict); delete "
                                     "it to start over")
    missing = [key for key in required if key not in state]
    if missing:
        raise DamagedCheckpointError(f"{path}: not a complete checkpoint (no {', '.join(missing)}); delete it to "
                                     "start over")
    return state


def tensor_digest(tensors: Iterable[torch.Tensor]) -> str:
    """The first 16 hex digits of the sha256 of the tensors' bytes, in order (any dtype and device; copied to the
    CPU): what a checkpoint's identity records of the data or the model a run started from."""
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()[:16]


def check_resumable(path: str | Path, state: dict[str, Any], identity: str | None, key: str = "identity") -> None:
    """Refuse to resume from a checkpoint that a run of other settings wrote into the same folder.

    Args:
        path: the checkpoint (named in the error). state: its content (:func:`load_checkpoint`).
        identity: what this run writes into its checkpoints (e.g. :meth:`~unsparse.prune.base.Pruner.identity`),
            JSON or any string; None checks nothing.
        key: the entry of ``state`` that holds what the run that wrote it recorded.

    Raises:
        CheckpointRefusedError: (a ``ValueError``) naming the checkpoint and the settings that differ, or, where
            ``identity`` is given, a checkpoint that records no ``key`` (an older version wrote it: the evolutionary
            and gradual pruners' checkpoints recorded no identity before ef1f1e6, and resumed unchecked).
    """
    saved = state.get(key)
    if identity is not None and saved is None:
        raise CheckpointRefusedError(f"{path}: records no {key!r} (the settings of the run that wrote it, which a "
                                     "resume must match): an older version, or another kind of run, wrote it; start "
                                     "the run in a new folder")
    if identity is None or saved == identity:
        return
    try:
        before, now = json.loads(saved), json.loads(identity)
    except json.JSONDecodeError:
        before, now = saved, identity
    if before == now:  # the same settings written differently, e.g. 1 and 1.0
        return
    differences = ", ".join(f"{key}: {old!r} there, {new!r} here" for key, old, new in _differences(before, now))
    raise CheckpointRefusedError(f"{path}: written by a run with other settings ({differences}); resume with the "
                                 "same settings, or start in another folder")


def _differences(before: Any, now: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """``(dotted key, value there, value here)`` of every leaf that differs between two JSON values."""
    if isinstance(before, dict) and isinstance(now, dict):
        return [difference for key in sorted(set(before) | set(now))
                for difference in _differences(before.get(key), now.get(key), f"{prefix}{key}.")]
    return [] if before == now else [(prefix.rstrip(".") or "identity", before, now)]


def _check_model_state(path: str | Path, saved: Any, model: nn.Module) -> None:
    """Refuse, naming ``path``, unless ``saved`` holds exactly the tensors of ``model.state_dict()``, of the same
    names and shapes (what ``load_state_dict`` needs; checked first, so a refused checkpoint changes nothing).

    Raises:
        DamagedCheckpointError: where ``saved`` is no state dict of tensors.
        CheckpointRefusedError: naming the tensors missing, unexpected or of another shape.
    """
    if not isinstance(saved, dict) or not all(isinstance(value, torch.Tensor) for value in saved.values()):
        raise DamagedCheckpointError(f"{path}: its 'model' is not a state dict of tensors; delete it to start over")
    expected = {name: tuple(value.shape) for name, value in model.state_dict().items()}
    found = {name: tuple(value.shape) for name, value in saved.items()}
    problems = [f"missing {name}" for name in expected if name not in found]
    problems += [f"unexpected {name}" for name in found if name not in expected]
    problems += [f"{name}: shape {found[name]} there, {shape} here" for name, shape in expected.items()
                 if name in found and found[name] != shape]
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise CheckpointRefusedError(f"{path}: written for another model ({shown}); resume with the same model, or "
                                     "start in another folder")


def _check_recorded(path: str | Path, state: dict[str, Any]) -> None:
    """Refuse a fit checkpoint whose history lacks ``elapsed_s`` in an entry (without it the wall time would count
    only the epochs after the resume). Checkpoints of older versions lack it; a run with one starts again in a new
    folder, as one with a checkpoint that records no settings or identity does (:func:`check_resumable`).

    Raises:
        CheckpointRefusedError: naming ``path`` and what it lacks.
    """
    if not all(isinstance(entry, dict) and "elapsed_s" in entry for entry in state["history"]):
        raise CheckpointRefusedError(f"{path}: records no 'elapsed_s' in its history (the seconds of its epochs, which "
                                     "the run's time sums): an older version, or another kind of run, wrote it; start "
                                     "the run in a new folder")


def check_loader_generator(path: str | Path, saved: torch.Tensor, generator: torch.Generator | None) -> None:
    """Refuse a checkpoint whose ``loader_rng`` (the state of the train loader's generator, empty where the loader
    had none) does not fit this run's train loader: a generator of another kind (another state size, e.g. a CUDA
    one) or one present on one side only would draw another training order than the run that wrote it.

    Raises:
        CheckpointRefusedError: naming ``path`` and ``loader_rng``, and both generators.
    """
    size = generator.get_state().numel() if generator is not None else 0
    if saved.numel() == size:
        return

    def described(state_bytes: int) -> str:
        return (f"a generator of a {state_bytes}-byte state" if state_bytes
                else "no generator (its order, if shuffled, drew from torch's global one)")

    raise CheckpointRefusedError(f"{path}: loader_rng: the train loader of the run that wrote it had "
                                 f"{described(saved.numel())}, this run's has {described(size)}; resume with the same "
                                 "data loader, or start in another folder")


LABEL_DTYPES = (torch.int64, torch.uint8)
"""The dtypes ``F.cross_entropy`` takes for class indices (it refuses other integer dtypes, e.g. int32)."""

SHOWN_LABELS = 10
"""At most this many distinct out-of-range labels are named in :func:`check_class_labels`' error."""


def check_label_dtype(labels: torch.Tensor, source: str = "Trainer: cross_entropy") -> None:
    """Refuse labels of a dtype ``F.cross_entropy`` does not take as class indices (it raises its own RuntimeError).

    Raises:
        ValueError: naming ``source`` and the dtype, where it is not one of :data:`LABEL_DTYPES`.
    """
    if labels.dtype not in LABEL_DTYPES:
        raise ValueError(f"{source}: labels of dtype {labels.dtype}; class indices must be torch.int64 (or "
                         "torch.uint8): cast them with .long()")


def check_class_labels(labels: torch.Tensor, num_classes: int, source: str = "Trainer: cross_entropy") -> None:
    """Refuse class indices that ``F.cross_entropy`` cannot take, before it is called: out of ``[0, num_classes)``
    it raises "Target k is out of bounds" on the CPU, naming no data set, and on CUDA it trips a device-side assert,
    after which the process's CUDA context is unusable.

    Costs one ``aminmax`` over ``labels`` on their device and one transfer of its two values to the CPU: for 128
    CPU labels about 6 us, for 128 CUDA labels about 44 us, a synchronisation included (an H200, torch 2.11). The
    distinct offending labels are gathered only once the check fails.

    Args:
        labels: ``(N,)`` class indices, any device.
        num_classes: C, the second dimension of the ``(N, C)`` logits they are scored against.
        source: what checks the labels, the message's first words (the trainer's loss for a batch,
            :func:`~unsparse.task.check_model_fits` names the model, data set and split).

    Raises:
        ValueError: naming the dtype, where it is not one of :data:`LABEL_DTYPES` (:func:`check_label_dtype`); naming
            C and the labels outside ``[0, C)`` (distinct, ascending, the first :data:`SHOWN_LABELS`, and how many more
            there are).
    """
    check_label_dtype(labels, source)
    if labels.numel() == 0:
        return
    low, high = torch.stack(torch.aminmax(labels)).tolist()
    if low >= 0 and high < num_classes:
        return
    outside = labels[(labels < 0) | (labels >= num_classes)].unique().tolist()
    more = f" and {len(outside) - SHOWN_LABELS} more" if len(outside) > SHOWN_LABELS else ""
    raise ValueError(f"{source}: labels {outside[:SHOWN_LABELS]}{more} outside [0, {num_classes}): the logits have "
                     f"C = {num_classes} classes (their second dimension), so labels must lie in [0, C)")


def running_statistics(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The buffers a train-mode forward of ``model`` updates in torch's normalisation layers, each with a copy of its
    value now: ``running_mean``, ``running_var`` and ``num_batches_tracked`` of every module that tracks running
    statistics (``track_running_stats``: batch norms, and instance norms that ask for it); a lazy module's are left out
    before its first forward, which creates their values. Copies two vectors of a layer's channel count and one integer
    per layer. :meth:`Trainer.train_epoch` takes them before an epoch's first forward and puts them back
    (``buffer.copy_(saved)``) where it refuses that batch after the forward."""
    return [(buffer, buffer.detach().clone()) for module in model.modules()
            if getattr(module, "track_running_stats", False)
            for name in ("running_mean", "running_var", "num_batches_tracked")
            if isinstance(buffer := getattr(module, name, None), torch.Tensor) and not is_lazy(buffer)]


def fit_seconds(history: list[dict[str, float]]) -> float:
    """Seconds the epochs of a :meth:`Trainer.fit` history took, summed over every process that ran them: its last
    entry's ``elapsed_s`` (fit refuses a checkpoint without it), 0 for no epoch."""
    return history[-1]["elapsed_s"] if history else 0.0


@dataclass
class Trainer:
    """SGD training on one data set.

    Attributes:
        loaders: ``{"train", "val", "test"}`` DataLoaders of ``(input, target)`` batches.
        device: where the model runs.
        loss: ``"cross_entropy"`` (classification; metric top-1 %) or ``"mse"`` (reconstruction; the metric
            is the mean squared error, reported as ``mse``; :meth:`score` negates it so higher is better).
        lr, momentum, weight_decay: SGD settings; the learning rate follows a cosine schedule within ``fit``.
        progress: show tqdm bars.

    Raises:
        ValueError: naming ``loss``, for a loss other than those of :data:`LOSSES`.
    """

    loaders: dict[str, DataLoader]
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    loss: str = "cross_entropy"
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 5e-4
    progress: bool = True

    def __post_init__(self) -> None:
        """Raises ValueError for an unknown ``loss``."""
        if self.loss not in LOSSES:
            raise ValueError(f"Trainer: unknown loss {self.loss!r}; known losses: {', '.join(LOSSES)}")

    def _check_targets(self, inputs: torch.Tensor, targets: torch.Tensor, num_classes: int | None) -> None:
        """Refuse, before a batch's forward, a classifier's targets that are no class indices for it: labels of a dtype
        ``cross_entropy`` does not take (:func:`check_label_dtype`) and, once ``num_classes`` is known (C of the logits
        of the batches before, None for a first batch), targets that are not ``(N,)`` for N inputs or labels outside
        ``[0, C)`` (:func:`check_class_labels`). A first batch's shape and range wait for its logits
        (:meth:`_check_outputs`): the message names their shape, and only they tell C. ``"mse"`` targets must have the
        outputs' shape, so they too are checked after the forward.

        The callers pass ``targets`` as the loader yields them, before they move to the device: the loaders of
        :meth:`~unsparse.data.Splits.loaders` yield CPU tensors, so the check costs an ``aminmax`` over N integers on
        the CPU and no device synchronisation; a loader that yields CUDA labels costs one synchronisation per batch, as
        the loops' loss figures (``float(loss)``) already do. Every batch is checked, not only a loader's first one: a
        bad label in a later batch would still reach the loss (on CUDA, its device-side assert).

        Raises:
            ValueError: naming the loss and the targets' shape and the inputs' count, or the labels' dtype, or the
                labels outside ``[0, C)`` and C.
        """
        if self.loss != "cross_entropy":
            return
        if num_classes is None:
            check_label_dtype(targets)
            return
        if targets.dim() != 1 or len(targets) != len(inputs):
            raise ValueError(f"Trainer: cross_entropy: targets of shape {tuple(targets.shape)} for {len(inputs)} "
                             "inputs; a classifier's output must be (N, num_classes) logits for N class indices, one "
                             "per input")
        check_class_labels(targets, num_classes)

    def _check_outputs(self, outputs: torch.Tensor, targets: torch.Tensor, checked: int | None) -> int | None:
        """Refuse, after a batch's forward, outputs that do not fit its targets (:meth:`_check_targets` checked what
        the targets alone tell).

        ``"mse"``: outputs and targets must have one shape; ``mse_loss`` would broadcast them (e.g. ``(N, 1, T)``
        against ``(N, T)`` to ``(N, N, T)``) with only a warning, into a mean over every pair of samples.
        ``"cross_entropy"``: outputs must be ``(N, num_classes)`` logits for ``(N,)`` class indices; ``cross_entropy``
        reads ``(N, C, d1, ...)`` as logits per position, which against ``(N,)`` labels failed inside torch naming
        neither shape's source, and against labels of shape ``(N, d1, ...)`` trained and scored every position as a
        sample of its own. Then the labels must lie in ``[0, C)`` (:func:`check_class_labels`), checked here only
        where C is not ``checked``, the C :meth:`_check_targets` held them against (None for a first batch).

        Returns:
            C, the logits' second dimension, for ``"cross_entropy"``; None for ``"mse"``.

        Raises:
            ValueError: naming the loss and both shapes, or the labels outside ``[0, C)`` and C.
        """
        if self.loss == "mse":
            if outputs.shape != targets.shape:
                raise ValueError(f"Trainer: mse: outputs of shape {tuple(outputs.shape)} against targets of shape "
                                 f"{tuple(targets.shape)}; the model's output must have its targets' shape")
            return None
        if outputs.dim() != 2 or targets.dim() != 1 or outputs.shape[0] != targets.shape[0]:
            raise ValueError(f"Trainer: cross_entropy: logits of shape {tuple(outputs.shape)} for targets of "
                             f"shape {tuple(targets.shape)}; a classifier's output must be (N, num_classes) "
                             "logits for N class indices")
        if outputs.shape[1] != checked:
            check_class_labels(targets, outputs.shape[1])
        return outputs.shape[1]

    def optimizer(self, model: nn.Module, lr: float | None = None) -> torch.optim.Optimizer:
        """SGD with Nesterov momentum over ``model``'s trainable parameters.

        Raises:
            ValueError: naming the model's class, where it has no trainable parameter (none, or all frozen).
        """
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError(f"Trainer: the model ({type(model).__name__}) has no trainable parameters (none, or every "
                             "one frozen with requires_grad=False); there is nothing to train")
        return torch.optim.SGD(params, lr=self.lr if lr is None else lr, momentum=self.momentum,
                               weight_decay=self.weight_decay, nesterov=self.momentum > 0)

    def train_epoch(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                    after_step: Callable[[], None] | None = None, desc: str = "train") -> float:
        """One pass over the training loader. Mutates ``model`` and ``optimizer``.

        Args:
            after_step: called after every optimizer step (e.g. gradient statistics, paper 004 eq. 10).

        Returns:
            Mean training loss over the epoch.

        Raises:
            ValueError: where the training loader yields no batch (an empty split, or ``drop_last`` with fewer
                samples than one batch); nothing is changed then. Where a batch does not fit the loss, before that
                batch's step: for ``"cross_entropy"`` labels that are not int64 (or uint8), or, from the second batch
                on, targets that are not ``(N,)`` for N inputs or labels outside ``[0, C)`` (C of the logits of the
                batches before), all before its forward (:meth:`_check_targets`); after its forward, logits that are
                not ``(N, num_classes)`` for ``(N,)`` targets, labels outside ``[0, num_classes)`` where the batch is
                the first (only its logits tell C), or, for ``"mse"``, outputs of another shape than the targets
                (:meth:`_check_outputs`). The steps of the batches before it stand. A batch refused before its
                forward changes nothing of ``model`` or ``optimizer``. A batch refused after its forward makes no step
                either, but has set every parameter's ``grad`` to None (as each batch does before its forward, to free
                the old gradients' memory for it), has drawn its dropout's random numbers from torch's generators,
                and, where it is not the epoch's first, leaves that forward's batch statistics in the running
                statistics of ``model``'s batch norms (outputs of another shape than those of the batches before, or
                ``"mse"`` targets that do not fit its outputs); a first batch's are put back
                (:func:`running_statistics`), except in a lazy batch norm, whose statistics that forward created.

        The model trains in train mode and stays in it on return. Where the epoch raises (the errors above, or
        whatever a forward, ``after_step`` or Ctrl-C raises), every module is back in the mode it was in first, as
        after :meth:`evaluate`: a caller that catches the error and goes on with an eval-mode model would otherwise
        get batch statistics and dropout in its inference.
        """
        modes = module_modes(model)
        model.train()
        try:
            loss_fn = LOSSES[self.loss]
            total, count = 0.0, 0
            classes: int | None = None  # C of the logits of the batches before: labels are checked against it early
            for inputs, loaded in tqdm(self.loaders["train"], desc=desc, leave=False, disable=not self.progress):
                self._check_targets(inputs, loaded, classes)
                inputs, targets = inputs.to(self.device), loaded.to(self.device)
                statistics = running_statistics(model) if count == 0 else []  # no batch trained yet
                optimizer.zero_grad(set_to_none=True)  # before the forward: the old gradients' memory is free for it
                outputs = model(inputs)
                try:
                    classes = self._check_outputs(outputs, loaded, classes)
                except ValueError:
                    for buffer, saved in statistics:
                        buffer.copy_(saved)
                    raise
                loss = loss_fn(outputs, targets)
                loss.backward()
                optimizer.step()
                if after_step is not None:
                    after_step()
                total += float(loss.detach()) * len(inputs)
                count += len(inputs)
            if count == 0:
                raise ValueError("train_epoch: the 'train' loader yielded no batch (an empty split, or drop_last with "
                                 "fewer samples than one batch)")
        except BaseException:
            restore_modes(modes)
            raise
        return total / count

    @torch.no_grad()
    def evaluate(self, model: nn.Module, split: str = "val", desc: str | None = None) -> dict[str, float]:
        """Metrics of ``model`` on a split, in eval mode; afterwards every module is back in the mode it was in.

        Returns:
            ``{"top1": %, "loss": mean cross-entropy per sample}`` or ``{"mse", "loss"}`` (both the mean squared
            error per target element). ``top1`` is NaN where a sample's largest logit is not finite (a diverged model:
            argmax of NaN logits names a class that is no prediction, a logit that overflowed to ``+inf`` wins every
            argmax, and a row of ``-inf`` names class 0, each beside a NaN or infinite loss); a ``-inf`` logit beside
            finite ones never wins an argmax, so its top-1 stands (its loss is infinite only where a sample's own class
            has it); the pruners score NaN as the worst outcome
            (:func:`~unsparse.prune.base.metric_score`), so a diverged model is told apart, not refused.

        Raises:
            ValueError: naming ``split``, where it has no samples; naming the shapes, where a batch's outputs do not
                fit its targets (for ``"cross_entropy"`` logits that are not ``(N, num_classes)``, or, from the second
                batch on, targets that are not one per input), or naming the labels and ``num_classes``, where they are
                not int64 (or uint8) class indices in ``[0, num_classes)``; before any metric is returned. As in
                :meth:`train_epoch`, what the targets alone tell is checked before the batch's forward
                (:meth:`_check_targets`), the fit of its outputs after it (:meth:`_check_outputs`); in eval mode the
                forward changes no running statistics.
        """
        with eval_mode(model):
            loss_fn = LOSSES[self.loss]
            correct, total_loss, count, elements, diverged = 0, 0.0, 0, 0, False
            classes: int | None = None  # C of the logits of the batches before, as in train_epoch
            for inputs, loaded in tqdm(self.loaders[split], desc=desc or f"eval {split}", leave=False,
                                       disable=not self.progress):
                self._check_targets(inputs, loaded, classes)
                inputs, targets = inputs.to(self.device), loaded.to(self.device)
                outputs = model(inputs)
                classes = self._check_outputs(outputs, loaded, classes)
                total_loss += float(loss_fn(outputs.float(), targets, reduction="sum"))
                count += len(inputs)
                elements += targets.numel()
                if self.loss == "cross_entropy":
                    correct += int((outputs.argmax(dim=1) == targets).sum())
                    diverged = diverged or not bool(outputs.amax(dim=1).isfinite().all())
        if count == 0:
            raise ValueError(f"evaluate: split {split!r} has no samples")
        if self.loss == "cross_entropy":
            return {"top1": math.nan if diverged else 100.0 * correct / count, "loss": total_loss / count}
        return {"mse": total_loss / elements, "loss": total_loss / elements}

    def score(self, model: nn.Module, split: str = "val") -> float:
        """Higher-is-better scalar: top-1 % for classification, ``-mse`` for reconstruction; NaN for a diverged
        classifier, one with a sample whose largest logit is not finite (:meth:`evaluate`)."""
        metrics = self.evaluate(model, split)
        return metrics["top1"] if self.loss == "cross_entropy" else -metrics["mse"]

    def fit(self, model: nn.Module, epochs: int, checkpoint: str | Path | None = None, lr: float | None = None,
            desc: str = "fit", after_step: Callable[[], None] | None = None,
            identity: str | None = None) -> list[dict[str, float]]:
        """Train for ``epochs`` epochs with a cosine learning-rate schedule, evaluating on ``val`` each epoch.

        If ``checkpoint`` exists, training resumes from it (model, optimizer, schedule, CPU and CUDA random states,
        history); after each epoch it is rewritten atomically. Masks attached as parametrizations stay applied
        throughout.
        ``after_step`` is passed to :meth:`train_epoch` (e.g. a pruning schedule). ``identity`` is written into
        the checkpoint and must match the one a checkpoint to resume from recorded (:func:`check_resumable`); so
        must the settings that shape the run (``epochs``, the learning rate used, ``momentum``, ``weight_decay``,
        ``loss``), which every checkpoint records under ``"settings"``, and the kind of the train loader's
        generator (``"loader_rng"``, empty without one), which draws the training order.

        Returns:
            One ``{"epoch", "train_loss", <val metrics>, "elapsed_s"}`` dict per epoch (resumed epochs included);
            ``elapsed_s`` is the seconds of training and evaluation up to that epoch's end, and of the checkpoint
            writes before it, summed over every process that ran the epochs (:func:`fit_seconds`).

        Raises:
            ValueError: naming ``epochs``, where it is no integer >= 0; for a model without trainable parameters
                (:meth:`optimizer`).
            CheckpointRefusedError: (a ``ValueError``, before anything is loaded) naming the checkpoint: one written
                with another ``identity``, other settings or another kind of loader generator, holding more than
                ``epochs`` epochs, written for another model or with an optimizer state that does not fit it, one of
                an older version that records no settings, no identity (where this run has one) or no
                ``elapsed_s``, or (:class:`DamagedCheckpointError`) not a readable, complete checkpoint
                (:func:`load_checkpoint`).
        """
        check_integer(epochs, "epochs", low=0)
        model.to(self.device)
        optimizer = self.optimizer(model, lr)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(epochs, 1))
        settings = json.dumps({"epochs": epochs, "lr": optimizer.defaults["lr"], "momentum": self.momentum,
                               "weight_decay": self.weight_decay, "loss": self.loss}, sort_keys=True)
        history: list[dict[str, float]] = []
        generator = self.loaders["train"].generator
        if checkpoint is not None and Path(checkpoint).exists():
            state = load_checkpoint(checkpoint, required=("model", "optimizer", "schedule", "rng", "history",
                                                          "loader_rng"))
            _check_recorded(checkpoint, state)
            check_resumable(checkpoint, state, identity)
            check_resumable(checkpoint, state, settings, key="settings")
            check_loader_generator(checkpoint, state["loader_rng"], generator)
            if len(state["history"]) > epochs:
                raise CheckpointRefusedError(f"{checkpoint}: holds {len(state['history'])} epochs, more than the "
                                             f"{epochs} asked for; resume with the same settings, or start in another "
                                             "folder")
            _check_model_state(checkpoint, state["model"], model)
            try:
                optimizer.load_state_dict(state["optimizer"])
            except ValueError as error:
                raise CheckpointRefusedError(f"{checkpoint}: its optimizer state does not fit this model ({error}); "
                                             "delete it to start over") from None
            model.load_state_dict(state["model"])
            schedule.load_state_dict(state["schedule"])
            restore_random_states(state)
            if generator is not None:
                generator.set_state(state["loader_rng"])
            history = state["history"]
            log.info("resumed %s from %s after epoch %d", desc, checkpoint, len(history))
        spent = fit_seconds(history)
        for epoch in tqdm(range(len(history), epochs), desc=desc, initial=len(history), total=epochs,
                          disable=not self.progress):
            epoch_started = time.perf_counter()
            train_loss = self.train_epoch(model, optimizer, after_step, desc=f"{desc} epoch {epoch + 1}")
            schedule.step()
            metrics = self.evaluate(model, "val")
            history.append({"epoch": epoch + 1, "train_loss": train_loss, **metrics,
                            "elapsed_s": spent + time.perf_counter() - epoch_started})
            log.info("%s epoch %d: %s", desc, epoch + 1, history[-1])
            if checkpoint is not None:
                save_checkpoint(checkpoint, {
                    "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "schedule": schedule.state_dict(), **random_states(),
                    "loader_rng": generator.get_state() if generator is not None else torch.empty(0),
                    "history": history, "settings": settings,
                    **({"identity": identity} if identity is not None else {})})
            spent += time.perf_counter() - epoch_started  # the checkpoint write counts in the next epoch's figure
        return history
