"""Write a run's report: ``report.json`` for machines, ``report.md`` (with PNG plots) for people.

When a sparse backend is slower than the dense baseline the report says so, layer by layer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from unsparse.atomic import atomic_write_json, atomic_write_text
from unsparse.quant.kmeans import FIT_SETTINGS, recorded_fit
from unsparse.runtime.baseline import NAME as BASELINE
from unsparse.sparse.functional import dense_fallback_backend

SMOKE_RUN = ("**Smoke run (budget `quick`): figures are not results.** A few training batches on a subset of the "
             "data, to check that the script runs from end to end.")
"""The line that opens a page made with a script's ``quick`` budget (:func:`smoke_run_notice`)."""


def smoke_run_notice(budget_names: Iterable[str]) -> list[str]:
    """:data:`SMOKE_RUN` and a blank line for the top of a page if one of its runs used the ``quick`` budget, else
    nothing: without it, figures of a few training batches read as results."""
    return [SMOKE_RUN, ""] if "quick" in budget_names else []


NOT_A_NUMBER = "n/a"
"""A table cell for a value that is None or a float that is NaN (``report.json`` holds such a value as null:
:func:`write_report`)."""


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-flavoured Markdown table; floats get 4 significant digits (an infinity reads ``inf`` or ``-inf``),
    None and NaN read :data:`NOT_A_NUMBER`, so that a report renders the same from its values and from
    ``report.json``."""
    def cell(value: Any) -> str:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return NOT_A_NUMBER
        return f"{value:.4g}" if isinstance(value, float) else str(value)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(value) for value in row) + " |" for row in rows]
    return "\n".join(lines)


def sparsity_percent(fraction: float) -> str:
    """A sparsity (fraction of zero weights) as a percentage with two decimals for a table cell, never rounded to
    ``100.00`` or ``0.00`` unless exact: a 2.4M-weight layer with 94 weights left (99.996 %) read as fully pruned
    (``>99.99`` and ``<0.01`` instead)."""
    text = f"{100 * fraction:.2f}"
    if text == "100.00" and fraction < 1:
        return ">99.99"
    if text == "0.00" and fraction > 0:
        return "<0.01"
    return text


def short_of(fraction: float, target: float) -> str:
    """A sparsity below ``target`` as a percentage with the fewest decimals (at least two) that tell the two apart:
    ``89.997`` for 0.89997 against 0.9, where two decimals read ``90.00`` beside "NOT reached"."""
    for digits in range(2, 10):
        text = f"{100 * fraction:.{digits}f}"
        if text != f"{100 * target:.{digits}f}":
            return text
    return f"{100 * fraction:.10f}"


def within_noise(ms: float, base_ms: float, margin: float) -> bool:
    """Whether ``ms`` is slower than ``base_ms`` by no more than ``margin`` (a fraction of ``base_ms``): slower all
    the same, which a page says (:func:`noise_text`), while decisions such as a plan's revert treat it as noise."""
    return base_ms < ms <= (1 + margin) * base_ms


def noise_text(margin: float) -> str:
    """``within the 3 % noise margin`` for ``margin`` 0.03: what a page adds to a slower time that
    :func:`within_noise` holds."""
    return f"within the {100 * margin:.0f} % noise margin"


NOT_RECORDED = "not recorded"
"""What a page says of a setting that ``report.json`` (or the file it describes) lacks, written before it was
recorded."""


def quantization_rows(description: dict[str, Any]) -> list[list[Any]]:
    """The ``key | value`` rows of ``report.md``'s quantization table for a model's quantization description
    (``scheme``, ``weights``, ``activations``), each as it is, except that a k-means description's fit settings
    (:data:`~unsparse.quant.kmeans.FIT_SETTINGS`: how its codebooks were made, paper 004 §4, Alg. 3 line 4) get a
    row of their own after ``weights``, read by :func:`~unsparse.quant.kmeans.recorded_fit`, each one
    :data:`NOT_RECORDED` where the description lacks it (a file written before it was recorded).

    Raises:
        SparseFormatError: a k-means description that is not valid, naming the field (as on load).
    """
    if description.get("scheme") != "kmeans":
        return [[key, value] for key, value in description.items()]
    fit = recorded_fit(description)
    settings = ", ".join(f"{key}={NOT_RECORDED if fit[key] is None else fit[key]}" for key in FIT_SETTINGS)
    rows = []
    for key, value in description.items():
        if key == "weights":
            rows += [[key, {name: setting for name, setting in value.items() if name not in FIT_SETTINGS}],
                     ["k-means fit settings", settings]]
        else:
            rows.append([key, value])
    return rows


