"""The main job as plain functions: train -> prune -> quantize -> export -> reload -> sparse run -> report.

Hydra only composes the configuration (``unsparse/cli.py``); everything here takes ordinary objects, so the
pipeline runs (and is tested) without Hydra.
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from unsparse.data import Splits
from unsparse.prune.base import Pruner
from unsparse.report import layer_rows, write_report
from unsparse.report.plots import plot_backend_times, plot_history, plot_layers
from unsparse.runtime.modules import sparse_layers, sparsify
from unsparse.sparse.functional import dense_fallback_backend
from unsparse.sparse.io import load_sparse, save_sparse
from unsparse.train import Trainer

log = logging.getLogger(__name__)


@dataclass
class TrainSettings:
    """Dense training settings (``train:`` in configs/config.yaml)."""

    epochs: int = 3
    batch_size: int = 128
    eval_batch_size: int = 1000
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 5e-4


@dataclass
class TimingSettings:
    """Per-layer timing in the report (``runtime.timing:``): images per call, timed runs, warm-up runs."""

    batch_size: int = 64
    repeats: int = 10
    warmup: int = 2


def resolve_device(name: str) -> torch.device:
    """``"auto"`` -> CUDA if available else CPU; otherwise ``torch.device(name)``."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def git_commit() -> str | None:
    """The repository's HEAD commit, or None outside a git checkout."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


@torch.no_grad()
def capture_layer_inputs(model: nn.Module, batch: torch.Tensor) -> dict[str, torch.Tensor]:
    """Run ``batch`` through ``model`` and keep the input each SparseConv received (NCHW, or NCL for 1-D)."""
    captured: dict[str, torch.Tensor] = {}
    hooks = [layer.register_forward_pre_hook(lambda module, args, name=name: captured.setdefault(name, args[0]))
             for name, layer in sparse_layers(model).items()]
    try:
        model.eval()(batch)
    finally:
        for hook in hooks:
            hook.remove()
    return captured


def relative_error(output: torch.Tensor, reference: torch.Tensor) -> float:
    """``||output - reference|| / ||reference||`` in float64 (0 when both are zero)."""
    difference = torch.linalg.vector_norm((output.double() - reference.double()).reshape(-1))
    scale = torch.linalg.vector_norm(reference.double().reshape(-1))
    return float(difference / scale) if scale > 0 else float(difference)


def time_layers(model: nn.Module, batch: torch.Tensor, backends: list[str], settings: TimingSettings
                ) -> list[dict[str, Any]]:
    """Time every backend on every SparseConv of ``model`` with the inputs ``batch`` produces there.

    Each backend's output is compared with the reference backend's (relative error reported). Layers a
    sparse backend does not support are reported with the reason instead of a time.

    Returns:
        One entry per (layer, backend): ``layer``, ``backend``, ``sparse``, ``input_shape``, ``device``,
        ``time_ms`` (median), ``min_ms``, ``runs``, ``rel_error``; or ``unsupported`` with the reason.
    """
    from unsparse.runtime.backends import get_backend
    from unsparse.runtime.timing import time_backend

    inputs = capture_layer_inputs(model, batch)
    entries = []
    for name, layer in sparse_layers(model).items():
        x = inputs[name].unsqueeze(2) if layer.geometry.spatial_dims == 1 else inputs[name]
        csr, bias, geometry = layer.csr, layer.bias, layer.geometry
        reference = get_backend("reference").conv(x, csr, bias, geometry) if geometry.groups == 1 else None
        for backend_name in backends:
            backend = get_backend(backend_name)
            entry: dict[str, Any] = {"layer": name, "backend": backend_name, "sparse": backend.sparse,
                                     "input_shape": list(x.shape), "device": str(x.device)}
            reason = backend.unsupported_reason(x, csr, geometry)
            if reason is not None:
                entries.append({**entry, "unsupported": reason})
                continue
            timing = time_backend(backend_name, x, csr, bias, geometry, runs=settings.repeats,
                                  warmup=settings.warmup)
            output = backend.conv(x, csr, bias, geometry)
            entries.append({**entry, "time_ms": timing.median_ms, "min_ms": timing.min_ms, "runs": timing.runs,
                            "rel_error": None if reference is None else relative_error(output, reference)})
    return entries


def run_pipeline(splits: Splits, model: nn.Module, pruner: Pruner, quantizer: Callable[..., nn.Module],
                 outdir: str | Path, train: TrainSettings, timing: TimingSettings, backend: str = "reference",
                 device: torch.device | None = None, progress: bool = True, seed: int = 0) -> dict[str, Any]:
    """Run the whole job and write ``model.safetensors``, ``report.json``, ``report.md`` and PNGs to ``outdir``.

    Checkpoints (``dense.pt``, ``prune/``) live in ``outdir`` too: running again with the same ``outdir``
    resumes after an interruption (Ctrl-C loses at most the current epoch).

    Args:
        splits: data (train/val/test tensors).
        model: a fresh model from ``create_model`` (mutated: trained, then masked).
        pruner: e.g. :class:`unsparse.prune.MagnitudePruner`.
        quantizer: ``quantizer(sparse_model, calibration_loader) -> sparse_model`` (identity for none).
        backend: backend the reloaded sparse model runs on.

    Returns:
        The report dict (also written as ``report.json``).
    """
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    device = device or torch.device("cpu")
    torch.manual_seed(seed)
    loaders = splits.loaders(train.batch_size, train.eval_batch_size, seed)
    trainer = Trainer(loaders, device, lr=train.lr, momentum=train.momentum, weight_decay=train.weight_decay,
                      progress=progress)
    dense_history = trainer.fit(model, train.epochs, outdir / "dense.pt", desc="dense training")
    accuracy = {"dense": trainer.evaluate(model, "test", "test dense")["top1"]}
    result = pruner.run(model, trainer, outdir / "prune")
    accuracy["pruned"] = trainer.evaluate(model, "test", "test pruned")["top1"]
    log.info("weighted sparsity %.4f, dense %.2f%%, pruned %.2f%%", result.weighted_sparsity, accuracy["dense"],
             accuracy["pruned"])

    sparse_model = quantizer(sparsify(model.cpu()), loaders["val"])
    path = save_sparse(sparse_model, outdir / "model.safetensors",
                       extra={"data": splits.name, "accuracy": accuracy, "weighted_sparsity": result.weighted_sparsity})
    loaded = load_sparse(path, device=device, backend=backend)
    accuracy["sparse_run"] = trainer.evaluate(loaded, "test", f"test sparse ({backend})")["top1"]

    rows = layer_rows(loaded, path)
    from unsparse.runtime.backends import available_backends

    batch = splits.test[0][: timing.batch_size].to(device)
    timings = time_layers(loaded, batch, available_backends(device), timing)
    report = {
        "run": {"data": splits.name, "model": model.unsparse_spec, "device": str(device), "torch": torch.__version__,
                "weights": "trained on the data set (not synthetic)", "commit": git_commit(), "seed": seed},
        "accuracy": accuracy,
        "dense_training": dense_history,
        "pruning": {"method": result.method, "weighted_sparsity": result.weighted_sparsity,
                    "layer_sparsity": result.layer_sparsity, "wall_time_s": result.wall_time_s,
                    "history": result.history},
        "quantization": getattr(loaded, "unsparse_quantization", None),
        "layers": rows,
        "timings": [entry for entry in timings if "time_ms" in entry],
        "unsupported": [entry for entry in timings if "unsupported" in entry],
        "timing_baseline": dense_fallback_backend(device),
        "file": {"path": path.name, "bytes": path.stat().st_size,
                 "sparse_conv_bytes": sum(row["file_bytes"] for row in rows),
                 "dense_conv_fp32_bytes": sum(row["dense_fp32_bytes"] for row in rows)},
    }
    figures = {"Layers: sparsity and storage": plot_layers(rows, outdir / "layers.png"),
               "Per-layer time by backend": plot_backend_times(report["timings"], outdir / "timings.png")}
    if result.history:
        metric = "val_top1" if "val_top1" in result.history[0] else "top1"
        figures["Pruning: accuracy and weighted sparsity"] = plot_history(
            result.history, outdir / "pruning.png", metric, f"{result.method} pruning (validation)")
    write_report(outdir, report, figures)
    return report
