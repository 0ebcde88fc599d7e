"""Break-even sparsity of the direct kernels against each cuDNN mode, from benchmark records.

A benchmark record (``unsparse.runtime.bench.bench_layer``) holds, for one layer, sparsity, batch and
precision, the median time of the fastest direct setting and of cuDNN's convolution alone in its fastest layout
(no bias, input already NCHW or NHWC: :mod:`unsparse.runtime.baseline`) measured in the same run, and their ratio
``speedup_vs_cudnn`` (cuDNN ms / direct ms). Records from before that baseline existed have none
(:func:`unsparse.report.results.load_result`) and are skipped. The precision names the cuDNN mode: ``fp32``
(TF32 off), ``tf32`` (direct still computes in float32), ``fp16`` (both in float16 storage; direct with float32
products) and ``fp16_half2`` (the same cuDNN mode against the half2-product kernel).
Paper 004 §6 and Escoin (paper 000) §5 report speedup against sparsity the same way; the break-even sparsity is
where the speedup crosses 1.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

MODES = {"fp32": "cuDNN FP32 (TF32 off)", "tf32": "cuDNN TF32", "fp16": "cuDNN FP16 (best layout)",
         "fp16_half2": "cuDNN FP16 (best layout), direct with half2 products",
         "fp32_generated": "cuDNN FP32 (TF32 off), weight-specialised kernels",
         "tf32_generated": "cuDNN TF32, weight-specialised kernels",
         "fp16_generated": "cuDNN FP16 (best layout), weight-specialised kernels"}
"""Benchmark precisions and the cuDNN mode each compares the direct kernel against."""

Curve = list[tuple[float, float]]
"""``(sparsity, speedup)`` points sorted by sparsity; speedup = cuDNN ms / direct ms."""


def curves(records: Sequence[dict[str, Any]], batch: int) -> dict[tuple[str, str], dict[str, Curve]]:
    """Speedup-against-sparsity curves per ``(model, layer)`` and precision, at one batch size.

    Args:
        records: benchmark layer records (several runs may be concatenated; each record's ratio is from its
            own run). Records without a direct or cuDNN time are skipped.
        batch: the batch size to keep.

    Returns:
        ``{(model, layer): {precision: curve}}``; a later record for the same point replaces an earlier one.
    """
    points: dict[tuple[str, str], dict[str, dict[float, float]]] = {}
    for record in records:
        if record["batch"] != batch or record.get("speedup_vs_cudnn") is None:
            continue
        per_layer = points.setdefault((record["model"], record["layer"]), {})
        per_layer.setdefault(record["precision"], {})[record["target_sparsity"]] = record["speedup_vs_cudnn"]
    return {key: {precision: sorted(curve.items()) for precision, curve in per_precision.items()}
            for key, per_precision in points.items()}


def break_even(curve: Curve) -> tuple[str, float | None]:
    """Where a speedup curve crosses 1.

    Returns:
        ``("at", s)`` with ``s`` linearly interpolated between the last measured sparsity below 1 and the next
        one at or above 1, when the curve ends at or above 1 after being below it; ``("below", s_min)`` when
        the lowest measured sparsity already breaks even; ``("above", s_max)`` when no measured sparsity
        does; ``("none", None)`` for an empty curve. Only the last crossing counts (measurement noise can
        make a curve cross more than once near 1).
    """
    if not curve:
        return "none", None
    if curve[-1][1] < 1.0:
        return "above", curve[-1][0]
    last_below = max((i for i, (_, speedup) in enumerate(curve) if speedup < 1.0), default=None)
    if last_below is None:
        return "below", curve[0][0]
    (s0, v0), (s1, v1) = curve[last_below], curve[last_below + 1]
    return "at", s0 + (1.0 - v0) * (s1 - s0) / (v1 - v0)


def describe(result: tuple[str, float | None], goal: float | None = None) -> str:
    """``break_even``'s result as table text: ``0.812``, ``<= 0.50``, ``> 0.98`` or ``n/a``.

    A crossing (``"at"``) has three decimals, and with a ``goal`` (a sparsity, the fraction of zero weights) as many
    more as it takes for the printed value to stand on the side of the goal that :func:`goal_verdict` judges it:
    at or below a goal it meets, above one it misses (``0.7004`` against 0.7, where three decimals read ``0.700``
    beside MISSED; ``0.6995`` against 0.6995, where they read ``0.700`` beside met), and every digit (``repr``)
    where twelve decimals do not tell it (within about 1e-12 of the goal's 1e-9 tolerance). A bound is the measured
    sparsity itself, with two decimals only where they are exact (``> 0.999``, not ``> 1.00``).

    Args:
        result: ``(kind, sparsity)`` from :func:`break_even`.
        goal: the sparsity the result is judged against where the text stands beside that verdict, else None.

    Returns:
        The text (no errors are raised for a result of :func:`break_even`).
    """
    kind, value = result
    if value is None:
        return "n/a"
    if kind == "at":
        for digits in range(3, 13):  # meets allows 1e-9 above the goal: twelve decimals tell a miss from it
            text = f"{value:.{digits}f}"
            if goal is None or (float(text) <= goal + 1e-9) == meets(result, goal):
                return text
        return repr(value)  # within about 1e-12 of goal + 1e-9: every digit
    bound = f"{value:.2f}" if abs(float(f"{value:.2f}") - value) <= 1e-12 else f"{value:g}"
    return {"below": f"<= {bound}", "above": f"> {bound}"}[kind]


def meets(result: tuple[str, float | None], goal: float) -> bool:
    """Whether a break-even result is at or below the sparsity ``goal``."""
    kind, value = result
    return value is not None and kind in ("at", "below") and value <= goal + 1e-9


def goal_verdict(result: tuple[str, float | None], goal: float) -> str:
    """A break-even result against the sparsity ``goal``: ``met``, ``MISSED``, or ``not shown: ...`` where the
    measured sparsities leave it open: no break-even up to a sparsity below the goal (``> 0.9`` against 0.95: it
    may lie between), or a break-even already at the lowest sparsity measured, which is above the goal (``<= 0.8``
    against 0.7)."""
    kind, value = result
    if meets(result, goal):
        return "met"
    if kind == "above" and value is not None and value < goal - 1e-9:
        return f"not shown: not measured between {value:g} and {goal:g}"
    if kind == "below" and value is not None:
        return f"not shown: not measured below {value:g}"
    return "MISSED"


def break_even_markdown(records: Sequence[dict[str, Any]], batch: int,
                        goals: Callable[[dict[str, Any]], dict[str, float]] | None = None) -> str:
    """Markdown tables: per layer, the measured speedups against sparsity and the break-even sparsity for each
    cuDNN mode; with ``goals`` (a layer record -> {precision: sparsity}), whether each break-even meets its
    goal (:func:`goal_verdict`), the break-even printed on the side of the goal its verdict says
    (:func:`describe`)."""
    lines = []
    by_layer = curves(records, batch)
    for (model, layer), per_precision in by_layer.items():
        record = next(r for r in records if r["model"] == model and r["layer"] == layer)
        lines += [f"### {model} {layer}: {record['in_chw']} -> {record['weight_shape'][0]} channels, "
                  f"{record['weight_shape'][2]}x{record['weight_shape'][3]}, batch {batch}", ""]
        sparsities = sorted({s for curve in per_precision.values() for s, _ in curve})
        layer_goals = goals(record) if goals else {}
        header = ["against", *[f"{s:g}" for s in sparsities], "break-even"]
        if goals:
            header.append("goal")
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for precision, mode in MODES.items():
            curve = dict(per_precision.get(precision, []))
            if not curve:
                continue
            result = break_even(sorted(curve.items()))
            row = [mode, *[f"{curve[s]:.2f}" if s in curve else "not measured" for s in sparsities],
                   describe(result, layer_goals.get(precision))]
            if precision in layer_goals:
                goal = layer_goals[precision]
                row.append(f"<= {goal:g}: {goal_verdict(result, goal)}")
            elif goals:
                row.append("")
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    return "\n".join(lines)


def plot_break_even(records: Sequence[dict[str, Any]], batch: int, path: str | Path) -> Path:
    """``path`` (PNG): one panel per layer, speedup of the direct kernel over each cuDNN mode against sparsity
    (log scale; the dashed line is break-even)."""
    from unsparse.report.plots import new_figure, save_figure

    by_layer = curves(records, batch)
    columns = min(3, max(1, len(by_layer)))
    rows = -(-len(by_layer) // columns) or 1
    with new_figure(nrows=rows, ncols=columns, figsize=(4.5 * columns, 3.4 * rows), squeeze=False) as (fig, axes):
        for ax, ((model, layer), per_precision) in zip(axes.flat, by_layer.items(), strict=False):
            for precision, mode in MODES.items():
                curve = per_precision.get(precision)
                if curve:
                    ax.plot([s for s, _ in curve], [v for _, v in curve], marker="o", label=f"over {mode}")
            ax.axhline(1.0, color="gray", linestyle="--")
            ax.set(title=f"{model} {layer}", xlabel="sparsity", ylabel="speedup (cuDNN ms / direct ms)", yscale="log")
            ax.legend(fontsize=6)
        for ax in list(axes.flat)[len(by_layer):]:
            ax.set_visible(False)
        fig.suptitle(f"Direct sparse kernels against cuDNN, batch {batch} (synthetic weights)")
        return save_figure(fig, path, dpi=90)