MARGIN_NOT_RECORDED = "the noise margin it was checked against was not recorded"
"""What a page says of a slower time where ``report.json`` has no plan-check ``margin`` (jobs before the check
recorded one): whether it was within the margin or beyond it is not said."""


def timing_verdicts(timings: Sequence[dict[str, Any]], baseline: str) -> list[dict[str, Any]]:
    """Per layer: baseline time, fastest backend, its speedup over the baseline and a plain verdict.

    Args:
        timings: entries with ``layer``, ``backend``, ``time_ms`` (median, ms) and ``sparse`` (bool).
        baseline: the backend name the speedups are relative to, at its fastest entry per layer (the pipeline
            passes :data:`unsparse.runtime.baseline.NAME`, the dense convolution alone in its faster layout).

    Returns:
        One dict per layer: ``layer``, ``baseline_ms``, ``fastest`` (among the other backends: what a plan can
        run), ``fastest_ms``, ``best_sparse``,
        ``best_sparse_ms``, ``sparse_speedup`` (baseline time / best sparse time; < 1 means slower) and
        ``verdict``.
    """
    verdicts = []
    for layer in dict.fromkeys(entry["layer"] for entry in timings):
        entries = [entry for entry in timings if entry["layer"] == layer]
        fastest = min((entry for entry in entries if entry["backend"] != baseline), key=lambda entry: entry["time_ms"],
                      default=None)
        bases = [entry for entry in entries if entry["backend"] == baseline]
        base = min(bases, key=lambda entry: entry["time_ms"]) if bases else None
        sparse = [entry for entry in entries if entry.get("sparse")]
        best_sparse = min(sparse, key=lambda entry: entry["time_ms"]) if sparse else None
        speedup = base["time_ms"] / best_sparse["time_ms"] if base and best_sparse else None
        if speedup is None:
            verdict = "no sparse/baseline pair measured"
        elif f"{speedup:.2f}" == "1.00" or f"{1 / speedup:.2f}" == "1.00":  # what the page prints: a tie
            verdict = "sparse as fast as the baseline (1.00x)"
        elif speedup > 1.0:
            verdict = f"sparse faster ({speedup:.2f}x)"
        else:
            verdict = f"sparse SLOWER ({1 / speedup:.2f}x the baseline time)"
        verdicts.append({"layer": layer, "baseline_ms": base["time_ms"] if base else None,
                         "fastest": fastest["backend"] if fastest else None,
                         "fastest_ms": fastest["time_ms"] if fastest else None,
                         "best_sparse": best_sparse["backend"] if best_sparse else None,
                         "best_sparse_ms": best_sparse["time_ms"] if best_sparse else None,
                         "sparse_speedup": speedup, "verdict": verdict})
    return verdicts


NOT_PLANNED = "dense default (not planned)"
"""A layer's backend under ``auto`` where the plan has no entry for it (``plan_check["layer_backends"]``)."""

DENSE_LABELS = frozenset({*(dense_fallback_backend(torch.device(kind)) for kind in ("cpu", "cuda")), NOT_PLANNED})
"""``layer_backends`` labels of a layer on its device's dense default
(:func:`~unsparse.sparse.functional.dense_fallback_backend`; cuDNN in the other layout reads ``"cudnn, converted
to ..."``)."""


