"""One table of whole-model results across benchmark runs: for each end-to-end record, the planned sparse model in
its faster layout against the best dense model of the same run (PyTorch's eager model, or the dense model fused by
cuDNN where the run timed one), and whether any sparse kernel is in the faster plan at all.

The per-run pages (:func:`~unsparse.report.benchmark.markdown_report`) hold each run's details; this page answers the
question a reader brings to them (UnSparse-Opt paper 004 §6, Escoin paper 000 §5: does the sparse model beat the dense
one on this GPU?) for every run at once, with the ratio against the strongest dense baseline each run measured, and
first, per model and cuDNN precision, the run where sparsity paid most (:func:`best_rows`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from unsparse.report.benchmark import (
    LAYOUT_SUFFIXES,
    dense_fused_ms,
    fastest_layout,
    fastest_ms,
    fold_policy,
    layout_times,
    precision_label,
    sparse_conv_count,
)
from unsparse.report.document import markdown_table
from unsparse.report.results import load_result
from unsparse.runtime.comparator import PLAN_MARGIN
from unsparse.runtime.precision import DENSE_PRECISIONS, PRECISIONS

HEADER = ("run", "model", "weights", "sparsity", "batch", "precision", "folded / fused", "eager dense ms",
          "dense fused ms", "planned ms", "best dense / planned", "eager dense / planned (CUDA graphs)",
          "convs on sparse kernels", "verdict", "switched: best dense / planned")


def best_graph_speedup(record: dict[str, Any]) -> float | None:
    """The eager dense model over the planned one as CUDA-graph replays (GPU time, without the host's per-layer work),
    each in its fastest layout: ``min(dense_graph_ms, dense_nhwc_graph_ms) / min(planned_graph_ms,
    planned_nhwc_graph_ms)``, with the ``*_switched_graph_ms`` times too in runs that timed every model switched
    (:func:`~unsparse.report.benchmark.layout_times`), a layout's time only where its output passed (its eager
    time, ``dense_nhwc_ms`` say, is not None); None where either side has no graph time. The dense fused model's
    graph times (runs since the forty-fourth session) are on each run's page, not in this ratio."""
    def fastest(kind: str) -> float | None:
        times = [record.get(f"{kind}{LAYOUT_SUFFIXES[layout]}_graph_ms") for layout in layout_times(record, kind)]
        return min((time for time in times if time is not None), default=None)

    dense, planned = fastest("dense"), fastest("planned")
    return None if dense is None or planned is None else dense / planned


def switched_speedup(record: dict[str, Any]) -> float | None:
    """The planned model with its layout switched after the first max pool (``planned_switched_ms``, runs since the
    fifty-first session) against the fastest dense model of the run: the eager dense model in its faster layout and
    the dense fused model in its faster single layout or switched alike (``dense_fused_switched_ms``, from runs that
    record ``dense_fused_layout_switch``: in the first runs the switched dense stem computed channels-last), whichever
    is fastest; None where the run has no switched planned time."""
    planned = record.get("planned_switched_ms")
    if planned is None:
        return None
    # a switched dense time counts from the run that names its pool (before, its stem computed channels-last)
    switched_dense = record.get("dense_fused_switched_ms") if "dense_fused_layout_switch" in record else None
    dense = [fastest_ms(record, "dense"), dense_fused_ms(record), switched_dense]
    return min(ms for ms in dense if ms is not None) / planned


def verdict(speedup: float, sparse_kernels: int | None) -> str:
    """Whether a planned model that runs ``sparse_kernels`` convs on sparse backends (None: not recorded) beats the
    best dense model by ``speedup`` (best dense ms over planned ms): "SLOWER" beyond the noise margin
    (:data:`~unsparse.runtime.comparator.PLAN_MARGIN`), else "no sparse kernel" where it runs none, else "faster"
    beyond the margin or "within noise"."""
    if speedup * (1 + PLAN_MARGIN) < 1:
        return "SLOWER"
    if sparse_kernels == 0:
        return "no sparse kernel"
    return "faster" if speedup > 1 + PLAN_MARGIN else "within noise"


