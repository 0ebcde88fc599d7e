"""Run one sparse backend's settings (``direct`` by default) on one synthetic layer a few times, for a profiler
(Nsight Compute) to catch.

Synthetic weights as in the benchmark: He-normal, magnitude-pruned to ``--sparsity`` with the layer norm kept
(``unsparse.runtime.bench.magnitude_prune_``). Prints the
median of CUDA-event timings of the runs so a profile can be matched to a benchmark figure.

    ncu --kernel-name regex:direct_tile --launch-skip 2 --launch-count 1 --section WarpStateStats \
        python3 scripts/profile_direct.py --shape 128 256 56 56 --out-channels 256 \
        --params '{"variant": "tile", "wx": 32, "py": 4, "nb": 2, "mw": 4, "warps": 16, "cc": 8}'
    ncu --kernel-name regex:direct_tile --launch-skip 1 --launch-count 1 --section Occupancy \
        python3 scripts/profile_direct.py --shape 128 512 14 14 --out-channels 512 --stride 2 --runs 1 \
        --params '{"variant": "tile", "wx": 8, "py": 2, "nb": 2, "mw": 8, "warps": 16, "cc": 16}'
    ncu --kernel-name regex:generated_conv --launch-skip 8 --launch-count 1 --section WarpStateStats \
        python3 scripts/profile_direct.py --backend generated --shape 128 256 56 56 --out-channels 256 \
        --params '{"rows": 32}'
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from unsparse.settings import positive_integer_argument, sparsity_argument


def main() -> None:
    """Parse arguments, build the layer, run the setting and print its median time (ms)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", nargs=4, type=positive_integer_argument, required=True,
                        metavar=("N", "C", "H", "W"))
    parser.add_argument("--out-channels", type=positive_integer_argument, required=True)
    parser.add_argument("--kernel", type=positive_integer_argument, default=3)
    parser.add_argument("--stride", type=positive_integer_argument, default=1,
                        help="both directions")
    parser.add_argument("--padding", type=int, default=None,
                        help="both directions (default: kernel // 2)")
    parser.add_argument("--sparsity", type=sparsity_argument, default=0.9, help="in [0, 1) (default %(default)s)")
    parser.add_argument("--dtype", choices=("float32", "float16"), default="float32")
    parser.add_argument("--backend", choices=("direct", "generated"), default="direct")
    parser.add_argument("--params", type=json.loads, action="append", required=True,
                        help="a tuning setting of the backend as JSON; repeat to run several")
    parser.add_argument("--runs", type=positive_integer_argument, default=5)
    args = parser.parse_args()
    import torch
    from torch import nn

    from unsparse.runtime import get_backend
    from unsparse.runtime.bench import magnitude_prune_, require_cuda
    from unsparse.sparse import ConvGeometry, UniformCSR

    require_cuda("profile_direct.py")

    device, dtype = torch.device("cuda"), getattr(torch, args.dtype)
    N, C, H, W = args.shape
    conv = nn.Conv2d(C, args.out_channels, args.kernel, bias=False)
    nn.init.kaiming_normal_(conv.weight, nonlinearity="relu")
    magnitude_prune_(conv, args.sparsity)
    csr = UniformCSR.from_dense(conv.weight.detach().to(device, dtype))
    x = torch.randn(N, C, H, W, device=device, dtype=dtype)
    geometry = ConvGeometry.of(args.stride, args.kernel // 2 if args.padding is None else args.padding)
    backend = get_backend(args.backend)
    for params in args.params:
        backend.conv(x, csr, None, geometry, **params)
        times = []
        for _ in range(args.runs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            backend.conv(x, csr, None, geometry, **params)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        print(json.dumps({"params": params, "median_ms": statistics.median(times)}), flush=True)


if __name__ == "__main__":
    main()
