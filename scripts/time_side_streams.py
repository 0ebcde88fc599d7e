"""Does a ``generated`` setting on several streams time the same in every process? Time it after other side streams.

The fifty-seventh and fifty-eighth sessions timed ResNet-50's ``layer4.0.conv3`` at 0.9 (FP32, batch 128, 64
programs of 32 rows on 8 streams) at about 0.55 ms in some processes and about 1.0 ms in others, the estimate and the
full timing alike. The slow processes had run the stem first, whose settings take :func:`side_streams` of 2 (its two
kernels) and 1 (the chunks' padding) before the layer's 8. ``torch.cuda.Stream()`` hands out the streams of a fixed
per-device pool in turn, and the driver feeds all streams through a few hardware work queues
(``CUDA_DEVICE_MAX_CONNECTIONS``, 8 by default), so two of the 8 streams may share a queue, and a kernel then waits
behind another that it does not depend on.

One process per call: it takes ``side_streams(device, k)`` for each ``k`` of ``--before`` (none by default), then
times the layer's 8-stream and one-stream settings (CUDA events, median of ``--runs`` after warm-up, inputs rotated
past the L2), each also as CUDA graph replays (the GPU time alone, ``*_graph_ms``) and by the host's time to issue
one call (``*_host_ms``: ten calls issued without waiting, 640 launches on 8 streams, well within the launch
queue, then the wall clock over ten), and prints one JSON line with the environment (GPU, driver, versions, commit) and
``CUDA_DEVICE_MAX_CONNECTIONS``. Synthetic He-normal weights magnitude-pruned to ``--sparsity``.

    for before in "" "2,1"; do PYTHONPATH=. python3 scripts/time_side_streams.py --before "$before"; done
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from unsparse.runtime import bench
from unsparse.runtime.backends import get_backend
from unsparse.runtime.backends.generated import side_streams
from unsparse.runtime.precision import precision_mode
from unsparse.runtime.timing import cache_bytes, capture_graph, rotated_inputs, rotation_count, time_fn
from unsparse.sparse.format import UniformCSR

HOST_CALLS = 10
"""Calls issued back to back without waiting to time the host's share of one."""


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, take the streams of ``--before``, time the two settings, print the JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="", help="comma-separated side_streams counts taken first, e.g. 2,1")
    parser.add_argument("--model", choices=bench.MODELS, default="resnet50")
    parser.add_argument("--layer", default="layer4.0.conv3")
    parser.add_argument("--sparsity", type=float, default=0.9)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--runs", type=int, default=50)
    args = parser.parse_args(argv)
    bench.require_cuda("time_side_streams.py")
    device = torch.device("cuda")
    before = [int(count) for count in args.before.split(",") if count]
    for count in before:
        side_streams(device, count)
    try:
        layer = bench.pruned_layers(args.model, args.sparsity, [args.layer])[args.layer]
    except ValueError as error:
        parser.error(f"--layer: {error}")
    csr = UniformCSR.from_dense(layer.weight.to(device))
    x = torch.randn(args.batch, *layer.in_chw, device=device)
    inputs = rotated_inputs(x, rotation_count(x.numel() * x.element_size(), cache_bytes(device)))
    backend = get_backend("generated")
    result = {"environment": bench.environment(os.environ.get("UNSPARSE_COMMIT")),
              "cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"), "before": before,
              "model": args.model, "layer": args.layer, "sparsity": args.sparsity, "batch": args.batch,
              "weights": "synthetic, magnitude-pruned", "runs": args.runs}
    with precision_mode(False):
        for streams in (args.streams, 1):
            settings = {"rows": 32, "programs": 1, "streams": streams}
            def call(i: int, s: dict[str, int] = settings) -> torch.Tensor:
                return backend.run(inputs[i % len(inputs)], csr, None, layer.geometry, **s)

            result[f"streams_{streams}_ms"] = time_fn(call, device, runs=args.runs, rotation=len(inputs)).median_ms
            graphs = [capture_graph(lambda i=i, c=call: c(i)) for i in range(len(inputs))]
            result[f"streams_{streams}_graph_ms"] = time_fn(lambda i, g=graphs: g[i % len(g)].replay(), device,
                                                             runs=args.runs, rotation=len(graphs)).median_ms
            torch.cuda.synchronize(device)
            started = time.perf_counter()
            for i in range(HOST_CALLS):
                call(i)
            result[f"streams_{streams}_host_ms"] = (time.perf_counter() - started) * 1e3 / HOST_CALLS
            torch.cuda.synchronize(device)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