def switched_cell(row: dict[str, Any]) -> str:
    """The summary's switched column for a :func:`summary_row`: ``switched_speedup`` to two decimals, then for a run
    that records the switched model's backends (since the fifty-second session) its :func:`verdict` and how many of
    its convs run on sparse kernels; ``-`` where the run timed no switched planned model."""
    speedup = row["switched_speedup"]
    if speedup is None:
        return "-"
    if row["switched_convs"] is None:
        return f"{speedup:.2f}"
    return (f"{speedup:.2f}, {verdict(speedup, row['switched_off_cudnn'])} "
            f"({row['switched_off_cudnn']} of {row['switched_convs']} convs sparse)")


LAYOUT_LABELS = {"nchw": "NCHW", "nhwc": "NHWC", "switched": "switched"}
"""Layout (:data:`~unsparse.report.benchmark.LAYOUT_SUFFIXES`) -> how the summary's time cells name it."""


def _layout(record: dict[str, Any], kind: str) -> tuple[float, str]:
    """The record's fastest time of ``kind`` ("dense", "planned"), ms, and its layout
    (:func:`~unsparse.report.benchmark.fastest_layout`, a :data:`LAYOUT_SUFFIXES` key)."""
    return fastest_ms(record, kind), fastest_layout(record, kind)


def summary_row(record: dict[str, Any], run: str) -> dict[str, Any]:
    """One end-to-end record (``bench.json``'s ``end_to_end`` entry) as a summary row.

    Returns:
        ``run``, ``model``, ``weights``, ``sparsity``, ``batch``, ``precision``
        (:func:`~unsparse.report.benchmark.precision_label`); ``folded``, ``fused_relu``,
        ``fused_residual`` (those of ``fused_relu`` that take the residual add before their ReLU; 0 for runs from
        before it was fused), ``fused_max_pool`` (counts of convs); ``dense_ms``/``dense_layout`` (eager, fastest
        layout: "NCHW", "NHWC", or "switched" in runs that timed every model switched too, :data:`LAYOUT_LABELS`),
        ``dense_fused_ms``/``dense_fused_layout`` (None where not timed), ``planned_ms``/``planned_layout`` (fastest
        layout), all ms; ``best_dense_ms`` (the faster of the two dense models) and ``speedup`` (it over
        ``planned_ms``); ``best_graph_speedup`` (:func:`best_graph_speedup`); ``off_cudnn`` and ``convs`` (the
        faster plan's convs on sparse backends and all its convs, None for a record without backend counts);
        ``verdict``:
        "SLOWER" (the plan loses beyond the noise margin, :data:`~unsparse.runtime.comparator.PLAN_MARGIN`), "no
        sparse kernel" (the faster plan runs every conv on cuDNN), "faster" (beyond the margin), or "within noise";
        the last two followed by "(no fused dense model timed)" for a run from before the fused dense model was timed
        beside the plan (:func:`verdict`). The verdict reads the eager times. ``switched_speedup``:
        :func:`switched_speedup`; ``switched_off_cudnn`` and ``switched_convs``: the switched planned model's convs on
        sparse backends and all its convs (``backend_counts_switched``), None for a record without them.
    """
    dense_ms, dense_layout = _layout(record, "dense")
    planned_ms, planned_layout = _layout(record, "planned")
    fused_ms = dense_fused_ms(record)
    best_dense = min(dense_ms, fused_ms) if fused_ms is not None else dense_ms
    suffix = LAYOUT_SUFFIXES[planned_layout]
    off, convs = sparse_conv_count(record, suffix) or (None, None)
    switched_off, switched_convs = sparse_conv_count(record, "_switched") or (None, None)
    row_verdict = verdict(best_dense / planned_ms, off)
    if "dense_fused_convs" not in record and row_verdict in ("faster", "within noise"):  # from before it was timed
        row_verdict += " (no fused dense model timed)"
    fused_layout = record.get("best_dense_fused_layout")
    return {"run": run, "model": record["model"], "weights": record.get("weights", "synthetic"),
            "sparsity": record.get("sparsity"), "batch": record["batch"],
            "precision": precision_label(record),
            "folded": record.get("folded_batch_norm" + suffix, record.get("folded_batch_norm", 0)),
            "fold_policy": fold_policy(record), "fused_relu": record.get("fused_relu", 0),
            "fused_residual": record.get("fused_residual", 0),
            "fused_max_pool": record.get("fused_max_pool", 0), "dense_ms": dense_ms,
            "dense_layout": LAYOUT_LABELS[dense_layout],
            "dense_fused_ms": fused_ms, "dense_fused_layout": LAYOUT_LABELS[fused_layout] if fused_layout else None,
            "planned_ms": planned_ms, "planned_layout": LAYOUT_LABELS[planned_layout], "best_dense_ms": best_dense,
            "speedup": best_dense / planned_ms, "best_graph_speedup": best_graph_speedup(record),
            "switched_speedup": switched_speedup(record), "off_cudnn": off,
            "convs": convs, "verdict": row_verdict, "switched_off_cudnn": switched_off,
            "switched_convs": switched_convs}


