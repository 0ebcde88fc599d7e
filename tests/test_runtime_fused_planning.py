"""Planning a layer fused with its ReLU and 2x2 max pool: the comparator checks and times every setting with them,
and the plan keys them apart from the same layer unfused."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from tests.fusing import RecordingFusing, layer
from unsparse.runtime import sparse_layers, sparsify
from unsparse.runtime.backends import base
from unsparse.runtime.comparator import compare_layer, plan_model
from unsparse.runtime.plan import Plan, PlanEntry, key_layout, layer_key, use_plan, without_epilogue
from unsparse.sparse.geometry import ConvGeometry

GEOMETRY = ConvGeometry.of(1, 1)


class FusesBoth(RecordingFusing):
    name = "test_fuses_both"
    fuses_relu = True
    fuses_max_pool = True


class Drops(RecordingFusing):
    """Says it fuses the ReLU and the pool, and leaves out the one ``dropped`` names (a wrong epilogue the check
    must catch)."""

    fuses_relu = True
    fuses_max_pool = True
    dropped = ""

    def conv(self, x, csr, bias, geometry, relu=False, max_pool=False, **params):
        flags = {"relu": relu, "max_pool": max_pool, self.dropped: False}
        return super().conv(x, csr, bias, geometry, **flags, **params)


class IgnoresPool(Drops):
    """Returns the convolution unpooled."""

    name = "test_ignores_pool"
    dropped = "max_pool"


class SkipsRelu(Drops):
    """Pools the convolution without its ReLU."""

    name = "test_skips_relu"
    dropped = "relu"


@pytest.fixture
def fusing(monkeypatch: pytest.MonkeyPatch) -> FusesBoth:
    """The three backends registered; the instance of :class:`FusesBoth` the registry hands out."""
    for cls in (FusesBoth, IgnoresPool, SkipsRelu):
        monkeypatch.setitem(base._REGISTRY, cls.name, cls)
    instance = FusesBoth()
    monkeypatch.setitem(base._INSTANCES, FusesBoth.name, instance)
    return instance


def test_the_key_names_the_epilogue_and_unfused_keys_are_unchanged() -> None:
    x, csr, _ = layer(1)
    plain = layer_key(x, csr, GEOMETRY)
    assert "epilogue" not in plain and layer_key(x, csr, GEOMETRY, relu=False, max_pool=False) == plain
    keys = {(relu, pool): layer_key(x, csr, GEOMETRY, relu=relu, max_pool=pool)
            for relu in (False, True) for pool in (False, True)}
    assert keys[True, False].endswith("|epilogue=relu") and keys[False, True].endswith("|epilogue=max_pool")
    assert keys[True, True].endswith("|epilogue=relu+max_pool") and len(set(keys.values())) == 4
    assert {without_epilogue(key) for key in keys.values()} == {plain}
    last = x.contiguous(memory_format=torch.channels_last)
    fused_nhwc = layer_key(last, csr, GEOMETRY, relu=True, max_pool=True)
    assert fused_nhwc.endswith("|epilogue=relu+max_pool|fmt=nhwc") and key_layout(fused_nhwc) == "nhwc"
    assert without_epilogue(fused_nhwc) == layer_key(last, csr, GEOMETRY)


@pytest.mark.parametrize(("relu", "max_pool"), [(True, False), (False, True), (True, True)])
def test_every_backend_is_checked_and_timed_with_the_layer_s_epilogue(fusing: FusesBoth, relu: bool,
                                                                       max_pool: bool) -> None:
    """The fusing backend gets the flags in each call (checked, screened or not, timed); the dense backend
    applies them after its conv and is correct against the fused reference; a backend that skips the part of the
    epilogue it claims to fuse is wrong (a pool it skips gives the wrong shape)."""
    x, csr, bias = layer(2)
    result = compare_layer(x, csr, bias, GEOMETRY, ["test_fuses_both", "test_ignores_pool", "test_skips_relu",
                                                    "dense_cpu"], runs=2, warmup=0, relu=relu, max_pool=max_pool)
    assert result.key == layer_key(x, csr, GEOMETRY, relu=relu, max_pool=max_pool)
    status = {m.backend: m.status for m in result.measurements}
    assert status["test_fuses_both"] == status["dense_cpu"] == "ok"
    assert status["test_ignores_pool"] == ("wrong" if max_pool else "ok")
    assert status["test_skips_relu"] == ("wrong" if relu else "ok")
    assert fusing.calls and all(call == {"relu": relu, "max_pool": max_pool} for call in fusing.calls)


def test_an_unfused_comparison_passes_no_epilogue(fusing: FusesBoth) -> None:
    x, csr, bias = layer(3)
    result = compare_layer(x, csr, bias, GEOMETRY, ["test_fuses_both", "test_ignores_pool"], runs=2, warmup=0)
    assert {m.status for m in result.measurements} == {"ok"} and "epilogue" not in result.key
    assert all(call == {"relu": False, "max_pool": False} for call in fusing.calls)


class TwoEpilogues(FusesBoth):
    """Offers a second way to run a fused ReLU, as cuDNN does (its fused call or passes)."""

    name = "test_two_epilogues"

    def epilogue_space(self, relu: bool) -> list[dict]:
        return [{}, {"epilogue": "passes"}] if relu else [{}]


@pytest.mark.parametrize("relu", [False, True])
def test_the_comparator_times_each_epilogue_a_backend_offers_for_the_layer(monkeypatch: pytest.MonkeyPatch,
                                                                           relu: bool) -> None:
    """The settings timed are the tuning space crossed with the epilogues offered for the layer as fused: two for a
    layer fused with its ReLU, one without; each setting's parameters reach the backend's call."""
    monkeypatch.setitem(base._REGISTRY, TwoEpilogues.name, TwoEpilogues)
    instance = TwoEpilogues()
    monkeypatch.setitem(base._INSTANCES, TwoEpilogues.name, instance)
    x, csr, bias = layer(4)
    result = compare_layer(x, csr, bias, GEOMETRY, [TwoEpilogues.name], runs=2, warmup=0, relu=relu)
    expected = [{}, {"epilogue": "passes"}] if relu else [{}]
    assert [m.params for m in result.measurements] == expected and {m.status for m in result.measurements} == {"ok"}
    assert {call.get("epilogue") for call in instance.calls} == {p.get("epilogue") for p in expected}


def vgg_block() -> nn.Sequential:
    """conv, ReLU, conv, ReLU, 2x2 max pool (float64; weights about half zeros)."""
    torch.manual_seed(5)
    block = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 5, 3, padding=1), nn.ReLU(),
                          nn.MaxPool2d(2)).double().eval()
    with torch.no_grad():
        for conv in (block[0], block[2]):
            conv.weight.mul_(torch.rand_like(conv.weight) > 0.5)
    return block


def test_plan_model_plans_fused_layers_under_their_own_keys_and_runs_them_fused(fusing: FusesBoth) -> None:
    """A VGG block with both fusions: the first conv is keyed with its ReLU, the second with its ReLU and pool; the
    planned model dispatches each to the fusing backend with its flags and computes the dense block; an unfused
    copy of the block finds neither key (its own are the fused ones without the epilogue)."""
    block = vgg_block()
    fused = sparsify(block, fuse_relu=True, fuse_max_pool=True)
    x = torch.randn(2, 3, 10, 9, dtype=torch.float64)
    plan, comparisons = plan_model(fused, x, Plan(), ["test_fuses_both"], runs=2, warmup=0)
    first, second = sparse_layers(fused).values()
    assert first.plan_key.endswith("|epilogue=relu") and second.plan_key.endswith("|epilogue=relu+max_pool")
    assert [c.key for c in comparisons] == [first.plan_key, second.plan_key] == list(plan.entries)
    fusing.calls.clear()
    with torch.no_grad():
        torch.testing.assert_close(fused(x), block(x))
    assert fusing.calls == [{"relu": True, "max_pool": False}, {"relu": True, "max_pool": True}]
    unfused = sparsify(block)
    _, again = plan_model(unfused, x, plan, ["dense_cpu"], runs=2, warmup=0)
    assert [c.key for c in again] == [without_epilogue(first.plan_key), without_epilogue(second.plan_key)]


def test_a_fused_layer_does_not_run_on_its_unfused_entry(fusing: FusesBoth, caplog: pytest.LogCaptureFixture) -> None:
    """The active plan holds the layer's unfused key only: the fused layer finds no entry, says so and runs dense
    (its ReLU and pool after the conv), still computing the dense block."""
    block = vgg_block()
    fused = sparsify(block, backend="auto", fuse_relu=True, fuse_max_pool=True)
    x = torch.randn(1, 3, 8, 8, dtype=torch.float64)
    first = next(iter(sparse_layers(fused).values()))
    use_plan(Plan({layer_key(x, first.csr, first.geometry): PlanEntry("test_fuses_both")}))
    with caplog.at_level(logging.WARNING), torch.no_grad():
        out = fused(x)
    torch.testing.assert_close(out, block(x))
    assert not fusing.calls and "epilogue=relu" in caplog.text and "running dense" in caplog.text
