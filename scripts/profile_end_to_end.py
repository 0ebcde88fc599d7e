"""Where a planned model's end-to-end time goes when every layer stays on cuDNN: GPU time (CUDA events) and host
enqueue time (wall clock of the forward calls without synchronisation) of the dense model against its sparse copy
run through the ``cudnn`` backend directly and through the plan (``auto``), plus the same with CUDA graphs, which
remove the host from the timed loop.

A planned model that is slower than the dense one although its plan keeps every layer on cuDNN (GoogLeNet, FP16,
b128: 0.87x and 0.93x in two runs of 2026-11-23) is either host-bound (its extra Python per layer exceeds the GPU
time per layer) or runs different GPU work; the graph timings tell the two apart. With ``--gc-blocks``, each model
is also timed eagerly in alternating blocks with Python's garbage collector on and off, and the collections that
ran inside the timed calls are counted with their pauses: whether the collector explains the 14-40 % by which eager
times of host-bound models moved within one process. Writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from unsparse.job import git_commit
from unsparse.runtime.bench import build_model, environment, magnitude_prune_, require_cuda
from unsparse.runtime.comparator import plan_model
from unsparse.runtime.modules import set_backend, sparsify
from unsparse.runtime.precision import PRECISIONS, precision_mode
from unsparse.runtime.timing import host_enqueue_ms, host_profile, time_fn, time_graph


def host_per_module(model: torch.nn.Module, forward, runs: int, top: int = 8) -> list[tuple[str, float]]:
    """The ``top`` leaf modules by host time per forward (ms, wall clock between a module's forward pre-hook
    and its forward hook, no synchronisation): where a host-bound forward spends its enqueue time."""
    spent: dict[str, float] = {}
    started: dict[str, float] = {}
    handles = []
    for name, module in model.named_modules():
        if next(module.children(), None) is None:
            handles.append(module.register_forward_pre_hook(
                lambda _m, _i, n=name: started.__setitem__(n, time.perf_counter())))
            handles.append(module.register_forward_hook(
                lambda _m, _i, _o, n=name: spent.__setitem__(n, spent.get(n, 0.0) + time.perf_counter() - started[n])))
    host_enqueue_ms(forward, "cuda", runs)
    for handle in handles:
        handle.remove()
    return sorted(((name, total / runs * 1e3) for name, total in spent.items()), key=lambda item: -item[1])[:top]


@contextmanager
def collector_pauses() -> Iterator[dict[int, list[float]]]:
    """Pauses (ms, wall clock between the ``gc.callbacks`` start and stop events) of the garbage collections that
    run inside the block, per generation (0, 1, 2)."""
    pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
    started: list[float] = []

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pauses[info["generation"]].append((time.perf_counter() - started.pop()) * 1e3)

    gc.callbacks.append(callback)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(callback)


def collector_blocks(forward, device: torch.device, runs: int, blocks: int) -> list[dict]:
    """``blocks`` pairs of eager timings of ``forward()`` (:func:`time_fn` GPU median and :func:`host_enqueue_ms`,
    ms), the first of each pair with the garbage collector on, the second with it off (``gc.disable``; a full
    collection before each block), with the collections counted per generation and their pauses summed per
    forward (ms; ``2 * runs + 3`` forwards per block, the warm-up included)."""
    rows = []
    for block in range(blocks):
        for enabled in (True, False):
            gc.collect()
            if not enabled:
                gc.disable()
            try:
                with collector_pauses() as pauses:
                    gpu_ms = time_fn(lambda i: forward(), device, runs=runs).median_ms
                    host_ms = host_enqueue_ms(forward, device, runs)
            finally:
                gc.enable()
            rows.append({"block": block, "collector": "on" if enabled else "off", "gpu_ms": gpu_ms,
                         "host_ms": host_ms, "collections": {str(g): len(p) for g, p in pauses.items()},
                         "pause_ms_per_forward": sum(map(sum, pauses.values())) / (2 * runs + 3),
                         "longest_pause_ms": max((max(p) for p in pauses.values() if p), default=0.0)})
    return rows


def collector_summary(rows: list[dict]) -> dict:
    """Medians over the blocks of :func:`collector_blocks`, collector on and off, and the spread of the GPU
    medians across the blocks (max / min): drift within the process."""
    summary = {}
    for state in ("on", "off"):
        gpu = [row["gpu_ms"] for row in rows if row["collector"] == state]
        summary[state] = {"gpu_ms": statistics.median(gpu), "gpu_spread": max(gpu) / min(gpu),
                          "host_ms": statistics.median(row["host_ms"] for row in rows if row["collector"] == state),
                          "pause_ms_per_forward": statistics.median(
                              row["pause_ms_per_forward"] for row in rows if row["collector"] == state)}
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="googlenet")
    parser.add_argument("--precision", default="fp16", choices=sorted(PRECISIONS))
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--planned", action="store_true",
                        help="also plan the sparse copy (comparator, every layer) and time the planned model")
    parser.add_argument("--gc-blocks", type=int, default=0,
                        help="also time each model eagerly in this many pairs of blocks, garbage collector on / off")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    require_cuda("profile_end_to_end.py")
    device = torch.device("cuda")
    dtype, tf32 = PRECISIONS[args.precision].dtype, PRECISIONS[args.precision].tf32
    torch.backends.cudnn.benchmark = True
    result = {"environment": environment(git_commit()), "model": args.model, "precision": args.precision,
              "batch": args.batch, "runs": args.runs, "rows": []}
    with precision_mode(tf32), torch.no_grad():
        dense = magnitude_prune_(build_model(args.model), 0.9).to(device, dtype).eval()
        sparse = set_backend(sparsify(dense), "cudnn")
        x = torch.randn(args.batch, 3, 224, 224, device=device, dtype=dtype)
        models = [("dense", dense), ("sparse_cudnn", sparse)]
        if args.planned:
            planned = sparsify(dense)
            plan, _ = plan_model(planned, x)
            models.append(("planned", planned))
            result["plan"] = plan.to_dict()
        for name, model in [*models, ("dense_again", dense)]:
            model(x)
            row = {"model": name,
                   "gpu_ms": time_fn(lambda i, m=model: m(x), device, runs=args.runs).median_ms,
                   "host_ms": host_enqueue_ms(lambda m=model: m(x), device, args.runs),
                   "host_top_modules_ms": host_per_module(model, lambda m=model: m(x), args.runs)}
            row["graph_ms"] = time_graph(lambda m=model: m(x), device, runs=args.runs).median_ms
            row["host_profile"] = host_profile(lambda m=model: m(x), device, args.runs)
            if args.gc_blocks:
                row["collector_blocks"] = collector_blocks(lambda m=model: m(x), device, args.runs, args.gc_blocks)
                row["collector"] = collector_summary(row["collector_blocks"])
            result["rows"].append(row)
            print(row)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "end_to_end_profile.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
