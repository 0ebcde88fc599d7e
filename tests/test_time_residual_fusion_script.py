"""``scripts/time_residual_fusion.py``: the comparison it records and the two calls it times against each other,
on the CPU (the ``reference`` backend stands in for the fusing ones; timings replaced by calls whose outputs are
kept)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from unsparse.runtime import bench
from unsparse.sparse.geometry import ConvGeometry


def test_the_fused_and_the_passes_calls_compute_the_same_block_end(load_script, monkeypatch: pytest.MonkeyPatch
                                                                   ) -> None:
    """Both timed calls of a fusing backend's fastest setting compute ``relu(conv(x) + bias + residual)`` on the
    inputs the timing rotates (so the ratio compares the same work), and the record names the backends' settings, the
    fastest backend and the layer's nonzeros per row; the comparator gets the screen ratio asked for."""
    script = load_script("time_residual_fusion")
    outputs: list[torch.Tensor] = []

    def time_fn(fn, device, runs=20, rotation=1):
        outputs.extend(fn(i).clone() for i in range(rotation))
        return SimpleNamespace(median_ms=1.0)

    monkeypatch.setattr(script, "time_fn", time_fn)
    monkeypatch.setattr(script, "BACKENDS", ("reference",))
    monkeypatch.setattr(script, "FUSING", ("reference",))
    monkeypatch.setattr(script, "rotation_count", lambda nbytes, cache: 2)
    real_compare = script.compare_layer
    screens: list[float | None] = []

    def compare_layer(*arguments, screen_ratio, **keywords):
        screens.append(screen_ratio)
        return real_compare(*arguments, screen_ratio=screen_ratio, **keywords)

    monkeypatch.setattr(script, "compare_layer", compare_layer)
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(12, 6, 1, 1, generator=generator)
    weight *= torch.rand(weight.shape, generator=generator) < 0.5
    layer = bench.ConvLayer("block.conv3", weight, torch.randn(12, generator=generator), ConvGeometry.of(1, 0),
                            (6, 5, 7), 1, False)
    torch.manual_seed(11)
    record = script.layer_record(layer, torch.float32, 3, 20, torch.device("cpu"), None)
    assert screens == [None]  # --all-settings: nothing screened out
    assert record["layer"] == "block.conv3" and record["best_backend"] == "reference" and record["rotation"] == 2
    assert record["nnz_per_row"] == int((weight != 0).sum(dim=(1, 2, 3)).max())
    entry = record["backends"]["reference"]
    assert entry["params"] == {} and entry["median_ms"] > 0 and entry["fused_ms"] == entry["passes_ms"] == 1.0
    fused, passes = outputs[:2], outputs[2:]
    assert len(passes) == 2 and not torch.equal(fused[0], fused[1])  # two rotated inputs, two different outputs
    for one, other in zip(fused, passes, strict=True):
        torch.testing.assert_close(one, other)
        assert (one == 0).any() and (one > 0).any()  # the ReLU cut some sums
    torch.manual_seed(11)
    x = torch.randn(3, 6, 5, 7)
    residual = torch.randn(3, 12, 5, 7)
    expected = torch.relu(F.conv2d(x, weight, layer.bias) + residual)
    torch.testing.assert_close(fused[0], expected)
