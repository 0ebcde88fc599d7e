"""What the residual add in the ``generated`` kernels' epilogue buys on a residual block's last conv, on the GPU.

ResNet-50's ``conv3`` layers (and the blocks' ends of any residual network fused with ``--fuse-relu``) meet the
residual add and the ReLU after it. Until v64 only ``direct`` and cuDNN added the residual in the convolution's own
call, so a comparator that planned ``generated`` for such a layer paid the add's pass over the output (a read of the
output and of the residual and a write), and ``direct`` won all 13 such layers of layer1-layer3 in the sixty-fourth
session's plan (ResNet-50 at 0.9, FP32, batch 128) though ``generated`` ran the same shape without the residual in
0.158 ms against ``direct``'s 0.385-0.399 with it.

Per layer of ``--layers`` (synthetic He-normal weights magnitude-pruned to ``--sparsity``, ``bench.pruned_layers``)
and dtype, in one process: a random residual of the output's shape; the comparator (``compare_layer``) on cuDNN,
``direct`` and ``generated`` with the ReLU and that residual, as the whole-model planner calls it (its inputs rotated
past the L2, CUDA events, median of ``--runs`` after warm-up, TF32 off); then, for the fastest setting of ``direct``
and of ``generated``, the same setting with the residual in the epilogue and with the add and the ReLU in passes after
it (``run(..., relu=False).add_(residual).relu_()``), timed back to back on the same inputs, so the fusion's gain is a
ratio of one run. ``--all-settings`` times every setting, also the ``generated`` kernels of several programs that the
comparator's screen leaves out where the one-program ones come too far behind (``SCREEN_RATIO``): its first run, on
5b70756, screened them out of all three layers, whose fastest ``generated`` setting was then one program per kernel
on 8 streams. Writes ``residual_fusion.json`` under ``--out`` (atomically, after every layer) with the
environment (GPU, driver, torch/CUDA/cuDNN/CuPy versions, commit).

    PYTHONPATH=. python3 scripts/time_residual_fusion.py --out $OUT/residual \\
        --layers layer1.0.conv3 layer2.0.conv3 layer3.0.conv3 layer4.0.conv3 --dtypes float32 --all-settings
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from unsparse.runtime import bench
from unsparse.runtime.backends import get_backend
from unsparse.runtime.comparator import SCREEN_RATIO, compare_layer
from unsparse.runtime.timing import cache_bytes, rotated_inputs, rotation_count, time_fn
from unsparse.sparse.format import UniformCSR

BACKENDS = ("cudnn", "direct", "generated")
"""What the comparator times on each layer: the dense default and the two sparse backends that fuse the residual."""

FUSING = ("direct", "generated")
"""The backends whose fastest setting is also timed with the add and the ReLU in passes."""


def layer_record(layer: bench.ConvLayer, dtype: torch.dtype, batch: int, runs: int, device: torch.device,
                 screen_ratio: float | None = SCREEN_RATIO) -> dict[str, Any]:
    """The comparison of ``layer`` fused with a random residual and its ReLU at ``dtype`` and ``batch``: per backend
    of :data:`BACKENDS` its fastest correct setting and median (ms, residual in the epilogue where the backend fuses
    it); per backend of :data:`FUSING` that setting's median with the residual in the epilogue (``fused_ms``) and with
    the add and ReLU in passes after it (``passes_ms``), timed back to back; the fastest backend. ``screen_ratio``:
    the comparator's (None: every setting built and timed)."""
    csr = UniformCSR.from_dense(layer.weight.to(device, dtype))
    bias = None if layer.bias is None else layer.bias.to(device, dtype)
    geometry = layer.geometry
    x = torch.randn(batch, *layer.in_chw, device=device, dtype=dtype)
    out_hw = geometry.output_size(*layer.in_chw[1:], csr.kernel_size)
    residual = torch.randn(batch, csr.out_channels, *out_hw, device=device, dtype=dtype)
    inputs = rotated_inputs(x, rotation_count(x.numel() * x.element_size(), cache_bytes(device)))
    comparison = compare_layer(x, csr, bias, geometry, backends=list(BACKENDS), runs=runs, relu=True,
                               residual=residual, screen_ratio=screen_ratio)
    best = comparison.best
    record: dict[str, Any] = {"layer": layer.name, "dtype": str(dtype).removeprefix("torch."), "batch": batch,
                              "nnz_per_row": csr.row_length, "rotation": len(inputs),
                              "best_backend": None if best is None else best.backend, "backends": {}}
    for name in BACKENDS:
        fastest = comparison.fastest(name)
        entry: dict[str, Any] = {"params": None if fastest is None else fastest.params,
                                 "median_ms": None if fastest is None else fastest.timing.median_ms}
        if fastest is not None and name in FUSING:
            backend, params = get_backend(name), fastest.params
            entry["fused_ms"] = time_fn(
                lambda i, b=backend, p=params: b.run(inputs[i % len(inputs)], csr, bias, geometry, relu=True,
                                                     residual=residual, **p),
                device, runs=runs, rotation=len(inputs)).median_ms
            entry["passes_ms"] = time_fn(
                lambda i, b=backend, p=params: b.run(inputs[i % len(inputs)], csr, bias, geometry,
                                                     **p).add_(residual).relu_(),
                device, runs=runs, rotation=len(inputs)).median_ms
        record["backends"][name] = entry
    return record


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, compare every layer and dtype, write the JSON after each."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench.add_layer_arguments(parser, "residual_fusion", dtypes=["float32"])
    parser.add_argument("--all-settings", action="store_true",
                        help="time every setting, also those the comparator's screen would leave out")
    args = parser.parse_args(argv)
    bench.require_cuda("time_residual_fusion.py")
    device = torch.device("cuda")
    screen_ratio = None if args.all_settings else SCREEN_RATIO
    result: dict[str, Any] = {"environment": bench.environment(os.environ.get("UNSPARSE_COMMIT")),
                              "model": args.model, "sparsity": args.sparsity, "weights": "synthetic, magnitude-pruned",
                              "residual": "random normal, the output's shape", "tf32": False, "runs": args.runs,
                              "screen_ratio": screen_ratio, "records": []}
    bench.time_layers(parser, args, result, "residual_fusion.json",
                      lambda layer, dtype: [layer_record(layer, dtype, args.batch, args.runs, device, screen_ratio)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
