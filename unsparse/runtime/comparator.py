"""The per-layer comparator (DESIGN.md, Runtime and comparator).

For one layer and input it runs every applicable backend over its tuning space, checks each setting's
output against a float64 reference, times the correct ones, and names the fastest. Large tuning spaces
are screened first (a few runs each) and only the best settings are timed with the full run count; both
measurements are recorded. A backend's settings that are dear to build (``generated``'s kernels of several programs)
wait for its cheap ones, and are built only where those come near the backends timed before (:data:`SCREEN_RATIO`).
:func:`plan_model` does this for every sparse layer of a model and fills a
:class:`~unsparse.runtime.plan.Plan`, reusing entries already planned.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from unsparse.runtime.backends import available_backends, get_backend
from unsparse.runtime.backends.base import EPILOGUE_PARAMETER, ConvBackend
from unsparse.runtime.backends.dense import MEMORY_FORMATS
from unsparse.runtime.baseline import Baseline, time_baseline
from unsparse.runtime.layout import layout_of
from unsparse.runtime.modules import SparseConv, set_backend, sparse_layers, temporary_backend, visit_layer_inputs
from unsparse.runtime.plan import Plan, PlanEntry, key_layout, layer_key, use_plan
from unsparse.runtime.precision import tf32_flags
from unsparse.runtime.timing import (
    MIN_RUNS,
    Timing,
    cache_bytes,
    capture_graph,
    rotated_inputs,
    rotation_count,
    time_fn,
    time_graph,
)
from unsparse.sparse.format import UniformCSR
from unsparse.sparse.geometry import ConvGeometry

log = logging.getLogger(__name__)

COMPARED_BY_DEFAULT_EXCLUDES = frozenset({"reference", "auto", "direct_half2", "generated"})
"""Backends not timed unless asked for: the reference is the check, ``auto`` is the plan itself,
``direct_half2`` rounds every product to float16 (an opt-in change of numerics), and ``generated`` compiles kernels
per weight (seconds to minutes per layer)."""
DENSE_DEFAULTS = {"cudnn": {"nchw": {"memory_format": "contiguous"}, "nhwc": {"memory_format": "channels_last"}},
                  "dense_cpu": {"nchw": {}, "nhwc": {}}}
"""Per backend name and input layout, the parameters of the dense default a plan falls back to: cuDNN in the input's
layout, which converts nothing; ``dense_cpu`` with its format left to the input's (:func:`is_dense_default`)."""
TIMINGS = ("eager", "graph")
"""How :func:`compare_layer` times a setting: ``eager`` calls (CUDA events around each call, host work included,
the default) or ``graph`` replays (each setting captured as a CUDA graph per rotated input: the GPU time alone,
what a graph-captured deployment sees; at batch 1 the eager times are host floors)."""
PLAN_MARGIN = 0.03
"""Fraction by which a setting must beat the dense default to be planned (run-to-run noise of the timings)."""
DISTURBED_RATIO = 1.5
"""A full timing whose median exceeds the same setting's screening median by more than this factor is taken for a
disturbed one and repeated once (:class:`Measurement` keeps both): on an H100 a tiling screened at 0.241 ms timed a
median of 0.543 ms (its maximum 1.71 ms) and lost to one of 0.239 ms; in two quiet runs the full and screening
medians of all 30 settings timed both ways agreed within 1.4 % (``h100_2026-11-25_twentyfirst_{final,retime}_*``)."""

SCREEN_RATIO = 1.3
"""How much slower than the fastest backend timed before it (cuDNN, which :func:`compare_layer` times first in the
benchmarks' order) the best of a backend's :meth:`~unsparse.runtime.backends.base.ConvBackend.screen_space` may be
for its other settings to be built and timed (:func:`compare_layer`'s ``screen_ratio``). In the committed H200
per-layer results (246 comparisons that timed ``generated``'s kernels of several programs, VGG16 and ResNet-50, FP32,
TF32 and FP16, batch 1 and 128), such a kernel was the fastest setting in 115; at this ratio 63 of the 246 would
have skipped them, and 2 of the 115 wins with them, VGG16 features.24 at 0.98 in TF32 (0.975 and 0.984 of cuDNN,
inside :data:`PLAN_MARGIN`, so no plan changes; ``scripts/screening_what_if.py`` replays this,
:mod:`unsparse.report.screening`)."""


def is_dense_default(backend: str, params: dict[str, Any], layout: str) -> bool:
    """Whether ``backend`` run with ``params`` is the dense default of a layer whose input is in ``layout``
    (``"nchw"`` or ``"nhwc"``): a backend of :data:`DENSE_DEFAULTS` computing in that layout, its ``memory_format``
    naming it or left out (the input's). ``dense_cpu``'s default entry leaves it out while the comparator times it
    named, as its tuning space offers it."""
    memory_format = params.get("memory_format")
    return (backend in DENSE_DEFAULTS and set(params) <= {"memory_format"}
            and (memory_format is None or MEMORY_FORMATS.get(memory_format) == layout))


