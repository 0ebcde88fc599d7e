"""Time cuDNN's convolutions in each memory layout, per layer and for whole dense models.

Three ways to run one layer's ``F.conv2d`` (dense random weights of the layer's shape, inputs rotated beyond L2):

- ``nchw``: input, weight and output NCHW (the ``cudnn`` backend's ``memory_format="contiguous"``);
- ``nhwc``: input and weight converted to channels-last before timing, output left channels-last: the kernel alone,
  as a model kept in channels-last from end to end runs it (DESIGN.md's "FP16 channels-last" figures);
- ``nhwc_converted``: the input converted inside the call and the output converted back to NCHW: the conversions
  of the ``cudnn`` backend's ``memory_format="channels_last"``, which an NCHW model pays (here without its bias
  and with the weight converted once).

Whole models (``--whole-models``): the dense model's eager forward with NCHW activations against the same model and
input in channels-last (``Module.to(memory_format=torch.channels_last)``), outputs compared. Precisions as in the
benchmark: ``fp32`` (TF32 off), ``tf32``, ``fp16``. CUDA events after warm-up, medians in ms; one JSON file.

    PYTHONPATH=. python3 scripts/time_cudnn_layouts.py --models vgg16 resnet50 --batch 128 --whole-models \
        --out $OUT/cudnn_layouts.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from unsparse.atomic import atomic_write_text
from unsparse.job import git_commit
from unsparse.runtime.baseline import time_baseline
from unsparse.runtime.bench import MODELS, ConvLayer, build_model, conv_layers, environment, require_cuda
from unsparse.runtime.comparator import relative_error, tolerance
from unsparse.runtime.end_to_end import dense_channels_last
from unsparse.runtime.layout import LAYOUTS as BASELINE_LAYOUTS
from unsparse.runtime.precision import PRECISIONS, precision_mode
from unsparse.runtime.timing import cache_bytes, rotated_inputs, rotation_count, time_fn
from unsparse.settings import output_file

LAYOUTS = (*BASELINE_LAYOUTS, "nhwc_converted")
"""Layer layouts timed, in the order of the records (see the module docstring)."""


def time_layer(layer: ConvLayer, batch: int, precision: str, device: torch.device, runs: int) -> dict[str, Any]:
    """Median ms of each layout of :data:`LAYOUTS` on one layer (dense random weights of the layer's shape), each
    output checked against the NCHW one (relative error): ``nchw`` and ``nhwc`` are the benchmark baseline's
    layouts, timed by :func:`~unsparse.runtime.baseline.time_baseline`; ``nhwc_converted`` converts the NCHW input
    inside the call and the output back.

    Returns:
        A JSON-ready record: layer, input ``(C, H, W)``, weight shape, stride, precision, ``ms`` per layout that
        computed within the precision's tolerance of NCHW, ``rel_error`` per layout against NCHW, the layouts left
        untimed with why (``failures``), rotation, and ``fastest`` (the timed layout with the smallest median; None
        when none computed within the tolerance).
    """
    mode = PRECISIONS[precision]
    g = layer.geometry
    bound = tolerance(mode.dtype, mode.tf32)
    with precision_mode(mode.tf32), torch.no_grad():
        torch.backends.cudnn.benchmark = device.type == "cuda"
        weight = torch.randn(layer.weight.shape, device=device, dtype=mode.dtype) * 0.05
        x = torch.randn(batch, *layer.in_chw, device=device, dtype=mode.dtype)
        inputs = rotated_inputs(x, rotation_count(x.numel() * x.element_size(), cache_bytes(device)))
        reference = F.conv2d(x, weight, None, g.stride, g.padding, g.dilation, g.groups).double()

        def error(out: torch.Tensor) -> float:
            return relative_error(out.double(), reference)

        baseline = time_baseline(inputs, weight, g, error, bound, runs)
        nhwc_weight = weight.contiguous(memory_format=torch.channels_last)

        def converted(i: int) -> torch.Tensor:
            nhwc = inputs[i % len(inputs)].contiguous(memory_format=torch.channels_last)
            return F.conv2d(nhwc, nhwc_weight, None, g.stride, g.padding, g.dilation, g.groups).contiguous()

        ms = {name: timing.median_ms for name, timing in baseline.timings.items()}
        errors = {**baseline.rel_error, "nhwc_converted": error(converted(0))}
        failures = dict(baseline.failures)
        if errors["nhwc_converted"] <= bound:
            ms["nhwc_converted"] = time_fn(converted, device, runs=runs, rotation=len(inputs)).median_ms
        else:
            failures["nhwc_converted"] = f"relative error {errors['nhwc_converted']:.3g} > {bound:.3g}"
    return {"model_layer": layer.name, "in_chw": list(layer.in_chw), "weight_shape": list(layer.weight.shape),
            "stride": list(g.stride), "count": layer.count, "batch": batch, "precision": precision,
            "ms": ms, "rel_error": errors, "failures": failures, "rotation": len(inputs),
            "fastest": min(ms, key=ms.__getitem__) if ms else None}


def time_model(name: str, batch: int, precision: str, device: torch.device, runs: int) -> dict[str, Any]:
    """Eager dense forward of ``name`` (224x224 inputs) in NCHW and in channels-last
    (:func:`~unsparse.runtime.end_to_end.dense_channels_last`): medians in ms, their ratio (``nhwc_speedup`` = NCHW
    over channels-last) and the relative error between the two outputs."""
    mode = PRECISIONS[precision]
    with precision_mode(mode.tf32), torch.no_grad():
        torch.backends.cudnn.benchmark = device.type == "cuda"
        model = build_model(name).to(device, mode.dtype)
        x = torch.randn(batch, 3, 224, 224, device=device, dtype=mode.dtype)
        nchw_ms = time_fn(lambda i: model(x), device, runs=runs).median_ms
        _, nhwc, error = dense_channels_last(model, x, model(x), runs)
        nhwc_ms = nhwc.median_ms
    return {"model": name, "batch": batch, "precision": precision, "nchw_ms": nchw_ms, "nhwc_ms": nhwc_ms,
            "nhwc_speedup": nchw_ms / nhwc_ms, "rel_error": error}


def cuda_device(text: str) -> torch.device:
    """``--device``'s value as a device, which must be a CUDA one: on another device these would be its own
    convolutions timed under cuDNN's labels.

    Raises:
        argparse.ArgumentTypeError: naming the value, if it is no device or not a CUDA one.
    """
    try:
        device = torch.device(text)
    except RuntimeError as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device (e.g. cuda, cuda:1)") from error
    if device.type != "cuda":
        raise argparse.ArgumentTypeError(f"{text!r} is not a CUDA device: the timings are cuDNN's (e.g. cuda, cuda:1)")
    return device


def build_parser() -> argparse.ArgumentParser:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["vgg16", "resnet50"], choices=MODELS)
    parser.add_argument("--precisions", nargs="+", default=["fp32", "tf32", "fp16"],
                        choices=["fp32", "tf32", "fp16"])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--layer-filter", default="", help="regular expression on layer names (search)")
    parser.add_argument("--whole-models", action="store_true", help="also time each dense model end to end")
    parser.add_argument("--device", type=cuda_device, default="cuda", help="a CUDA device (default: cuda)")
    parser.add_argument("--out", type=output_file, required=True, help="JSON file to write (not a folder)")
    return parser


def measure(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Time every layer and model that ``args`` select on ``device`` (the tests pass the CPU): the JSON-ready
    result, with the environment, the layouts and the per-layer and per-model records."""
    layers, models = [], []
    for name in args.models:
        for layer in conv_layers(build_model(name), (3, 224, 224)):
            if re.search(args.layer_filter, layer.name):
                for precision in args.precisions:
                    record = {"model": name, **time_layer(layer, args.batch, precision, device, args.runs)}
                    print(record["model"], record["model_layer"], precision,
                          {k: round(v, 4) for k, v in record["ms"].items()}, flush=True)
                    layers.append(record)
        if args.whole_models:
            for precision in args.precisions:
                models.append(time_model(name, args.batch, precision, device, args.runs))
                print(models[-1], flush=True)
    return {"environment": environment(git_commit()), "runs": args.runs, "layouts": list(LAYOUTS),
            "layers": layers, "models": models}


def main(argv: list[str] | None = None) -> None:
    """Parse arguments (a non-CUDA ``--device`` is refused, and an ``--out`` that is a folder, which the write
    would fail on only after every timing: :func:`~unsparse.settings.output_file`), check that CUDA is there, time
    every selected layer and model, write the JSON atomically."""
    args = build_parser().parse_args(argv)
    require_cuda("time_cudnn_layouts.py")
    atomic_write_text(args.out, json.dumps(measure(args, args.device), indent=1))


if __name__ == "__main__":
    main()
