"""Probe of the weight-specialised kernels (``kernels/generated_conv.cu``) against cuDNN alone, on synthetic layers.

For each case (layer shape, sparsity, dtype) the script draws a weight with the same number of nonzeros in every
output channel at random positions (seeded), compiles one kernel per KT output channels with NVRTC (in parallel),
checks the output against ``F.conv2d`` in float64 on a fresh random input, and times the kernels and cuDNN's
convolution alone in FP32 (TF32 off), TF32 and FP16 (faster of NCHW and NHWC) with CUDA events, median of
``--runs`` after warm-up, in one process. It writes ``probe.json`` under ``--out`` after every case.

    PYTHONPATH=. python3 scripts/probe_generated.py --out $OUT
    CUPY_CACHE_DIR=$(mktemp -d) PYTHONPATH=. python3 scripts/probe_generated.py --out $OUT/mid --cases 0 \
        --skip-icache --nvrtc-option=--Ofast-compile=mid    # one case with another NVRTC option, compiled afresh
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from unsparse.atomic import atomic_write_text
from unsparse.runtime import generated_source as gs
from unsparse.runtime.backends.generated import compile_all, padded_float32
from unsparse.runtime.baseline import time_baseline
from unsparse.runtime.cupy_launcher import COMPILE_OPTIONS
from unsparse.runtime.timing import time_fn
from unsparse.sparse.geometry import ConvGeometry

CASES = (
    ("vgg16.features.12", 256, 256, 56, 3, 1, 0.9, "float32", 32),
    ("vgg16.features.12", 256, 256, 56, 3, 1, 0.9, "float32", 64),
    ("vgg16.features.12", 256, 256, 56, 3, 1, 0.7, "float32", 32),
    ("vgg16.features.19", 512, 512, 28, 3, 1, 0.9, "float32", 32),
    ("resnet50.layer3.1.conv1", 1024, 256, 14, 1, 0, 0.9, "float32", 32),
    ("vgg16.features.12", 256, 256, 56, 3, 1, 0.95, "float16", 32),
    ("resnet50.layer1.0.conv2", 64, 64, 56, 3, 1, 0.9, "float32", 32),
    ("resnet50.layer2.1.conv2", 128, 128, 28, 3, 1, 0.9, "float32", 32),
    ("resnet50.layer3.1.conv2", 256, 256, 14, 3, 1, 0.9, "float32", 32),
    ("vgg16.features.12", 256, 256, 56, 3, 1, 0.9, "float16", 32),
)
"""(layer, C, M, H = W, R = S, padding, sparsity, dtype, KT)."""

ICACHE_BODIES = (512, 1024, 2048, 4096, 6144, 8192, 10240, 12288, 16384)
"""Loop bodies (FFMA instructions, 16 bytes each) of the instruction-cache probe."""


def uniform_weight(out_channels: int, channels: int, kernel: int, sparsity: float, seed: int) -> np.ndarray:
    """``(M, C, R, R)`` float32 with round((1 - sparsity) * C * R * R) nonzeros per row at random positions."""
    rng = np.random.default_rng(seed)
    taps = channels * kernel * kernel
    nnz = round((1 - sparsity) * taps)
    keep = np.argsort(rng.random((out_channels, taps)), axis=1)[:, :nnz]
    weight = np.zeros((out_channels, taps), np.float32)
    np.put_along_axis(weight, keep, rng.standard_normal(keep.shape).astype(np.float32) / math.sqrt(taps), axis=1)
    return weight.reshape(out_channels, channels, kernel, kernel)


def kernel_arguments(padded: Any, y: Any, total: int, out_channels: int, first: int) -> tuple[Any, ...]:
    """``generated_conv``'s arguments, in the order of its signature (``kernels/generated_conv.cu``): the padded
    float32 input, no bias, no residual, the output, ``N * E * F`` pixels, the layer's output channels, the
    program's first row, and the ReLU and max-pool flags off. A launch that passes fewer than the kernel takes reads
    past its argument array (the first run of the sixty-second session segfaulted so, its launch predating v39's
    ``pool``)."""
    return (padded, np.uint64(0), np.uint64(0), y, np.int32(total), np.int32(out_channels), np.int32(first),
            np.int32(0), np.int32(0))


def run_case(case: tuple, batch: int, runs: int, options: tuple[str, ...],
             load_batch: int = gs.LOAD_BATCH, min_blocks: int = 0) -> dict[str, Any]:
    """Compile with the NVRTC ``options``, ``load_batch`` taps per group of loads
    (:func:`~unsparse.runtime.generated_source.products_source`) and ``min_blocks`` blocks per SM in the launch
    bound (0: none; ptxas fits the registers to it, :func:`~unsparse.runtime.generated_source.kernel_source`), check
    and time one case; the record holds every figure and how it was obtained (``compile_s`` is NVRTC's time only
    where CuPy's kernel cache misses: give the run an empty ``CUPY_CACHE_DIR``)."""
    import cupy

    name, channels, out_channels, size, kernel, padding, sparsity, dtype_name, rows = case
    dtype = getattr(torch, dtype_name)
    device = torch.device("cuda")
    weight = uniform_weight(out_channels, channels, kernel, sparsity, seed=0)
    if dtype == torch.float16:
        weight = weight.astype(np.float16).astype(np.float32)
    programs = gs.programs(weight, (padding, padding), (size, size), rows)
    started = time.perf_counter()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    threads = gs.choose_threads(batch * size * size, sms)
    sources = [(gs.kernel_source(program, dtype, min_blocks, load_batch), gs.ENTRY) for program in programs]
    functions = compile_all(sources, options=options)
    compile_s = time.perf_counter() - started
    x = torch.randn(batch, channels, size, size, device=device).to(dtype)
    y = torch.empty(batch, out_channels, size, size, device=device, dtype=dtype)
    grids = [gs.launch_grid(batch * size * size, threads, gs.resident_blocks(f.num_regs, threads), sms)
             for f in functions]
    y_cp = cupy.from_dlpack(y)

    def generated(_: int) -> torch.Tensor:
        padded = padded_float32(x, (padding, padding))  # the backend's padded float32 input (pad_planes)
        padded_cp = cupy.from_dlpack(padded)
        for program, function, grid in zip(programs, functions, grids, strict=True):
            function(grid, (threads, 1, 1), kernel_arguments(padded_cp, y_cp, batch * size * size, out_channels,
                                                                program.first))
        return y

    dense = torch.from_numpy(weight).to(device)
    reference = F.conv2d(x.double(), dense.double(), padding=padding)
    generated(0)
    torch.cuda.synchronize()
    scale = reference.abs().max().item()
    rel_error = ((y.double() - reference).abs().max() / scale).item()
    timing = time_fn(generated, device, runs=runs, warmup=3)
    useful_flop = 2.0 * np.count_nonzero(weight) * batch * size * size
    record: dict[str, Any] = {
        "layer": name, "in_chw": [channels, size, size], "weight_shape": list(weight.shape), "batch": batch,
        "dtype": dtype_name, "target_sparsity": sparsity,
        "measured_sparsity": 1 - np.count_nonzero(weight) / weight.size,
        "weights": "synthetic: uniform nnz per output channel, random positions, seed 0",
        "rows_per_kernel": rows, "load_batch": load_batch, "min_blocks": min_blocks, "nvrtc_options": list(options),
        "threads": threads, "kernels": len(programs),
        "grids": [g[0] for g in grids],
        "body_instructions": [len(p.taps) + p.products for p in programs], "compile_s": compile_s,
        "rel_error": rel_error,
        "generated_ms": timing.to_dict(), "useful_tflops": useful_flop / timing.median_ms / 1e9,
        "registers": [int(f.num_regs) for f in functions],
    }
    geometry = ConvGeometry(stride=(1, 1), padding=(padding, padding), dilation=(1, 1), groups=1)
    modes = {"fp32": (torch.float32, False), "tf32": (torch.float32, True), "fp16": (torch.float16, False)}
    for mode, (mode_dtype, tf32) in modes.items():
        if dtype == torch.float16 and mode != "fp16":
            continue
        saved = torch.backends.cudnn.allow_tf32
        torch.backends.cudnn.allow_tf32 = tf32
        try:
            inputs = [x.to(mode_dtype)]
            ref = reference

            def error(out: torch.Tensor, ref: torch.Tensor = ref) -> float:
                return ((out.double() - ref).abs().max() / scale).item()

            base = time_baseline(inputs, dense.to(mode_dtype), geometry, error, bound=0.05, runs=runs)
        finally:
            torch.backends.cudnn.allow_tf32 = saved
        record[f"cudnn_{mode}"] = base.to_dict()
        if base.median_ms is not None:
            record[f"speedup_vs_cudnn_{mode}"] = base.median_ms / timing.median_ms
    return record


def icache_source(body: int) -> str:
    """PTX of ``icache(out, iterations)`` (:func:`probe_instruction_fetch.ffma_loops_ptx`): one loop of ``body``
    FFMAs with immediate weights."""
    from probe_instruction_fetch import ffma_loops_ptx  # beside this script, on sys.path when it runs

    weights = np.random.default_rng(body).uniform(0.4, 0.6, body).astype(np.float32).view(np.uint32)
    return ffma_loops_ptx("icache", "", "", [], [weights])


def icache_probe(runs: int) -> list[dict[str, Any]]:
    """FFMA issue rate per SM for each loop body of :data:`ICACHE_BODIES` (the same count of FFMAs each): where it
    falls, the body no longer fits the SM's instruction cache."""
    import cupy

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    folder = Path(tempfile.mkdtemp())
    functions = []
    for body in ICACHE_BODIES:
        path = folder / f"icache_{body}.ptx"
        path.write_text(icache_source(body))
        functions.append(cupy.RawModule(path=str(path)).get_function("icache"))
    out = cupy.empty(sms * 8 * 256, dtype=cupy.float32)
    records = []
    for body, function in zip(ICACHE_BODIES, functions, strict=True):
        iterations = 2**21 // body
        timing = time_fn(lambda _, f=function, i=iterations: f((sms * 8, 1, 1), (256, 1, 1), (out, np.int32(i))),
                         torch.device("cuda"), runs=runs, warmup=2)
        warp_instructions = sms * 8 * 8 * body * iterations
        records.append({"body_instructions": body, "body_bytes": 16 * body, "iterations": iterations,
                        "median_ms": timing.median_ms, "registers": int(function.num_regs),
                        "ffma_warp_instructions_per_ns_per_sm": warp_instructions / timing.median_ms / 1e6 / sms})
        print(json.dumps(records[-1]), flush=True)
    return records


def environment() -> dict[str, Any]:
    """GPU, driver and library versions of this run."""
    import cupy

    properties = torch.cuda.get_device_properties(0)
    return {"gpu": properties.name, "sms": properties.multi_processor_count,
            "driver": cupy.cuda.runtime.driverGetVersion(), "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
            "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "cupy": cupy.__version__,
            "python": platform.python_version()}


def main() -> None:
    """Run every case of :data:`CASES` (or ``--cases`` of them) and write ``probe.json`` after each."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--cases", type=int, nargs="*", help="indices into CASES (default: all)")
    parser.add_argument("--nvrtc-option", action="append", default=[],
                        help="an NVRTC option added to COMPILE_OPTIONS (repeatable), e.g. --Ofast-compile=mid")
    parser.add_argument("--skip-icache", action="store_true", help="leave out the instruction-cache probe")
    parser.add_argument("--load-batches", type=int, nargs="+", default=[gs.LOAD_BATCH],
                        help="taps per group of loads in the generated bodies; each case runs once per value")
    parser.add_argument("--min-blocks", type=int, nargs="+", default=[0],
                        help="blocks per SM of the kernels' launch bound (0: none); each case runs once per value "
                             "and --load-batches value")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    result: dict[str, Any] = {"environment": environment(), "commit": args.commit, "batch": args.batch,
                              "runs": args.runs, "records": []}
    args.out.mkdir(parents=True, exist_ok=True)
    options = (*COMPILE_OPTIONS, *args.nvrtc_option)
    result["icache"] = [] if args.skip_icache else icache_probe(args.runs)
    atomic_write_text(args.out / "probe.json", json.dumps(result, indent=1))
    for index in args.cases if args.cases is not None else range(len(CASES)):
        for load_batch, min_blocks in itertools.product(args.load_batches, args.min_blocks):
            try:
                record = run_case(CASES[index], args.batch, args.runs, options, load_batch, min_blocks)
            except Exception as error:  # a failed case is recorded, and the next one still runs
                record = {"case": list(CASES[index]), "load_batch": load_batch, "min_blocks": min_blocks,
                          "error": f"{type(error).__name__}: {error}"}
            result["records"].append(record)
            print(json.dumps({k: v for k, v in record.items() if not k.startswith("cudnn_")}), flush=True)
            atomic_write_text(args.out / "probe.json", json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
