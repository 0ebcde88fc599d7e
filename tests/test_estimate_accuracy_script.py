"""``scripts/estimate_accuracy.py``: which settings it estimates and times (GPU work replaced by CPU stand-ins)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from unsparse.runtime import bench
from unsparse.sparse.geometry import ConvGeometry


class Backend:
    """The generated backend's calls the script makes, on the CPU: ``run`` is the float32 convolution, except for
    the settings in ``wrong``, whose output is off by one."""

    def __init__(self, wrong: list[dict[str, Any]]) -> None:
        self.estimated: list[list[dict[str, Any]]] = []
        self.wrong = wrong

    def screen_space(self, x, csr, geometry) -> list[dict[str, Any]]:
        return [{"rows": 32, "programs": 1}, {"rows": 64, "programs": 1}, {"rows": 32, "programs": 4}]

    def estimate_ms(self, inputs, csr, geometry, space) -> list[float]:
        self.estimated.append(list(space))
        return [0.5 * params["rows"] / 32 for params in space]

    def precompile(self, x, csr, geometry, space) -> None:
        assert all(isinstance(params, dict) for params in space)

    def run(self, x, csr, bias, geometry, **params) -> torch.Tensor:
        out = F.conv2d(x, csr.to_conv2d_weight(), bias, geometry.stride, geometry.padding, geometry.dilation)
        return out + 1 if params in self.wrong else out


@pytest.fixture
def script(load_script, monkeypatch: pytest.MonkeyPatch):
    script = load_script("estimate_accuracy")
    monkeypatch.setattr(script, "time_fn", lambda fn, device, runs=20, rotation=1: SimpleNamespace(median_ms=1.0))
    return script


def layer() -> bench.ConvLayer:
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(40, 8, 3, 3, generator=generator)
    weight *= torch.rand(weight.shape, generator=generator) < 0.3
    return bench.ConvLayer("a", weight, None, ConvGeometry.of(1, 1), (8, 7, 9), 1, False)


def test_the_screen_spaces_one_program_settings_are_estimated_and_timed(script, monkeypatch) -> None:
    backend = Backend([])
    monkeypatch.setattr(script, "get_backend", lambda name: backend)
    records = script.layer_records(layer(), torch.float32, 3, 20, torch.device("cpu"))
    assert [r["params"] for r in records] == [{"rows": 32, "programs": 1}, {"rows": 64, "programs": 1}]
    assert [r["estimate_ms"] for r in records] == [0.5, 1.0] and [r["ratio"] for r in records] == [2.0, 1.0]
    assert all(r["correct"] for r in records)


def test_given_settings_are_timed_and_only_those_of_one_program_estimated(script, monkeypatch) -> None:
    """A setting of several programs has no probe: its estimate fields are null, and it is still built, checked
    against the float64 reference (a wrong output is marked so) and timed."""
    shared = {"rows": 32, "programs": 4, "min_blocks": 3}
    backend = Backend([shared])
    monkeypatch.setattr(script, "get_backend", lambda name: backend)
    settings = [{"rows": 32, "programs": 4}, shared, {"rows": 32, "programs": 1, "min_blocks": 3}]
    records = script.layer_records(layer(), torch.float32, 3, 20, torch.device("cpu"), settings)
    assert [r["params"] for r in records] == settings
    assert backend.estimated == [[settings[2]], [settings[2]]]  # rotated inputs, then the one input
    assert [r["estimate_ms"] for r in records] == [None, None, 0.5]
    assert [r["ratio"] for r in records] == [None, None, 2.0]
    assert [r["built_at_screen_ratio"] for r in records][:2] == [None, None]
    assert [r["correct"] for r in records] == [True, False, True]
    assert all(r["median_ms"] == 1.0 for r in records)
