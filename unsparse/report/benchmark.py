"""The benchmark's report: issue targets evaluated from its records, ``bench.md`` and its PNG plots.

Reads the result dictionary that :func:`unsparse.runtime.bench.run_bench` builds (``layers`` and ``end_to_end``
records, ``environment``); writes nothing itself except the plots, which the page links. Where sparse is slower
than cuDNN the report says so, per precision and per end-to-end run.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

from unsparse.report.document import MARGIN_NOT_RECORDED, noise_text, within_noise
from unsparse.runtime.comparator import PLAN_MARGIN
from unsparse.runtime.precision import PRECISIONS

ESCOIN_MODELS = ("alexnet", "googlenet", "resnet50")
"""Models of Escoin's Fig. 8 comparison against im2col + cuBLAS / cuSPARSE."""
ESCOIN_TARGETS = {"im2col_cublas": 2.63, "im2col_cusparse": 3.07}
"""Escoin's P100 geometric-mean speedups of direct sparse convolution (paper 000 §4), issue 5 targets."""

CUDNN_MODES = {"fp32": "cuDNN FP32 (TF32 off)", "tf32": "cuDNN TF32", "fp16": "cuDNN FP16", "fp16_half2": "cuDNN FP16",
               "fp32_generated": "cuDNN FP32 (TF32 off)", "tf32_generated": "cuDNN TF32",
               "fp16_generated": "cuDNN FP16"}
"""The cuDNN mode each precision of :data:`~unsparse.runtime.precision.PRECISIONS` is timed in, what its speedups
are over (``fp16_half2``: cuDNN FP16, against the half2-product direct kernel), for the speedup plot's axes."""


LAYOUT_SUFFIXES = {"nchw": "", "nhwc": "_nhwc", "switched": "_switched"}
"""Layout of a model timed whole -> the suffix of its end-to-end record fields (``planned_nhwc_ms``,
``backend_counts_switched``): NCHW, channels-last, or NCHW switched to channels-last after the first max pool."""
LAYOUT_WORDS = {"nchw": "NCHW", "nhwc": "channels-last", "switched": "switched"}
"""Layout -> the word a page's sentence uses for it ("the channels-last plan", "the dense model in NCHW")."""


def counts_switched(record: dict[str, Any]) -> bool:
    """Whether an end-to-end record's best layouts count switched as a third layout: the run also timed the eager
    dense model switched (``dense_switched_ms``, runs since the fifty-third session), so both sides of its ratios
    choose among the same three layouts."""
    return "dense_switched_ms" in record


def comparative(layouts: int) -> str:
    """``"faster"`` for the better of two layouts, ``"fastest"`` for the best of three: how a sentence names it."""
    return "faster" if layouts < 3 else "fastest"


def in_layout_text(layout: str) -> str:
    """``in NCHW``, ``in channels-last`` or ``switched to channels-last after the first max pool``: where a
    sentence says a model ran."""
    if layout == "switched":
        return "switched to channels-last after the first max pool"
    return f"in {LAYOUT_WORDS[layout]}"


def sparse_convs(record: dict[str, Any], suffix: str = "") -> dict[str, str]:
    """Layer name -> sparse backend for the convs an end-to-end record's plan runs on a sparse kernel (the NCHW
    plan's, with ``suffix="_nhwc"`` the channels-last plan's, with ``"_switched"`` the switched model's): its
    ``off_cudnn`` labels less the cuDNN layers that compute in the other layout (``"cudnn, converted to nhwc"``,
    :func:`~unsparse.runtime.comparator.planned_backends`), which run no sparse kernel."""
    return {name: backend for name, backend in (record.get("off_cudnn" + suffix) or {}).items()
            if not backend.startswith("cudnn")}


def sparse_conv_count(record: dict[str, Any], suffix: str = "") -> tuple[int, int] | None:
    """``(convs on sparse kernels, all convs)`` of the plan ``suffix`` names (as :func:`sparse_convs`), None for an
    end-to-end record without its ``backend_counts``."""
    counts = record.get("backend_counts" + suffix)
    return (len(sparse_convs(record, suffix)), sum(counts.values())) if counts else None


def _off_cudnn(record: dict[str, Any], suffix: str = "") -> str:
    """``; not on cuDNN: NAME (BACKEND), ...`` for an end-to-end record's layers planned on sparse kernels
    (:func:`sparse_convs`), then ``; on cuDNN after a layout conversion: NAME (converted to LAYOUT), ...`` for its
    cuDNN layers that compute in the other layout; ``""`` for neither."""
    off = record.get("off_cudnn" + suffix) or {}
    sparse = sparse_convs(record, suffix)
    converted = {name: label.removeprefix("cudnn, ") for name, label in off.items() if name not in sparse}
    text = "; not on cuDNN: " + ", ".join(f"{name} ({backend})" for name, backend in sparse.items()) if sparse else ""
    if converted:
        text += "; on cuDNN after a layout conversion: " + ", ".join(f"{name} ({label})"
                                                                   for name, label in converted.items())
    return text


def _slower(ms: float, base_ms: float, margin: float) -> str:
    """``"SLOWER"`` where ``ms`` exceeds ``base_ms`` by more than ``margin`` (a fraction), ``"slower"`` where by no
    more (:func:`~unsparse.report.document.within_noise`), ``""`` where it does not or the page prints both times
    alike (3 decimals: a tie on the page is not called a loss)."""
    if ms <= base_ms or _fmt(ms) == _fmt(base_ms):
        return ""
    return "slower" if within_noise(ms, base_ms, margin) else "SLOWER"


def _host_time(record: dict[str, Any], planned_suffix: str, dense_suffix: str) -> str:
    """The clause that says an eager loss is host time: where the record's CUDA-graph times have the planned model
    in one layout faster than the dense model in one layout (each suffix ``""`` for NCHW, ``"_nhwc"``: the pair
    the eager sentence compares), else ``""``."""
    dense_graph = record.get(f"dense{dense_suffix}_graph_ms")
    planned_graph = record.get(f"planned{planned_suffix}_graph_ms")
    if dense_graph and planned_graph and planned_graph < dense_graph:
        return (f"; as CUDA graphs it takes {_fmt(planned_graph)} against {_fmt(dense_graph)} ms, so the eager loss is "
                "host time")
    return ""


def dense_fused_ms(record: dict[str, Any]) -> float | None:
    """An end-to-end record's dense model fused by cuDNN (convolution, bias and ReLU in one call) in its fastest
    layout (``best_dense_fused_layout``, switched in runs since the fifty-third session where that was fastest), ms;
    None for a record without one (nothing fused, its output off, or from before it was timed)."""
    layout = record.get("best_dense_fused_layout")
    return record.get(f"dense_fused{LAYOUT_SUFFIXES[layout]}_ms") if layout else None


def dense_fused_name(record: dict[str, Any]) -> str:
    """What an end-to-end record's fused dense model is, for a sentence: its ReLUs fused by cuDNN, its BatchNorms
    folded (``dense_folded_batch_norm``), or both."""
    folded = "its BatchNorms folded into its convolutions"
    if record.get("dense_fused_convs") == 0 and record.get("dense_folded_batch_norm"):
        return f"the dense model with {folded}"
    fused = "the dense model fused by cuDNN (convolution, bias and ReLU in one call"
    return fused + (f"; {folded})" if record.get("dense_folded_batch_norm") else ")")


