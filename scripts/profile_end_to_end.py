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
from unsparse.runtime.modules import set_backend, sparsify
from unsparse.runtime.timing import time_fn, time_graph


def host_ms(forward, runs: int) -> float:
    """Mean wall-clock ms per call of ``forward()`` without synchronising (the host's enqueue rate)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(runs):
        forward()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / runs * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="googlenet")
    parser.add_argument("--precision", default="fp16", choices=sorted(PRECISIONS))
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    dtype, tf32 = PRECISIONS[args.precision]
    torch.backends.cudnn.benchmark = True
    result = {"environment": environment(git_commit()), "model": args.model, "precision": args.precision,
              "batch": args.batch, "runs": args.runs, "rows": []}
    with precision_mode(tf32), torch.no_grad():
        dense = magnitude_prune_(build_model(args.model), 0.9).to(device, dtype).eval()
        sparse = set_backend(sparsify(dense), "cudnn")
        x = torch.randn(args.batch, 3, 224, 224, device=device, dtype=dtype)
        for name, model in [("dense", dense), ("sparse_cudnn", sparse), ("dense_again", dense)]:
            model(x)
            row = {"model": name,
                   "gpu_ms": time_fn(lambda i, m=model: m(x), device, runs=args.runs).median_ms,
                   "host_ms": host_ms(lambda m=model: m(x), args.runs)}
            row["graph_ms"] = time_graph(lambda m=model: m(x), device, runs=args.runs).median_ms
            result["rows"].append(row)
            print(row)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "end_to_end_profile.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