def plan_check_text(check: dict[str, Any]) -> str:
    """One paragraph on the whole planned model against its dense default (the report's ``plan_check``: the fields
    of :class:`~unsparse.runtime.comparator.PlanCheck`, its ``margin`` a fraction, plus ``images`` per
    forward, ``model_runs_on``, the backend the test set ran on, ``layer_backends``, each layer's backend there,
    for ``auto`` ``unplanned_images``, the test images in batches of a size the plan has no entry for, and
    where that is not ``auto`` ``model_runs_on_ms``, ``model_runs_on_default_ms`` and ``model_runs_on_timing``,
    the model's time on it and on its dense default, and how both were timed, or ``model_runs_on_is_default`` where
    it is that default). Says whether the plan is faster,
    slower within the margin (run-to-run noise) or SLOWER, that slower plans were set back, and what the test set
    ran on: the plan's backend per layer, or another backend's whole-model time against the dense default (slower
    within the margin or SLOWER, the same way). Where the plan keeps every layer on its dense default
    (:data:`DENSE_LABELS`), both forwards ran the same layers, and a gap either way is said to be noise, not a
    speedup.

    ``report.json`` of an older job lacks fields added since; none is filled in, each reads :data:`NOT_RECORDED`.
    Without ``margin`` (jobs before 7a6912f) a slower time is called slower with :data:`MARGIN_NOT_RECORDED`,
    neither within the margin nor SLOWER, except a plan that was set back, which was beyond it. Without
    ``layer_backends`` (before 6152685) the page says that the layers' backends under ``auto``, or the layers a
    named backend declined, were not recorded; without ``unplanned_images`` (before dcb4d97), how many test images
    ran on the dense default under ``auto``; without ``model_runs_on_ms`` (before 6152685), the named backend's
    time. A ``model_runs_on_ms`` without ``model_runs_on_default_ms`` (before 4b0071b) is given alone, and a missing
    ``model_runs_on_timing`` (before 4b0071b) reads "how: not recorded". Every version wrote ``images``,
    ``model_runs_on`` and the fields of :class:`~unsparse.runtime.comparator.PlanCheck` other than ``margin`` (since
    370a8ce, when the main job began checking its plan).

    Raises:
        KeyError: naming another missing field.
    """
    how = "as CUDA-graph replays (GPU time)" if check["timing"] == "graph" else "eagerly (host clock included)"
    planned, default, margin = check["planned_ms"], check["default_ms"], check.get("margin")
    speed = default / planned
    labels = set(check.get("layer_backends", {}).values())
    same_layers = check["model_runs_on"] == "auto" and bool(labels) and labels <= DENSE_LABELS
    if same_layers and not check["reverted"]:
        verdict = (f"{speed:.2f}x the default's speed, but every layer of the plan runs its dense default, so both "
                   "forwards ran the same layers: the gap is the plan's per-layer dispatch (host time) or noise")
    elif speed >= 1:
        verdict = f"{speed:.2f}x the default's speed"
    elif margin is not None and within_noise(planned, default, margin):
        verdict = f"{speed:.2f}x the default's speed: slower, {noise_text(margin)}"
    elif margin is None and not check["reverted"]:
        verdict = f"{speed:.2f}x the default's speed: slower ({MARGIN_NOT_RECORDED})"
    else:
        verdict = f"{speed:.2f}x the default's speed, so the plan is SLOWER"
    text = (f"The planned model took {planned:.4g} ms per forward of {check['images']} images, against "
            f"{default:.4g} ms with every layer on its dense default, timed {how} in the same run: {verdict}.")
    if check["reverted"]:
        text += (f" Being slower by more than the planning margin, the plan's {len(check['reverted'])} new layer "
                 "entries were set back to the dense default.")
    elif margin is not None and planned > (1 + margin) * default and not same_layers:
        text += (" Every layer of the plan already runs its dense default, so nothing was set back: the gap is the "
                 "plan's per-layer dispatch (host time) or noise.")
    if check["model_runs_on"] != "auto":
        declined = {layer: backend for layer, backend in check.get("layer_backends", {}).items()
                    if backend != check["model_runs_on"]}
        text += f" The test set ran on `{check['model_runs_on']}`, not on the plan" + (
            f" (which layers it declined, running them on the dense default instead: {NOT_RECORDED})"
            if "layer_backends" not in check else
            f" (**{len(declined)} of {len(check['layer_backends'])} layers ran dense instead**: "
            + "; ".join(f"`{layer}` on {backend}" for layer, backend in declined.items()) + ")" if declined else "")
        if check.get("model_runs_on_is_default"):
            text += ", which is the dense default itself (not timed against itself)"
        elif check.get("model_runs_on_ms") is None:
            text += f": its time per forward was {NOT_RECORDED}"
        elif check.get("model_runs_on_default_ms") is None:
            text += (f": {check['model_runs_on_ms']:.4g} ms per forward (its time on the dense default was not "
                     "recorded)")
        else:
            runs_on, runs_on_default = check["model_runs_on_ms"], check["model_runs_on_default_ms"]
            how_runs_on = {"graph": "as CUDA-graph replays", "eager": "eagerly"}.get(
                check.get("model_runs_on_timing"), f"(how: {NOT_RECORDED})")
            slower = ("" if runs_on <= runs_on_default else f" (slower; {MARGIN_NOT_RECORDED})" if margin is None
                      else f" (slower, {noise_text(margin)})" if within_noise(runs_on, runs_on_default, margin)
                      else " (SLOWER)")
            text += (f": {runs_on:.4g} ms per forward against {runs_on_default:.4g} ms on the dense default, both "
                     f"timed {how_runs_on}, {runs_on_default / runs_on:.2f}x its speed{slower}")
        text += "."
    elif "layer_backends" not in check or check["layer_backends"]:
        text += " The test set ran on the plan" + (
            f" (which backend each layer ran on: {NOT_RECORDED})." if "layer_backends" not in check else ": "
            + ", ".join(f"`{layer}` on {backend}" for layer, backend in check["layer_backends"].items()) + ".")
        if "unplanned_images" not in check:
            text += (" How many test images ran on the dense default instead, in a batch of another size than the "
                     f"plan's {check['images']} images, which the plan has no entry for: {NOT_RECORDED}.")
        elif check["unplanned_images"]:
            text += (f" **{check['unplanned_images']} test images ran on the dense default instead**: they came in a "
                     f"batch of another size than the plan's {check['images']} images, which the plan has no entry "
                     "for.")
    return text + _folding_text(check.get("batch_norm_folding"))