def _slower_end_to_end(records: Sequence[dict[str, Any]]) -> list[str]:
    """The "Where sparse is slower" lines of end-to-end records: per record and layout, a plan its check found
    slower than its dense default (set back, or kept: within the check's margin, or with no key of this run to set
    back), and the planned model slower eagerly than the dense one in that layout; then the planned model in its
    fastest layout slower than the dense one in its fastest layout (:func:`fastest_layout`; beyond
    :data:`PLAN_MARGIN` with "run that one instead", and then no per-layout line of the eager times; within it only
    where the two fastest layouts differ, since a layout's line names the same pair otherwise). A time slower by no
    more than the margin is said to be "slower, within the 3 % noise margin", not called SLOWER. A plan check
    without its ``margin`` (a result written before the check recorded one) that kept a slower plan is said to be
    slower and kept, with :data:`~unsparse.report.document.MARGIN_NOT_RECORDED`, as the job report says it: today's
    :data:`PLAN_MARGIN` need not be the one it was checked against, so neither "within the margin" nor SLOWER is
    said. Then the planned model in its fastest layout slower than the dense model fused by cuDNN
    (:func:`dense_fused_ms`), where timed; last, a fastest plan with no conv off cuDNN (:func:`_all_on_cudnn`).
    Records that timed two layouts of each model say "faster layout", those that timed three (switched too)
    "fastest" (:func:`comparative`)."""
    lines = []
    for r in records:
        run = f"end to end {r['model']} {precision_label(r)} b{r['batch']}"
        dense, planned = fastest_ms(r, "dense"), fastest_ms(r, "planned")
        slower_overall = planned > (1 + PLAN_MARGIN) * dense  # closer than that is run-to-run noise
        for layout, suffix in LAYOUT_SUFFIXES.items():
            check, words = r.get("plan_check" + suffix) or {}, LAYOUT_WORDS[layout]
            margin = check.get("margin")
            if check.get("reverted"):
                lines.append(f"- {run}: the {words} plan ({_fmt(check['planned_ms'])} ms) was SLOWER than its "
                             f"dense default ({_fmt(check['default_ms'])} ms, timed {check.get('timing', 'eagerly')});"
                             f" {len(check['reverted'])} layer keys were set back to the default before the times "
                             "below.")
            # an infinite margin: slower as the page prints the times, judged against no margin
            elif check and margin is None and _slower(check["planned_ms"], check["default_ms"], math.inf):
                lines.append(f"- {run}: the {words} plan ({_fmt(check['planned_ms'])} ms) was slower than its dense "
                             f"default ({_fmt(check['default_ms'])} ms, timed {check.get('timing', 'eagerly')}) and "
                             f"kept ({MARGIN_NOT_RECORDED}).")
            elif check and (kept := _slower(check["planned_ms"], check["default_ms"], margin)):
                lines.append(f"- {run}: the {words} plan ({_fmt(check['planned_ms'])} ms) was {kept} than its dense "
                             f"default ({_fmt(check['default_ms'])} ms, timed {check.get('timing', 'eagerly')}), "
                             + (f"{noise_text(margin)}, so it was kept." if kept == "slower" else
                                "and kept: no layer key planned in this run had left the default."))
            dense_ms, planned_ms = r.get(f"dense{suffix}_ms"), r.get(f"planned{suffix}_ms")
            eager = _slower(planned_ms, dense_ms, PLAN_MARGIN) if dense_ms and planned_ms else ""
            if not slower_overall and eager:
                host = _host_time(r, suffix, suffix)
                lines.append(f"- {run}: the {words} plan is {eager} eagerly than the dense model "
                             f"{in_layout_text(layout)} "
                             f"({_fmt(planned_ms)} against {_fmt(dense_ms)} ms)"
                             f"{f', {noise_text(PLAN_MARGIN)}' if eager == 'slower' else ''}{host}.")
        dense_layout, planned_layout = fastest_layout(r, "dense"), fastest_layout(r, "planned")
        fastest = comparative(len(layout_times(r, "planned")))
        if slower_overall:
            host = _host_time(r, LAYOUT_SUFFIXES[planned_layout], LAYOUT_SUFFIXES[dense_layout])
            lines.append(f"- {run}: the planned model ({_fmt(planned)} ms in its {fastest} layout) is SLOWER than the "
                         f"dense model {in_layout_text(dense_layout)} ({_fmt(dense)} ms); run that one instead{host}.")
        elif _slower(planned, dense, PLAN_MARGIN) and planned_layout != dense_layout:
            lines.append(f"- {run}: the planned model ({_fmt(planned)} ms {in_layout_text(planned_layout)}, its "
                         f"{fastest} layout) is slower than the dense model {in_layout_text(dense_layout)} "
                         f"({_fmt(dense)} ms), {noise_text(PLAN_MARGIN)}.")
        fused = dense_fused_ms(r)
        if fused is not None and (against_fused := _slower(planned, fused, PLAN_MARGIN)):
            lines.append(f"- {run}: the planned model ({_fmt(planned)} ms in its {fastest} layout) is {against_fused} "
                         f"than {dense_fused_name(r)}: {_fmt(fused)} ms "
                         f"{in_layout_text(r['best_dense_fused_layout'])}"
                         + (f", {noise_text(PLAN_MARGIN)}" if against_fused == "slower" else "")
                         + _fused_graph_text(r, planned_layout) + ".")
        lines += _all_on_cudnn(r, run, planned_layout)
    return lines


def _fused_graph_text(record: dict[str, Any], planned_layout: str) -> str:
    """``; as CUDA graphs ...``: the planned model's graph time in ``planned_layout`` (a :data:`LAYOUT_SUFFIXES`
    key) against the dense fused model's in its fastest layout, where both were timed (records from before the fused
    model's graphs were timed have none, and switched models are replayed since the fifty-third session's fourth
    call), else ``""``. Where the eager gap is host time, the two graph times are close."""
    fused_tag = LAYOUT_SUFFIXES[record["best_dense_fused_layout"]]
    planned_graph = record.get(f"planned{LAYOUT_SUFFIXES[planned_layout]}_graph_ms")
    fused_graph = record.get(f"dense_fused{fused_tag}_graph_ms")
    if planned_graph is None or fused_graph is None:
        return ""
    return (f"; as CUDA graphs (GPU time, without the host's per-layer work) {_fmt(planned_graph)} against "
            f"{_fmt(fused_graph)} ms")


def _all_on_cudnn(record: dict[str, Any], run: str, planned_layout: str) -> list[str]:
    """The line for an end-to-end record whose fastest plan (``planned_layout``, a :data:`LAYOUT_SUFFIXES` key) put
    every conv on cuDNN: sparsity gains nothing in the run, whatever that plan gains or loses against the dense model;
    with each other layout's plan (:func:`layout_times`) that puts convs on sparse backends, and its time. Empty for a
    plan with any conv off cuDNN, or a record without backend counts."""
    suffix = LAYOUT_SUFFIXES[planned_layout]
    if not record.get("backend_counts" + suffix) or sparse_convs(record, suffix):
        return []
    times = layout_times(record, "planned")
    line = (f"- {run}: the planned model's {comparative(len(times))} layout "
            f"({LAYOUT_WORDS[planned_layout]}) runs every conv on cuDNN, so sparsity gains nothing in this run")
    for layout, ms in times.items():
        off = sparse_convs(record, LAYOUT_SUFFIXES[layout]) if layout != planned_layout else {}
        if off:
            convs = sum(record["backend_counts" + LAYOUT_SUFFIXES[layout]].values())
            line += (f"; the {LAYOUT_WORDS[layout]} plan, with {len(off)} of {convs} convs on sparse kernels, takes "
                     f"{_fmt(ms)} ms")
    return [line + "."]


def geomean(values: Sequence[float]) -> float | None:
    """Geometric mean of positive values; None for an empty sequence."""
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


VGG16_TARGET_INPUTS = (224, 112, 56, 28)
"""Input heights of the VGG16 3x3 layers issue 5's FP32 target covers; a run missing one cannot meet it."""


