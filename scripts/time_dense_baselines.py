"""How fast the dense model could be: PyTorch's eager model against the same model with each convolution fused with
its bias and ReLU by cuDNN (``unsparse.runtime.dense_fusion``) and, with ``--compile``, against ``torch.compile``
of it, per precision and layout, all timed in one process (CUDA events after warm-up, medians; CUDA-graph replays
beside the eager times for the eager models). A model with BatchNorms is also timed with them folded into its convs
(``batch_norm_folded``), and every model whose convs have a bias with that bias added by :class:`ConvThenBiasRows`
instead of PyTorch's own pass (``bias_rows``, or ``batch_norm_folded_bias_rows`` after folding).

The end-to-end pages hold the planned sparse model against the eager dense one, whose bias, ReLU and pool passes
took 59 % of VGG16's FP16 channels-last forward (``kernels/NOTES.md``, forty-first session). This measures how much
of that a dense model keeps once fused. Each variant's output is compared with the eager model's of the same
precision and layout (relative error, within 10x the precision's tolerance, else its time is not counted). cuDNN
picks its algorithms by timing them (``torch.backends.cudnn.benchmark``, as the ``cudnn`` backend and the end-to-end
runs do; ``cudnn_benchmark`` in the JSON; the first run, ``..._cudnn_benchmark_off.json``, used its heuristics).
Writes JSON to ``--out`` atomically after every measurement, so a run cut short keeps what it finished.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from unsparse.atomic import atomic_write_text
from unsparse.job import git_commit
from unsparse.runtime.batch_norm_folding import fold_batch_norm_
from unsparse.runtime.bench import MODELS, build_model, environment, require_cuda
from unsparse.runtime.comparator import relative_error, tolerance
from unsparse.runtime.dense_fusion import fuse_dense_conv_relu
from unsparse.runtime.precision import DENSE_PRECISIONS, PRECISIONS, precision_mode
from unsparse.runtime.timing import time_fn, time_graph
from unsparse.settings import positive_integer_argument

LAYOUTS = {"nchw": torch.contiguous_format, "nhwc": torch.channels_last}


class ConvThenBiasRows(nn.Module):
    """An ``nn.Conv2d`` run without its bias, the bias then added over the output viewed as rows of its innermost
    dimension: ``(N*E*F, M)`` in channels-last, ``(N*M, E*F)`` in NCHW (a probe of whether PyTorch's own bias pass,
    ``add_`` of an ``(1, M, 1, 1)`` view, is what makes a folded BatchNorm slower than the BatchNorm pass in FP16
    channels-last; ``kernels/NOTES.md``, forty-second session). Same function as the convolution; the parameters are
    the convolution's own (shared)."""

    def __init__(self, conv: nn.Conv2d) -> None:
        super().__init__()
        self.conv = conv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        conv = self.conv
        out = conv._conv_forward(x, conv.weight, None)  # the convolution's own padding mode
        if conv.bias is None:
            return out
        if out.dim() == 4 and out.is_contiguous(memory_format=torch.channels_last):
            out.permute(0, 2, 3, 1).view(-1, out.shape[1]).add_(conv.bias)
        else:
            out.view(out.shape[0], out.shape[1], -1).add_(conv.bias[:, None])
        return out


def bias_rows_copy(model: nn.Module) -> tuple[nn.Module, int]:
    """A copy of ``model`` with every plain ``nn.Conv2d`` that has a bias in a :class:`ConvThenBiasRows`, and how
    many; ``model`` is not modified."""
    copied = copy.deepcopy(model)
    convs = [(name, module) for name, module in copied.named_modules()
             if type(module) is nn.Conv2d and module.bias is not None]
    for name, conv in convs:
        copied.set_submodule(name, ConvThenBiasRows(conv))
    return copied, len(convs)


def folded_copy(model: nn.Module) -> tuple[nn.Module, int]:
    """A copy of ``model`` with its BatchNorms folded into its convs (:func:`fold_batch_norm_`), and how many."""
    copied = copy.deepcopy(model)
    return copied, len(fold_batch_norm_(copied))