def _folding_text(folding: dict[str, Any] | None) -> str:
    """The plan check's sentence on BatchNorms folded into the convolutions the test set ran (``runtime.
    fold_batch_norm``; nothing for a job that did not fold, or from before folding was recorded)."""
    if not folding or folding["policy"] == "off":
        return ""
    where = ("every convolution with an eval-mode BatchNorm after it, before the comparisons"
             if folding["policy"] == "all" else
             "the layers whose planned backend adds the bias in its epilogue, after the plan check (those on cuDNN "
             "keep their BatchNorm pass)")
    layers = ", ".join(f"`{name}`" for name in folding["folded"]) or "none"
    return (f" BatchNorms folded ({folding['policy']}: {where}) into {len(folding['folded'])} convolutions: {layers}; "
            "the test set ran on the folded model, the file holds the unfolded one.")


def _trivial_text(run: dict[str, Any], accuracy: dict[str, float | None]) -> str:
    """What a model that learned nothing scores (``run["metric_trivial"]``), and the stages that do no better (a
    diverged stage's NaN, null in ``report.json``, counts as no better); that it was not recorded where
    ``report.json`` lacks it or ``run["metric"]`` (jobs before both were recorded)."""
    trivial = run.get("metric_trivial")
    if trivial is None or run.get("metric") is None:
        return "What a model that learned nothing scores here was not recorded."
    top1 = run["metric"] == "top1"
    text = (f"A model that learned nothing scores {trivial:.4g} here ("
            + ("always the most frequent training label" if top1 else "each window predicted by its own mean") + ").")
    no_better = [stage for stage, value in accuracy.items()
                 if value is None or math.isnan(value) or (value <= trivial if top1 else value >= trivial)]
    if no_better:
        text += f" **No better than that: {', '.join(f'`{stage}`' for stage in no_better)}.**"
    return text


def not_timed_text(not_timed: Sequence[dict[str, Any]], timed: Sequence[dict[str, Any]] = ()) -> str:
    """One line naming the backends that could not be timed, grouped by backend, status and reason with their
    layers; rows of status ``"ok"`` without a time (settings the comparator's screening left out of a backend it
    timed) are not named, nor a backend on a layer where one of ``timed`` (rows with a time) gives it a time there
    (one of its settings failed, another ran). Empty when there is nothing to name."""
    ran = {(entry["backend"], entry["layer"]) for entry in timed}
    layers: dict[tuple[str, str, str], list[str]] = {}
    for entry in not_timed:
        if entry["status"] != "ok" and (entry["backend"], entry["layer"]) not in ran:
            names = layers.setdefault((entry["backend"], entry["status"], entry.get("reason") or ""), [])
            names += [entry["layer"]] * (entry["layer"] not in names)
    return "" if not layers else "Not timed: " + "; ".join(
        f"`{backend}` on {', '.join(f'`{layer}`' for layer in names)} ({status}{': ' * bool(reason)}{reason})"
        for (backend, status, reason), names in layers.items()) + "."