def evaluate_targets(result: dict[str, Any]) -> dict[str, Any]:
    """Issue 5's targets computed from the measured records (batch 128, H100, sparsity 0.9).

    * ``vgg16_fp32_2x``: per VGG16 3x3 layer with input 224..28, direct FP32 vs cuDNN FP32 (TF32 off) >= 2; met
      only if every input size of :data:`VGG16_TARGET_INPUTS` was measured (``missing_inputs`` lists those not).
    * ``escoin_geomean``: geometric mean over non-stem layers of AlexNet, GoogLeNet and ResNet-50 of
      direct vs im2col + cuBLAS (>= 2.63) and vs im2col + cuSPARSE (>= 3.07), FP32.
    * ``end_to_end``: the planned model in its fastest layout not slower than the dense model in its fastest layout
      (:func:`fastest_ms`: NCHW, NHWC where recorded, switched where both were timed switched; :data:`PLAN_MARGIN`
      noise allowance), per model and precision.

    Each target also lists under ``not_run`` what the run left out of its records (:func:`unmeasured`: stopped by
    the time budget, or failed), and ``held`` says whether the records measured meet it; it is ``met`` only where
    it held and none is left out, since a left-out record may miss it.
    """
    gaps = unmeasured(result)
    layers = [r for r in result["layers"] if r["batch"] == 128 and abs(r["target_sparsity"] - 0.9) < 1e-9]
    vgg = [r for r in layers if r["model"] == "vgg16" and r["precision"] == "fp32"
           and r["weight_shape"][2:] == [3, 3] and 28 <= r["in_chw"][1] <= 224]
    vgg_rows = [{"layer": r["layer"], "in_chw": r["in_chw"], "speedup": r["speedup_vs_cudnn"],
                 "met": r["speedup_vs_cudnn"] is not None and r["speedup_vs_cudnn"] >= 2} for r in vgg]
    missing = sorted(set(VGG16_TARGET_INPUTS) - {r["in_chw"][1] for r in vgg}, reverse=True)
    vgg_gaps = [g["what"] for g in gaps["layers"] if g["model"] == "vgg16" and g["precision"] == "fp32"]
    targets: dict[str, Any] = {"vgg16_fp32_2x": judged(bool(vgg_rows) and not missing
                                                       and all(r["met"] for r in vgg_rows), vgg_gaps,
                                                       layers=vgg_rows, missing_inputs=missing)}
    escoin = [r for r in layers if r["model"] in ESCOIN_MODELS and r["precision"] == "fp32" and not r["stem"]]
    escoin_gaps = [g["what"] for g in gaps["layers"] if g["model"] in ESCOIN_MODELS and g["precision"] == "fp32"]
    for name, goal in ESCOIN_TARGETS.items():
        speedups = [r[f"speedup_vs_{name}"] for r in escoin for _ in range(r["count"])
                    if r[f"speedup_vs_{name}"] is not None]
        value = geomean(speedups)
        targets[f"escoin_geomean_vs_{name}"] = judged(value is not None and value >= goal, escoin_gaps,
                                                      geomean=value, goal=goal, layers=len(speedups))
    e2e = [{"model": r["model"], "precision": r["precision"],
            "speedup": fastest_ms(r, "dense") / fastest_ms(r, "planned"),
            "met": fastest_ms(r, "planned") <= (1 + PLAN_MARGIN) * fastest_ms(r, "dense")}
           for r in result["end_to_end"]]
    targets["end_to_end_not_slower"] = judged(bool(e2e) and all(r["met"] for r in e2e), gaps["end_to_end"], runs=e2e)
    return targets


def judged(held: bool, not_run: list[str], **fields: Any) -> dict[str, Any]:
    """A target of :func:`evaluate_targets`: ``fields``, then ``held`` (the records measured meet it), ``not_run``
    and ``met`` (held, and nothing bearing on it left out)."""
    return {**fields, "held": held, "not_run": not_run, "met": held and not not_run}


def unmeasured(result: dict[str, Any]) -> dict[str, list[Any]]:
    """What a bench result's run left out (its ``stopped_early`` descriptions and ``failed`` entries' ``what``),
    split by the targets they bear on.

    Returns:
        ``{"layers": [...], "end_to_end": [...]}``: per-layer settings of batch 128 at sparsity 0.9 as dicts
        ``{"what", "model", "precision"}`` (``run_bench`` describes one as ``"<model> <layer> s<sparsity>
        b<batch> <precision>"``), and the descriptions of end-to-end runs (``"end to end <model> <precision>"``,
        ``"trained model <file> b<batch>"``).
    """
    left_out = [*result.get("stopped_early", []), *(entry["what"] for entry in result.get("failed", []))]
    end_to_end = [what for what in left_out if what.startswith(("end to end ", "trained model "))]
    layers = []
    for what in left_out:
        words = what.split(" ")
        if what not in end_to_end and len(words) == 5 and words[2:4] == ["s0.9", "b128"]:
            layers.append({"what": what, "model": words[0], "precision": words[4]})
    return {"layers": layers, "end_to_end": end_to_end}


def layout_times(record: dict[str, Any], model: str, switched: bool = True) -> dict[str, float]:
    """Layout (``"nchw"``, ``"nhwc"``, ``"switched"``) -> time (ms) of an end-to-end record's ``"dense"``,
    ``"planned"`` or ``"dense_fused"`` model, for the layouts it was timed in with an output that passed: NCHW (always
    for the first two), channels-last where recorded (records before the thirteenth session have none), and switched
    after the first max pool only where the run also timed the eager dense model switched (``dense_switched_ms``,
    runs since the fifty-third session; earlier runs timed only the planned and the fused dense models switched), so
    both sides of a ratio choose among the same layouts; ``switched=False`` leaves it out (the single layouts).

    Raises:
        ValueError: a ``"dense"`` or ``"planned"`` model without its NCHW time (``dense_ms``/``planned_ms`` null).
    """
    layouts = ("nchw", "nhwc", "switched") if switched and counts_switched(record) else ("nchw", "nhwc")
    times = {layout: record.get(f"{model}{LAYOUT_SUFFIXES[layout]}_ms") for layout in layouts}
    if model != "dense_fused" and times["nchw"] is None:
        raise ValueError(f"end-to-end record {record.get('model')!r}: {model}_ms is null, expected a time in ms")
    return {layout: ms for layout, ms in times.items() if ms is not None}


def fastest_layout(record: dict[str, Any], model: str) -> str:
    """The layout of :func:`layout_times` in which the record's ``model`` is fastest (NCHW on a tie)."""
    times = layout_times(record, model)
    return min(times, key=times.__getitem__)


def fastest_ms(record: dict[str, Any], model: str, switched: bool = True) -> float:
    """The fastest layout's time (ms) of an end-to-end record's ``"dense"`` or ``"planned"`` model
    (:func:`layout_times`; ``switched=False``: of its single layouts)."""
    return min(layout_times(record, model, switched).values())


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def compiled_ahead(record: dict[str, Any]) -> str:
    """What a ``compile_ahead`` record of :func:`~unsparse.runtime.bench.run_bench` compiled, in words: "161 kernels
    of 13 layers", or "16 of 109 kernels of 9 layers" where the time budget left ``skipped`` kernels unstarted
    (records before the budget reached the compile have no ``skipped``), "... of the whole model" for the convs of a
    model timed end to end (``end_to_end``), and "(with the settings a plan already chose for 38 of them)" where a
    resumed run also compiled its planned layers' kernels (``planned_layers``); "161 kernels, those of several
    programs too, of 13 layers" where it compiled those beside the probes (``shared``)."""
    skipped = record.get("skipped", 0)
    done = f"{record['kernels'] - skipped} of {record['kernels']}" if skipped else f"{record['kernels']}"
    planned = record.get("planned_layers", 0)
    kernels = "kernels, those of several programs too," if record.get("shared", False) else "kernels"
    return (f"{done} {kernels} of {record['layers']} layers" + " of the whole model" * record.get("end_to_end", False)
            + f" (with the settings a plan already chose for {planned} of them)" * bool(planned))


