"""The one script the GPU machine runs: GPU tests (``pytest -m gpu``), then the benchmark.

Writes under ``--out`` (default ``$OUT``): ``gpu_check.log`` (environment, pytest output with the 30 slowest GPU
tests' seconds, where a session's device budget goes first), and the
benchmark's ``bench.json``, ``bench.md``, ``plan.json`` and PNG plots; INFO log lines (each layer planned, with
its seconds) go to standard error. The git commit comes from
``UNSPARSE_COMMIT`` (pass it in: ``.git`` does not travel to the device machine) or ``git rev-parse``.

Usage (repository root): ``PYTHONPATH=. python3 scripts/gpu_check.py --quick``
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from unsparse.job import git_commit
from unsparse.runtime import bench
from unsparse.runtime.batch_norm_folding import FOLD_POLICIES
from unsparse.runtime.precision import PRECISIONS, SPARSE_BACKENDS
from unsparse.settings import sparsity_argument


def main(argv: list[str] | None = None) -> int:
    """Run tests and benchmark; returns pytest's exit code (the benchmark still runs after failures), or 2 without
    a CUDA device when only tests were asked for (they would all skip, which pytest counts as success).

    Raises:
        SystemExit: with status 2 and one line, before anything is written: for a bad option (argparse, and the
            benchmark's settings through :func:`~unsparse.runtime.bench.check_run_settings`, which ``run_bench``
            found only after the GPU tests), or without a CUDA device when the benchmark was asked for
            (:func:`~unsparse.runtime.bench.require_cuda`; with ``--skip-tests``, ``run_bench`` stopped there with a
            traceback).
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu_out"))
    parser.add_argument("--quick", action="store_true", help="FP32, batch 128, sparsity 0.9, VGG16 end to end")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--models", nargs="*", choices=bench.MODELS)
    parser.add_argument("--sparsities", nargs="*", type=sparsity_argument, help="each in [0, 1)")
    parser.add_argument("--batches", nargs="*", type=int)
    parser.add_argument("--precisions", nargs="*", choices=list(PRECISIONS),
                        help="fp16_half2: the half2-product kernel, direct_half2, against cuDNN FP16")
    parser.add_argument("--end-to-end", nargs="*", choices=bench.MODELS)
    parser.add_argument("--end-to-end-sparsity", type=sparsity_argument,
                        help="sparsity of the models timed whole, in [0, 1) (default: run_bench's, 0.9)")
    parser.add_argument("--end-to-end-batch", type=int,
                        help="batch size of the models timed whole (default: run_bench's, 128)")
    parser.add_argument("--fuse-relu", action="store_true",
                        help="the models timed whole fuse each conv with the ReLU after it in their sparse copy")
    parser.add_argument("--fuse-max-pool", action="store_true",
                        help="and with the 2x2 max pool after it (after its ReLU, if fused too)")
    parser.add_argument("--fold-batch-norm", choices=FOLD_POLICIES, default="off",
                        help="where the models timed whole fold each BatchNorm after a conv into it: nowhere "
                        "('off'), 'all' convs, or 'epilogue': the layers planned on a backend that adds the bias in "
                        "its epilogue (the fused dense baseline folds every one unless 'off')")
    parser.add_argument("--no-channels-last-plan", action="store_true",
                        help="plan the models timed whole in NCHW only (no channels-last or switched planned times)")
    parser.add_argument("--compile-shared-kernels", action="store_true",
                        help="compile ahead the layers' kernels of several programs too, not only the probes that "
                        "screen them (for whole models, whose layers mostly pass the screen)")
    parser.add_argument("--end-to-end-backends", nargs="*", default=[],
                        choices=SPARSE_BACKENDS,
                        help="sparse backends the models timed whole may also be planned on, beside each precision's "
                        "own (e.g. generated at fp32: cudnn, direct or generated per layer)")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--layer-filter", help="time only the layers whose name matches this regular expression; "
                        "no model end to end then, unless --end-to-end names one")
    parser.add_argument("--time-budget", type=float, help="seconds after which the benchmark starts nothing new")
    parser.add_argument("--timing", choices=["eager", "graph"], default="eager",
                        help="per-layer timing: eager calls, or CUDA-graph replays (GPU time only)")
    parser.add_argument("--sparse-file", help="a trained model (model.safetensors) timed per layer and end to end")
    parser.add_argument("--sparse-input-shape", nargs="*", type=int, help="its per-sample input shape, e.g. 1 28 28")
    args = parser.parse_args(argv)
    if args.layer_filter is not None and args.end_to_end is None:
        args.end_to_end = []
    settings = {"runs": args.runs, "layer_filter": args.layer_filter, "time_budget_s": args.time_budget,
                "sparse_file": args.sparse_file, "sparse_input_shape": args.sparse_input_shape, "timing": args.timing,
                "end_to_end_fuse_relu": args.fuse_relu, "end_to_end_fuse_max_pool": args.fuse_max_pool,
                "end_to_end_fold_batch_norm": args.fold_batch_norm, "end_to_end_backends": args.end_to_end_backends,
                "end_to_end_channels_last": not args.no_channels_last_plan,
                "compile_shared_kernels": args.compile_shared_kernels,
                **(bench.QUICK if args.quick else {}),
                **{name: getattr(args, name) for name in ("models", "sparsities", "batches", "precisions",
                                                           "end_to_end", "end_to_end_sparsity",
                                                           "end_to_end_batch")
                   if getattr(args, name) is not None}}
    if not args.skip_bench:
        try:
            bench.check_run_settings(**settings)
        except bench.BenchRefusedError as error:
            parser.error(str(error))
        bench.require_cuda("gpu_check.py")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = bench.environment(git_commit())
    log = out / "gpu_check.log"
    log.write_text(json.dumps(env, indent=1) + "\n")
    print(json.dumps(env), flush=True)
    code = 0
    if not args.skip_tests and not torch.cuda.is_available():  # every GPU test would skip, and pytest exit 0
        message = "gpu_check: no CUDA device here; no GPU test ran"
        with log.open("a") as handle:
            handle.write(message + "\n")
        print(message, file=sys.stderr, flush=True)
        return 2
    if not args.skip_tests:
        tests = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-x", "-p", "no:cacheprovider",
                                "--durations=30", "tests/gpu"], capture_output=True, text=True)
        with log.open("a") as handle:
            handle.write(tests.stdout + tests.stderr)
        print(tests.stdout[-3000:] + tests.stderr[-2000:], flush=True)
        code = tests.returncode
    if not args.skip_bench:
        result = bench.run_bench(out, commit=env["commit"], **settings)
        print(json.dumps(result["targets"], indent=1), flush=True)
    return code


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    sys.exit(main())
