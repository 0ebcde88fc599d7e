"""Device-agnostic timing (DESIGN.md, Benchmark protocol).

CUDA: events around each run on the current stream, warm-up first, median of the runs, inputs rotated so
that the rotated set is larger than twice the L2 cache. CPU: ``time.perf_counter`` around each run, same
statistics, no rotation.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from unsparse.sparse.format import UniformCSR
from unsparse.sparse.geometry import ConvGeometry

MIN_RUNS = 20
"""Fewest timed runs behind a reported median (DESIGN.md)."""


@dataclass(frozen=True)
class Timing:
    """Statistics of repeated runs, all in milliseconds.

    Attributes:
        median_ms, min_ms, max_ms: over the timed runs.
        runs: number of timed runs (warm-up excluded).
        rotation: number of distinct input sets the runs cycled through.
    """

    median_ms: float
    min_ms: float
    max_ms: float
    runs: int
    rotation: int

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return asdict(self)


def time_fn(fn: Callable[[int], Any], device: torch.device | str, runs: int = MIN_RUNS, warmup: int = 3,
            rotation: int = 1) -> Timing:
    """Time ``fn(i)`` for ``i = 0 .. runs-1`` after ``warmup`` untimed calls.

    Args:
        fn: called with the run index; it should pick input set ``i % rotation`` itself.
        device: where ``fn`` runs; CUDA uses events on the current stream, anything else a host clock.
        runs: timed runs (>= 1). warmup: untimed calls first (>= 0). rotation: recorded in the result.

    Returns:
        A :class:`Timing` in milliseconds.

    Raises:
        ValueError: if ``runs < 1`` or ``warmup < 0``.
    """
    if runs < 1 or warmup < 0:
        raise ValueError(f"runs: need runs >= 1 and warmup >= 0, got {runs}, {warmup}")
    device = torch.device(device)
    for i in range(warmup):
        fn(i)
    times: list[float] = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(runs)]
        for i, (start, end) in enumerate(events):
            start.record()
            fn(i)
            end.record()
        torch.cuda.synchronize(device)
        times = [start.elapsed_time(end) for start, end in events]
    else:
        for i in range(runs):
            start = time.perf_counter()
            fn(i)
            times.append((time.perf_counter() - start) * 1e3)
    return Timing(statistics.median(times), min(times), max(times), runs, rotation)


def capture_graph(forward: Callable[[], Any]) -> torch.cuda.CUDAGraph:
    """``forward()`` captured as a CUDA graph on the current device, after three warm-up calls on a side stream
    (torch's recipe for ``torch.cuda.graph``; the warm-up also builds whatever ``forward`` caches on first use).

    Raises:
        RuntimeError: from the capture, if ``forward`` synchronises or does anything else a graph cannot hold.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    return graph


def time_graph(forward: Callable[[], Any], device: torch.device | str, runs: int = MIN_RUNS) -> Timing:
    """GPU time of ``forward()`` replayed as a CUDA graph (:func:`capture_graph`), timed as :func:`time_fn`
    does (ms): what the kernels cost once the host's per-call work (Python, dispatch, launches) is out of the
    timed loop, so that a host-bound forward's time can be told apart from its kernels' time.

    Raises:
        RuntimeError: from :func:`capture_graph`.
    """
    graph = capture_graph(forward)
    return time_fn(lambda i: graph.replay(), device, runs=runs)


def _synchronizer(device: torch.device | str) -> Callable[[], None]:
    """``torch.cuda.synchronize`` for a CUDA device, a no-op otherwise."""
    return torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)


def host_enqueue_ms(forward: Callable[[], Any], device: torch.device | str, runs: int = MIN_RUNS) -> float:
    """Mean wall-clock ms per ``forward()`` call without synchronising between calls: the host's enqueue cost
    (on CUDA the device is synchronised only before the first and after the last call). Where it exceeds the
    GPU time of a call, eager timings of that call measure the host, not the kernels."""
    synchronize = _synchronizer(device)
    synchronize()
    start = time.perf_counter()
    for _ in range(runs):
        forward()
    elapsed = time.perf_counter() - start
    synchronize()
    return elapsed / runs * 1e3


def host_profile(forward: Callable[[], Any], device: torch.device | str, runs: int = MIN_RUNS, top: int = 15) -> str:
    """cProfile of ``runs`` back-to-back ``forward()`` calls (each output dropped at once, as in a serving loop):
    the ``top`` functions by own time, as pstats prints them. A call that blocks (a synchronisation, an
    allocation that waits) shows as a large own time."""
    def repeat() -> None:
        for _ in range(runs):
            forward()

    profile = cProfile.Profile()
    profile.runcall(repeat)
    _synchronizer(device)()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def cache_bytes(device: torch.device | str) -> int:
    """Last-level cache to defeat when rotating inputs: the GPU's L2 size in bytes; 0 on the CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return 0
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 * 2**20))


def rotation_count(input_bytes: int, cache: int, limit: int = 16) -> int:
    """Input sets needed so that cycling through them touches more than ``2 * cache`` bytes (<= ``limit``).

    Raises:
        ValueError: for a negative byte count or ``limit < 1``.
    """
    if input_bytes < 0 or cache < 0 or limit < 1:
        raise ValueError(f"rotation_count: bad arguments {input_bytes}, {cache}, {limit}")
    if input_bytes == 0:
        return 1
    return min(limit, 2 * cache // input_bytes + 1)


def rotated_inputs(x: torch.Tensor, count: int) -> list[torch.Tensor]:
    """``x`` plus ``count - 1`` independent random copies of its shape, dtype and device (never zeros)."""
    return [x] + [torch.randn_like(x) for _ in range(count - 1)]


def time_backend(backend: str, x: torch.Tensor, csr: UniformCSR, bias: torch.Tensor | None,
                 geometry: ConvGeometry, params: dict[str, Any] | None = None, runs: int = MIN_RUNS,
                 warmup: int = 3, inputs: Sequence[torch.Tensor] | None = None) -> Timing:
    """Time one backend's convolution on one layer (the comparator's unit of measurement).

    Args:
        backend: registered backend name. x: ``(N, C, H, W)`` input. csr, bias, geometry: the layer.
        params: one entry of the backend's tuning space.
        inputs: rotated input set to cycle through; by default :func:`rotated_inputs` of ``x`` sized by
            :func:`rotation_count` against the device's cache.

    Returns:
        Median etc. of ``runs`` timed calls of ``backend.run``, in milliseconds.
    """
    from unsparse.runtime.backends import get_backend

    chosen = get_backend(backend)
    params = dict(params or {})
    if inputs is None:
        inputs = rotated_inputs(x, rotation_count(x.numel() * x.element_size(), cache_bytes(x.device)))
    return time_fn(lambda i: chosen.run(inputs[i % len(inputs)], csr, bias, geometry, **params), x.device,
                   runs=runs, warmup=warmup, rotation=len(inputs))