def _no_speedup(records: Sequence[dict[str, Any]], key: str, base: str) -> str:
    """Why per-layer ``records`` lack the speedup ``key``: ``no direct time on 2, no cuDNN alone time on 1`` (the
    sparse backend, else the baseline ``base``, had no correct timed setting, or was not run), ``""`` where none
    lacks it."""
    missing = [r for r in records if r.get(key) is None]
    sparse = Counter(backend for r in missing
                     if r["best_ms"].get(backend := r.get("sparse_backend", "direct")) is None)
    parts = [f"no {backend} time on {count}" for backend, count in sparse.items()]
    parts += [f"no {base} time on {len(missing) - sparse.total()}"] if len(missing) > sparse.total() else []
    return ", ".join(parts)


def _error_text(error: float | None) -> str:
    """An end-to-end record's relative error for its table cell: ``1.23e-04``, or ``not finite`` for null (a NaN or
    infinite error, which ``bench.json`` holds as null: :func:`~unsparse.runtime.bench.for_json`)."""
    return "not finite" if error is None else f"{error:.2e}"


def weights_text(result: dict[str, Any]) -> str:
    """What the weights of a result's records are: ``result["weights"]`` (how the synthetic ones were made) where any
    per-layer or end-to-end record is synthetic, and the files of trained end-to-end records."""
    trained = list(dict.fromkeys(r["model"] for r in result["end_to_end"] if r.get("weights") == "trained"))
    synthetic = bool(result["layers"]) or any(r.get("weights") != "trained" for r in result["end_to_end"])
    parts = [result["weights"]] if synthetic else []
    parts += [f"trained: {', '.join(trained)} (end-to-end rows marked trained)"] if trained else []
    return "; ".join(parts) or "no records"


def _rotated_bytes(record: dict[str, Any]) -> int | None:
    """Bytes of the input sets a per-layer record's timed calls cycled through (its timings' ``rotation`` times one
    input's bytes), None if no setting was timed."""
    rotations = [m["timing"]["rotation"] for m in record.get("comparison", {}).get("measurements", [])
                 if m.get("timing")]
    if not rotations:
        return None
    channels, height, width = record["in_chw"]
    return max(rotations) * record["batch"] * channels * height * width * PRECISIONS[record["precision"]].dtype.itemsize


def rotation_text(result: dict[str, Any]) -> str:
    """What the timed calls' inputs were, for the page's protocol line. Per-layer records cycle through input sets
    (:func:`~unsparse.runtime.timing.rotation_count`: enough to exceed twice the L2 cache, at most 16), so their
    inputs come from beyond L2 except where 16 sets of a small input fit in it: counted from each record's rotation
    and input size against the GPU's recorded ``l2_bytes`` (not counted where that is missing). End-to-end records
    call the model on one input every time (:func:`~unsparse.runtime.end_to_end.bench_end_to_end`: its timings' rotation
    is 1). A result of per-layer records only, all from beyond L2, reads ``inputs rotated beyond L2``, as before
    end-to-end inputs were told apart."""
    l2 = result["environment"].get("l2_bytes")
    sizes = [size for size in map(_rotated_bytes, result["layers"]) if size is not None]
    fit = sum(size <= l2 for size in sizes) if l2 else 0
    if not l2:
        layers = "inputs rotated (at most 16 sets; L2 size not recorded)"
    elif fit == len(sizes) > 0:
        layers = "inputs rotated (at most 16 sets, which fit in L2)"
    else:
        layers = "inputs rotated beyond L2" + (f" in {len(sizes) - fit} of {len(sizes)} timed records (the others' "
                                               "sets, at most 16, fit in it)" if fit else "")
    if not result["end_to_end"]:
        return layers
    return (f"per-layer {layers}; " if result["layers"] else "") + "end-to-end runs on one input, not rotated"


def largest_batch(result: dict[str, Any]) -> int:
    """The largest batch of a result's per-layer records (0 without any): the batch the speedup and breakdown plots
    show."""
    return max((record["batch"] for record in result["layers"]), default=0)


PLOTS = {
    "speedup": "the sparse kernel's speedup over cuDNN alone (best layout) of the same precision, per layer against "
               "sparsity, batch {batch}, one panel per model and precision (synthetic weights); above the dashed line "
               "at 1 the sparse kernel is faster.",
    "breakdown": "summed FP32 (TF32 off) conv layer time per model and backend at sparsity 0.9, batch {batch}, log "
                 "scale (each layer times its count; cuDNN alone for cuDNN; no bar: not measured).",
    "end_to_end": "whole-model time (ms, eager) per end-to-end run: the dense model (cuDNN) and the planned one, each "
                  "in NCHW and channels-last, and in runs that timed every model switched after the first max pool "
                  "(since the fifty-third session) switched too (no bar: not run).",
}
"""What each of :func:`plot_results`'s plots shows, by the name it ends in (``<kind>.png``), for the page."""


def plot_kind(name: str) -> str:
    """The :data:`PLOTS` key of a plot file name (``run_s0.9_speedup.png`` -> ``speedup``).

    Raises:
        ValueError: naming the file, if its name ends in none of :data:`PLOTS`' ``<kind>.png``.
    """
    for kind in PLOTS:
        if name.endswith(f"{kind}.png"):
            return kind
    raise ValueError(f"plot {name}: not one of plot_results' plots ({', '.join(f'{k}.png' for k in PLOTS)})")


def linked_plots(page: Path, name: str) -> list[str]:
    """The plot files ``<name>_<kind>.png`` (:data:`PLOTS` order) that the Markdown ``page`` links and that exist
    beside it: what a re-render without new plots keeps linking (none for a page not written yet). A link is looked
    for as :func:`markdown_report` writes it, percent-encoded (``run%201_speedup.png`` for ``run 1``)."""
    text = page.read_text(encoding="utf-8") if page.is_file() else ""
    return [f"{name}_{kind}.png" for kind in PLOTS
            if f"]({quote(f'{name}_{kind}.png')})" in text and (page.parent / f"{name}_{kind}.png").is_file()]


