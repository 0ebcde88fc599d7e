"""Host cost of one layer's call against its GPU time, per backend setting (default: a batch-1 1x1 layer).

At batch 1 the per-layer benchmark times host floors (~0.06-0.1 ms for the direct backend, ~0.03-0.05 ms for
cuDNN), so this times, on the current GPU, each of: one direct setting (``--params``; for the default
``pointwise`` setting also with each split of ``POINTWISE_SPLITS``) and ``F.conv2d`` (cuDNN); every one three
ways: eagerly (CUDA events around back-to-back calls: the host's floor where it exceeds the kernel), replayed as a
CUDA graph (the GPU time alone), and as host enqueue time (wall clock per call, no synchronisation). It also prints
a cProfile of the eager direct call. Microseconds; JSON to ``--out``.

``--blocks B`` measures host enqueue B times per path, in rounds over all paths (this host's speed moved by up to
2x between paths measured one after the other), and records every block and their median.

``--modules`` adds the paths a model takes, to price the wrapper around the kernels: the layer as ``nn.Conv2d``,
and as a :class:`~unsparse.runtime.SparseConv` on ``cudnn``, on ``auto`` planned to cuDNN, and on ``direct`` with
the setting above, each with a cProfile of its calls.

    PYTHONPATH=. python3 scripts/profile_launch.py --layer 3 64 224 --kernel 7 --stride 2 --padding 3 \
        --batch 128 --dtype float16 --params '{"variant": "tile", "wx": 32, "py": 4, "nb": 2, "mw": 4, \
        "warps": 16, "cc": 8, "stage": "vector"}' --out OUT
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from unsparse.job import git_commit
from unsparse.runtime import set_backend, sparsify
from unsparse.runtime.backends.direct import DirectBackend
from unsparse.runtime.backends.direct_space import POINTWISE_SPLITS
from unsparse.runtime.bench import environment, require_cuda
from unsparse.runtime.comparator import plan_model
from unsparse.runtime.timing import host_enqueue_ms, host_profile, time_fn, time_graph
from unsparse.sparse import ConvGeometry, UniformCSR


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--layer", type=int, nargs=3, default=[1024, 256, 14], metavar=("C", "M", "HW"),
                        help="input channels, output channels, input plane side")
    parser.add_argument("--kernel", type=int, default=1)
    parser.add_argument("--stride", type=int, default=1)
    parser.add_argument("--padding", type=int, default=0)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", choices=["float32", "float16"], default="float32")
    parser.add_argument("--params", type=json.loads, help="the direct setting (default: a 1x1 pointwise one)")
    parser.add_argument("--modules", action="store_true", help="also time the module paths (see above)")
    parser.add_argument("--blocks", type=int, default=1,
                        help="host enqueue in this many rounds over every path, interleaved (median and spread)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    require_cuda("profile_launch.py")
    device = torch.device("cuda", torch.cuda.current_device())
    dtype = getattr(torch, args.dtype)
    C, M, side = args.layer
    weight = torch.randn(M, C, args.kernel, args.kernel, device=device)
    weight[torch.rand_like(weight) < 0.9] = 0
    weight = weight.to(dtype)
    csr, geometry = UniformCSR.from_dense(weight), ConvGeometry.of(args.stride, args.padding)
    x = torch.randn(args.batch, C, side, side, device=device, dtype=dtype)
    backend = DirectBackend()
    base = args.params or {"variant": "pointwise", "pv": 1, "mw": 8, "warps": 8, "cc": 32, "stage": "vector"}
    calls = {"direct": lambda: backend.conv(x, csr, None, geometry, **base)}
    if base["variant"] == "pointwise":
        for splits in POINTWISE_SPLITS:
            calls[f"direct_splits{splits}"] = lambda s=splits: backend.conv(x, csr, None, geometry, **base, splits=s)
    calls["cudnn"] = lambda: F.conv2d(x, weight, None, args.stride, args.padding)
    profiles = {"direct": calls["direct"]}
    if args.modules:
        # A Sequential, as in the earlier sessions' host-cost runs; no bias, as in the bare calls.
        conv = torch.nn.Sequential(torch.nn.Conv2d(C, M, args.kernel, args.stride, args.padding, bias=False,
                                                   device=device, dtype=dtype)).eval()
        with torch.no_grad():
            conv[0].weight.copy_(weight)
        modules = {"module_conv2d": conv, "sparse_cudnn": set_backend(sparsify(conv), "cudnn"),
                   "sparse_direct": set_backend(sparsify(conv), "direct", **base)}
        planned = sparsify(conv)
        plan, _ = plan_model(planned, x, backends=["cudnn"], runs=5)
        modules["sparse_auto_cudnn"] = planned
        chosen = {key: (entry.backend, entry.params) for key, entry in plan.entries.items()}
        for name, module in modules.items():
            calls[name] = profiles[name] = lambda m=module: m(x)
    rows = {}
    with torch.no_grad():
        for name, call in calls.items():
            rows[name] = {"eager_us": time_fn(lambda i, c=call: c(), device, runs=args.runs).median_ms * 1e3,
                          "graph_us": time_graph(call, device, runs=args.runs).median_ms * 1e3,
                          "host_us": host_enqueue_ms(call, device, args.runs) * 1e3}
            print(name, rows[name])
        rounds = [{name: host_enqueue_ms(call, device, args.runs) * 1e3 for name, call in calls.items()}
                  for _ in range(args.blocks - 1)]
        for name in calls:
            block_us = [rows[name]["host_us"], *(measured[name] for measured in rounds)]
            rows[name].update(host_blocks_us=block_us, host_median_us=statistics.median(block_us))
        profile = {name: host_profile(call, device, args.runs, top=12) for name, call in profiles.items()}
    for text in profile.values():
        print(text)
    layer = (f"{C}->{M} {args.kernel}x{args.kernel} stride {args.stride} pad {args.padding} at {side}x{side}, "
             f"batch {args.batch}, {args.dtype}, 0.9")
    result = {"environment": environment(git_commit()), "layer": layer, "params": base, "runs": args.runs,
              "us": rows, "profile": profile, "auto_plan": chosen if args.modules else None}
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    name = f"launch_profile_{C}_{M}_{side}" + ("" if args.params is None else f"_k{args.kernel}_s{args.stride}")
    (path / f"{name}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