def summary_rows(paths: Iterable[str | Path]) -> list[dict[str, Any]]:
    """:func:`summary_row` of every end-to-end record of the benchmark results at ``paths`` (``.json`` or
    ``.json.xz``, :func:`~unsparse.report.results.load_result`), in the order given; ``run`` is the file's name.

    Raises:
        ValueError: a file that is no strict JSON (from ``load_result``).
    """
    rows = []
    for path in map(Path, paths):
        for record in load_result(path).get("end_to_end") or []:
            rows.append(summary_row(record, path.name))
    return rows


LATEST_KEY = ("model", "weights", "precision", "sparsity", "batch")


def latest_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The last of ``rows`` (:func:`summary_row`) for each model, weights, precision label, sparsity and batch
    (:data:`LATEST_KEY`), sorted by those: "the latest run of each setting" when ``rows`` come in the order the runs
    were made (:func:`summary_rows` of files sorted by name, which begin with the date and the session). What the
    runs folded or fused is not in the key, so a setting's latest run may fuse more than an earlier one; each row
    says what it fused."""
    latest = {tuple(row[field] for field in LATEST_KEY): row for row in rows}
    return [latest[key] for key in sorted(latest, key=lambda key: tuple((value is None, value if value is not None
                                                                          else "") for value in key))]


def dense_mode(precision: str) -> str:
    """The dense precision (one of :data:`~unsparse.runtime.precision.DENSE_PRECISIONS`: fp32, tf32, fp16) whose
    cuDNN mode a row's ``precision`` label (:func:`~unsparse.report.benchmark.precision_label`) was timed against:
    ``tf32_generated`` and ``tf32 (direct+generated)`` are both ``tf32``, ``fp16_half2`` is ``fp16``.

    Raises:
        KeyError: a label whose first word is no key of :data:`~unsparse.runtime.precision.PRECISIONS`."""
    mode = PRECISIONS[precision.split()[0]]
    return next(name for name in DENSE_PRECISIONS if (PRECISIONS[name].dtype, PRECISIONS[name].tf32) == (
        mode.dtype, mode.tf32))


def best_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Of ``rows`` (:func:`summary_row`) that timed the dense model fused by cuDNN beside the plan (the strongest
    dense baseline), the one with the highest ``speedup`` for each model, weights, dense precision
    (:func:`dense_mode`: whichever sparse backends the plan chose among) and batch, at any sparsity; the first of
    equal ones; sorted by those. The best of several runs leans to the lucky side of their noise."""
    best: dict[tuple[Any, ...], dict[str, Any]] = {}
    for row in rows:
        if row["dense_fused_ms"] is None:
            continue
        key = (row["model"], row["weights"], dense_mode(row["precision"]), row["batch"])
        if key not in best or row["speedup"] > best[key]["speedup"]:
            best[key] = row
    return [best[key] for key in sorted(best)]


def _residual_text(row: dict[str, Any]) -> str:
    """`` (16 residual)`` after a row's fused ReLUs where that many of them take the residual add too, else ``""``."""
    return f" ({row['fused_residual']} residual)" if row.get("fused_residual") else ""