def markdown_report(result: dict[str, Any], plots: Sequence[str | Path] = ()) -> str:
    """Markdown tables: environment, targets, every per-layer record, end-to-end runs; with ``plots`` (the files
    :func:`plot_results` wrote beside the page: names, or paths of which the name is linked) a section that links
    each and says what it shows. Without, the page is the one pages rendered before plots were linked.

    Raises:
        ValueError: for a plot that is not one of :func:`plot_results`' (see :func:`plot_kind`).
    """
    env = result["environment"]
    lines = ["# UnSparse benchmark", "", f"GPU: {env.get('gpu')}; driver {env.get('driver')}; torch {env['torch']}; "
             f"CUDA {env['cuda']}; cuDNN {env.get('cudnn')}; CuPy {env.get('cupy')}; commit {env['commit']}; "
             f"{env['date_utc']}.", "", f"Weights: {weights_text(result)}. Medians of {result['runs']} runs (ms), "
             f"CUDA events, {rotation_text(result)}. FP32 columns have TF32 off.", ""]
    if any("baseline" not in r for r in result["layers"]):
        lines += ["Some records predate the cuDNN-alone baseline (twelfth session): their speedups are against the "
                  "cuDNN call (bias added in a separate pass, NCHW) and appear as direct/cuDNN call only; targets "
                  "read from them say not measured.", ""]
    if result.get("timing") == "graph":
        lines += ["Per-layer times are CUDA-graph replays of each call: GPU time only, without the host's per-call "
                  "work (Python, dispatch, launch), which eager calls at small batches mostly measure.", ""]
    lines += ["## Targets (issue 5)", ""]
    targets = result["targets"]

    def verdict(target: dict[str, Any], measured: bool) -> str:
        """``met``, ``missed``, ``not measured in this run``, or ``not shown: ...`` where the records measured
        meet the target (``held``) but the run left some out (``not_run``)."""
        if not measured:
            return "not measured in this run"
        if target["held"] and target["not_run"]:
            return f"not shown: met by the records measured, {len(target['not_run'])} left out of the run (below)"
        return "met" if target["met"] else "missed"

    vgg = targets["vgg16_fp32_2x"]
    missing = vgg.get("missing_inputs", [])
    lines.append("- VGG16 3x3 layers 224..28, FP32, b128, 0.9: direct >= 2x cuDNN: "
                 f"**{verdict(vgg, any(r['speedup'] is not None for r in vgg['layers']))}**"
                 + (f" (no layer measured at input {', '.join(map(str, missing))})" if missing and vgg["layers"]
                    else ""))
    lines += [f"  - {r['layer']} {r['in_chw']}: {_fmt(r['speedup'], 2)}x" for r in vgg["layers"]]
    for name in ESCOIN_TARGETS:
        t = targets[f"escoin_geomean_vs_{name}"]
        lines.append(f"- geomean direct vs {name} (AlexNet/GoogLeNet/ResNet-50 non-stem layers, FP32, b128, 0.9, "
                     f"{t['layers']} layers): {_fmt(t['geomean'], 2)}x, goal {t['goal']}x: "
                     f"**{verdict(t, bool(t['layers']))}**")
    e2e = targets["end_to_end_not_slower"]
    noise = sum(_slower(fastest_ms(r, "planned"), fastest_ms(r, "dense"), PLAN_MARGIN) == "slower"
                for r in result["end_to_end"])
    lines.append(f"- end to end, planned not slower than dense: "
                 f"**{verdict(e2e, bool(e2e['runs']))}**"
                 + (f" ({noise} of {len(e2e['runs'])} runs slower, {noise_text(PLAN_MARGIN)})" if noise else ""))
    killed = result.get("complete") is False and not result.get("stopped_early") and not result.get("failed")
    if result.get("stopped_early") or result.get("failed") or killed:
        lines += ["", "## Not measured", ""]
        lines += [f"- stopped by the time budget before: {what}" for what in result.get("stopped_early", [])]
        lines += [f"- FAILED: {f['what']}: {f['error']}" for f in result.get("failed", [])]
        if killed:
            lines.append("- **the run was cut off** (`complete` is false: killed before its end, e.g. by a time "
                         "limit): the records below are those it wrote, and what it would have measured next is "
                         "missing")
    lines += ["", "## Where sparse is slower", ""]
    heading = len(lines)
    for precision in PRECISIONS:
        records = [r for r in result["layers"] if r["precision"] == precision]
        for key, against, base in (("speedup_vs_cudnn", "cuDNN (alone, best layout)", "cuDNN alone"),
                                   ("speedup_vs_cudnn_call", "the cuDNN call (records before the baseline)",
                                    "cuDNN call")):
            speedups = [r[key] for r in records if r.get(key) is not None]
            if speedups:
                slower = sum(value < 1 for value in speedups)
                missing = _no_speedup(records, key, base)
                lines.append(f"- {precision}: {PRECISIONS[precision].sparse} is SLOWER than {against} on {slower} of "
                             f"{len(speedups)} layer settings (geomean direct/cuDNN speedup "
                             f"{_fmt(geomean(speedups), 2)}x, best {_fmt(max(speedups), 2)}x, worst "
                             f"{_fmt(min(speedups), 2)}x)"
                             + (f"; no speedup on {len(records) - len(speedups)} more: {missing}." if missing else
                                "."))
                break
        else:
            if records:
                lines.append(f"- {precision}: no speedup on any of its {len(records)} layer settings: "
                             f"{_no_speedup(records, 'speedup_vs_cudnn', 'cuDNN alone')}.")
    lines += _slower_end_to_end(result["end_to_end"])
    if len(lines) == heading:
        lines.append("- nothing in this run: no layer setting ran slower than cuDNN, and no whole model's plan "
                     "slower than the dense models timed beside it.")
    if plots:
        lines += ["", "## Plots", ""]
        for plot in plots:
            name = Path(plot).name
            kind = plot_kind(name)
            lines += [f"{name}: {PLOTS[kind].format(batch=largest_batch(result))}", "",
                      f"![{kind.replace('_', ' ')}]({quote(name)})", ""]
        lines.pop()
    if result.get("compile_ahead"):
        lines += ["", "## Kernels compiled ahead", "",
                  "Kernels that CuPy finds in its kernel cache on disk (`CUPY_CACHE_DIR`, by default "
                  "`~/.cupy/kernel_cache`), compiled by an earlier process on the machine from the same source and "
                  "options, are loaded instead of compiled: these seconds depend on what ran there before.", ""] + [
            f"- {a['model']} at {a['sparsity']}: {compiled_ahead(a)} compiled together before any was timed, in "
            f"{_fmt(a['seconds'], 1)} s" + (" (a layer's direct compile s counts what was left)." if result["layers"]
                                            else ".")
            for a in result["compile_ahead"]]
    lines += _planning_lines(result["end_to_end"])
    if result["layers"]:
        lines += _layer_table(result["layers"])
    if result["end_to_end"]:
        lines += _end_to_end_table(result["end_to_end"])
    trained = [(r, layer) for r in result["end_to_end"] for layer in r.get("layers", [])]
    if trained:
        lines += ["", "## Trained model, per layer (every backend, ms)", "",
                  "Times of the planner's per-layer comparison (inputs rotated, at most 16 sets). Fastest: the "
                  "backend of the fastest time; planned: the one the plan kept for the key, the dense default unless "
                  f"the fastest beat it by more than {100 * PLAN_MARGIN:.0f} % and the end-to-end check kept the plan "
                  "(—: not recorded in this result).", "",
                  "| batch | layer key | fastest | planned | cuDNN alone | cuDNN call | direct | im2col+cuBLAS "
                  "| im2col+cuSPARSE |", "|" + "---|" * 9]
        for r, layer in trained:
            best = layer["best_ms"]
            alone = (layer.get("baseline") or {}).get("median_ms")
            lines.append(f"| {r['batch']} | `{layer['key']}` | {layer['best']} | {layer.get('planned', '—')} | "
                         f"{_fmt(alone)} | "
                         f"{_fmt(best.get('cudnn'))} | "
                         f"{_fmt(best.get('direct'))} | {_fmt(best.get('im2col_cublas'))} | "
                         f"{_fmt(best.get('im2col_cusparse'))} |")
    return "\n".join(lines) + "\n"


def _layer_table(records: Sequence[dict[str, Any]]) -> list[str]:
    """The "Per layer" section of :func:`markdown_report`: one row per layer setting."""
    compile_column = any("direct_compile_s" in r for r in records)  # older results render as they did
    lines = ["", "## Per layer", "", "cuDNN alone: the convolution without bias, input and weight already in the "
             "layout named and the output left in it (`unsparse.runtime.baseline`); direct/cuDNN is against it. "
             "cuDNN call: `F.conv2d` as an NCHW model calls it (bias added in a separate kernel; its channels-last "
             "setting converts inside the call), the figure results before the twelfth session compared with."
             + (" Direct compile s: seconds the sparse backend compiled kernels before timing (near 0 where CuPy's "
                "kernel cache held them; '-' for a backend that compiles nothing ahead)." if compile_column else ""),
             "", "| model | layer | n | C,H,W | weight | stride | batch | prec | sparsity | L "
             "| cuDNN alone | layout | cuDNN call | direct | im2col+cuBLAS | im2col+cuSPARSE | direct/cuDNN "
             "| direct/cuDNN call | direct TFLOP/s | direct params |" + " direct compile s |" * compile_column,
             "|" + "---|" * (20 + compile_column)]
    for r in records:
        best = r["best_ms"]
        sparse_ms = best.get(r.get("sparse_backend", "direct"))
        baseline = r.get("baseline") or {}
        lines.append(f"| {r['model']} | {r['layer']} | {r['count']} | {r['in_chw']} | {r['weight_shape']} | "
                     f"{r['geometry']['stride']} | {r['batch']} | {r['precision']} | {r['sparsity']:.3f} | "
                     f"{r['row_length']} | {_fmt(baseline.get('median_ms'))} | {baseline.get('layout') or '-'} | "
                     f"{_fmt(best.get('cudnn'))} | {_fmt(sparse_ms)} | "
                     f"{_fmt(best.get('im2col_cublas'))} | {_fmt(best.get('im2col_cusparse'))} | "
                     f"{_fmt(r['speedup_vs_cudnn'], 2)} | {_fmt(r.get('speedup_vs_cudnn_call'), 2)} | "
                     f"{_fmt(r['direct_useful_tflops'], 1)} | {json.dumps(r['direct_params'])} |"
                     + (f" {_fmt(r.get('direct_compile_s'), 1)} |" if compile_column else ""))
    return lines