def _count(number: int | None, what: str) -> str:
    """``20 timed calls``, or ``timed calls (how many: not recorded)`` for a count that ``report.json`` lacks."""
    return f"{what} (how many: {NOT_RECORDED})" if number is None else f"{number} {what}"


def _masked_sparsity(pruning: dict[str, Any]) -> str:
    """The clause naming the weighted sparsity over the pruned layers, where it differs from the model's (what a
    whole-model target is measured on, not a per-layer one)."""
    masked = pruning.get("masked_weighted_sparsity", pruning["weighted_sparsity"])
    if abs(masked - pruning["weighted_sparsity"]) <= 1e-9:
        return ""
    measured = ", which the target is measured on" if pruning.get("layer_targets") is None else ""
    return f"; **{sparsity_percent(masked)}%** over the pruned layers only{measured}"


UNRECORDED_SHORTFALL_REASON = "its iteration budget ran out, or no layer could be pruned further"
"""What the page of a job whose ``report.json`` has no ``shortfall_reason`` (written before it was recorded) says of
a weighted-sparsity target not reached, as such pages did."""


def layer_goal_text(layer_targets: Mapping[str, float], target: float) -> str:
    """A per-layer goal (paper 004 §3.1, layer-wise sparsity) as asked: ``each pruned layer at 90.00%`` where every
    layer's is ``target``, else ``each pruned layer at its own sparsity (7.0: 50.00%, others: 90.00%)``, naming the
    layers whose target is not ``target``."""
    named = {name: goal for name, goal in layer_targets.items() if goal != target}
    if not named:
        return f"each pruned layer at {sparsity_percent(target)}%"
    others = [f"others: {sparsity_percent(target)}%"] if len(named) < len(layer_targets) else []
    return ("each pruned layer at its own sparsity ("
            + ", ".join([*(f"{name}: {sparsity_percent(goal)}%" for name, goal in named.items()), *others]) + ")")


def layers_short_text(pruning: Mapping[str, Any]) -> str:
    """The layers of ``pruning["layers_short"]``, each with the sparsity it reached and how far below its own target
    in ``pruning["layer_targets"]`` (``7.0 at 45.00%, 5 points below its 50.00%``), from ``layer_sparsity``."""
    goals, reached = pruning["layer_targets"], pruning["layer_sparsity"]
    return "; ".join(f"{name} at {short_of(reached[name], goals[name])}%, {100 * (goals[name] - reached[name]):.3g} "
                     f"points below its {sparsity_percent(goals[name])}%" for name in pruning["layers_short"])


def _target_text(pruning: dict[str, Any]) -> str:
    """The sentence on the pruning target: none without a ``target`` (older jobs). For per-layer ``layer_targets``,
    the goal as asked (:func:`layer_goal_text`) and whether every layer reached its own, naming those that did not
    (:func:`layers_short_text`); otherwise (``layer_targets`` None or, from older jobs, missing) whether the weighted
    sparsity over the pruned layers reached ``target`` (eq. 7-8), and if not where it stopped and the recorded
    ``shortfall_reason`` (missing from older jobs: :data:`UNRECORDED_SHORTFALL_REASON`)."""
    if "target" not in pruning:
        return ""
    if pruning.get("layer_targets") is not None:
        short = pruning["layers_short"]
        return f" Target: {layer_goal_text(pruning['layer_targets'], pruning['target'])}: " + (
            "reached." if pruning["target_reached"] else
            f"**NOT reached** by {len(short)} layer{'s' * (len(short) != 1)}: {layers_short_text(pruning)}.")
    head = f" Target {100 * pruning['target']:.2f}%: "
    if pruning["target_reached"]:
        return head + "reached."
    reason = pruning.get("shortfall_reason", UNRECORDED_SHORTFALL_REASON)
    stopped = short_of(pruning.get("masked_weighted_sparsity", pruning["weighted_sparsity"]), pruning["target"])
    return head + f"**NOT reached**: the run stopped below it, at {stopped}%" + (f" ({reason})." if reason else ".")


