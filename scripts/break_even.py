"""Break-even report of the direct kernels against cuDNN FP32, TF32 and FP16 (issue 6's sparsity sweep).

Reads benchmark JSON files written by ``scripts/gpu_check.py`` (one sweep may span several device calls; every
ratio comes from the run that measured it) and writes a Markdown report and a PNG with one panel per layer.

The page needs speedups over cuDNN's convolution alone (records with ``baseline``, written since the twelfth
session) at ``--batch``. A file without any such record (one written before that baseline) is named on stderr and
left out of the page, like the baseline-less records of the other files; if no file has one, the script writes
nothing and exits with status 2. A file that cannot be read, is not JSON, or lacks a field the page reads also stops
it with status 2 and one line naming the file: a page missing part of a sweep would read as the whole sweep.

    PYTHONPATH=. python scripts/break_even.py benchmarks/results/h100_2026-11-24_baseline_sweep_*.json.xz \
        --out benchmarks/results/h100_2026-11-24_break_even_baseline_vgg16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from unsparse.atomic import atomic_write_text
from unsparse.report.break_even import MODES, break_even, break_even_markdown, curves, meets, plot_break_even
from unsparse.report.results import beside, load_result

FP32_GOAL, TF32_GOAL, FP16_GOAL = 0.70, 0.90, 0.95
"""Issue 6: break-even against cuDNN FP32 <= 70 %, TF32 <= 90 %, FP16 <= 95 % (56x56 and larger layers)."""
FP32_TFLOPS_GOAL, FP16_TFLOPS_GOAL = 30.0, 60.0
"""Issue 6: useful throughput at 90 % sparsity on VGG16's 3x3 layers, TFLOP/s."""


GOALS = {"fp32": FP32_GOAL, "tf32": TF32_GOAL, "fp16": FP16_GOAL, "fp16_half2": FP16_GOAL,
         "fp32_generated": FP32_GOAL, "tf32_generated": TF32_GOAL, "fp16_generated": FP16_GOAL}
"""Break-even goal per benchmark precision; every FP16 kernel faces issue 6's FP16 goal."""
TFLOPS_GOALS = {"fp32": FP32_TFLOPS_GOAL, "fp16": FP16_TFLOPS_GOAL, "fp16_half2": FP16_TFLOPS_GOAL,
                "fp32_generated": FP32_TFLOPS_GOAL, "fp16_generated": FP16_TFLOPS_GOAL}
"""Throughput goal per benchmark precision (TF32 is a cuDNN mode; direct computes FP32 there)."""


RESULT_FIELDS = ("environment", "device", "weights", "runs", "layers")
"""Fields of a bench result that the page reads."""
RECORD_FIELDS = {"model": str, "layer": str, "in_chw": list, "weight_shape": list, "batch": int, "precision": str,
                 "target_sparsity": (int, float)}
"""Fields of each layer record that the page reads, with their JSON types (``speedup_vs_cudnn`` may be absent or
null: left out)."""


def read_result(path: Path) -> dict[str, Any]:
    """The bench result in ``path`` (``.json`` or ``.json.xz``), checked for the fields the page reads.

    Raises:
        ValueError: naming the file, if it cannot be read, is not a JSON object, or lacks a field (naming the
            field, and for a layer record its index).
    """
    try:
        result = load_result(path)
    except OSError as error:
        raise ValueError(f"result {path}: cannot be read ({error.strerror or error})") from error
    missing = [field for field in RESULT_FIELDS if field not in result]
    if missing:
        raise ValueError(f"result {path}: not a bench result, no {', '.join(missing)}")
    if not isinstance(result["environment"], dict) or not isinstance(result["layers"], list):
        raise ValueError(f"result {path}: 'environment' must be an object and 'layers' a list")
    for index, record in enumerate(result["layers"]):
        lacking = [field for field in RECORD_FIELDS if not isinstance(record, dict) or field not in record]
        if lacking:
            raise ValueError(f"result {path}: layers[{index}] has no {', '.join(lacking)}")
        wrong = [field for field, kind in RECORD_FIELDS.items()
                 if not isinstance(record[field], kind) or isinstance(record[field], bool)
                 or (kind is list and not all(type(size) is int for size in record[field]))]
        if wrong:
            raise ValueError(f"result {path}: layers[{index}] has {', '.join(wrong)} of the wrong type")
    return result


def without_baseline(result: dict[str, Any], batch: int) -> str | None:
    """Why ``result`` gives the page no point at ``batch`` (None if it gives one): no layer records, none with
    cuDNN's convolution alone timed (written before that baseline), or none of those at this batch."""
    if not result["layers"]:
        return "no layer records"
    records = [record for record in result["layers"] if record.get("speedup_vs_cudnn") is not None]
    if not records:
        return ("no record has a speedup over cuDNN's convolution alone ('baseline', 'speedup_vs_cudnn'): "
                "written before that baseline existed")
    if not any(record["batch"] == batch for record in records):
        batches = sorted({record["batch"] for record in records})
        return f"no record at batch {batch} has a speedup over cuDNN's convolution alone (batches {batches})"
    return None


