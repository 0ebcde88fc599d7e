"""The dense default of a plan on the CPU: ``dense_cpu`` names its memory format, as ``cudnn`` does."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from unsparse.runtime import sparse_layers, sparsify
from unsparse.runtime.comparator import LayerComparison, Measurement, check_plan, plan_model
from unsparse.runtime.plan import PlanEntry, use_plan
from unsparse.runtime.timing import Timing


def measured(backend: str, params: dict, ms: float) -> Measurement:
    return Measurement(backend, params, "ok", 0.0, timing=Timing(ms, ms, ms, 20, 1))


@pytest.mark.parametrize(("layout", "default"), [("nchw", "contiguous"), ("nhwc", "channels_last")])
def test_a_cpu_plan_keeps_dense_cpu_for_a_win_within_the_margin(layout: str, default: str) -> None:
    """``dense_cpu`` offers both memory formats since plans were checked against its settings, while the dense
    default stayed ``{}``: no measurement was ever the default, so a CPU plan left it for any win, noise included."""
    other = {"contiguous": "channels_last", "channels_last": "contiguous"}[default]
    comparison = LayerComparison("k", [measured("dense_cpu", {"memory_format": default}, 1.0),
                                       measured("dense_cpu", {"memory_format": other}, 1.5),
                                       measured("im2col_cublas", {}, 0.99)], layout=layout)
    assert comparison.best.backend == "im2col_cublas"
    assert comparison.default_measurement().params == {"memory_format": default}
    entry = comparison.plan_entry()
    assert (entry.backend, entry.params, entry.median_ms) == ("dense_cpu", {"memory_format": default}, 1.0)
    assert comparison.plan_entry(margin=0.0).backend == "im2col_cublas"
    assert comparison.default_entry("dense_cpu").median_ms == 1.0  # the revert's entry keeps the measured time


def test_check_plan_does_not_count_the_dense_default_in_its_own_layout_as_set_back() -> None:
    """An entry already on the dense default in the layer's layout, its format named, was listed as set back."""
    torch.manual_seed(0)
    sparse, x = sparsify(nn.Sequential(nn.Conv2d(4, 6, 3, padding=1)).eval()), torch.randn(2, 4, 9, 8)
    plan, comparisons = plan_model(sparse, x, backends=["dense_cpu"], runs=2, warmup=0)
    (layer,) = sparse_layers(sparse).values()
    plan.entries[layer.plan_key] = PlanEntry("dense_cpu", {"memory_format": "contiguous"}, 1.0)
    use_plan(plan)
    assert check_plan(sparse, x, plan, comparisons, runs=2, warmup=0, margin=-1.0).reverted == ()
    plan.entries[layer.plan_key] = PlanEntry("dense_cpu", {"memory_format": "channels_last"}, 1.0)
    use_plan(plan)
    assert check_plan(sparse, x, plan, comparisons, runs=2, warmup=0, margin=-1.0).reverted == (layer.plan_key,)