def write_report(outdir: str | Path, report: dict[str, Any], figures: dict[str, Path]) -> dict[str, Path]:
    """Write ``report.json`` and ``report.md`` into ``outdir`` (atomically).

    Args:
        report: JSON-ready dict with keys ``run`` (with ``metric`` (``"top1"`` or ``"mse"``), ``metric_label``,
            ``metric_trivial``, ``timing_runs`` and ``timing_warmup``, for each of which the page says "not
            recorded" where it is missing, as from ``report.json`` of older jobs, and ``tree_modified``),
            ``accuracy`` (the test metric per stage; a NaN or None, or one no better than ``metric_trivial``, is
            named), ``pruning`` (its ``target`` and ``target_reached`` stated when present, as :func:`_target_text`
            reads them with ``layer_targets``, ``layers_short`` and ``shortfall_reason``; ``fully_pruned_layers``
            warned about), ``quantization`` (the model's description; a k-means one's fit
            settings are read by :func:`quantization_rows`), optionally ``conv_nonzeros`` (``pruned``
            and ``exported`` nonzero conv weights, whose difference quantization rounded to zero), ``layers``
            (rows of :func:`unsparse.report.layers.layer_rows`), ``timings``, ``timing_baseline``,
            ``timing_verdicts`` (from :func:`timing_verdicts`), ``file`` (with optional
            ``weighted_sparsity``: the weights as stored, after quantization), optionally
            ``not_timed`` (rows without a time; those whose status is not ``"ok"`` are listed) and optionally
            ``plan_check`` (the fields of :class:`~unsparse.runtime.comparator.PlanCheck` with the keys
            :func:`plan_check_text` names; those older jobs did not write may be missing, as it says).
        figures: title -> PNG path (relative links are written into the Markdown).

    ``report.json`` is strict JSON, indented: NaN as null, infinities (a diverged model's MSE, a pruning history's
    change) as ``1e999`` and ``-1e999``, which :func:`~unsparse.strict_json.loads_strict` reads back as the
    infinities (:func:`~unsparse.strict_json.dumps_strict`); ``report`` as read back from it renders the same
    ``report.md``.

    Returns:
        ``{"json": path, "markdown": path}``.

    Raises:
        KeyError: naming a missing field that is not said above to be optional or to be missing from older jobs'
            ``report.json``; nothing is written then.
        SparseFormatError: a malformed k-means ``quantization`` description (:func:`quantization_rows`); nothing
            is written then.
    """
    outdir = Path(outdir)
    run, accuracy, pruning = report["run"], report["accuracy"], report["pruning"]
    modified = " (working tree modified: the code that ran is not that commit's)" if run.get("tree_modified") else ""
    commit = run.get("commit") or "unknown (not run from a git checkout)"
    sections = [
        f"# UnSparse report: {run['model']['name']} on {run['data']}",
        f"Device: {run['device']}; torch {run['torch']}; weights: {run['weights']}; commit {commit}"
        f"{modified}.",
        "## Test metric",
        "On the test split: `dense` after dense training, `pruned` after pruning and fine-tuning (masks on, before "
        "quantization), `sparse_run` the exported file reloaded (quantized, if a scheme was chosen) and run on the "
        "backend named under Whole model.",
        markdown_table(["stage", run.get("metric_label", f"test metric (which: {NOT_RECORDED})")],
                       [[key, value] for key, value in accuracy.items()]),
        _trivial_text(run, accuracy),
        "## Pruning",
        f"Method **{pruning['method']}**, weighted sparsity **{sparsity_percent(pruning['weighted_sparsity'])}%** "
        f"(paper 004 eq. 7-8, over conv and linear layers){_masked_sparsity(pruning)}, wall time "
        f"{pruning['wall_time_s']:.1f} s.{_target_text(pruning)}",
        markdown_table(["layer", "sparsity (%)"],
                       [[name, sparsity_percent(value)] for name, value in pruning["layer_sparsity"].items()]),
    ]
    if pruning.get("fully_pruned_layers"):
        sections.append(f"**{len(pruning['fully_pruned_layers'])} layer(s) fully pruned** "
                        f"({', '.join(pruning['fully_pruned_layers'])}): every weight is zero, so the signal is cut "
                        "there and only biases pass; a global magnitude threshold does this to layers of small "
                        "weights.")
    if report.get("quantization"):
        quant = report["quantization"]
        sections += ["## Quantization", markdown_table(["key", "value"], quantization_rows(quant))]
        counts = report.get("conv_nonzeros")
        if counts:
            lost = counts["pruned"] - counts["exported"]
            sections.append(f"The pruned model's convolutions hold {counts['pruned']} nonzero weights; "
                            + (f"quantization rounded {lost} of them to zero, so the exported file holds "
                               f"{counts['exported']} (its sparsities below count from the file)." if lost else
                               "quantization kept every one of them nonzero."))
    file_info = report["file"]
    stored = file_info.get("weighted_sparsity")
    stored_text = "" if stored is None else (
        f"Weighted sparsity of the weights as stored (eq. 7-8, conv and linear): **{sparsity_percent(stored)}%**"
        + (f", against {sparsity_percent(pruning['weighted_sparsity'])}% after pruning (quantization rounded weights "
           "to zero). " if abs(stored - pruning["weighted_sparsity"]) > 1e-9 else ", as after pruning. "))
    sections += [
        "## Export",
        f"{stored_text}`{file_info['path']}`: {file_info['bytes']} bytes in the file; the conv weights would take "
        f"{file_info['dense_conv_fp32_bytes']} bytes dense in FP32 and take {file_info['sparse_conv_bytes']} here. "
        "Each conv is a uniform-nnz CSR matrix (paper 004 §5): every output channel stores `L` entries, the nonzeros "
        "of its densest channel, so sparser channels are padded with zero entries (`padding entries`).",
        markdown_table(["layer", "kind", "weight shape", "stride", "sparsity (%)", "nnz", "L", "padding entries",
                        "file bytes", "dense FP32 bytes"],
                       [[r["layer"], r["kind"], "x".join(map(str, r["weight_shape"])), r["stride"],
                         sparsity_percent(r["sparsity"]), r["nnz"], r["row_length"], r["padding_entries"],
                         r["file_bytes"], r["dense_fp32_bytes"]] for r in report["layers"]]),
        "## Per-layer time",
        f"Median of {_count(run.get('timing_runs'), 'timed calls')} after "
        f"{_count(run.get('timing_warmup'), 'warm-up calls')} on {run['device']} "
        f"(see `timings` in report.json for every measurement). Speedups are relative to "
        f"`{report['timing_baseline']}`, measured in the same run"
        + (": the dense convolution alone (no bias) in its faster layout, NCHW or NHWC, with the input already in it "
           "(cuDNN on a GPU)." if report["timing_baseline"] == BASELINE else "."),
        markdown_table(["layer", "input shape", "backend", "params", "median ms", "rel. error vs reference"],
                       [[t["layer"], "x".join(map(str, t["input_shape"])), t["backend"], t.get("params") or "",
                         t["time_ms"], t["rel_error"]] for t in report["timings"]]),
        "Per layer against the baseline: the fastest other backend measured, the fastest sparse one and its "
        "speedup (the baseline's time over its time).",
        markdown_table(["layer", "baseline ms", "fastest", "best sparse", "sparse speedup", "verdict"],
                       [[v["layer"], v["baseline_ms"], v["fastest"], v["best_sparse"], v["sparse_speedup"],
                         v["verdict"]] for v in report["timing_verdicts"]]),
    ]
    not_timed = not_timed_text(report.get("not_timed", []), report["timings"])
    if not_timed:
        sections.append(not_timed)
    if report.get("plan_check"):
        sections += ["## Whole model", plan_check_text(report["plan_check"])]
    sections += [f"## {title}\n\n![{title}]({path.relative_to(outdir)})" for title, path in figures.items()]
    paths = {"json": atomic_write_json(outdir / "report.json", report),
             "markdown": atomic_write_text(outdir / "report.md", "\n\n".join(sections) + "\n")}
    return paths
