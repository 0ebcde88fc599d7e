"""PNG plots for the reports (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.ticker import MaxNLocator

from unsparse.atomic import atomic_write


def save_figure(figure: plt.Figure, path: str | Path, dpi: int = 110) -> Path:
    """Lay out ``figure`` and write it to ``path`` atomically (a report never links to a torn PNG) at ``dpi`` dots
    per inch, in the image format its suffix names (``.png``, ``.svg``, ``.pdf``, any case: one of
    ``figure.canvas.get_supported_filetypes()``); close it however the call ends.

    A path without such a suffix is refused, not written as PNG: the format came from whatever followed the last dot
    (``page_s0.9`` asked matplotlib for format "9"), and an image under a name that does not say it is one is a file
    that neither the report's link nor a viewer takes for one. Add the suffix with
    :func:`unsparse.report.results.beside`, which keeps a dot inside the name.

    Raises:
        ValueError: naming ``path`` and the suffixes known, for another suffix or none; nothing is written.
    """
    path = Path(path)
    try:
        formats = figure.canvas.get_supported_filetypes()
        kind = path.suffix[1:].lower()
        if kind not in formats:
            raise ValueError(f"{path}: expected an image suffix ({', '.join(f'.{name}' for name in sorted(formats))}), "
                             f"got {path.suffix or 'none'}")
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.tight_layout()
        return atomic_write(path, lambda handle: figure.savefig(handle, dpi=dpi, format=kind))
    finally:
        plt.close(figure)


@contextmanager
def new_figure(**subplots: Any) -> Iterator[tuple[plt.Figure, Any]]:
    """``plt.subplots(**subplots)`` (its keyword arguments: ``nrows``, ``ncols``, ``figsize`` in inches, ...) as
    ``(figure, axes)`` for a ``with`` block, which closes the figure however the block ends: an error while drawing
    (rows missing a field) left it open in pyplot's registry, and a job that went on kept it in memory.
    :func:`save_figure` closing it first is harmless.

    Raises:
        Whatever ``plt.subplots`` or the block raises, after closing the figure.
    """
    figure, axes = plt.subplots(**subplots)
    try:
        yield figure, axes
    finally:
        plt.close(figure)


def integer_steps(axis: Axes, steps: Sequence[int]) -> None:
    """Ticks only at integers on ``axis``' x axis, which counts ``steps`` (iterations, epochs): matplotlib's default
    put them at fractions, 0.96 to 1.04 for a single fine-tuning epoch. ``MaxNLocator(integer=True)`` keeps to
    integers only where at least two (its ``min_n_ticks``) lie in view, which the few hundredths either side of a
    single step do not hold, so steps that are all one value get one step of room either side."""
    axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    if min(steps) == max(steps):
        axis.set_xlim(steps[0] - 1, steps[0] + 1)


def plot_layers(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """Per-layer sparsity (bars, left) and file bytes vs dense FP32 bytes (right), one PNG at ``path``.

    Raises:
        KeyError: a row of ``rows`` (:func:`unsparse.report.layers.layer_rows`) missing a field.
        ValueError: ``path`` without an image suffix (:func:`save_figure`).
        Either way nothing is written and no figure is left open (:func:`new_figure`).
    """
    names = [row["layer"] for row in rows]
    positions = list(range(len(rows)))
    with new_figure(nrows=1, ncols=2, figsize=(12, 4)) as (figure, (left, right)):
        left.bar(positions, [100 * row["sparsity"] for row in rows], color="tab:blue")
        for index, row in enumerate(rows):
            left.annotate(f"L={row['row_length']}", (index, 100 * row["sparsity"]), ha="center", va="bottom",
                          fontsize=7)
        left.set(ylabel="sparsity (%)", title="Weight sparsity per conv layer (L = stored entries per row)",
                 ylim=(0, 105))
        right.bar([p - 0.2 for p in positions], [row["dense_fp32_bytes"] / 1024 for row in rows], 0.4,
                  label="dense FP32")
        right.bar([p + 0.2 for p in positions], [row["file_bytes"] / 1024 for row in rows], 0.4, label="sparse file")
        right.set(ylabel="KiB", title="Storage per conv layer")
        right.legend()
        for axis in (left, right):
            axis.set_xticks(positions)
            axis.set_xticklabels(names, rotation=60, fontsize=7)
        return save_figure(figure, path)


def plot_backend_times(timings: Sequence[dict[str, Any]], path: Path) -> Path:
    """Median time (ms, log scale) of every backend on every layer (its fastest setting), grouped by layer; sparse
    backends are marked ``(sparse)`` in the legend.

    Raises:
        KeyError: an entry of ``timings`` missing ``layer``, ``backend`` or ``time_ms``.
        ValueError: ``path`` without an image suffix (:func:`save_figure`).
        Either way nothing is written and no figure is left open (:func:`new_figure`).
    """
    layers = list(dict.fromkeys(entry["layer"] for entry in timings))
    backends = list(dict.fromkeys(entry["backend"] for entry in timings))
    sparse = {entry["backend"] for entry in timings if entry.get("sparse")}
    width = 0.8 / max(len(backends), 1)
    with new_figure(figsize=(max(8, 0.9 * len(layers) * max(len(backends), 1) / 2), 4)) as (figure, axis):
        for index, backend in enumerate(backends):
            times: dict[str, float] = {}
            for entry in timings:
                if entry["backend"] == backend:
                    times[entry["layer"]] = min(entry["time_ms"], times.get(entry["layer"], entry["time_ms"]))
            axis.bar([p + index * width for p in range(len(layers))], [times.get(layer, 0.0) for layer in layers],
                     width, label=f"{backend} (sparse)" if backend in sparse else backend)
        axis.set_yscale("log")
        axis.set(ylabel="median time per call (ms)", title="Per-layer time by backend (lower is better)")
        axis.set_xticks([p + 0.4 - width / 2 for p in range(len(layers))])
        axis.set_xticklabels(layers, rotation=60, fontsize=7)
        axis.legend(fontsize=8)
        return save_figure(figure, path)


def plot_history(history: Sequence[dict[str, Any]], path: Path, metric: str, title: str, label: str,
                 axis_label: str = "iteration") -> Path:
    """``metric`` (left axis, labelled ``label``) and ``weighted_sparsity`` (right axis, %) over the entries of
    ``history``, placed at their ``iteration`` (what it counts is ``axis_label``, the pruner's
    :attr:`~unsparse.prune.base.Pruner.history_axis`) or, without one, their ``epoch``, on an axis ticked at
    integers (:func:`integer_steps`).

    Raises:
        ValueError: an empty ``history`` (nothing to plot), or ``path`` without an image suffix
            (:func:`save_figure`).
        TypeError: an entry whose ``weighted_sparsity`` is None (null in JSON).
        Either way nothing is written and no figure is left open (:func:`new_figure`).
    """
    if not history:
        raise ValueError("history: no entries to plot")
    steps = [entry.get("iteration", entry.get("epoch", index + 1)) for index, entry in enumerate(history)]
    with new_figure(figsize=(8, 4)) as (figure, axis):
        lines = axis.plot(steps, [entry.get(metric) for entry in history], marker="o", color="tab:blue", label=label)
        axis.set(xlabel=axis_label, ylabel=label, title=title)
        integer_steps(axis, steps)
        top = axis
        if any("weighted_sparsity" in entry for entry in history):
            top = axis.twinx()
            lines += top.plot(steps, [100 * entry.get("weighted_sparsity", float("nan")) for entry in history],
                              marker="s", color="tab:red", label="weighted sparsity (%)")
            top.set_ylabel("weighted sparsity (%)", color="tab:red")
            axis.set_zorder(top.get_zorder() + 1)  # the metric over the sparsity: one entry put both on one pixel
            axis.patch.set_visible(False)  # (the twin axis drawn later hid it)
        axis.legend(lines, [line.get_label() for line in lines], fontsize=8, loc="upper center",
                    bbox_to_anchor=(0.5, -0.15), ncol=2)  # below the axes: "best" avoided one axis' points only
        return save_figure(figure, path)