def _planning_lines(records: Sequence[dict[str, Any]]) -> list[str]:
    """A line per end-to-end record that says what its planning compiled and screened (records since the fifty-sixth
    session: ``planning_compile_s``, ``layers_screened``) and how many entries its plan held when it began
    (``plan_entries_reused``: read from a saved plan, whose earlier runs' compiles are not counted here, or left by an
    earlier run of the same process, possibly for another model or precision, whose layers it does not reuse);
    none for older records (which have no ``planning_compile_s``) or where nothing was compiled, screened or
    reused."""
    shown = [r for r in records if "planning_compile_s" in r
             and (r["planning_compile_s"] or r.get("layers_screened") or r.get("plan_entries_reused"))]
    if not shown:
        return []
    return ["", "Planning, per whole-model run (layer keys of both layouts; kernels compiled while comparing, beyond "
                "those compiled ahead; a backend's settings screened out are not built, `SCREEN_RATIO`; the entries a "
                "plan held when the run began were compared by earlier runs, whose compiles these seconds do not "
                "count):", ""] + [
        f"- {r['model']} {precision_label(r)} b{r['batch']}: {r['layers_planned_now']} layer keys compared, "
        f"{_fmt(r['planning_compile_s'], 1)} s of compiles, settings screened out on {r['layers_screened']}"
        + (f"; the plan held {r['plan_entries_reused']} entries when it began" if r.get("plan_entries_reused")
           else "")
        for r in shown]


def _end_to_end_table(records: Sequence[dict[str, Any]]) -> list[str]:
    """The "End to end" section of :func:`markdown_report`: one row per model and precision timed whole."""
    lines = ["", "## End to end", "", "Eager times include the host's per-layer work; CUDA-graph times replay the "
             "same forward without it (GPU time only), so where the two speedups differ the model is host-bound.", "",
             "NHWC: the model and its input in channels-last from end to end (a planned model's layers then receive "
             "and return NHWC; the direct kernels' conversions are part of their planned time). Speedup (NCHW): "
             "planned over dense, both NCHW; best planned / best dense: the faster layout of each"
             + (" (of three in the runs that timed every model switched too, \"Layout switched\" below; best "
                "planned / dense fused likewise)" if any(map(counts_switched, records)) else "")
             + ".", ""]
    fused = [r for r in records if r.get("fused_relu") or r.get("fused_max_pool")]
    if fused:
        planned = sum(bool(r.get("fusion_planned")) for r in fused)
        timed = ("" if not planned else "The per-layer comparisons timed each fused layer with what it is fused with"
                 + ("" if planned == len(fused) else " in the rows that say 'planned fused', the convolution alone in "
                    "the others") + ". ")
        direct = ("the ReLU, at a residual block's end after the residual add; their wide tilings and split-K "
                  "settings, and with the add their half2 tilings, in passes"
                  if any(r.get("direct_fuses_residual") and r.get("fused_residual") for r in fused) else
                  "the ReLU; their wide tilings and split-K settings in a pass")
        kernels = (f"the direct kernels ({direct} after them) and " if any(r.get("direct_fuses_relu") for r in fused)
                   else "") + "the generated kernels in their epilogue"
        where = (f"{kernels}, cuDNN the ReLU in its call (the pool in a pass after it), the other backends in a pass "
                 "after the conv" if any(r.get("cudnn_fuses_relu") for r in fused) else
                 f"{kernels}, the other backends (cuDNN among them) in a pass after the conv")
        lines += ["ReLU (max pool) fused into K convs: the planned model's convs apply the ReLU (the 2x2 max pool) "
                  f"that follows them, {where}; the dense model runs its ReLUs and pools apart, as PyTorch does. "
                  f"{timed}Unfused: the same plan without fusion, NCHW, eager, timed in the same run.", ""]
    policies = {fold_policy(r) for r in records if _shows_folds(r)}
    if policies:
        where = ("" if "epilogue" not in policies else " (in the rows that say 'epilogue' only into the layers whose "
                 "planned backend adds the bias in its epilogue, direct or generated, each layout's plan its own: "
                 "a layer planned on cuDNN keeps its BatchNorm, since PyTorch adds cuDNN's bias in a pass of its own)")
        lines += ["BatchNorm folded into K convs: each eval-mode BatchNorm after a conv is folded into the conv's "
                  f"weights and bias (no pass of its own), in the planned model{where} and in the dense fused one "
                  "(which, where no conv is followed by a ReLU it can fuse, is the dense model with its BatchNorms "
                  "folded and nothing more), not in the eager dense model.", ""]
    fused_dense = any("dense_fused_ms" in r for r in records)
    if fused_dense:
        residual = (" (at a residual block's end the convolution, its bias, the residual add and the ReLU: "
                    "`torch.cudnn_convolution_add_relu`, as the planned model's cuDNN layers do)"
                    if any(r.get("fused_residual") for r in records) else "")
        lines += ["Dense fused: the dense model with each convolution, its bias and its ReLU in one cuDNN call "
                  f"(`torch.cudnn_convolution_relu`; its pools still apart){residual}, eager, in its "
                  f"{comparative(3 if any(map(counts_switched, records)) else 2)} layout, "
                  "timed in the same run: the dense model a deployment could run instead of PyTorch's eager one. "
                  "Best planned / "
                  "dense fused below 1: the sparse model is slower than it (see \"Where sparse is slower\", which "
                  "says SLOWER beyond the noise margin); none fused: the model has no conv followed by a ReLU; "
                  "refused: cuDNN had no fused engine; off: its output disagreed.", ""]
    if any(r.get(field) for r in records for field in ("dense_fused_passes", "dense_fused_nhwc_passes",
                                                         "epilogue_passes", "epilogue_passes_nhwc")):
        lines += ["Epilogue as passes: where cuDNN's fused call timed slower on a layer than its convolution followed "
                  "by the bias, residual add and ReLU as passes, that layer runs the passes, in the dense fused model "
                  "(each layout timed on its own: 'N as passes') and in a plan (a cuDNN setting the comparator timed: "
                  "'ReLU as passes after cuDNN' names the layers).", ""]
    fused_head = "| dense fused ms (layout) | best planned / dense fused " if fused_dense else ""
    lines += ["| model | weights | batch | prec | dense ms | dense NHWC ms | planned ms | planned NHWC ms "
              "| speedup (NCHW) | best planned / best dense " + fused_head + "| dense ms (graph) | planned ms (graph) "
              "| speedup (graph) | dense NHWC ms (graph) | planned NHWC ms (graph) | rel. error | backends (NCHW plan) "
              "| backends (NHWC plan) |", "|" + "---|" * (20 if fused_dense else 18)]
    for r in records:
        best = fastest_ms(r, "dense") / fastest_ms(r, "planned")
        fused_cells = ""
        if fused_dense:
            fused_cells = f"{_dense_fused_cell(r)} | {_fmt(r.get('best_speedup_vs_dense_fused'), 2)} | "
        lines.append(f"| {r['model']} | {r['weights']} | {r['batch']} | {precision_label(r)} | {_fmt(r['dense_ms'])} | "
                     f"{_fmt(r.get('dense_nhwc_ms'))} | {_fmt(r['planned_ms'])} | {_fmt(r.get('planned_nhwc_ms'))} | "
                     f"{_fmt(r['speedup'], 2)} | {_fmt(best, 2)} | " + fused_cells
                     + f"{_fmt(r.get('dense_graph_ms'))} | "
                     f"{_fmt(r.get('planned_graph_ms'))} | {_fmt(r.get('graph_speedup'), 2)} | "
                     f"{_fmt(r.get('dense_nhwc_graph_ms'))} | {_fmt(r.get('planned_nhwc_graph_ms'))} | "
                     f"{_error_text(r['rel_error'])} | {r.get('backend_counts', '')}{_off_cudnn(r)}"
                     + _fusion_text(r) + _passes_text(r) + " | "
                     f"{r.get('backend_counts_nhwc') or '-'}{_off_cudnn(r, '_nhwc')}" + _passes_text(r, "_nhwc")
                     + ("; " + _fold_text(r, "_nhwc") if fold_policy(r) == "epilogue" and r.get("backend_counts_nhwc")
                        else "")
                     + " |")
    unasked = [f"{r['model']} {precision_label(r)} b{r['batch']}" for r in records
               if r.get("channels_last_plan") == "not asked"]
    if unasked:
        lines += ["", "Planned in NCHW only, as the run asked (`end_to_end_channels_last` false): "
                  f"{', '.join(unasked)}; their planned NHWC and switched times were not measured, not found slower."]
    return lines + _switched_lines(records)


