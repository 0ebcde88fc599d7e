"""Batch-1 cost of one 1x1 layer: host time against GPU time, per backend setting.

At batch 1 the per-layer benchmark times host floors (~0.06-0.1 ms for the direct backend, ~0.03-0.05 ms for
cuDNN), so this times, on the current GPU, each of: the direct ``pointwise`` setting without split-K and with
each split of ``POINTWISE_SPLITS``, and ``F.conv2d`` (cuDNN); every one twice, eagerly (CUDA events around back-
to-back calls: the host's floor where it exceeds the kernel) and replayed as a CUDA graph (the GPU time alone).
It also prints a cProfile of the eager direct call. Microseconds; JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
from pathlib import Path

import torch
import torch.nn.functional as F

from unsparse.pipeline import git_commit
from unsparse.runtime.backends.direct import POINTWISE_SPLITS, DirectBackend
from unsparse.runtime.bench import environment
from unsparse.runtime.timing import time_fn, time_graph
from unsparse.sparse import ConvGeometry, UniformCSR


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--layer", type=int, nargs=3, default=[1024, 256, 14], metavar=("C", "M", "HW"),
                        help="1x1 layer: input channels, output channels, plane side")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    C, M, side = args.layer
    weight = torch.randn(M, C, 1, 1, device=device)
    weight[torch.rand_like(weight) < 0.9] = 0
    csr, geometry = UniformCSR.from_dense(weight), ConvGeometry.of(1, 0)
    x = torch.randn(1, C, side, side, device=device)
    backend = DirectBackend()
    base = {"variant": "pointwise", "pv": 1, "mw": 8, "warps": 8, "cc": 32, "stage": "vector"}
    calls = {"direct": lambda: backend.conv(x, csr, None, geometry, **base)}
    for splits in POINTWISE_SPLITS:
        calls[f"direct_splits{splits}"] = lambda s=splits: backend.conv(x, csr, None, geometry, **base, splits=s)
    calls["cudnn"] = lambda: F.conv2d(x, weight)
    rows = {}
    for name, call in calls.items():
        rows[name] = {"eager_us": time_fn(lambda i, c=call: c(), device, runs=args.runs).median_ms * 1e3,
                      "graph_us": time_graph(call, device, runs=args.runs).median_ms * 1e3}
        print(name, rows[name])
    profile = cProfile.Profile()
    profile.runcall(lambda: [calls["direct"]() for _ in range(args.runs)])
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(12)
    print(text.getvalue())
    result = {"environment": environment(git_commit()), "layer": f"{C}->{M} 1x1 at {side}x{side}, batch 1, 0.9",
              "params": base, "runs": args.runs, "us": rows, "profile": text.getvalue()}
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    (path / f"launch_profile_{C}_{M}_{side}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
