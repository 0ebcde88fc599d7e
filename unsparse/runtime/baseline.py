"""cuDNN's convolution alone, in its fastest memory layout: the baseline that speedups are reported against.

Issue 6 and DESIGN.md quote cuDNN as the convolution alone. For VGG16's 256x56x56 layer at batch 128 that is
9.84 ms FP32, 1.73 ms TF32 and 0.64 ms FP16 in channels-last. The ``cudnn`` backend times what an NCHW model runs
instead: ``F.conv2d`` with the layer's bias, which PyTorch adds in a separate kernel after cuDNN's. Its channels-last
setting also does both layout conversions inside the call. On VGG16's layers that measured 1.03-2.0x slower than the
convolution alone in FP32, and up to 3.4x in TF32 and 4.4x in FP16 (twelfth session, ``kernels/NOTES.md``), so
speedups against it flattered the sparse kernels.

The baseline here gives cuDNN its best case:
- the input and the weight are converted to the layout before timing, and the output stays in it, as in a model
  kept in that layout from end to end;
- no bias: the direct kernels add theirs in the epilogue, so leaving cuDNN's out favours cuDNN;
- the faster of NCHW and NHWC (``torch.channels_last``), each checked for correctness first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from unsparse.runtime.layout import LAYOUTS
from unsparse.runtime.timing import MIN_RUNS, Timing, capture_graph, time_fn
from unsparse.sparse.geometry import ConvGeometry

NAME = "dense_alone"
"""The baseline's name where it is listed beside the backends (per-layer report rows): cuDNN on CUDA, torch's
CPU convolution on the CPU."""


@dataclass(frozen=True)
class Baseline:
    """The dense convolution alone, per layout.

    Attributes:
        timings: layout name -> :class:`~unsparse.runtime.timing.Timing` (ms) of each layout that computed
            correctly.
        rel_error: layout name -> relative error of its bias-free output against the float64 reference without
            bias (inf where it raised).
        failures: layout name -> why it was not timed (raised, or an error above the bound).
    """

    timings: dict[str, Timing]
    rel_error: dict[str, float]
    failures: dict[str, str]

    @property
    def layout(self) -> str | None:
        """The fastest correct layout, None if none was correct."""
        return min(self.timings, key=lambda name: self.timings[name].median_ms) if self.timings else None

    @property
    def median_ms(self) -> float | None:
        """The fastest correct layout's median (ms), None if none was correct."""
        return None if self.layout is None else self.timings[self.layout].median_ms

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form: ``layout``, ``median_ms``, ``rel_error``, ``failures`` and ``timings`` per layout."""
        return {"layout": self.layout, "median_ms": self.median_ms, "rel_error": self.rel_error,
                "failures": self.failures, "timings": {name: timing.to_dict() for name, timing in self.timings.items()}}


def time_baseline(inputs: Sequence[torch.Tensor], weight: torch.Tensor, geometry: ConvGeometry,
                  error: Callable[[torch.Tensor], float], bound: float, runs: int = MIN_RUNS,
                  warmup: int = 3, graphs: bool = False) -> Baseline:
    """Time ``F.conv2d`` without bias in every layout of :data:`LAYOUTS`, each input and weight converted before.

    Args:
        inputs: rotated ``(N, C, H, W)`` inputs (the comparator's set), any layout; each is converted once.
        weight: dense ``(M, C / groups, R, S)`` weight of the inputs' dtype and device.
        geometry: stride, padding, dilation, groups.
        error: maps a layout's bias-free ``(N, M, E, F)`` output of ``inputs[0]`` to its relative error (the
            caller compares it with its reference less the bias).
        bound: errors above it exclude the layout (recorded in ``rel_error`` and ``failures``, not timed).
        runs, warmup: as in :func:`~unsparse.runtime.timing.time_fn`.
        graphs: time CUDA-graph replays (one graph per rotated input) instead of eager calls, as the comparator's
            ``"graph"`` timing does for the backends.

    Returns:
        A :class:`Baseline`; a layout whose call or graph capture raises a ``RuntimeError`` or ``ValueError`` is
        recorded in ``failures`` and the others are still timed. On CUDA, ``torch.backends.cudnn.benchmark`` is on
        during the calls (as the ``cudnn`` backend sets it), so cuDNN picks its algorithm per layout by timing
        them at the first call; the flag is restored afterwards.
    """
    saved = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = saved or inputs[0].device.type == "cuda"
    timings: dict[str, Timing] = {}
    errors: dict[str, float] = {}
    failures: dict[str, str] = {}
    try:
        for name, memory_format in LAYOUTS.items():
            converted = [x.contiguous(memory_format=memory_format) for x in inputs]
            w = weight.contiguous(memory_format=memory_format)

            def conv(i: int, converted: list[torch.Tensor] = converted, w: torch.Tensor = w) -> torch.Tensor:
                return F.conv2d(converted[i % len(converted)], w, None, geometry.stride, geometry.padding,
                                geometry.dilation, geometry.groups)

            try:
                errors[name] = error(conv(0))
                if errors[name] > bound:
                    failures[name] = f"relative error {errors[name]:.3g} > {bound:.3g}"
                    continue
                timings[name] = time_fn(_replayed(conv, len(converted)) if graphs else conv, inputs[0].device,
                                        runs=runs, warmup=warmup, rotation=len(converted))
            except (RuntimeError, ValueError) as exc:
                errors.setdefault(name, float("inf"))
                failures[name] = f"{type(exc).__name__}: {exc}"
    finally:
        torch.backends.cudnn.benchmark = saved
    return Baseline(timings, errors, failures)


def _replayed(conv: Callable[[int], torch.Tensor], count: int) -> Callable[[int], None]:
    """``conv(i)`` for ``i < count`` captured as one CUDA graph each; the result replays graph ``i % count``."""
    replays = [capture_graph(lambda i=i: conv(i)) for i in range(count)]
    return lambda i: replays[i % count].replay()
