"""Where a planned model's end-to-end time goes when every layer stays on cuDNN: GPU time (CUDA events) and host
enqueue time (wall clock of the forward calls without synchronisation) of the dense model against its sparse copy
run through the ``cudnn`` backend directly and through the plan (``auto``), plus the same with CUDA graphs, which
remove the host from the timed loop.

A planned model that is slower than the dense one although its plan keeps every layer on cuDNN (GoogLeNet, FP16,
b128: 0.87x and 0.93x in two runs of 2026-11-23) is either host-bound (its extra Python per layer exceeds the GPU
time per layer) or runs different GPU work; the graph timings tell the two apart. Writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from unsparse.pipeline import git_commit
from unsparse.runtime.bench import PRECISIONS, build_model, environment, magnitude_prune_, precision_mode
from unsparse.runtime.comparator import plan_model
from unsparse.runtime.modules import set_backend, sparsify
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="googlenet")
    parser.add_argument("--precision", default="fp16", choices=sorted(PRECISIONS))
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--planned", action="store_true",
                        help="also plan the sparse copy (comparator, every layer) and time the planned model")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
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
            result["rows"].append(row)
            print(row)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "end_to_end_profile.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
