"""A whole model switched from NCHW to channels-last after its first max pool, on the GPU: the planned model (its
layers after the pool on the channels-last plan's entries), the eager dense model and the dense fused model agree with
the dense model, and the switched layout is a third layout of each model's best time."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from unsparse.runtime import bench, end_to_end
from unsparse.runtime.dense_fusion import fuse_dense_conv_relu
from unsparse.runtime.layout import channels_last_after, layout_of
from unsparse.runtime.plan import Plan

CUDA = torch.device("cuda")


def stem_and_block() -> nn.Module:
    """A ResNet-like stem (7x7 stride-2 conv, BatchNorm, ReLU, 3x3 stride-2 max pool) and two 3x3 convs, pruned to 0.9
    with BatchNorm statistics far from the identity."""
    torch.manual_seed(5)
    model = nn.Sequential(nn.Conv2d(3, 32, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
                          nn.MaxPool2d(3, stride=2, padding=1), nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64),
                          nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU())
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.uniform_(-1, 1)
            module.running_var.uniform_(0.25, 2)
    return bench.magnitude_prune_(model, 0.9).eval()


@pytest.mark.parametrize("precision", ["fp32", "tf32", "fp16"])
def test_a_switched_model_agrees_with_the_dense_one(precision: str) -> None:
    record = end_to_end.bench_end_to_end(stem_and_block(), (3, 64, 48), 4, precision, CUDA, 5, Plan(),
                                         ["cudnn", "direct"], fuse_relu=True, fold_batch_norm="all")
    assert record["layout_switch"] == "3"
    assert record["planned_switched_rel_error"] <= record["tolerance"] and record["planned_switched_ms"] > 0
    assert record["dense_fused_switched_rel_error"] <= record["tolerance"] and record["dense_fused_switched_ms"] > 0
    assert record["dense_switched_rel_error"] <= record["tolerance"] and record["dense_switched_ms"] > 0
    for model in ("planned", "dense", "dense_fused"):  # each also replayed as a CUDA graph, the switch captured
        assert record[f"{model}_switched_graph_ms"] > 0 and record[f"{model}_switched_graph_error"] is None, model
    for model, field in (("planned", "best_planned_layout"), ("dense", "best_dense_layout"),
                         ("dense_fused", "best_dense_fused_layout")):  # switched is a third layout of each
        times = {layout: record[f"{model}{suffix}_ms"] for layout, suffix in
                 (("nchw", ""), ("nhwc", "_nhwc"), ("switched", "_switched"))}
        assert record[field] == min(times, key=times.__getitem__), (field, times)
    assert sum(record["backend_counts_switched"].values()) == sum(record["backend_counts"].values()) == 3
    expected = {name: label for name, label in record["off_cudnn_nhwc"].items() if name != "0"}  # after the pool
    if "0" in record["off_cudnn"]:  # the stem, before the pool, reads the NCHW plan
        expected["0"] = record["off_cudnn"]["0"]
    assert record["off_cudnn_switched"] == expected, record


def test_the_switched_dense_model_computes_its_stem_in_nchw_on_cuda() -> None:
    """cuDNN's fused module reads its child conv's weight without calling the child: the switched dense model must
    still hold that weight in NCHW, so the stem's output (and cuDNN's computation) is NCHW, and the layers after the
    pool receive channels-last (before the fix, the stem ran channels-last)."""
    dense = stem_and_block().to(CUDA)
    fused, _ = fuse_dense_conv_relu(dense)
    x = torch.randn(4, 3, 64, 48, device=CUDA)
    switched, switch = end_to_end._switched_dense(fused, end_to_end.channels_last_copy(fused), x)
    layouts: dict[str, str] = {}

    def record(name: str, out: torch.Tensor) -> None:
        layouts.setdefault(name, layout_of(out))

    for name, module in switched.named_children():
        module.register_forward_hook(lambda module, inputs, out, name=name: record(name, out))
    with torch.no_grad(), channels_last_after(switched, switch):
        switched(x)
    first, last = next(iter(layouts)), list(layouts)[-1]
    assert layouts[first] == "nchw" and layouts[last] == "nhwc", layouts


def test_a_whole_model_planned_on_generated_records_what_planning_compiled() -> None:
    """The record of a whole model planned with the generated kernels counts the seconds its comparisons compiled
    (each layer's one-program kernels at least, none compiled ahead here) and the layer keys where the kernels of
    several programs were screened out, at most every key, and the planned model still agrees with the dense one."""
    record = end_to_end.bench_end_to_end(stem_and_block(), (3, 64, 48), 4, "tf32", CUDA, 5, Plan(),
                                         ["cudnn", "generated"], fuse_relu=True, fold_batch_norm="all")
    assert record["layers_planned_now"] == 6 and record["planning_compile_s"] > 0
    assert 0 <= record["layers_screened"] <= record["layers_planned_now"]
    assert record["planned_switched_rel_error"] <= record["tolerance"]