def tolerance(dtype: torch.dtype, tf32: bool = False) -> float:
    """Relative-error bound ``||out - ref|| / ||ref||`` for a backend output of ``dtype``.

    float32 1e-5 (5e-3 when TF32 is allowed), float16 2e-3, bfloat16 1.5e-2, float64 1e-10.
    """
    if dtype == torch.float32:
        return 5e-3 if tf32 else 1e-5
    return {torch.float16: 2e-3, torch.bfloat16: 1.5e-2, torch.float64: 1e-10}[dtype]


def check_images(batch: int) -> list[int]:
    """Images whose outputs are checked: first, middle and last (covers sub-batch starts and tails)."""
    return sorted({0, batch // 2, batch - 1})


def reference_output(x: torch.Tensor, csr: UniformCSR, bias: torch.Tensor | None, geometry: ConvGeometry,
                     images: list[int]) -> torch.Tensor:
    """float64 ``F.conv2d`` of the selected images with the decompressed weight, on ``x``'s device.

    Returns:
        ``(len(images), M, E, F)`` float64.
    """
    weight = csr.to_conv2d_weight().double()
    return F.conv2d(x[images].double(), weight, None if bias is None else bias.double(), geometry.stride,
                    geometry.padding, geometry.dilation, geometry.groups)


def with_epilogue(out: torch.Tensor, relu: bool, max_pool: bool, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``out`` (``(n, M, E, F)``) through what a fused layer applies after its convolution: ``+ residual`` where
    given (of ``out``'s shape, or one that broadcasts to it), ``torch.relu`` where ``relu``, then
    ``F.max_pool2d(., 2)`` where ``max_pool`` (``(n, M, E // 2, F // 2)``); a new tensor or ``out``
    itself, never modified."""
    out = out if residual is None else out + residual
    out = torch.relu(out) if relu else out
    return F.max_pool2d(out, 2) if max_pool else out


def resolution(dtype: torch.dtype) -> float:
    """The spacing of ``dtype``'s subnormal numbers: no rounding to ``dtype`` can be closer than half of it.

    float16 2**-24, bfloat16 2**-133, float32 2**-149, float64 0 (negligible).
    """
    return {torch.float16: 2.0**-24, torch.bfloat16: 2.0**-133, torch.float32: 2.0**-149}.get(dtype, 0.0)


def relative_error(out: torch.Tensor, ref: torch.Tensor, floor: float = 0.0) -> float:
    """``||out - ref|| / max(||ref||, floor)`` in float64 (absolute when both are zero); inf for NaN or shape
    mismatch.

    ``floor`` keeps outputs whose magnitude is near the storage dtype's resolution (underflowing activations
    in float16) from reading as large relative errors: :func:`check_error` sets it so that an RMS error of
    one subnormal step counts as exactly at the tolerance.
    """
    if out.shape != ref.shape:
        return float("inf")
    diff = torch.linalg.vector_norm(out.double() - ref).item()
    scale = max(torch.linalg.vector_norm(ref).item(), floor)
    error = diff / scale if scale > 0 else diff
    return error if error == error else float("inf")


def check_error(out: torch.Tensor, ref: torch.Tensor, bound: float) -> float:
    """The error :func:`compare_layer` holds against ``bound``: :func:`relative_error` with a floor of
    ``sqrt(numel) * resolution(out.dtype) / bound`` on ``||ref||``, i.e. accepted when
    ``||out - ref|| <= max(bound * ||ref||, sqrt(numel) * resolution)``."""
    floor = math.sqrt(ref.numel()) * resolution(out.dtype) / bound
    return relative_error(out, ref, floor)


@dataclass
class Measurement:
    """One backend setting on one layer.

    Attributes:
        backend, params: what ran. status: ``"ok"`` (correct and timed), ``"wrong"`` (failed the check),
            ``"unsupported"``, ``"error"`` (raised), ``"screened"`` (not built: the backend's first settings were
            too slow, :data:`SCREEN_RATIO`). rel_error: against the float64 reference.
        screen: timing of the screening pass (few runs), if any. timing: full timing (>= 20 runs), if any.
        disturbed: a first full timing whose median was more than :data:`DISTURBED_RATIO` times the screening
            median (the machine was busy meanwhile), kept for the record; ``timing`` is then a second one.
        estimate_ms: the time (ms) the backend expected of this setting before building it
            (:meth:`~unsparse.runtime.backends.base.ConvBackend.estimate_ms`), where it estimated one: a screened
            setting's reason, and beside a built one's timings the estimate's accuracy.
        reason: why it is not ``"ok"``.
    """

    backend: str
    params: dict[str, Any]
    status: str
    rel_error: float | None = None
    screen: Timing | None = None
    timing: Timing | None = None
    disturbed: Timing | None = None
    estimate_ms: float | None = None
    reason: str | None = None

    @property
    def median_ms(self) -> float:
        """Full-timing median (ms), else the screening median, else inf."""
        chosen = self.timing or self.screen
        return chosen.median_ms if chosen is not None else float("inf")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (timings as dicts)."""
        data = asdict(self)
        data["median_ms"] = self.median_ms if self.median_ms != float("inf") else None
        return data


@dataclass
class LayerComparison:
    """All measurements of one layer on one input, and the fastest correct one (``best``).

    ``baseline``: cuDNN's convolution alone in its fastest layout (:mod:`unsparse.runtime.baseline`), when asked
    for; speedups are reported against it, while plans choose among the measurements. ``layout``: the input's
    (:func:`~unsparse.runtime.layout.layout_of`); every measured output was returned in it. ``compile_s``: seconds
    (wall clock) each backend's ``precompile`` took before its settings ran, with its estimates
    (:meth:`~unsparse.runtime.backends.base.ConvBackend.estimate_ms`, whose probes compile too), the kernel compiles
    of the weight-specialised backend above all (NVRTC; near 0 where CuPy's kernel cache or this process already
    held them); backends with neither have no entry.
    """

    key: str
    measurements: list[Measurement] = field(default_factory=list)
    baseline: Baseline | None = None
    layout: str = "nchw"
    compile_s: dict[str, float] = field(default_factory=dict)

    @property
    def best(self) -> Measurement | None:
        """Fastest fully timed correct setting (None if nothing ran correctly)."""
        timed = [m for m in self.measurements if m.status == "ok" and m.timing is not None]
        return min(timed, key=lambda m: m.timing.median_ms) if timed else None

    def fastest(self, backend: str) -> Measurement | None:
        """Fastest fully timed correct setting of one backend."""
        timed = [m for m in self.measurements if m.backend == backend and m.status == "ok" and m.timing]
        return min(timed, key=lambda m: m.timing.median_ms) if timed else None

    def chosen(self, margin: float = PLAN_MARGIN) -> Measurement | None:
        """The setting a plan should run: :attr:`best`, unless the dense default (the dense backend in the input's
        layout, :data:`DENSE_DEFAULTS`) is within ``margin`` of it, then the default.

        A layer-by-layer win smaller than run-to-run noise buys nothing and can cost a whole model time
        (a layout switch, a kernel that behaves differently between neighbours), so a plan only leaves the
        dense default for a measured gain of more than ``margin`` (a fraction of the default's median).
        """
        best, default = self.best, self.default_measurement()
        if best is None or default is None:
            return best
        return default if best.timing.median_ms > (1 - margin) * default.timing.median_ms else best

    def plan_entry(self, margin: float = PLAN_MARGIN) -> PlanEntry:
        """The plan entry this comparison implies (:meth:`chosen`).

        Raises:
            RuntimeError: if no backend ran correctly.
        """
        best = self.chosen(margin)
        if best is None:
            raise RuntimeError(f"{self.key}: no backend produced a correct output")
        others = sorted({m.backend for m in self.measurements if m.status == "ok" and m.backend != best.backend})
        runner = min(others, key=lambda b: self.fastest(b).median_ms) if others else None
        return PlanEntry(best.backend, best.params, best.timing.median_ms, runner)

    def default_measurement(self, backend: str | None = None) -> Measurement | None:
        """The timed, correct measurement of the dense default in this layer's layout (:func:`is_dense_default`), of
        ``backend`` if named, else of any dense backend; None if it was not timed."""
        return next((m for m in self.measurements if m.status == "ok" and m.timing is not None
                     and (backend is None or m.backend == backend)
                     and is_dense_default(m.backend, m.params, self.layout)), None)

    def default_entry(self, backend: str, runner_up: str | None = None) -> PlanEntry:
        """The plan entry of the dense default ``backend`` (a key of :data:`DENSE_DEFAULTS`) in this layer's layout,
        with its measured median (NaN where it was not timed, e.g. a comparison of other backends only)."""
        measured = self.default_measurement(backend)
        return PlanEntry(backend, dict(DENSE_DEFAULTS[backend][self.layout]),
                         measured.timing.median_ms if measured else float("nan"), runner_up)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form with every measurement and the winner."""
        best = self.best
        return {"key": self.key, "layout": self.layout, "best": None if best is None else best.to_dict(),
                "measurements": [m.to_dict() for m in self.measurements], "compile_s": dict(self.compile_s),
                "baseline": None if self.baseline is None else self.baseline.to_dict()}


def compare_layer(x: torch.Tensor, csr: UniformCSR, bias: torch.Tensor | None, geometry: ConvGeometry,
                  backends: list[str] | None = None, runs: int = MIN_RUNS, warmup: int = 3,
                  screen_runs: int = 3, keep: int = 3, tol: float | None = None,
                  timing: str = "eager", baseline: bool = False, relu: bool = False,
                  max_pool: bool = False, residual: torch.Tensor | None = None,
                  screen_ratio: float | None = SCREEN_RATIO) -> LayerComparison:
    """Compare backends on one layer (DESIGN.md, Runtime and comparator).

    Args:
        x: ``(N, C, H, W)`` input on the device to compare on, NCHW or channels-last: every setting returns its
            output in ``x``'s layout (conversions timed with it), and the plan key and the dense default follow
            it. csr, bias, geometry: the layer.
        relu, max_pool: the layer is fused with the ReLU, and the 2x2 max pool, that follow it
            (:func:`~unsparse.runtime.modules.sparsify`'s fusions): every setting is checked and timed with them, in
            its epilogue where its backend fuses them, else as a separate pass after it
            (:meth:`~unsparse.runtime.backends.base.ConvBackend.run`), so a plan chooses by what the model runs, and
            the key carries them (:func:`~unsparse.runtime.plan.layer_key`). The baseline stays the convolution
            alone.
        residual: the layer is fused with a residual add before its ReLU (``SparseConv.residual``): every setting
            is checked and timed adding this tensor (the one the model's forward gave the layer; the same tensor in
            every timed call, while the inputs rotate), and the key says ``residual``.
        backends: names to try; default every backend available on ``x``'s device except those in
            :data:`COMPARED_BY_DEFAULT_EXCLUDES`.
        runs, warmup: full timing of each backend's ``keep`` best settings (runs >= 1; the protocol wants
            >= 20), repeated once where it reads as disturbed (:data:`DISTURBED_RATIO`). screen_runs: runs per
            setting when a backend has more than ``keep`` settings, or before its settings beyond its
            :meth:`~unsparse.runtime.backends.base.ConvBackend.screen_space` are built.
        screen_ratio: a backend's settings beyond its ``screen_space`` are built and timed only where the best of
            that space screens at most this many times the fastest full median of the backends before it (in
            ``backends``' order), else recorded as ``"screened"`` (:data:`SCREEN_RATIO`); None: all are timed.
        tol: relative error bound; default :func:`tolerance` of ``x.dtype`` (TF32-aware).
        timing: one of :data:`TIMINGS`; a setting whose graph capture fails is recorded as an error.
        baseline: also time the dense convolution alone in each layout
            (:func:`~unsparse.runtime.baseline.time_baseline`, eager or as graphs like the rest), same inputs.

    Returns:
        Every measurement, correct or not; ``best`` is the fastest correct one.

    Raises:
        ValueError: for an unknown ``timing``, or ``"graph"`` on a device other than CUDA.
    """
    if timing not in TIMINGS:
        raise ValueError(f"timing: unknown {timing!r}, expected one of {TIMINGS}")
    if timing == "graph" and x.device.type != "cuda":
        raise ValueError(f"timing: CUDA graphs need a CUDA input, got {x.device}")
    names = backends if backends is not None else [
        b for b in available_backends(x.device) if b not in COMPARED_BY_DEFAULT_EXCLUDES]
    tf32 = x.device.type == "cuda" and tf32_flags()[0]
    bound = tol if tol is not None else tolerance(x.dtype, tf32)
    images = check_images(x.shape[0])
    epilogue = {"relu": relu, "max_pool": max_pool}
    with torch.no_grad():
        ref = reference_output(x, csr, bias, geometry, images)
        checked = with_epilogue(ref, **epilogue, residual=_checked_images(residual, images, x.shape[0]))
        inputs = rotated_inputs(x, rotation_count(x.numel() * x.element_size(), cache_bytes(x.device)))
        result = LayerComparison(layer_key(x, csr, geometry, **epilogue, residual=residual is not None),
                                 layout=layout_of(x))
        if residual is not None:
            epilogue["residual"] = residual
        for name in names:
            rival_ms = min((m.timing.median_ms for m in result.measurements if m.status == "ok" and m.timing),
                           default=None)
            measured, seconds = _measure_backend(name, inputs, csr, bias, geometry, checked, images, bound, runs,
                                                 warmup, screen_runs, keep, timing == "graph", epilogue, rival_ms,
                                                 screen_ratio)
            result.measurements += measured
            if seconds is not None:
                result.compile_s[name] = seconds
        if baseline:
            conv_ref = ref if bias is None else ref - bias.double().reshape(1, -1, 1, 1)
            result.baseline = time_baseline(inputs, csr.to_conv2d_weight().to(x.dtype), geometry,
                                            lambda out: check_error(out[images], conv_ref, bound), bound, runs,
                                            warmup, timing == "graph")
    return result


def _checked_images(residual: Any, images: list[int], batch: int) -> Any:
    """What the reference adds for the checked ``images``: a residual with a row per image, those rows in float64;
    one that broadcasts over the batch (a ``(1, M, 1, 1)`` parameter), or a number, as it is."""
    if not isinstance(residual, torch.Tensor):
        return residual
    return (residual[images] if residual.dim() == 4 and residual.shape[0] == batch else residual).double()


def _measure_backend(name: str, inputs: list[torch.Tensor], csr: UniformCSR, bias: torch.Tensor | None,
                     geometry: ConvGeometry, ref: torch.Tensor, images: list[int], bound: float, runs: int,
                     warmup: int, screen_runs: int, keep: int, graphs: bool, epilogue: dict[str, Any],
                     rival_ms: float | None = None,
                     screen_ratio: float | None = SCREEN_RATIO) -> tuple[list[Measurement], float | None]:
    """The measurements of backend ``name``, each setting run with ``epilogue`` (``relu``, ``max_pool`` and
    ``residual`` of :meth:`~unsparse.runtime.backends.base.ConvBackend.run`; ``ref`` is the reference through them),
    and the seconds its ``precompile`` and estimates took (None without either). Of more than ``keep`` correct settings
    the ``keep`` fastest in a short screening are timed in full, and the dense default (:func:`is_dense_default`)
    whatever its screening: :meth:`LayerComparison.chosen` holds every other setting to :data:`PLAN_MARGIN` against its
    full timing (cuDNN has four settings for a layer fused with its ReLU, so its default could be screened out). With
    ``graphs`` the settings that replay their own CUDA graph (``graph``, the ``generated`` backend's) are left out:
    inside the timed capture they run as their twin without it. Once all are timed, the backend releases what
    it held for them alone (:meth:`~unsparse.runtime.backends.base.ConvBackend.release`).

    With ``rival_ms`` (the fastest full median of the layer's backends timed before) and ``screen_ratio``, the
    settings of the backend's :meth:`~unsparse.runtime.backends.base.ConvBackend.screen_space` are first estimated
    (:meth:`~unsparse.runtime.backends.base.ConvBackend.estimate_ms`, as graph replays with ``graphs``; its seconds
    count as compile seconds), and one
    estimated at more than ``screen_ratio`` times ``rival_ms`` is not built but recorded with status ``"screened"``,
    its estimate and both times in its reason. The settings the screen space leaves out are built (``precompile``),
    checked and timed only if the best screening median or estimate of the others is at most ``screen_ratio`` times
    ``rival_ms``, else recorded the same way. ``rival_ms`` or ``screen_ratio`` None: every setting runs."""
    backend = get_backend(name)
    x = inputs[0]
    reason = backend.unsupported_reason(x, csr, geometry)
    if reason is not None:
        return [Measurement(name, {}, "unsupported", reason=reason)], None
    space = [params for params in backend.settings(x, csr, geometry, epilogue["relu"])
             if not (graphs and params.get("graph"))]
    screening = rival_ms is not None and screen_ratio is not None
    first = ([params for params in backend.settings(x, csr, geometry, epilogue["relu"],
                                                    backend.screen_space(x, csr, geometry)) if params in space]
             if screening else space)
    rest = [params for params in space if params not in first]
    replays: dict[int, list[torch.cuda.CUDAGraph]] = {}
    compile_s: list[float] = []

    def checked(settings: list[dict[str, Any]]) -> list[Measurement]:
        precompile = getattr(backend, "precompile", None)
        if precompile is not None and settings:
            started = time.perf_counter()
            precompile(x, csr, geometry, settings)
            compile_s.append(time.perf_counter() - started)
        measured = [_check_setting(backend, x, csr, bias, geometry, ref, images, bound, epilogue, params)
                    for params in settings]
        for m in measured if graphs else []:
            if m.status == "ok":
                try:
                    replays[id(m)] = [capture_graph(lambda v=v, m=m: backend.run(v, csr, bias, geometry, **epilogue,
                                                                                 **m.params))
                                      for v in inputs]
                except RuntimeError as exc:
                    m.status, m.reason = "error", f"graph capture: {type(exc).__name__}: {exc}"
        return measured

    def timed(m: Measurement, count: int, warm: int) -> Timing:
        if not graphs:
            return time_fn(lambda i: backend.run(inputs[i % len(inputs)], csr, bias, geometry, **epilogue,
                                                 **m.params),
                           x.device, runs=count, warmup=warm, rotation=len(inputs))
        captured = replays[id(m)]
        return time_fn(lambda i: captured[i % len(captured)].replay(), x.device, runs=count, warmup=warm,
                       rotation=len(captured))

    def screened(measured: list[Measurement]) -> list[Measurement]:
        for m in measured:
            if m.status == "ok" and m.screen is None:
                m.screen = timed(m, screen_runs, 1)
        return [m for m in measured if m.status == "ok"]

    def too_slow(what: str, ms: float) -> str:
        return (f"screened out: {what} {ms:.4g} ms, more than {screen_ratio:g} x the fastest other backend's "
                f"{rival_ms:.4g} ms")

    estimates = [None] * len(first)
    if screening:
        started = time.perf_counter()
        estimates = backend.estimate_ms(inputs, csr, geometry, first, epilogue["relu"], epilogue["max_pool"], graphs)
        if any(estimate is not None for estimate in estimates):
            compile_s.append(time.perf_counter() - started)
    promising = [e is None or e <= screen_ratio * rival_ms for e in estimates]
    measurements = checked([params for params, keep in zip(first, promising, strict=True) if keep])
    for m, estimate in zip(measurements, [e for e, keep in zip(estimates, promising, strict=True) if keep],
                           strict=True):
        m.estimate_ms = estimate
    probed = [Measurement(name, params, "screened", estimate_ms=estimate,
                          reason=too_slow("estimated before its build at", estimate))
              for params, estimate, keep in zip(first, estimates, promising, strict=True) if not keep]
    measurements += probed
    if rest:
        best_ms, how = min([(m.screen.median_ms, "timed") for m in screened(measurements)]
                           + [(m.estimate_ms, "estimated") for m in probed], default=(None, None))
        if best_ms is not None and best_ms <= screen_ratio * rival_ms:
            measurements += checked(rest)
        else:
            reason = ("screened out: no setting timed first ran correctly" if best_ms is None
                      else too_slow(f"the best setting tried first was {how} at", best_ms))
            measurements += [Measurement(name, params, "screened", reason=reason) for params in rest]
    correct = [m for m in measurements if m.status == "ok"]
    if len(correct) > keep:
        ranked = sorted(screened(correct), key=lambda m: m.screen.median_ms)
        layout = layout_of(x)  # the dense default is timed in full whatever its screening: the margin reads it
        correct = ranked[:keep] + [m for m in ranked[keep:] if is_dense_default(name, m.params, layout)]
    for m in correct:
        m.timing = timed(m, runs, warmup)
        if m.screen is not None and m.timing.median_ms > DISTURBED_RATIO * m.screen.median_ms:
            m.disturbed, m.timing = m.timing, timed(m, runs, warmup)
    backend.release(csr)
    return measurements, sum(compile_s) if compile_s else None


def _check_setting(backend: ConvBackend, x: torch.Tensor, csr: UniformCSR, bias: torch.Tensor | None,
                   geometry: ConvGeometry, ref: torch.Tensor, images: list[int], bound: float,
                   epilogue: dict[str, Any], params: dict[str, Any]) -> Measurement:
    """One setting of ``backend`` run once on ``x`` and its ``images`` checked against ``ref``: a measurement of
    status ``"ok"`` (untimed), ``"wrong"`` or ``"error"`` (a ``RuntimeError`` or ``ValueError`` raised)."""
    try:
        out = backend.run(x, csr, bias, geometry, **epilogue, **params)
        error = check_error(out[images], ref, bound)
    except (RuntimeError, ValueError) as exc:
        return Measurement(backend.name, params, "error", reason=f"{type(exc).__name__}: {exc}")
    if error > bound:
        return Measurement(backend.name, params, "wrong", error, reason=f"relative error {error:.3g} > {bound:.3g}")
    return Measurement(backend.name, params, "ok", error)


def plan_model(model: nn.Module, example: torch.Tensor, plan: Plan | None = None,
               backends: list[str] | None = None, checkpoint: Callable[[Plan], Any] | None = None,
               **compare_kwargs: Any) -> tuple[Plan, list[LayerComparison]]:
    """Plan every :class:`SparseConv` of ``model`` for input ``example`` and switch them to ``"auto"``.

    One forward pass runs the layers on their dense fallback; before each sparse layer runs, its actual
    input is compared with :func:`compare_layer` unless its key is already in ``plan`` (plan reuse). A layer fused
    with its ReLU or its max pool (``SparseConv.relu``, ``max_pool``), or with a residual add before its ReLU
    (``SparseConv.residual``, with the residual the forward gives it), is compared with them and keyed so
    (``epilogue=``), its entry apart from the same layer's unfused one.
    The resulting plan is activated (:func:`~unsparse.runtime.plan.use_plan`); each layer's key is left in
    its ``plan_key`` attribute. A layer that none of the compared backends computes correctly (e.g. ``backends``
    naming only sparse backends that refuse a grouped layer) is planned on the dense default, with a logged reason.

    Args:
        model: holds SparseConv layers, on the device of ``example``.
        example: a model input (batch size, dtype and layout as they will be run). In channels-last it plans the
            model for channels-last activations: every layer then receives and returns NHWC, and its keys carry
            ``fmt=nhwc``, so one plan holds a model's NCHW and NHWC entries side by side. An activation with one
            channel or one pixel per channel has the same bytes in both layouts and counts as NCHW
            (:func:`~unsparse.runtime.layout.layout_of`): a one-channel model input therefore keeps the model in
            NCHW.
        plan: earlier plan to extend; a new one if None. backends, compare_kwargs: for :func:`compare_layer`.
        checkpoint: called with the plan after each entry this call adds (e.g. to save it, so that a run killed
            while planning resumes from the layers planned so far: their keys are then in ``plan``).

    Each entry added is logged at INFO: the layer's name in ``model``, its entry's backend, parameters and median
    (ms), and the seconds its comparison took, wall clock, with the part its backends spent compiling, in all and per
    backend that compiled (``LayerComparison.compile_s``), so a long planning run shows where its time goes as it
    goes.

    Returns:
        The plan and the comparisons made in this call (empty for fully reused plans).
    """
    from unsparse.sparse.functional import dense_fallback_backend

    plan = plan if plan is not None else Plan()
    comparisons: list[LayerComparison] = []
    names = {id(module): name for name, module in model.named_modules()}

    def before(layer: SparseConv, x: torch.Tensor, residual: torch.Tensor | None = None) -> None:
        epilogue = {"relu": layer.relu, "max_pool": layer.max_pool}
        key = layer_key(x, layer.csr, layer.geometry, **epilogue, residual=residual is not None)
        layer.plan_key = key
        if plan.get(key) is None:
            started = time.perf_counter()
            comparison = compare_layer(x, layer.csr, layer.bias, layer.geometry, backends, **epilogue,
                                       residual=residual, **compare_kwargs)
            comparisons.append(comparison)
            if comparison.chosen() is not None:
                plan.entries[key] = comparison.plan_entry()
            else:
                fallback = dense_fallback_backend(x.device)
                outcomes = sorted({f"{m.backend} {m.status}" for m in comparison.measurements})
                log.warning("%s: no backend compared computed this layer correctly (%s); planned on the dense "
                            "default, %s", key, ", ".join(outcomes) or "none ran", fallback)
                plan.entries[key] = comparison.default_entry(fallback)
            entry = plan.entries[key]
            split = ", ".join(f"{name} {seconds:.1f}" for name, seconds in comparison.compile_s.items())
            log.info("planned %s (%d in this call) in %.1f s, %.1f s of it compiling%s: %s %s, %.4f ms",
                     names.get(id(layer), key), len(comparisons), time.perf_counter() - started,
                     sum(comparison.compile_s.values()), f" ({split})" if split else "", entry.backend, entry.params,
                     entry.median_ms)
            if checkpoint is not None:
                checkpoint(plan)

    visit_layer_inputs(model, example, before)
    set_backend(model, "auto")
    use_plan(plan)
    return plan, comparisons


def planning_summary(comparisons: Sequence[LayerComparison]) -> dict[str, Any]:
    """What planning the layers of ``comparisons`` took, for a benchmark's record: ``layers_planned_now`` (their
    number), ``layers_screened`` (those where a backend's settings beyond its ``screen_space`` were recorded as
    ``"screened"``, not built: :data:`SCREEN_RATIO`) and ``planning_compile_s`` (the seconds their ``precompile``
    calls took, wall clock, summed over layers and backends: kernels compiled during planning, not ahead)."""
    return {"layers_planned_now": len(comparisons),
            "layers_screened": sum(any(m.status == "screened" for m in c.measurements) for c in comparisons),
            "planning_compile_s": sum(sum(c.compile_s.values()) for c in comparisons)}


@dataclass(frozen=True)
class PlanCheck:
    """A planned model timed end to end against the same model with every layer on its dense default.

    Attributes:
        planned_ms, default_ms: medians (ms) of the model's forward on its plan and on the dense default (cuDNN in
            the input's layout on CUDA), measured in the same process before any revert.
        reverted: plan keys whose entries :func:`check_plan` set back to the dense default (empty: plan kept).
        timing: ``"graph"`` (CUDA-graph replays: GPU time) or ``"eager"`` (:data:`TIMINGS`).
        margin: the noise allowance the check used (a fraction of ``default_ms``): slower than
            ``(1 + margin) * default_ms`` reverts.
    """

    planned_ms: float
    default_ms: float
    reverted: tuple[str, ...]
    timing: str
    margin: float


def best_times(comparison: LayerComparison, names: Sequence[str]) -> dict[str, float | None]:
    """Median ms of each backend's fastest parameter set on a layer (None: not timed or failed)."""
    fastest = {name: comparison.fastest(name) for name in names}
    return {name: None if m is None else m.timing.median_ms for name, m in fastest.items()}


def time_forward(model: nn.Module, example: torch.Tensor, timing: str, runs: int = MIN_RUNS, warmup: int = 3) -> float:
    """Median time (ms) of ``model(example)``: ``timing`` ``"graph"`` replays a CUDA graph of the forward
    (:func:`~unsparse.runtime.timing.time_graph`, GPU time; no warm-up), ``"eager"`` calls it
    (:func:`~unsparse.runtime.timing.time_fn`, host time included). Call it under ``torch.no_grad()``.

    Raises:
        RuntimeError: a CUDA graph capture that failed (the forward synchronises or allocates on the host).
    """
    def forward() -> None:
        model(example)

    if timing == "graph":
        return time_graph(forward, example.device, runs).median_ms
    return time_fn(lambda i: forward(), example.device, runs=runs, warmup=warmup).median_ms


def time_against_default(model: nn.Module, example: torch.Tensor, timing: str, runs: int = MIN_RUNS,
                         warmup: int = 3) -> tuple[float, float]:
    """Medians (ms) of ``model(example)`` as its layers are set, then with every layer on its dense default
    (:func:`~unsparse.sparse.functional.dense_fallback_backend`; each layer's setting is put back), both timed
    ``timing`` (:func:`time_forward`), without autograd.

    Raises:
        RuntimeError: a CUDA graph capture that failed.
    """
    from unsparse.sparse.functional import dense_fallback_backend

    with torch.no_grad():
        as_set = time_forward(model, example, timing, runs, warmup)
        with temporary_backend(model, dense_fallback_backend(example.device)):
            return as_set, time_forward(model, example, timing, runs, warmup)


def check_plan(model: nn.Module, example: torch.Tensor, plan: Plan, comparisons: list[LayerComparison],
               runs: int = MIN_RUNS, warmup: int = 3, margin: float = PLAN_MARGIN) -> PlanCheck:
    """Time a model :func:`plan_model` planned against its dense default; keep the plan only if it is not slower.

    Per-layer times need not add up to the model's: in the thirteenth session (``kernels/NOTES.md``) a
    channels-last ResNet-50 FP16 plan put nine layers on cuDNN computing in NCHW, each measured faster alone,
    and the model ran 0.95x of the same model on cuDNN in NHWC. So if the planned forward is slower than the dense
    default by more than ``margin`` (a fraction of the default's median), every entry of ``comparisons`` that
    left the dense default is set back to it (:meth:`LayerComparison.default_entry`: its measured median, NaN if the
    comparison did not time it; runner-up the backend it replaces) and the changed plan is activated. All or
    nothing: one layer's share of a model's time is below the noise that per-layer reverts would have to beat.
    Entries reused from an earlier plan are not in ``comparisons`` and stay.

    On CUDA both forwards are timed as CUDA-graph replays, the GPU time the plan chose kernels for: eager times of
    a host-bound model (AlexNet and GoogLeNet in FP16 at batch 128) moved by 14-40 % within one process, which
    made an eager check revert plans that were 10 % faster on the GPU. Where a capture fails, both are timed
    eagerly.

    Args:
        model: planned by :func:`plan_model` (layers on ``"auto"``), on ``example``'s device.
        example: the planning input (its batch size, dtype and layout).
        plan, comparisons: what :func:`plan_model` returned (``plan`` is modified in place on a revert).
        runs, warmup: as in :func:`~unsparse.runtime.timing.time_fn` (graph replays take no warm-up).

    Returns:
        Both medians, the reverted keys, how the forwards were timed and the margin used.
    """
    from unsparse.sparse.functional import dense_fallback_backend

    default_backend = dense_fallback_backend(example.device)
    timing = "graph" if example.device.type == "cuda" else "eager"
    try:
        planned_ms, default_ms = time_against_default(model, example, timing, runs, warmup)
    except RuntimeError as error:  # a capture that failed: time both eagerly
        log.warning("check_plan: CUDA graph capture failed (%s); timing eagerly", error)
        timing = "eager"
        planned_ms, default_ms = time_against_default(model, example, timing, runs, warmup)
    reverted = []
    if planned_ms > (1 + margin) * default_ms:
        for comparison in comparisons:
            entry = plan.get(comparison.key)
            if entry is not None and not (entry.backend == default_backend
                                          and is_dense_default(entry.backend, entry.params, comparison.layout)):
                plan.entries[comparison.key] = comparison.default_entry(default_backend, runner_up=entry.backend)
                reverted.append(comparison.key)
        if reverted:
            log.warning("planned model %.3f ms, dense default %.3f ms (%s): %d layer keys set back to the dense "
                        "default", planned_ms, default_ms, timing, len(reverted))
            use_plan(plan)
    return PlanCheck(planned_ms, default_ms, tuple(reverted), timing, margin)


def planned_backends(model: nn.Module, plan: Plan) -> dict[str, str]:
    """Layer name -> planned backend, for each SparseConv of a model :func:`plan_model` planned (layers without an
    entry in ``plan`` left out); a cuDNN entry that computes in the other layout than the layer's input reads
    ``"cudnn, converted to nchw"`` (or ``nhwc``)."""
    labels = {}
    for name, layer in sparse_layers(model).items():
        entry = plan.get(getattr(layer, "plan_key", ""))
        if entry is None:
            continue
        computed = MEMORY_FORMATS.get(entry.params.get("memory_format"))
        converted = entry.backend == "cudnn" and computed not in (None, key_layout(layer.plan_key))
        labels[name] = f"cudnn, converted to {computed}" if converted else entry.backend
    return labels


def epilogue_passes(model: nn.Module, plan: Plan) -> list[str]:
    """The names of the SparseConvs of a planned model whose plan entry runs its fused ReLU (and residual add) as
    passes after the convolution, ``"epilogue": "passes"`` (cuDNN's fused call timed slower on the layer:
    :meth:`~unsparse.runtime.backends.dense.DenseBackend.epilogue_space`), in the model's order."""
    return [name for name, layer in sparse_layers(model).items()
            if (entry := plan.get(getattr(layer, "plan_key", ""))) is not None
            and entry.params.get(EPILOGUE_PARAMETER) == "passes"]