def with_baseline(paths: list[Path], results: list[dict[str, Any]], batch: int
                  ) -> tuple[list[tuple[Path, dict[str, Any]]], list[str]]:
    """The ``(path, result)`` pairs that give the page a point at ``batch``, and a ``"path: why"`` line for each
    of the others (:func:`without_baseline`)."""
    kept, left_out = [], []
    for path, result in zip(paths, results, strict=True):
        why = without_baseline(result, batch)
        if why is None:
            kept.append((path, result))
        else:
            left_out.append(f"{path}: {why}")
    return kept, left_out


def goals(record: dict[str, Any]) -> dict[str, float]:
    """The break-even goals of one layer: FP16 only for inputs of 56x56 and larger."""
    large = min(record["in_chw"][1:]) >= 56
    return {precision: goal for precision, goal in GOALS.items() if large or not precision.startswith("fp16")}


def report(results: list[dict[str, Any]], sources: list[Path], batch: int, png_name: str) -> str:
    """The Markdown text: sources and environment, the verdicts, per-layer tables and the plot."""
    records = [record for result in results for record in result["layers"]]
    lines = ["# Break-even of the direct kernels against cuDNN", ""]
    for path, result in zip(sources, results, strict=True):
        env = result["environment"]
        lines.append(f"- `{path.name}`: {result['device']}, driver {env.get('driver')}, torch {env.get('torch')}, "
                     f"CuPy {env.get('cupy')}, cuDNN {env.get('cudnn')}, commit {env.get('commit')}; "
                     f"{len(result['layers'])} records; not measured: {result.get('stopped_early') or 'none'}.")
    lines += ["", f"Weights: {results[0]['weights']}. Batch {batch}, {results[0]['runs']} timed runs per setting "
              "after warm-up (CUDA events, median); each speedup is cuDNN ms / direct ms, measured in the same run: "
              "cuDNN's convolution alone (no bias, input and weight already in the layout) in the faster of NCHW "
              "and NHWC (`unsparse/runtime/baseline.py`), the fastest direct setting (bias added in its epilogue). "
              "Records without that baseline (before the twelfth session) are left out. Direct computes in float32 "
              "against both cuDNN FP32 and TF32, and "
              "in float16 storage with float32 products against cuDNN FP16; the fp16_half2 rows run the half2-product "
              "kernel (backend direct_half2: float16 products summed in runs of at most 16, then in float32) "
              "against the same cuDNN FP16.", "", "## Targets (issue 6)", ""]
    by_layer = curves(records, batch)
    for precision, mode in MODES.items():
        checked = [(layer, break_even(per_precision[precision]))
                   for (model, layer), per_precision in by_layer.items() if precision in per_precision
                   and precision in goals(next(r for r in records if r["model"] == model and r["layer"] == layer))]
        goal = GOALS[precision]
        met = [layer for layer, result in checked if meets(result, goal)]
        if not checked:
            lines.append(f"- Break-even against {mode} <= {goal:g}: not measured in these runs.")
            continue
        lines.append(f"- Break-even against {mode} <= {goal:g}: met on {len(met)} of {len(checked)} layers"
                     + (f" ({', '.join(met)})" if met else "") + ".")
    for precision, goal in TFLOPS_GOALS.items():
        rates = [r["direct_useful_tflops"] for r in records if r["precision"] == precision and r["batch"] == batch
                 and abs(r["target_sparsity"] - 0.9) < 1e-9 and r.get("direct_useful_tflops") is not None]
        if rates:
            lines.append(f"- Useful {precision.upper()} throughput at 0.9 (2 x nnz x N x E x F / time): "
                         f"{min(rates):.1f} to {max(rates):.1f} TFLOP/s against the {goal:g} asked: "
                         f"{'met' if min(rates) >= goal else 'MISSED'}.")
    lines += ["", f"![break-even]({png_name})", "", "## Per layer (speedup over cuDNN; below 1 the direct kernel is "
              "SLOWER)", "", break_even_markdown(records, batch, goals)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Write ``<out>.md`` and ``<out>.png`` from the given benchmark JSON files; files without a point at
    ``--batch`` are named on stderr and left out, and without any such file, or for a bad file, it exits with
    status 2 (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path, help="bench JSON files of one sweep (.json or .json.xz)")
    parser.add_argument("--out", type=Path, required=True, help="output path without suffix")
    parser.add_argument("--batch", type=int, default=128)
    args = parser.parse_args(argv)
    try:
        results = [read_result(path) for path in args.results]
    except ValueError as error:
        parser.error(str(error))
    kept, left_out = with_baseline(args.results, results, args.batch)
    if not kept:
        parser.error("nothing to report: " + "; ".join(left_out))
    for line in left_out:
        print(f"break_even: left out {line}", file=sys.stderr)
    sources, results = [path for path, _ in kept], [result for _, result in kept]
    png = beside(args.out, ".png")
    text = report(results, sources, args.batch, png.name)  # before any file is written: a failure leaves none
    plot_break_even([r for result in results for r in result["layers"]], args.batch, png)
    page = atomic_write_text(beside(args.out, ".md"), text)
    print(f"wrote {page} and {png}")


if __name__ == "__main__":
    main()