def _switched_lines(records: Sequence[dict[str, Any]]) -> list[str]:
    """The records' times with the layout switched after the first max pool (``layout_switch``; NCHW before it,
    channels-last after it: :func:`~unsparse.runtime.end_to_end.bench_end_to_end`), planned against the dense fused
    model switched alike, beside each one's faster single layout; "SLOWER" or "slower" where the switched planned
    model loses beyond or within :data:`PLAN_MARGIN`. Empty where no record switched."""
    switched = [r for r in records if r.get("layout_switch") or r.get("dense_fused_layout_switch")]
    if not switched:
        return []
    counted = ("; timed in the same run. Where a line gives the eager dense model's switched time too, the ratios "
               "above count switched as a third layout of every model; in the other runs it enters none of them."
               if any(map(counts_switched, switched)) else "; timed in the same run, in none of the "
               "ratios above.")
    lines = ["", "Layout switched: the planned model and the dense fused model fed NCHW, in NCHW up to the model's "
             "first max pool and in channels-last after it (the planned model's layers after it run the channels-last "
             "plan's entries" + ("; a planned model whose pools are fused switches after the conv that applies the "
                                 "first one" if any(r.get("layout_switch") and r.get("dense_fused_layout_switch")
                                                    and r["layout_switch"] != r["dense_fused_layout_switch"]
                                                    for r in switched) else "")
             + f"){counted}", ""]
    for r in switched:
        planned_switch, dense_switch = r.get("layout_switch"), r.get("dense_fused_layout_switch")
        run = f"- {r['model']} {precision_label(r)} b{r['batch']}, switched after `{planned_switch or dense_switch}`"
        if planned_switch and dense_switch and dense_switch != planned_switch:
            run += f" (the dense fused model after `{dense_switch}`)"
        planned, dense = r.get("planned_switched_ms"), r.get("dense_fused_switched_ms")
        if planned is None or dense is None:
            why = r.get("dense_fused_switched_error") or "not timed or its output disagreed"
            lines.append(f"{run}: planned {_fmt(planned)} ms, dense fused {_fmt(dense)} ms (none: {why}).")
            continue
        fused_single = layout_times(r, "dense_fused", switched=False)
        single = (f"; in its faster single layout the planned model takes "
                  f"{_fmt(fastest_ms(r, 'planned', switched=False))} ms"
                  + (f", the dense fused model {_fmt(min(fused_single.values()))} ms" if fused_single else "") + ".")
        if "dense_fused_layout_switch" not in r:  # timed before the fix that kept its stem in NCHW
            lines.append(f"{run}: planned {_fmt(planned)} ms; dense fused {_fmt(dense)} ms, but its stem computed "
                         "channels-last (a run from before the switched dense model kept its NCHW weights; not an "
                         "NCHW stem)" + single)
            continue
        verdict = _slower(planned, dense, PLAN_MARGIN)
        eager = f", eager dense {_fmt(r['dense_switched_ms'])} ms" if counts_switched(r) else ""
        graphs = [r.get(f"{model}_switched_graph_ms") for model in ("planned", "dense_fused")]
        graph = (f"; as CUDA graphs {_fmt(graphs[0])} against {_fmt(graphs[1])} ms ({_fmt(graphs[1] / graphs[0], 2)}x)"
                 if all(graphs) else "")
        lines.append(f"{run}: planned {_fmt(planned)} ms, dense fused {_fmt(dense)} ms{eager}, "
                     f"{_fmt(dense / planned, 2)}x"
                     + (f" ({verdict}" + (f", {noise_text(PLAN_MARGIN)}" if verdict == "slower" else "") + ")"
                        if verdict else "") + graph + _switched_sparse_text(r) + single)
    return lines


def _switched_sparse_text(record: dict[str, Any]) -> str:
    """``; N of M convs on sparse kernels: NAME (BACKEND), ...`` for the switched planned model of an end-to-end record
    (``backend_counts_switched``, runs since the fifty-second session), ``""`` for a record without them."""
    counted = sparse_conv_count(record, "_switched")
    if counted is None:
        return ""
    sparse = sparse_convs(record, "_switched")
    return (f"; {counted[0]} of {counted[1]} convs on sparse kernels"
            + (": " + ", ".join(f"{name} ({backend})" for name, backend in sparse.items()) if sparse else ""))


def _dense_fused_cell(record: dict[str, Any]) -> str:
    """The end-to-end row's fused dense model: its time and layout, or why there is none."""
    fused = dense_fused_ms(record)
    if fused is not None:
        layout = record["best_dense_fused_layout"]
        passes = record.get(f"dense_fused{LAYOUT_SUFFIXES[layout]}_passes")  # none recorded for switched
        return f"{_fmt(fused)} ({layout}{f', {passes} as passes' if passes else ''})"
    if record.get("dense_fused_convs") == 0 and not record.get("dense_folded_batch_norm"):
        return "none fused"
    if record.get("dense_fused_error"):
        return "refused"
    return "off" if record.get("dense_fused_rel_error") is not None else "-"


def _passes_text(record: dict[str, Any], suffix: str = "") -> str:
    """The end-to-end row's note on the layers of one layout's plan (``suffix`` ``""`` NCHW, ``"_nhwc"``) that run
    their fused ReLU as passes after cuDNN's convolution; empty where none does."""
    names = record.get("epilogue_passes" + suffix)
    return f"; ReLU as passes after cuDNN: {', '.join(names)}" if names else ""


def _fusion_text(record: dict[str, Any]) -> str:
    """The end-to-end row's note on folded BatchNorms, fused ReLUs, residual adds and max pools: how many, and the
    same plan unfused timed in the same run."""
    fused = [f"{what} fused into {record[field]} convs" for what, field in (("ReLU", "fused_relu"),
                                                                            ("residual add", "fused_residual"),
                                                                            ("max pool", "fused_max_pool"))
             if record.get(field)]
    folded = [_fold_text(record)] if _shows_folds(record) else []
    if not fused and not folded:
        return ""
    text = "; " + ", ".join(folded + fused) + (", planned fused" if fused and record.get("fusion_planned") else "")
    if record.get("planned_unfused_ms") is not None:
        text += f" (unfused {_fmt(record['planned_unfused_ms'])} ms: fusing {_fmt(record['fusion_speedup'], 2)}x)"
    return text


