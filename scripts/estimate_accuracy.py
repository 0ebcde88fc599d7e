"""How close the ``generated`` backend's estimates come to its settings' full timings, on chosen layers of a
torchvision model with synthetic weights magnitude-pruned to a stated sparsity (``bench.build_model``,
``bench.magnitude_prune_``).

Per layer and dtype, at one batch size, in one process: every one-program setting of the layer's screen space is
estimated (``GeneratedBackend.estimate_ms``: the setting's call with one program's kernel launched once per kernel,
paper 004 §5's uniform row length) on the inputs rotated past the L2, as the comparator estimates it, and on the layer's
input alone; then built, checked against ``F.conv2d`` in float64 (first, middle and last image) and timed in full the
way the comparator times it (CUDA events, median of ``--runs`` after warm-up, inputs rotated past the L2), and on the
one input too, so that the two ratios (full over estimate, each on the same inputs) separate what the rotation changes
from what the probe misses. cuDNN's convolution (NCHW, TF32 off in float32) is timed beside it, so each record also says
whether the comparator, at ``SCREEN_RATIO``, would have built the setting. Writes ``estimate_accuracy.json`` under
``--out`` (atomically, after every layer) with the environment (GPU, driver, torch/CUDA/cuDNN/CuPy versions, commit).

``--settings`` times the given settings instead (JSON objects of :data:`SETTING_KEYS`, any values
``GeneratedBackend.conv`` accepts, also outside the tuning space, e.g. a launch bound on a stride-1 layer): those of
one program per kernel are estimated as above, those of several programs have no estimate (null) and are built and
timed alone.

    PYTHONPATH=. python3 scripts/estimate_accuracy.py --out $OUT/est --model resnet50 --sparsity 0.9 \\
        --layers conv1 layer4.0.conv3 --dtypes float32 float16
    PYTHONPATH=. python3 scripts/estimate_accuracy.py --out $OUT/est --layers layer2.1.conv2 --dtypes float32 \\
        --settings '{"rows": 32, "programs": 4}' '{"rows": 32, "programs": 4, "min_blocks": 3}'
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from unsparse.runtime import bench
from unsparse.runtime.backends import get_backend
from unsparse.runtime.comparator import SCREEN_RATIO, check_error, check_images, reference_output, tolerance
from unsparse.runtime.timing import cache_bytes, rotated_inputs, rotation_count, time_fn
from unsparse.settings import generated_setting_argument
from unsparse.sparse.format import UniformCSR

SETTING_KEYS = ("rows", "programs", "streams", "chunks", "min_blocks", "load_batch")
"""What a ``--settings`` entry may set (:func:`~unsparse.settings.generated_setting_argument`): ``rows`` required,
``programs`` 1 unless given."""


def layer_records(layer: bench.ConvLayer, dtype: torch.dtype, batch: int, runs: int, device: torch.device,
                  settings: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """One record per one-program setting of ``layer``'s screen space at ``dtype`` and ``batch``, or per setting of
    ``settings``: the setting, its estimate and full median (ms) on the rotated inputs and on the first input alone
    (``*_one_input_ms``), each pair's ratio (median over estimate), its relative error against the float64 reference,
    cuDNN's median (ms) and whether the estimate is within ``SCREEN_RATIO`` of it (estimate fields null for a setting
    of several programs per kernel, which has no probe)."""
    backend = get_backend("generated")
    csr = UniformCSR.from_dense(layer.weight.to(device, dtype))
    bias = None if layer.bias is None else layer.bias.to(device, dtype)
    x = torch.randn(batch, *layer.in_chw, device=device, dtype=dtype)
    inputs = rotated_inputs(x, rotation_count(x.numel() * x.element_size(), cache_bytes(device)))
    space = settings or [params for params in backend.screen_space(x, csr, layer.geometry) if params["programs"] == 1]
    probed = [params for params in space if params["programs"] == 1]
    estimates, one_input_estimates = (iter(backend.estimate_ms(v, csr, layer.geometry, probed) if probed else [])
                                      for v in (inputs, [x]))
    backend.precompile(x, csr, layer.geometry, space)
    images = check_images(batch)
    ref = reference_output(x, csr, bias, layer.geometry, images)
    weight = csr.to_conv2d_weight()
    g = layer.geometry
    cudnn_ms = time_fn(lambda i: F.conv2d(inputs[i % len(inputs)], weight, bias, g.stride, g.padding, g.dilation),
                       device, runs=runs, rotation=len(inputs)).median_ms
    records = []
    for params in space:
        estimate, one_input_estimate = ((next(estimates), next(one_input_estimates)) if params["programs"] == 1
                                        else (None, None))
        out = backend.run(x, csr, bias, layer.geometry, **params)
        error = check_error(out[images], ref, tolerance(dtype))
        median = time_fn(lambda i, p=params: backend.run(inputs[i % len(inputs)], csr, bias, layer.geometry, **p),
                         device, runs=runs, rotation=len(inputs)).median_ms
        one_input = time_fn(lambda i, p=params: backend.run(x, csr, bias, layer.geometry, **p), device,
                            runs=runs).median_ms
        records.append({"layer": layer.name, "dtype": str(dtype).removeprefix("torch."), "batch": batch,
                        "params": params, "estimate_ms": estimate, "median_ms": median,
                        "ratio": None if estimate is None else median / estimate,
                        "estimate_one_input_ms": one_input_estimate, "median_one_input_ms": one_input,
                        "ratio_one_input": None if one_input_estimate is None else one_input / one_input_estimate,
                        "rotation": len(inputs), "rel_error": error, "correct": error <= tolerance(dtype),
                        "cudnn_ms": cudnn_ms,
                        "built_at_screen_ratio": None if estimate is None else estimate <= SCREEN_RATIO * cudnn_ms})
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench.add_layer_arguments(parser, "estimate_accuracy")
    parser.add_argument("--settings", nargs="+", type=functools.partial(generated_setting_argument, keys=SETTING_KEYS),
                        help="JSON objects of the generated backend's parameters to time instead of the screen space, "
                        "e.g. '{\"rows\": 32, \"programs\": 4, \"min_blocks\": 3}'")
    args = parser.parse_args(argv)
    settings = [{"programs": 1, **setting} for setting in args.settings] if args.settings else None
    bench.require_cuda("estimate_accuracy.py")
    device = torch.device("cuda")
    result: dict[str, Any] = {"environment": bench.environment(os.environ.get("UNSPARSE_COMMIT")),
                              "model": args.model, "sparsity": args.sparsity, "weights": "synthetic, magnitude-pruned",
                              "screen_ratio": SCREEN_RATIO, "tf32": False, "records": []}
    bench.time_layers(parser, args, result, "estimate_accuracy.json",
                      lambda layer, dtype: layer_records(layer, dtype, args.batch, args.runs, device, settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