def measure(name: str, forward: Callable[[], torch.Tensor], reference: torch.Tensor, bound: float,
            device: torch.device, runs: int, graphs: bool) -> dict[str, Any]:
    """One variant: its relative error against ``reference`` and, within ``bound``, its eager median (ms) and, where
    ``graphs``, its CUDA-graph median (ms); a capture that fails is recorded, not raised."""
    error = relative_error(forward().double(), reference.double())
    record: dict[str, Any] = {"variant": name, "rel_error": error, "eager_ms": None, "graph_ms": None}
    if error > bound:
        record["reason"] = f"relative error {error:.3g} > {bound:.3g}"
        return record
    record["eager_ms"] = time_fn(lambda i: forward(), device, runs=runs).median_ms
    if graphs:
        try:
            record["graph_ms"] = time_graph(forward, device, runs).median_ms
        except RuntimeError as capture_error:
            record["graph_error"] = str(capture_error)
    return record


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="vgg16")
    parser.add_argument("--precisions", nargs="+", choices=DENSE_PRECISIONS, default=list(DENSE_PRECISIONS))
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--batch", type=positive_integer_argument, default=128)
    parser.add_argument("--runs", type=positive_integer_argument, default=20)
    parser.add_argument("--compile", action="store_true", help="also time torch.compile of the eager model")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds after which no further torch.compile starts")
    parser.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args(argv)
    require_cuda("time_dense_baselines.py")
    started = time.monotonic()
    device = torch.device("cuda", 0)
    torch.backends.cudnn.benchmark = True
    result: dict[str, Any] = {"environment": environment(git_commit()), "model": args.model, "batch": args.batch,
                              "runs": args.runs, "weights": "synthetic (He-normal, dense)", "cudnn_benchmark": True,
                              "runs_by_setting": []}
    for precision in args.precisions:
        mode = PRECISIONS[precision]
        bound = 10 * tolerance(mode.dtype, mode.tf32)
        for layout in args.layouts:
            memory_format = LAYOUTS[layout]
            with precision_mode(mode.tf32), torch.no_grad():
                model = build_model(args.model).to(device, mode.dtype).to(memory_format=memory_format)
                fused, count = fuse_dense_conv_relu(model)
                x = torch.randn(args.batch, 3, 224, 224, device=device, dtype=mode.dtype).contiguous(
                    memory_format=memory_format)
                reference = model(x)
                variants: list[tuple[str, nn.Module, bool]] = [("eager", model, True),
                                                                ("conv_bias_relu_fused", fused, True)]
                folded, folds = folded_copy(model)
                if folds:
                    variants.append(("batch_norm_folded", folded, True))
                rows, with_bias = bias_rows_copy(folded)
                if with_bias:
                    variants.append(("batch_norm_folded_bias_rows" if folds else "bias_rows", rows, True))
                if args.compile and (args.time_budget is None or time.monotonic() - started < args.time_budget):
                    variants.append(("torch_compile", torch.compile(model), False))
                setting = {"precision": precision, "layout": layout, "fused_convs": count, "folded_convs": folds,
                           "bias_rows_convs": with_bias, "variants": []}
                result["runs_by_setting"].append(setting)
                for name, module, graphs in variants:
                    try:
                        setting["variants"].append(measure(name, lambda m=module, x=x: m(x), reference, bound, device,
                                                           args.runs, graphs))
                    except Exception as error:  # a compile that fails (no Triton, say) is a result, not a crash
                        setting["variants"].append({"variant": name, "error": f"{type(error).__name__}: {error}"})
                    atomic_write_text(Path(args.out), json.dumps(result, indent=1) + "\n")
                    last = setting["variants"][-1]
                    print(f"{args.model} {precision} {layout} b{args.batch} {name}: eager {last.get('eager_ms')} ms, "
                          f"graph {last.get('graph_ms')} ms, error {last.get('rel_error', last.get('error'))}",
                          flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
