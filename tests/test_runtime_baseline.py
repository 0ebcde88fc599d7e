"""CPU tests of the cuDNN baseline's logic (``unsparse.runtime.baseline``) with torch's CPU convolution: every
layout computes the layer without its bias, is checked before it is timed, and the fastest correct one is named."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from unsparse.runtime.baseline import time_baseline
from unsparse.runtime.comparator import compare_layer, tolerance
from unsparse.runtime.layout import LAYOUTS
from unsparse.sparse import ConvGeometry, UniformCSR


def layer(seed: int, bias: bool):
    """An odd-shaped sparse layer (stride 2, one all-zero and one fully dense output channel), float32."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(5, 3, 3, 3, generator=gen)
    weight[torch.rand(weight.shape, generator=gen) < 0.8] = 0
    weight[0] = 0
    weight[1] = torch.randn(3, 3, 3, generator=gen)
    return (torch.randn(3, 3, 11, 7, generator=gen), UniformCSR.from_dense(weight),
            torch.randn(5, generator=gen) if bias else None)


def grouped_layer(kind: str):
    """A grouped (2 groups), depthwise or Conv1d-shaped (``(N, C, 1, L)``) layer with bias, its geometry."""
    gen = torch.Generator().manual_seed(3)
    C, M, groups, R, S, H, W, geometry = {
        "grouped": (4, 6, 2, 3, 3, 9, 8, ConvGeometry.of(1, 1, 1, 2)),
        "depthwise": (5, 5, 5, 3, 3, 7, 10, ConvGeometry.of(2, 1, 1, 5)),
        "conv1d": (3, 4, 1, 1, 5, 1, 17, ConvGeometry.of(1, 2, 1, 1, 1)),
    }[kind]
    weight = torch.randn(M, C // groups, S, generator=gen) if kind == "conv1d" else \
        torch.randn(M, C // groups, R, S, generator=gen)
    weight[torch.rand(weight.shape, generator=gen) < 0.6] = 0
    return (torch.randn(2, C, H, W, generator=gen), UniformCSR.from_dense(weight), torch.randn(M, generator=gen),
            geometry)


@pytest.mark.parametrize("kind", ["plain", "plain_bias", "grouped", "depthwise", "conv1d"])
def test_compare_layer_times_each_layout_of_the_dense_convolution(kind: str) -> None:
    if kind.startswith("plain"):
        x, csr, b = layer(1, kind == "plain_bias")
        geometry = ConvGeometry.of(2, 1)
    else:
        x, csr, b, geometry = grouped_layer(kind)
    result = compare_layer(x, csr, b, geometry, ["dense_cpu"], runs=3, baseline=True)
    baseline = result.baseline
    assert set(baseline.timings) == set(baseline.rel_error) == set(LAYOUTS) and baseline.failures == {}
    assert max(baseline.rel_error.values()) <= tolerance(torch.float32)
    assert baseline.layout in LAYOUTS
    assert baseline.median_ms == min(t.median_ms for t in baseline.timings.values())
    assert all(t.runs == 3 for t in baseline.timings.values())
    record = result.to_dict()["baseline"]
    assert record["layout"] == baseline.layout and set(record["timings"]) == set(LAYOUTS)
    assert compare_layer(x, csr, b, geometry, ["dense_cpu"], runs=3).baseline is None


def test_baseline_leaves_the_bias_out_and_skips_a_wrong_layout() -> None:
    """The output handed to the check is the convolution without bias, in the layout's memory format; a layout
    whose error exceeds the bound is recorded and not timed; with none correct there is no baseline figure."""
    x, csr, _ = layer(2, True)
    geometry = ConvGeometry.of(1, 1)
    weight = csr.to_dense().reshape(5, 3, 3, 3)
    expected = F.conv2d(x.double(), weight.double(), None, 1, 1)
    seen = {}

    def error(out: torch.Tensor) -> float:
        layout = "nhwc" if out.is_contiguous(memory_format=torch.channels_last) else "nchw"
        seen[layout] = torch.allclose(out.double(), expected, atol=1e-5)
        return 1.0 if layout == "nhwc" else 0.0

    baseline = time_baseline([x], weight, geometry, error, bound=1e-3, runs=2, warmup=0)
    assert seen == {"nchw": True, "nhwc": True}
    assert set(baseline.timings) == {"nchw"} and baseline.rel_error == {"nchw": 0.0, "nhwc": 1.0}
    assert baseline.layout == "nchw" and set(baseline.failures) == {"nhwc"}
    none = time_baseline([x], weight, geometry, lambda out: 1.0, bound=1e-3, runs=2, warmup=0)
    assert none.layout is None and none.median_ms is None and none.to_dict()["timings"] == {}


def test_a_layout_that_raises_is_recorded_and_the_other_still_timed() -> None:
    """An error from one layout's call (here the check raising for NHWC) is recorded under ``failures`` with an
    infinite error instead of ending the comparison; the benchmark flag of cuDNN is left as it was."""
    x, csr, _ = layer(4, False)
    weight = csr.to_conv2d_weight()

    def error(out: torch.Tensor) -> float:
        if out.is_contiguous(memory_format=torch.channels_last):
            raise RuntimeError("no NHWC kernel")
        return 0.0

    flag = torch.backends.cudnn.benchmark
    baseline = time_baseline([x], weight, ConvGeometry.of(1, 1), error, bound=1e-3, runs=2, warmup=0)
    assert torch.backends.cudnn.benchmark == flag
    assert set(baseline.timings) == {"nchw"} and baseline.rel_error["nhwc"] == float("inf")
    assert baseline.failures == {"nhwc": "RuntimeError: no NHWC kernel"}