def fold_policy(record: dict[str, Any]) -> str:
    """An end-to-end record's BatchNorm-folding policy (:data:`~unsparse.runtime.batch_norm_folding.FOLD_POLICIES`);
    records from before it was recorded folded every BatchNorm or none."""
    return record.get("fold_batch_norm", "all" if record.get("folded_batch_norm") else "off")


def precision_label(record: dict[str, Any]) -> str:
    """An end-to-end record's precision as its table shows it: the key of
    :data:`~unsparse.runtime.precision.PRECISIONS`, followed by the sparse backends its plan chose among where they
    are more than the precision's own (``sparse_backends``, from ``run_bench``'s ``end_to_end_backends``), e.g.
    ``fp32 (direct+generated)``.

    Raises:
        KeyError: a record without ``precision``."""
    backends = record.get("sparse_backends") or []
    return record["precision"] + (f" ({'+'.join(backends)})" if len(backends) > 1 else "")


def _shows_folds(record: dict[str, Any]) -> bool:
    """Whether the record's row says how many convs took a BatchNorm: every "epilogue" record (none folded is news:
    every layer on cuDNN), an "all" one only where some did (VGG16 has no BatchNorm)."""
    policy = fold_policy(record)
    return policy == "epilogue" or (policy == "all" and bool(record.get("folded_batch_norm")))


def _fold_text(record: dict[str, Any], tag: str = "") -> str:
    """How many convs of the plan of layout ``tag`` (``""``: NCHW, ``"_nhwc"``) took their BatchNorm; the NHWC plan's
    row says it only under "epilogue", where each layout folds by its own plan (under "all" both fold alike)."""
    policy = fold_policy(record)
    return f"BatchNorm folded into {record.get(f'folded_batch_norm{tag}', 0)} convs" + (
        " (epilogue)" if policy == "epilogue" else "")


def plot_results(result: dict[str, Any], out_dir: Path, prefix: str = "") -> list[Path]:
    """``speedup.png`` (direct over cuDNN alone of the same precision per layer against sparsity, largest batch;
    one panel per model and precision: the break-even plot), ``breakdown.png`` (summed FP32 layer time per backend
    and model at sparsity 0.9, cuDNN alone for cuDNN) and ``end_to_end.png``, each name after ``prefix`` (so that
    the plots of several results can share a folder). What each shows: :data:`PLOTS`.

    A plot with nothing to show is not written: no speedup over cuDNN alone at the largest batch (records from
    before that baseline have none), no FP32 layer time at sparsity 0.9 there (an FP16-only run: the chart was
    empty axes), no end-to-end run. A model or precision without data gets no panel or bar group, and a backend not
    timed on every layer of a model no bar there (a sum over the layers it was timed on is no model's time).

    Returns:
        The paths written, in :data:`PLOTS`' order: what the page links (:func:`markdown_report`'s ``plots``).
    """
    from unsparse.report.plots import new_figure, save_figure

    paths = []
    largest = largest_batch(result)
    records = [r for r in result["layers"] if r["batch"] == largest]
    curves: dict[tuple[str, str], dict[str, list[tuple[float, float]]]] = {}
    for r in records:
        if r["speedup_vs_cudnn"] is not None:
            curves.setdefault((r["precision"], r["model"]), {}).setdefault(r["layer"], []).append(
                (r["target_sparsity"], r["speedup_vs_cudnn"]))
    models = sorted({model for _, model in curves})
    precisions = [p for p in PRECISIONS if any(precision == p for precision, _ in curves)]
    if curves:
        with new_figure(nrows=len(precisions), ncols=len(models), figsize=(5 * len(models), 4 * len(precisions)),
                        squeeze=False) as (fig, axes):
            for row, precision in zip(axes, precisions, strict=True):
                for ax, name in zip(row, models, strict=True):
                    by_layer = curves.get((precision, name), {})
                    for layer, points in by_layer.items():
                        points.sort()
                        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=layer)
                    ax.axhline(1.0, color="gray", linestyle="--")
                    ax.set(title=f"{name} {precision} b{largest} (synthetic weights)", xlabel="sparsity",
                           ylabel=f"speedup over {CUDNN_MODES[precision]}")
                    if 0 < len(by_layer) <= 16:
                        ax.legend(fontsize=6)
            paths.append(save_figure(fig, out_dir / f"{prefix}speedup.png", dpi=100))
    layers = [r for r in records if r["precision"] == "fp32" and abs(r["target_sparsity"] - 0.9) < 1e-9]
    backends = {"cuDNN alone": lambda r: (r.get("baseline") or {}).get("median_ms"),
                **{name: lambda r, name=name: r["best_ms"].get(name)
                   for name in ("direct", "im2col_cublas", "im2col_cusparse")}}
    per_model = {m: [r for r in layers if r["model"] == m] for m in sorted({r["model"] for r in layers})}
    totals = {backend: {m: sum(ms(r) * r["count"] for r in rs) if all(ms(r) is not None for r in rs) else 0
                        for m, rs in per_model.items()} for backend, ms in backends.items()}
    models = sorted({m for by_model in totals.values() for m, total in by_model.items() if total > 0})
    if models:
        with new_figure(figsize=(8, 4)) as (fig, ax):
            width = 0.8 / len(backends)
            for i, (backend, by_model) in enumerate(totals.items()):
                ax.bar([j + i * width for j in range(len(models))], [by_model[m] for m in models], width, label=backend)
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(models))], models)
            ax.set(ylabel="sum of conv layer times (ms), sparsity 0.9", yscale="log")
            ax.legend()
            paths.append(save_figure(fig, out_dir / f"{prefix}breakdown.png", dpi=100))
    if result["end_to_end"]:
        with new_figure(figsize=(11, 4)) as (fig, ax):
            labels = [f"{r['model'].split('/')[-1]}\n{precision_label(r)} b{r['batch']}"
                      for r in result["end_to_end"]]
            xs = range(len(labels))
            runs = result["end_to_end"]
            bars: dict[str, Callable[[dict[str, Any]], float | None]] = {
                "dense (cuDNN, NCHW)": lambda r: r.get("dense_ms"),
                "dense (cuDNN, NHWC)": lambda r: r.get("dense_nhwc_ms"),
                "planned (NCHW)": lambda r: r.get("planned_ms"), "planned (NHWC)": lambda r: r.get("planned_nhwc_ms")}
            three = any(map(counts_switched, runs))
            if three:
                bars |= {"dense (cuDNN, switched after the first pool)": lambda r: r.get("dense_switched_ms"),
                         "planned (switched)": lambda r: r.get("planned_switched_ms")}
            if any(dense_fused_ms(r) is not None for r in runs):
                folded = any(r.get("dense_folded_batch_norm") for r in runs)
                bars["dense, " + ("BatchNorms folded, " if folded else "")
                     + f"conv+bias+ReLU fused by cuDNN ({comparative(3 if three else 2)} layout)"] = dense_fused_ms
            width = 0.8 / len(bars)
            for i, (label, value) in enumerate(bars.items()):
                ax.bar([x + (i - (len(bars) - 1) / 2) * width for x in xs], [value(r) or 0 for r in runs], width,
                       label=label)
            ax.set_xticks(list(xs), labels, fontsize=7)
            ax.set(ylabel="model time (ms)")
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the bars, not over them
            paths.append(save_figure(fig, out_dir / f"{prefix}end_to_end.png", dpi=100))
    return paths
