"""Host cost of one direct-kernel call, piece by piece, against cuDNN through ``F.conv2d``.

At batch 1 every layer's measured time is a host floor (~0.1 ms for the direct backend, ~0.04-0.05 ms for cuDNN
in the 2026-11-23 runs), so this times, for a small 1x1 layer on the current GPU (microseconds per call, host
wall clock over many calls, the GPU kept busy enough not to matter): the whole ``DirectBackend.conv``; its
kernel-argument conversion; ``cupy_launcher.launch`` with prepared arguments; the bare CuPy kernel call with
converted arguments, with and without the device and stream contexts; and ``F.conv2d``. Writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from unsparse.pipeline import git_commit
from unsparse.runtime import cupy_launcher as cl
from unsparse.runtime.backends.direct import DirectBackend
from unsparse.runtime.bench import environment
from unsparse.sparse import ConvGeometry, UniformCSR


def per_call_us(call: Callable[[], object], calls: int) -> float:
    """Mean host microseconds per ``call()`` over ``calls`` calls, after warm-up, synchronised at both ends."""
    for _ in range(20):
        call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--layer", type=int, nargs=3, default=[1024, 256, 14], metavar=("C", "M", "HW"),
                        help="1x1 layer: input channels, output channels, plane side (a tiny layer isolates host "
                             "cost; a real one shows where the kernel itself exceeds it)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import cupy

    device = torch.device("cuda", torch.cuda.current_device())
    C, M, side = args.layer
    weight = torch.randn(M, C, 1, 1, device=device)
    weight[torch.rand_like(weight) < 0.9] = 0
    csr, geometry = UniformCSR.from_dense(weight), ConvGeometry.of(1, 0)
    x = torch.randn(1, C, side, side, device=device)
    backend = DirectBackend()
    params = {"variant": "pointwise", "pv": 1, "mw": 8, "warps": 8, "cc": 32, "stage": "vector"}
    out = backend.conv(x, csr, None, geometry, **params)
    spec = backend._launch(x, csr, geometry, params)
    arrays = next(value for key, value in backend._cache[csr].items() if key[0] == "tile")
    groups = -(-M // 64)
    kernel_args = (x, arrays.chunk_ptr, arrays.entries, None, out, 1, C, side * side, M, groups)
    converted = cl.kernel_arguments(kernel_args, device)
    kernel = cl.get_kernel(spec.name)
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream, device.index)

    def bare() -> None:
        kernel(spec.grid, spec.block, converted, stream=stream)

    def with_contexts() -> None:
        with cupy.cuda.Device(device.index), stream:
            kernel(spec.grid, spec.block, converted)

    dense = weight.clone()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(100):
        bare()
    end.record()
    torch.cuda.synchronize()
    rows = {
        "gpu_us_per_kernel_back_to_back": start.elapsed_time(end) / 100 * 1e3,
        "direct_conv": per_call_us(lambda: backend.conv(x, csr, None, geometry, **params), args.calls),
        "kernel_arguments": per_call_us(lambda: cl.kernel_arguments(kernel_args, device), args.calls),
        "launch": per_call_us(lambda: cl.launch(spec, kernel_args, device), args.calls),
        "cupy_call_with_contexts": per_call_us(with_contexts, args.calls),
        "cupy_call_bare": per_call_us(bare, args.calls),
        "torch_empty": per_call_us(lambda: torch.empty(1, M, side, side, device=device), args.calls),
        "f_conv2d": per_call_us(lambda: F.conv2d(x, dense), args.calls),
    }
    print(rows)
    profile = cProfile.Profile()
    profile.runcall(lambda: [backend.conv(x, csr, None, geometry, **params) for _ in range(args.calls)])
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(15)
    print(text.getvalue())
    result = {"environment": environment(git_commit()), "layer": f"{C}->{M} 1x1 at {side}x{side}, batch 1, 0.9",
              "params": params, "calls": args.calls, "host_us_per_call": rows, "profile": text.getvalue()}
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    (path / f"launch_profile_{C}_{M}_{side}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
