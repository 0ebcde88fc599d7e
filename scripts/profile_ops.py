"""Where a dense model's forward time goes on the GPU, by PyTorch operator: each aten operator's own kernel time
(``torch.profiler``'s self device time, so an operator that calls another is not counted twice) per forward, for
one model, precision, layout and batch, beside the forward's median time (CUDA events).

Written to check the split that ``kernels/NOTES.md`` (thirty-seventh session) only counted: VGG16's dense
channels-last TF32 forward at batch 128 took 21.2 ms, which the per-layer cuDNN times (convolution alone, no bias)
plus a bias pass, a ReLU pass and the pools add up to at 3 TB/s. ``--fold-batch-norm`` profiles the model with its
BatchNorms folded into its convs (the forty-second session found ResNet-50's FP16 channels-last forward slower folded,
8.1 -> 9.2 ms, and a bias added as rows no faster: where the time goes is the question). Writes JSON to ``--out``
(atomically) and prints the operators by time.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from unsparse.atomic import atomic_write_text
from unsparse.job import git_commit
from unsparse.runtime.batch_norm_folding import fold_batch_norm_
from unsparse.runtime.bench import MODELS, build_model, environment, require_cuda
from unsparse.runtime.precision import DENSE_PRECISIONS, PRECISIONS, precision_mode
from unsparse.runtime.timing import time_fn
from unsparse.settings import positive_integer_argument


def op_table(events: Iterable[Any], forwards: int) -> list[dict[str, Any]]:
    """One row per aten operator with kernel time of its own, ``{"op", "calls_per_forward", "ms_per_forward"}``,
    the slowest first, from ``torch.profiler``'s ``key_averages()`` (``key``, ``count``, ``self_device_time_total``
    in us) over ``forwards`` forward calls.

    ``key_averages()`` also lists each CUDA kernel by name, with its time again, and the profiler's own activities
    (``Command Buffer Full``); only the operators (keys ``aten::...``) are kept, so the rows add up to the kernel
    time of the forward once (the first GPU run summed all of them: 48.4 ms for a 21.8 ms forward).

    Raises:
        ValueError: for ``forwards`` < 1.
    """
    if forwards < 1:
        raise ValueError(f"forwards: {forwards}, expected at least 1")
    rows = [{"op": event.key, "calls_per_forward": event.count / forwards,
             "ms_per_forward": event.self_device_time_total / 1e3 / forwards}
            for event in events if event.key.startswith("aten::") and event.self_device_time_total > 0]
    return sorted(rows, key=lambda row: -row["ms_per_forward"])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="vgg16")
    parser.add_argument("--precision", choices=DENSE_PRECISIONS, default="tf32")
    parser.add_argument("--layout", choices=["nchw", "nhwc"], default="nhwc")
    parser.add_argument("--batch", type=positive_integer_argument, default=128)
    parser.add_argument("--runs", type=positive_integer_argument, default=20)
    parser.add_argument("--fold-batch-norm", action="store_true",
                        help="fold the model's BatchNorms into its convs first (unsparse.runtime.batch_norm_folding)")
    parser.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args(argv)
    require_cuda("profile_ops.py")
    device = torch.device("cuda", 0)
    mode = PRECISIONS[args.precision]
    memory_format = torch.channels_last if args.layout == "nhwc" else torch.contiguous_format
    with precision_mode(mode.tf32), torch.no_grad():
        model = build_model(args.model).to(device, mode.dtype).to(memory_format=memory_format)
        folded = len(fold_batch_norm_(model)) if args.fold_batch_norm else 0
        x = torch.randn(args.batch, 3, 224, 224, device=device, dtype=mode.dtype).contiguous(
            memory_format=memory_format)
        forward_ms = time_fn(lambda i: model(x), device, runs=args.runs).median_ms
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
            for _ in range(args.runs):
                model(x)
            torch.cuda.synchronize(device)
    rows = op_table(profiler.key_averages(), args.runs)
    result = {"environment": environment(git_commit()), "model": args.model, "precision": args.precision,
              "layout": args.layout, "batch": args.batch, "runs": args.runs, "weights": "synthetic (He-normal, dense)",
              "folded_batch_norm": folded, "forward_ms": forward_ms,
              "kernel_ms_per_forward": sum(row["ms_per_forward"] for row in rows),
              "ops": rows}
    atomic_write_text(Path(args.out), json.dumps(result, indent=1) + "\n")
    print(f"{args.model} {args.precision} {args.layout} b{args.batch}: forward {forward_ms:.3f} ms (CUDA events), "
          f"kernels {result['kernel_ms_per_forward']:.3f} ms per forward")
    for row in rows:
        print(f"  {row['ms_per_forward']:8.3f} ms  {row['calls_per_forward']:5.1f} calls  {row['op']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