def summary_markdown(rows: Sequence[dict[str, Any]], command: str) -> str:
    """The summary page: what the columns mean, ``command`` (how the page was made), the best run of each model and
    precision (:func:`best_rows`), the latest run of each setting (:func:`latest_rows`) and the table of all
    ``rows``."""
    def cell(ms: float | None, layout: str | None) -> str:
        return "-" if ms is None else f"{ms:.3f} ({layout})"

    def table(chosen: Sequence[dict[str, Any]]) -> str:
        return markdown_table(HEADER, [
            [f"`{r['run']}`", r["model"], r["weights"], "-" if r["sparsity"] is None else r["sparsity"], r["batch"],
             r["precision"],
             f"{r['folded']}{' (epilogue)' if r['fold_policy'] == 'epilogue' else ''} / {r['fused_relu']}"
             f"{_residual_text(r)}+{r['fused_max_pool']}",
             cell(r["dense_ms"], r["dense_layout"]), cell(r["dense_fused_ms"], r["dense_fused_layout"]),
             cell(r["planned_ms"], r["planned_layout"]), f"{r['speedup']:.2f}",
             "-" if r["best_graph_speedup"] is None else f"{r['best_graph_speedup']:.2f}",
             "-" if r["convs"] is None else f"{r['off_cudnn']} of {r['convs']}", r["verdict"],
             switched_cell(r)] for r in chosen])
    return "\n".join([
        "# Whole models: does the sparse model beat the dense one?", "",
        f"Made by `{command}` from the benchmark results named in the first column (under `benchmarks/results/`, "
        "each with its page); nothing here is typed by hand.", "",
        "Times are eager medians (ms) in each model's fastest layout: NCHW, NHWC, or, in runs since the fifty-third "
        "session, switched (NCHW up to the first max pool, channels-last after it; every model of the run was timed "
        "that way too). Eager dense: PyTorch's model as it runs; dense "
        "fused: the same run's dense model with each conv, bias and ReLU in one cuDNN call (at a residual block's "
        "end with the add, where the run fused residuals) and, where the run folds, its BatchNorms folded. Best "
        "dense / planned: the faster of the two dense models over the planned sparse model (above 1: the sparse "
        "model is faster). Eager dense / planned (CUDA graphs): the same run's "
        "eager dense and planned models replayed as CUDA graphs, each in its fastest layout: GPU time without the "
        "host's per-layer work, which tells a host-bound eager ratio (GoogLeNet in FP16) from the kernels' (this "
        "column leaves the fused dense model out: runs before the forty-fourth session have no graph time for it; "
        "later pages give both). Folded / fused: the faster plan's convs that took a "
        "BatchNorm (epilogue: only layers planned on a backend that adds the bias in its epilogue) / a ReLU (in "
        "parentheses, how many of them take a residual block's add before it) + a 2x2 max pool. Convs on sparse "
        "kernels: the faster plan's convs on a sparse backend (not cuDNN in either layout). Verdict: SLOWER or faster "
        f"beyond the {PLAN_MARGIN:.0%} noise margin, within noise, or no sparse kernel (the faster plan runs every "
        "conv on cuDNN, so sparsity gains nothing in that run); runs before the fused dense model was timed say so, "
        "and their ratio is against the eager dense model alone (where later runs timed both, the fused one was "
        "the faster dense model). Switched: the planned model fed NCHW, in NCHW up to the first max pool and "
        "channels-last after it (runs since the fifty-first session), against the fastest dense model of the run "
        "(eager, fused, or fused and switched alike), with its own verdict and count of convs on sparse kernels "
        "in runs since the fifty-second session; the verdict column does not read it.", "",
        "## Best run of each model and precision", "",
        "Of the runs that timed the dense model fused by cuDNN beside the plan, the one with the highest best dense / "
        "planned ratio for each model, weights, cuDNN precision (FP32, TF32 or FP16, whichever sparse backends its "
        "plan chose among) and batch, "
        "at any sparsity: where sparsity has paid most on this GPU so far, and where it has not paid at all. The best "
        f"of several runs leans to the lucky side of their noise (about {PLAN_MARGIN:.0%}).", "",
        table(best_rows(rows)), "",
        "## Latest run of each setting", "",
        "The last run below (files in name order: date, then session) of each model, weights, precision, sparsity "
        "and batch; what it folded and fused is in its row.", "",
        table(latest_rows(rows)), "",
        "## Every run", "",
        table(rows), ""])
