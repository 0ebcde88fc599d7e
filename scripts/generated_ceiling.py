"""The instruction-issue ceiling of the weight-specialised kernels per layer and sparsity, against measured cuDNN.

A generated FP32 program (``unsparse/runtime/generated_source.py``) runs, per warp of 32 output pixels, one load per
tap that any of its rows uses, one FFMA per product and one store per row. No kernel of that code can issue faster
than the instruction-cache probe's rate for a loop body of the same size (``icache`` in a probe JSON of
``scripts/probe_generated.py``: FFMA warp instructions per ns per SM, measured on the GPU). So

    ceiling ms = sum over programs of (warp instructions of its body) x warps of pixels / (rate x SMs)

is a lower bound on the layer's time (index arithmetic, tails and memory stalls only add to it), and cuDNN's time
over it an upper bound on the speedup the design can reach. Where that bound is below 1, the layer cannot break
even at that sparsity with these kernels, however their memory behaves (``kernels/NOTES.md``, thirty-first session).

``--model fp32`` counts the kernels built, against cuDNN FP32 from a benchmark JSON; ``--model half2`` counts a
float16 design that is not built (:func:`half2_body`), against cuDNN FP16 from a probe JSON's records, to decide
whether building it can pay. Weights are synthetic and drawn as the benchmark draws them (He-normal, magnitude-pruned
per layer with ``magnitude_prune_``, seed 0 per layer here), so their counts match the benchmark's in distribution,
not draw for draw. Nothing runs on a GPU here.

    PYTHONPATH=. python scripts/generated_ceiling.py --cudnn benchmarks/results/h200_..._s09_fp32_tf32.json \
        --probe benchmarks/results/h200_2026-11-29_ptx_body_probe.json --out benchmarks/results/h200_..._ceiling
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

import torch
from torch import nn

from unsparse.atomic import atomic_write_text
from unsparse.report.document import markdown_table
from unsparse.report.results import load_result
from unsparse.runtime import generated_source as gs
from unsparse.runtime.bench import magnitude_prune_

ROWS = 32
"""KT of the programs counted (the setting that won every layer from 56x56 down at 0.9)."""

RUN = 16
"""Products a float16 accumulator takes before the half2 model adds it to float32 (``direct_half2``'s runs)."""

FLUSH = 5
"""Instructions of one such addition in the half2 model: two conversions, two float adds and a reset."""


def fp32_body(program: gs.Program) -> int:
    """Warp instructions of a generated FP32 program per warp of 32 pixels: a load per used tap, an FFMA per product,
    a store per row (the kernels built: ``kernels/generated_conv.cu``)."""
    return len(program.taps) + program.products + program.rows


def half2_body(program: gs.Program) -> int:
    """Warp instructions of a hypothetical float16 program with two neighbouring output pixels per thread (not
    built), per warp of 64 pixels: per used tap one 32-bit load where the tap's offset is even, else two loads and a
    pack (3); one ``HFMA2`` per product (the weight as two equal halves); per row :data:`FLUSH` instructions for each
    run of :data:`RUN` products; two stores per row. Assumes an even padded width, so that the pair's parity is the
    offset's."""
    loads = sum(1 if tap.offset % 2 == 0 else 3 for tap in program.taps)
    per_row = [0] * program.rows
    for tap in program.taps:
        for row, _ in tap.products:
            per_row[row] += 1
    flushes = sum(math.ceil(count / RUN) for count in per_row)
    return loads + program.products + FLUSH * flushes + 2 * program.rows


MODELS = {"fp32": (fp32_body, 32), "half2": (half2_body, 64)}
"""Body counter and output pixels per warp of each model."""


def issue_rate(icache: list[dict[str, Any]], body_instructions: int) -> float:
    """The probe's FFMA warp instructions per ns per SM for the smallest probed body at least ``body_instructions``
    long (the largest probed body's rate beyond them).

    Raises:
        ValueError: for an empty ``icache``.
    """
    if not icache:
        raise ValueError("icache: no probe records")
    ordered = sorted(icache, key=lambda record: record["body_instructions"])
    fitting = [record for record in ordered if record["body_instructions"] >= body_instructions]
    return (fitting[0] if fitting else ordered[-1])["ffma_warp_instructions_per_ns_per_sm"]


def layer_ceiling(weight: torch.Tensor, padding: tuple[int, int], in_hw: tuple[int, int], batch: int,
                  icache: list[dict[str, Any]], sms: int, model: str = "fp32") -> dict[str, Any]:
    """Instruction counts and the ceiling time of one layer.

    Args:
        weight: ``(M, C, R, S)`` float32, already pruned. padding, in_hw: the layer's. batch: N.
        icache: the probe's records. sms: the GPU's SM count. model: a key of :data:`MODELS`.

    Returns:
        ``programs``, ``products`` (per output pixel, summed over programs), the largest body (warp instructions),
        the share of products among all its programs' instructions (``product_share``) and ``ceiling_ms``.
    """
    body_of, pixels_per_warp = MODELS[model]
    programs = gs.programs(weight.numpy(), padding, in_hw, ROWS)
    warps = math.ceil(batch * programs[0].out_hw[0] * programs[0].out_hw[1] / pixels_per_warp)
    instructions = products = largest = 0
    nanoseconds = 0.0
    for program in programs:
        body = body_of(program)
        instructions, products, largest = instructions + body, products + program.products, max(largest, body)
        nanoseconds += body * warps / (issue_rate(icache, body) * sms)
    return {"programs": len(programs), "products": products, "largest_body_instructions": largest,
            "product_share": products / instructions, "ceiling_ms": nanoseconds / 1e6}


def bench_layers(bench: dict[str, Any]) -> list[dict[str, Any]]:
    """The FP32 layers of a benchmark JSON with cuDNN FP32's time (alone, best layout, TF32 off)."""
    return [{"layer": r["layer"], "in_chw": r["in_chw"], "weight_shape": r["weight_shape"], "batch": r["batch"],
             "padding": r["geometry"]["padding"], "cudnn_ms": r["baseline"]["median_ms"]}
            for r in bench["layers"] if r["precision"] == "fp32_generated" and r.get("baseline") is not None]


def probe_layers(probe: dict[str, Any]) -> list[dict[str, Any]]:
    """The layers of a probe JSON (``scripts/probe_generated.py``) with the median over its records of cuDNN FP16's
    time (best layout); padding keeps the plane (kernel // 2), as in every probed layer."""
    shapes: dict[tuple, list[float]] = {}
    for record in probe["records"]:
        if (record.get("cudnn_fp16") or {}).get("median_ms") is not None:
            key = (record["layer"], tuple(record["in_chw"]), tuple(record["weight_shape"]), record["batch"])
            shapes.setdefault(key, []).append(record["cudnn_fp16"]["median_ms"])
    return [{"layer": layer, "in_chw": list(in_chw), "weight_shape": list(weight_shape), "batch": batch,
             "padding": [weight_shape[2] // 2, weight_shape[3] // 2], "cudnn_ms": statistics.median(times)}
            for (layer, in_chw, weight_shape, batch), times in shapes.items()]


def ceilings(layers: list[dict[str, Any]], icache: list[dict[str, Any]], sms: int, sparsities: list[float],
             model: str) -> list[dict[str, Any]]:
    """One record per layer and sparsity: the layer, cuDNN's time, the ceiling and cuDNN over it."""
    records = []
    for layer in layers:
        out_channels, channels, kernel, _ = layer["weight_shape"]
        for sparsity in sparsities:
            torch.manual_seed(0)
            conv = nn.Conv2d(channels, out_channels, kernel, bias=False)
            nn.init.kaiming_normal_(conv.weight, nonlinearity="relu")
            magnitude_prune_(conv, sparsity)
            counts = layer_ceiling(conv.weight.detach(), tuple(layer["padding"]), tuple(layer["in_chw"][1:]),
                                   layer["batch"], icache, sms, model)
            records.append({**layer, "sparsity": sparsity, **counts,
                            "ceiling_speedup": layer["cudnn_ms"] / counts["ceiling_ms"]})
    return records


BASELINES = {"fp32": "cuDNN FP32 (alone, best layout, TF32 off)", "half2": "cuDNN FP16 (best layout)"}
"""What each model's kernels are compared with."""


def markdown(records: list[dict[str, Any]], model: str, cudnn_name: str, probe_name: str) -> str:
    """The page: how the bound is computed, then one row per layer and sparsity."""
    rows = [[r["layer"], r["in_chw"], r["weight_shape"], f"{r['sparsity']:.2f}", r["programs"],
             r["largest_body_instructions"], f"{r['product_share']:.2f}", f"{r['ceiling_ms']:.3f}",
             f"{r['cudnn_ms']:.3f}", f"{r['ceiling_speedup']:.2f}",
             "cannot break even" if r["ceiling_speedup"] < 1 else ""] for r in records]
    header = ["layer", "C,H,W", "weight", "sparsity", "programs", "largest body", "product share", "ceiling ms",
              "cuDNN ms", "best possible speedup", ""]
    kernels = ("the generated FP32 kernels (one output pixel per thread)" if model == "fp32" else
               "a HYPOTHETICAL float16 kernel that is not built (two output pixels per thread, HFMA2, float16 runs of "
               f"{RUN} products added to float32)")
    return "\n".join([
        f"# Instruction-issue ceiling: {kernels}", "",
        f"{BASELINES[model]} from `{cudnn_name}`; issue rates by body size from the instruction-cache probe in "
        f"`{probe_name}`. Weights: synthetic (He-normal, magnitude-pruned per layer, seed 0); programs of {ROWS} "
        "rows. The ceiling counts each program's warp instructions (`scripts/generated_ceiling.py`, "
        f"`{MODELS[model][0].__name__}`) at the probe's rate for a body of that size: a lower bound on the layer's "
        "time, so 'best possible speedup' is an upper bound. Below 1 this design cannot break even on that layer "
        "at that sparsity. Computed on the CPU; nothing here was timed.", "", markdown_table(header, rows), ""])


def main() -> None:
    """Compute the ceilings and write ``<out>.json`` and ``<out>.md``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="fp32")
    parser.add_argument("--cudnn", type=Path, required=True,
                        help="fp32: a benchmark JSON with fp32_generated records; half2: a probe JSON with cudnn_fp16")
    parser.add_argument("--probe", type=Path, required=True, help="a probe JSON with icache records")
    parser.add_argument("--sparsities", type=float, nargs="+", default=[0.7, 0.8, 0.9])
    parser.add_argument("--out", type=Path, required=True, help="output path without suffix")
    args = parser.parse_args()
    cudnn, probe = load_result(args.cudnn), load_result(args.probe)
    if args.model == "fp32":
        layers, sms = bench_layers(cudnn), cudnn["environment"]["sm_count"]
    else:
        layers, sms = probe_layers(cudnn), cudnn["environment"]["sms"]
    records = ceilings(layers, probe["icache"], sms, args.sparsities, args.model)
    result = {"model": args.model, "cudnn": args.cudnn.name, "probe": args.probe.name, "rows": ROWS,
              "records": records}
    atomic_write_text(args.out.with_suffix(".json"), json.dumps(result, indent=1))
    atomic_write_text(args.out.with_suffix(".md"), markdown(records, args.model, args.cudnn.name, args.probe.name))
    print(f"wrote {args.out.with_suffix('.json')} and {args.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
