"""The instruction-issue ceiling of the weight-specialised kernels per layer and sparsity, against measured cuDNN.

A generated program (``unsparse/runtime/generated_source.py``) runs, per warp of 32 output pixels, one load per tap
that any of its rows uses, one FFMA per product and one store per row. No kernel of that code can issue faster than
the instruction-cache probe's rate for a loop body of the same size (``icache`` in a probe JSON of
``scripts/probe_generated.py``: FFMA warp instructions per ns per SM, measured on the GPU). So

    ceiling ms = sum over programs of (loads + products + rows) x ceil(N * E * F / 32) / (rate x SMs)

is a lower bound on the layer's time (index arithmetic, tails and memory stalls only add to it), and cuDNN's time
over it an upper bound on the speedup this design can reach. Where that bound is below 1, the layer cannot break
even at that sparsity with these kernels, however their memory behaves (``kernels/NOTES.md``, thirty-first session).

Weights are synthetic, as in the benchmark: He-normal, magnitude-pruned per layer (``magnitude_prune_``), seed 0.
cuDNN times are the benchmark's (cuDNN FP32 alone, best layout, TF32 off) from its JSON. Nothing runs on a GPU here.

    PYTHONPATH=. python scripts/generated_ceiling.py --bench benchmarks/results/h200_..._s09_fp32_tf32.json \
        --probe benchmarks/results/h200_2026-11-29_ptx_body_probe.json --out benchmarks/results/h200_..._ceiling
"""

from __future__ import annotations

import argparse
import json
import math
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
                  icache: list[dict[str, Any]], sms: int) -> dict[str, Any]:
    """Instruction counts and the ceiling time of one layer.

    Args:
        weight: ``(M, C, R, S)`` float32, already pruned. padding, in_hw: the layer's. batch: N.
        icache: the probe's records. sms: the GPU's SM count.

    Returns:
        ``programs``, ``loads``, ``products`` and ``stores`` (per output pixel, summed over programs), the largest
        body (instructions), its FFMA share and ``ceiling_ms``.
    """
    programs = gs.programs(weight.numpy(), padding, in_hw, ROWS)
    warps = math.ceil(batch * programs[0].out_hw[0] * programs[0].out_hw[1] / 32)
    loads = products = stores = 0
    nanoseconds = 0.0
    largest = 0
    for program in programs:
        body = len(program.taps) + program.products + program.rows
        loads, products, stores = loads + len(program.taps), products + program.products, stores + program.rows
        largest = max(largest, body)
        nanoseconds += body * warps / (issue_rate(icache, body) * sms)
    return {"programs": len(programs), "loads": loads, "products": products, "stores": stores,
            "largest_body_instructions": largest, "ffma_share": products / (loads + products + stores),
            "ceiling_ms": nanoseconds / 1e6}


def ceilings(bench: dict[str, Any], icache: list[dict[str, Any]], sparsities: list[float]) -> list[dict[str, Any]]:
    """One record per FP32 layer of ``bench`` and sparsity: the layer, cuDNN's time and the ceiling."""
    sms = bench["environment"]["sm_count"]
    records = []
    for layer in bench["layers"]:
        if layer["precision"] != "fp32_generated" or layer.get("baseline") is None:
            continue
        out_channels, channels, kernel, _ = layer["weight_shape"]
        for sparsity in sparsities:
            torch.manual_seed(0)
            conv = nn.Conv2d(channels, out_channels, kernel, bias=False)
            nn.init.kaiming_normal_(conv.weight, nonlinearity="relu")
            magnitude_prune_(conv, sparsity)
            counts = layer_ceiling(conv.weight.detach(), tuple(layer["geometry"]["padding"]),
                                   tuple(layer["in_chw"][1:]), layer["batch"], icache, sms)
            cudnn_ms = layer["baseline"]["median_ms"]
            records.append({"layer": layer["layer"], "in_chw": layer["in_chw"], "weight_shape": layer["weight_shape"],
                            "batch": layer["batch"], "sparsity": sparsity, "cudnn_fp32_ms": cudnn_ms, **counts,
                            "ceiling_speedup": cudnn_ms / counts["ceiling_ms"]})
    return records


def markdown(records: list[dict[str, Any]], bench_name: str, probe_name: str) -> str:
    """The page: how the bound is computed, then one row per layer and sparsity."""
    rows = [[r["layer"], r["in_chw"], r["weight_shape"], f"{r['sparsity']:.2f}", r["programs"],
             r["largest_body_instructions"], f"{r['ffma_share']:.2f}", f"{r['ceiling_ms']:.3f}",
             f"{r['cudnn_fp32_ms']:.3f}", f"{r['ceiling_speedup']:.2f}",
             "cannot break even" if r["ceiling_speedup"] < 1 else ""] for r in records]
    header = ["layer", "C,H,W", "weight", "sparsity", "programs", "largest body", "FFMA share", "ceiling ms",
              "cuDNN FP32 ms", "best possible speedup", ""]
    return "\n".join([
        "# Instruction-issue ceiling of the weight-specialised kernels", "",
        f"cuDNN FP32 (alone, best layout, TF32 off) from `{bench_name}`; issue rates by body size from the "
        f"instruction-cache probe in `{probe_name}`. Weights: synthetic (He-normal, magnitude-pruned per layer, "
        f"seed 0); programs of {ROWS} rows. The ceiling counts one load per used tap, one FFMA per product and one "
        "store per row for each warp of 32 output pixels, at the probe's rate for a body of that size: a lower bound "
        "on the layer's time, so 'best possible speedup' is an upper bound. Below 1 this design cannot break even "
        "on that layer at that sparsity. Computed on the CPU by `scripts/generated_ceiling.py`; nothing here was "
        "timed.", "", markdown_table(header, rows), ""])


def main() -> None:
    """Compute the ceilings and write ``<out>.json`` and ``<out>.md``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bench", type=Path, required=True, help="a benchmark JSON with fp32_generated records")
    parser.add_argument("--probe", type=Path, required=True, help="a probe JSON with icache records")
    parser.add_argument("--sparsities", type=float, nargs="+", default=[0.7, 0.8, 0.9])
    parser.add_argument("--out", type=Path, required=True, help="output path without suffix")
    args = parser.parse_args()
    bench, probe = load_result(args.bench), load_result(args.probe)
    records = ceilings(bench, probe["icache"], args.sparsities)
    result = {"bench": args.bench.name, "probe": args.probe.name, "rows": ROWS, "records": records}
    atomic_write_text(args.out.with_suffix(".json"), json.dumps(result, indent=1))
    atomic_write_text(args.out.with_suffix(".md"), markdown(records, args.bench.name, args.probe.name))
    print(f"wrote {args.out.with_suffix('.json')} and {args.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
