"""Shared test setup: GPU tests skip cleanly without CUDA; every test gets a fixed-but-fresh seed. Fixtures:
``load_script`` (a ``scripts/*.py`` file as a module), ``run_script`` (a script's ``main()`` run in-process on a
command line), ``interrupt_at_epoch`` (a trainer that raises Ctrl-C's
``KeyboardInterrupt`` as an epoch starts), ``crash_at_save`` (a module's ``save_checkpoint`` raising it at its n-th
call), ``tuned_kernel_names`` (the kernel instantiations the direct backend's
tuning spaces name for a few representative layers) and ``virtual_clock`` (CPU timings on a clock that only charged
backend calls advance)."""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


@functools.cache
def _load_script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def load_script() -> Callable[[str], ModuleType]:
    """``load_script("prune_table")`` imports ``scripts/prune_table.py`` (once; the folder is no package)."""
    return _load_script


@pytest.fixture
def run_script(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
               ) -> Callable[[ModuleType, list[str]], tuple[int, str]]:
    """``run_script(module, ["--device", "bogus"])`` runs ``module.main()`` with that command line (``sys.argv``)
    and returns its exit status (0 if it returned) and its stdout and stderr, each space run as one space (argparse
    wraps lines)."""
    def run(module: ModuleType, argv: list[str]) -> tuple[int, str]:
        monkeypatch.setattr(sys, "argv", [f"{module.__name__}.py", *argv])
        try:
            module.main()
            code = 0
        except SystemExit as exited:
            code = exited.code
        captured = capsys.readouterr()
        return code, " ".join((captured.out + captured.err).split())
    return run


def _interrupt_at_epoch(trainer: Any, epoch: int) -> None:
    """Make ``trainer`` (mutated) raise ``KeyboardInterrupt`` when its ``epoch``-th ``train_epoch`` call starts."""
    started = []
    train_epoch = trainer.train_epoch

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        started.append(1)
        if len(started) == epoch:
            raise KeyboardInterrupt
        return train_epoch(*args, **kwargs)
    trainer.train_epoch = interrupted


@pytest.fixture(scope="session")
def interrupt_at_epoch() -> Callable[[Any, int], None]:
    """``interrupt_at_epoch(trainer, 2)``: Ctrl-C as the trainer's second epoch starts (resume tests)."""
    return _interrupt_at_epoch


@pytest.fixture
def crash_at_save(monkeypatch: pytest.MonkeyPatch) -> Callable[[ModuleType, int], AbstractContextManager[None]]:
    """``with crash_at_save(module, 4): run()``: ``module.save_checkpoint`` raises ``KeyboardInterrupt`` at its 4th
    call inside the block (the calls before it write), which the block must end with; the function is put back
    afterwards (resume tests)."""
    @contextmanager
    def crash(module: ModuleType, count: int) -> Iterator[None]:
        calls, original = [], module.save_checkpoint

        def crashing(path: Any, state: Any) -> None:
            calls.append(path)
            if len(calls) == count:
                raise KeyboardInterrupt
            original(path, state)

        monkeypatch.setattr(module, "save_checkpoint", crashing)
        try:
            with pytest.raises(KeyboardInterrupt):
                yield
        finally:
            monkeypatch.setattr(module, "save_checkpoint", original)
    return crash


@pytest.fixture(scope="session")
def tuned_kernel_names() -> list[str]:
    """Sorted template instantiations of every tuning setting of 3x3 (56x56), 1x1 (14x14; batch 128 and batch 1,
    whose small grids add split-K settings), 5x5 (28x28) and 3x3 stride-2 (56x56, whose phase split is a 2x2
    layer) layers in each supported dtype, and those of the half2 backend in float16, as the kernel compile tests
    build them."""
    from unsparse.runtime import launch_geometry as lg
    from unsparse.runtime.backends.direct import DirectBackend, DirectHalf2Backend
    from unsparse.sparse import ConvGeometry, UniformCSR

    backend, half2 = DirectBackend(), DirectHalf2Backend()
    names: set[str] = set()
    for shape, kernel, geometry in [((128, 64, 56, 56), (3, 3), ConvGeometry.of(1, 1)),
                                    ((128, 256, 14, 14), (1, 1), ConvGeometry.of(1, 0)),
                                    ((1, 256, 14, 14), (1, 1), ConvGeometry.of(1, 0)),
                                    ((32, 48, 28, 28), (5, 5), ConvGeometry.of(1, 2)),
                                    ((128, 128, 56, 56), (3, 3), ConvGeometry.of(2, 1))]:
        for dtype in lg.supported_dtypes():
            x = torch.zeros(shape, dtype=dtype)
            csr = UniformCSR.from_dense(torch.randn(16, shape[1], *kernel, dtype=dtype))
            names.update(backend.kernel_names(x, csr, geometry))
            if dtype == torch.float16:
                names.update(half2.kernel_names(x, csr, geometry))
    return sorted(names)


@pytest.fixture(scope="session")
def tuned_kernel_name_chunks(tuned_kernel_names: list[str]) -> list[list[str]]:
    """``tuned_kernel_names`` dealt into one chunk per CPU core this process may use (at most 4), so the compile
    tests build their chunks at once: nvcc or NVRTC on all of them in one program took 86 and 57 s of the suite's
    eight minutes on two cores."""
    count = max(1, min(4, len(os.sched_getaffinity(0))))
    return [tuned_kernel_names[start::count] for start in range(count)]


class VirtualClock:
    """The clock of CPU timings (``time_fn`` and ``host_enqueue_ms`` of :mod:`unsparse.runtime.timing`) while the
    ``virtual_clock`` fixture is active: it stands still unless a test advances it, directly (:meth:`advance`) or by
    a backend call it charges (:meth:`charge`), so every median and mean is exact whatever else the machine runs.

    Attributes:
        ms: the time it reads, in milliseconds (starts at 0).
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.ms = 0.0
        self._monkeypatch = monkeypatch

    def perf_counter(self) -> float:
        """What ``time.perf_counter`` reads in :mod:`unsparse.runtime.timing`: :attr:`ms` in seconds."""
        return self.ms / 1e3

    def advance(self, ms: float) -> None:
        """Move the clock on by ``ms`` milliseconds."""
        self.ms += ms

    def charge(self, cost: Callable[[str, Any, dict[str, Any]], float], *backends: type) -> None:
        """Make each call of the given backend classes' convolution (and of their subclasses that inherit it)
        advance the clock by ``cost(backend name, csr, params)`` ms before it computes: the calls ``conv_call``
        returns, through which ``conv`` and ``run`` (the comparator's, the timings' and a prepared model's call) go,
        and so does ``auto`` through its planned backend. Backends not charged cost nothing."""
        for cls in backends:
            def costed(backend: Any, x: Any, csr: Any, *args: Any,
                       conv_call: Callable[..., Any] = cls.conv_call, **params: Any) -> Callable[[Any], Any]:
                call = conv_call(backend, x, csr, *args, **params)

                def charged(x: Any) -> Any:
                    self.advance(cost(backend.name, csr, params))
                    return call(x)

                return charged
            self._monkeypatch.setattr(cls, "conv_call", costed)


@pytest.fixture
def virtual_clock(monkeypatch: pytest.MonkeyPatch) -> VirtualClock:
    """A :class:`VirtualClock` that the CPU timings of :mod:`unsparse.runtime.timing` read instead of
    ``time.perf_counter`` until the test ends (the charged backends are put back then too)."""
    from types import SimpleNamespace

    from unsparse.runtime import timing

    clock = VirtualClock(monkeypatch)
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    return clock


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
