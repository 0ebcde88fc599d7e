"""``unsparse.runtime.end_to_end`` on the CPU: the planned model against the dense one in NCHW and in channels-last."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import pytest
import torch
from torch import nn

from unsparse.runtime import bench, comparator, dense_fusion, end_to_end
from unsparse.runtime.backends.dense import DenseBackend
from unsparse.runtime.backends.lowering import LoweringBackend
from unsparse.runtime.layout import layout_of
from unsparse.runtime.modules import sparsify
from unsparse.runtime.plan import Plan, PlanEntry, without_epilogue

if TYPE_CHECKING:
    from conftest import VirtualClock


def model() -> nn.Module:
    torch.manual_seed(0)
    return bench.magnitude_prune_(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                                                nn.Conv2d(8, 4, 3, stride=2)).eval(), 0.7)


def test_end_to_end_compares_both_planned_layouts_with_both_dense_layouts() -> None:
    plan = Plan()
    record = end_to_end.bench_end_to_end(model(), (3, 12, 10), 2, "fp32", torch.device("cpu"), 3, plan,
                                    ["dense_cpu", "im2col_cublas"])
    assert record["dense_nhwc_ms"] > 0 and record["dense_nhwc_rel_error"] < 1e-5
    assert record["planned_nhwc_ms"] > 0 and record["planned_nhwc_rel_error"] < 1e-5
    best = min(record["dense_ms"], record["dense_nhwc_ms"])
    assert record["speedup_vs_best_dense"] == pytest.approx(best / record["planned_ms"])
    assert record["best_dense_layout"] == ("nchw" if best == record["dense_ms"] else "nhwc")
    best_planned = min(record["planned_ms"], record["planned_nhwc_ms"])
    assert record["best_planned_layout"] == ("nchw" if best_planned == record["planned_ms"] else "nhwc")
    assert record["best_speedup"] == pytest.approx(best / best_planned)
    assert record["layers_planned_now"] == 4 and len(plan.entries) == 4  # two layers, each in both layouts
    assert record["layers_screened"] == 0 and record["planning_compile_s"] == 0  # no backend here compiles
    assert sum(record["backend_counts_nhwc"].values()) == 2
    for check in (record["plan_check"], record["plan_check_nhwc"]):
        assert check["planned_ms"] > 0 and check["default_ms"] > 0 and isinstance(check["reverted"], tuple)
    assert record["rel_error"] < 1e-5 and record["graph_error"] == "no CUDA graphs on cpu"
    # one input every call, as the page says of end-to-end runs (per-layer timings rotate theirs)
    assert record["dense_timing"]["rotation"] == record["planned_timing"]["rotation"] == 1
    assert record["planned_nhwc_timing"]["rotation"] == 1
    assert record["channels_last_plan"] == "planned"


def test_a_model_planned_in_nchw_only_still_times_the_dense_model_in_both_layouts() -> None:
    """``channels_last=False`` skips the channels-last plan (its planning's device time) and what needs it, the
    planned NHWC and switched times, and says so; the dense baselines keep every layout."""
    torch.manual_seed(3)
    pooled = bench.magnitude_prune_(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                                  nn.Conv2d(4, 4, 3), nn.ReLU()).eval(), 0.5)
    plan = Plan()
    record = end_to_end.bench_end_to_end(pooled, (3, 12, 10), 2, "fp32", torch.device("cpu"), 3, plan,
                                         ["dense_cpu", "im2col_cublas"], channels_last=False)
    assert record["channels_last_plan"] == "not asked"
    assert len(plan.entries) == record["layers_planned_now"] == 2  # each layer once, in NCHW
    assert all("fmt=nhwc" not in key for key in plan.entries)
    assert record["planned_nhwc_ms"] is None and record["planned_nhwc_rel_error"] is None
    assert record["plan_check_nhwc"] is None and record["backend_counts_nhwc"] == {}
    assert record["layout_switch"] is None and record["planned_switched_ms"] is None
    assert record["best_planned_layout"] == "nchw"
    assert record["dense_nhwc_ms"] > 0 and record["dense_switched_ms"] > 0
    assert record["planned_ms"] > 0 and record["rel_error"] < 1e-5


def test_the_callers_model_keeps_its_device_dtype_and_weights_after_a_half_precision_run() -> None:
    """``run_bench`` times one model at each precision in turn: an FP16 run converted it in place, so the FP32 run
    after it timed FP16-rounded weights (and missed the kernels compiled ahead from the unrounded ones)."""
    dense = model()
    before = {name: value.clone() for name, value in dense.state_dict().items()}
    record = end_to_end.bench_end_to_end(dense, (3, 12, 10), 2, "fp16", torch.device("cpu"), 3, Plan(), ["dense_cpu"])
    assert record["rel_error"] < 1e-2
    after = dense.state_dict()
    assert all(after[name].dtype == torch.float32 and torch.equal(after[name], value) for name, value in before.items())


def test_a_channels_last_model_that_disagrees_is_not_a_baseline(monkeypatch: pytest.MonkeyPatch) -> None:
    """If the channels-last run's output is off, its (here very short) time is not used."""
    class Zeros(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.zeros(())

    monkeypatch.setattr(end_to_end, "channels_last_copy", lambda dense: Zeros())
    record = end_to_end.bench_end_to_end(model(), (3, 12, 10), 2, "fp32", torch.device("cpu"), 3, Plan(), ["dense_cpu"])
    assert record["dense_nhwc_ms"] is None and record["dense_nhwc_rel_error"] == float("inf")
    assert record["best_dense_layout"] == "nchw"
    assert record["speedup_vs_best_dense"] == pytest.approx(record["speedup"])


def test_planned_backends_name_cudnn_layers_that_compute_in_the_other_layout() -> None:
    sparse = end_to_end.sparsify(model())
    x = torch.randn(2, 3, 12, 10)
    plan, _ = end_to_end.plan_model(sparse, x.contiguous(memory_format=torch.channels_last), Plan(), ["dense_cpu"],
                                    runs=3)
    first, second = end_to_end.sparse_layers(sparse).values()
    plan.entries[first.plan_key] = PlanEntry("cudnn", {"memory_format": "contiguous"})
    plan.entries[second.plan_key] = PlanEntry("cudnn", {"memory_format": "channels_last"})
    assert list(comparator.planned_backends(sparse, plan).values()) == ["cudnn, converted to nchw", "cudnn"]
    end_to_end.plan_model(sparse, x, plan, ["dense_cpu"], runs=3)  # the same layers' NCHW keys
    plan.entries[first.plan_key] = PlanEntry("cudnn", {"memory_format": "channels_last"})
    plan.entries[second.plan_key] = PlanEntry("direct", {})
    assert list(comparator.planned_backends(sparse, plan).values()) == ["cudnn, converted to nhwc", "direct"]


def test_a_channels_last_planned_model_that_disagrees_is_not_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    """The second sparse copy (the one planned on the NHWC input) computes a wrong output: its time is not used."""
    copies, original = [], end_to_end.sparsify

    class Off(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x) + 1

    def sparsify(dense: nn.Module, **fusions: bool) -> nn.Module:
        copies.append(original(dense, **fusions))
        return copies[-1] if len(copies) == 1 else Off(copies[-1])

    monkeypatch.setattr(end_to_end, "sparsify", sparsify)
    record = end_to_end.bench_end_to_end(model(), (3, 12, 10), 2, "fp32", torch.device("cpu"), 3, Plan(), ["dense_cpu"])
    assert record["planned_nhwc_rel_error"] > 1e-3 and record["planned_nhwc_ms"] is None
    assert record["best_planned_layout"] == "nchw"


def test_a_one_channel_model_is_not_planned_in_channels_last() -> None:
    torch.manual_seed(0)
    one_channel = bench.magnitude_prune_(nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 3)).eval(), 0.5)
    record = end_to_end.bench_end_to_end(one_channel, (1, 9, 8), 2, "fp32", torch.device("cpu"), 3, Plan(),
                                         ["dense_cpu"])
    assert record["planned_nhwc_ms"] is None and record["planned_nhwc_rel_error"] is None
    assert record["plan_check_nhwc"] is None
    assert record["layers_planned_now"] == 2 and record["best_planned_layout"] == "nchw"
    assert record["channels_last_plan"] == "one channel"


COSTS_MS = {("dense_cpu", 8): 1.0, ("im2col_cublas", 8): 0.99, ("im2col_cusparse", 8): 2.0,
            ("dense_cpu", 4): 1.0, ("im2col_cublas", 4): 0.5, ("im2col_cusparse", 4): 2.0}
"""What a call of each CPU backend costs on the virtual clock (``virtual_clock``), per backend and layer (its output
channels: 8, then 4, in :func:`model`)."""


def test_a_sparse_model_records_the_backend_its_plan_kept_per_layer(virtual_clock: VirtualClock,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A trained model's layer records named only the fastest backend; the plan keeps the dense default for a win
    within the margin (the first layer: 1 % faster), leaves it for a larger one (the second: 2x), and every key goes
    back to the default where the end-to-end check sets the plan back (forced here: margin -1). The test once timed
    the backends for real and could only check the record against the plan, whichever backend won."""
    virtual_clock.charge(lambda name, csr, params: COSTS_MS[name, csr.out_channels], DenseBackend, LoweringBackend)
    plan = Plan()
    sparse = end_to_end.sparsify(model())
    record = end_to_end.bench_end_to_end_sparse(sparse, (3, 12, 10), 2, torch.device("cpu"), 3, plan)
    assert [(layer["best"], layer["planned"]) for layer in record["layers"]] == [("im2col_cublas", "dense_cpu"),
                                                                                 ("im2col_cublas", "im2col_cublas")]
    assert [layer["planned"] for layer in record["layers"]] == [plan.entries[layer["key"]].backend
                                                                for layer in record["layers"]]
    assert record["layers"][0]["best_ms"] == pytest.approx({"dense_cpu": 1.0, "im2col_cublas": 0.99,
                                                             "im2col_cusparse": 2.0})
    check = record["plan_check"]
    assert (check["planned_ms"], check["default_ms"], check["reverted"]) == (pytest.approx(1.5), pytest.approx(2.0), ())
    assert record["dense_ms"] == pytest.approx(2.0) and record["speedup"] == pytest.approx(2.0 / 1.5)
    check_plan = comparator.check_plan
    monkeypatch.setattr(end_to_end, "check_plan", lambda *args: check_plan(*args, margin=-1.0))
    sparse = end_to_end.sparsify(model())
    record = end_to_end.bench_end_to_end_sparse(sparse, (3, 12, 10), 2, torch.device("cpu"), 3, Plan())
    assert [(layer["best"], layer["planned"]) for layer in record["layers"]] == [("im2col_cublas", "dense_cpu")] * 2
    assert record["plan_check"]["reverted"] == (record["layers"][1]["key"],)  # the first was on the default already
    assert record["speedup"] == pytest.approx(1.0)


def test_a_sparse_model_is_timed_on_its_dense_default_and_on_its_plan_one_after_the_other(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The dense side of a trained model was timed before planning, and the host's pace drifted in between (the
    twenty-fourth session's H200 run: 0.557 against 2.154 ms eagerly, 0.137 against 0.128 ms as CUDA graphs; the
    dense model alone took 0.50, then 1.03 ms in one process); and its record had no graph times to tell host time
    from kernels. Both are now timed after planning, and as graphs too."""
    sparse, seen, time_fn = end_to_end.sparsify(model()), [], end_to_end.time_fn

    def spy(*args, **kwargs):
        layers = end_to_end.sparse_layers(sparse).values()
        seen.append(({layer.backend for layer in layers}, all(hasattr(layer, "plan_key") for layer in layers)))
        return time_fn(*args, **kwargs)

    monkeypatch.setattr(end_to_end, "time_fn", spy)
    record = end_to_end.bench_end_to_end_sparse(sparse, (3, 12, 10), 2, torch.device("cpu"), 3, Plan())
    assert seen == [({"cudnn"}, True), ({"auto"}, True)]
    assert record["graph_error"] == "no CUDA graphs on cpu" and record["dense_graph_ms"] is None
    assert {layer.backend for layer in end_to_end.sparse_layers(sparse).values()} == {"auto"}


def test_a_model_timed_with_its_relus_fused_agrees_with_the_dense_model_and_says_so(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``fuse_relu`` the sparse copies hold the first conv fused with its ReLU (the record counts it) and still
    agree with the dense model, whose ReLU runs apart; an unfused copy on the same plan, planned no further, is
    timed in the same run for what fusing buys. Without it nothing is fused and nothing more is timed."""
    timed, time_fn, copies, sparsify = [], end_to_end.time_fn, [], end_to_end.sparsify

    def spy(fn, *args, **kwargs):
        timed.append(fn(0))
        return time_fn(fn, *args, **kwargs)

    def kept_sparsify(*args, **kwargs):
        copies.append(sparsify(*args, **kwargs))
        return copies[-1]

    monkeypatch.setattr(end_to_end, "time_fn", spy)
    monkeypatch.setattr(end_to_end, "sparsify", kept_sparsify)
    plan = Plan()
    record = end_to_end.bench_end_to_end(model(), (3, 12, 10), 2, "fp32", torch.device("cpu"), 3, plan,
                                         ["dense_cpu"], fuse_relu=True)
    assert record["fused_relu"] == 1
    assert record["rel_error"] <= record["tolerance"] and record["planned_nhwc_rel_error"] <= record["tolerance"]
    assert record["layers_planned_now"] == len(plan.entries) == 4  # two layers in two layouts; the unfused copy: none
    fused, unfused = copies[0], copies[2]
    assert [layer.relu for layer in end_to_end.sparse_layers(unfused).values()] == [False, False]
    assert [layer.relu for layer in end_to_end.sparse_layers(fused).values()] == [True, False]
    assert record["fusion_planned"] and sum("|epilogue=relu" in key for key in plan.entries) == 2  # both layouts
    assert record["cudnn_fuses_relu"] is True and record["direct_fuses_relu"] is True
    assert record["direct_fuses_residual"] is True
    assert [layer.plan_key for layer in end_to_end.sparse_layers(unfused).values()] == [
        without_epilogue(layer.plan_key) for layer in end_to_end.sparse_layers(fused).values()]
    torch.testing.assert_close(timed[2], timed[1])  # dense, fused, unfused: the same function
    assert record["planned_unfused_ms"] > 0
    assert record["fusion_speedup"] == pytest.approx(record["planned_unfused_ms"] / record["planned_ms"])
    timed.clear()
    plain = end_to_end.bench_end_to_end(model(), (3, 12, 10), 2, "fp32", torch.device("cpu"), 3, Plan(),
                                        ["dense_cpu"])
    assert plain["fused_relu"] == 0 and plain["planned_unfused_ms"] is None and plain["fusion_speedup"] is None
    assert len(timed) == 6  # dense, planned, the two channels-last models, the cuDNN-fused dense model in both


def test_a_layer_planned_with_its_relu_as_passes_runs_the_same_choice_unfused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The unfused copy takes each fused key's entry less its epilogue setting, which only a fused layer has (the
    forty-seventh session's first GPU run stopped on a PlanError there); the record names the layer planned as passes.
    cuDNN is let onto the CPU (its fused call falls back there) and offers only the passes for a fused ReLU."""
    from unsparse.runtime.backends.dense import CudnnBackend

    monkeypatch.setattr(CudnnBackend, "device_types", frozenset({"cpu"}))
    monkeypatch.setattr(CudnnBackend, "epilogue_space", lambda self, relu: [{"epilogue": "passes"}] if relu else [{}])
    monkeypatch.setattr(end_to_end, "check_plan",  # kept whatever CPU noise says, so the passes reach the unfused copy
                        lambda *args, **kwargs: comparator.PlanCheck(1.0, 1.0, (), "eager", 0.0))
    plan = Plan()
    record = end_to_end.bench_end_to_end(model(), (3, 12, 10), 2, "fp32", torch.device("cpu"), 3, plan, ["cudnn"],
                                         fuse_relu=True)
    assert record["epilogue_passes"] == record["epilogue_passes_nhwc"] == ["0"]
    assert record["planned_unfused_ms"] > 0 and record["rel_error"] <= record["tolerance"]
    fused = [entry for key, entry in plan.entries.items() if "|epilogue=relu" in key]
    assert len(fused) == 2 and all(entry.params.get("epilogue") == "passes" for entry in fused)
    assert all(entry.unfused().params == {"memory_format": entry.params["memory_format"]} for entry in fused)
    unfused = PlanEntry("cudnn", {"memory_format": "contiguous"})
    assert unfused.unfused() is unfused


def test_the_dense_model_fused_by_cudnn_is_timed_in_both_layouts_beside_the_plan() -> None:
    """The stronger dense baseline (each conv with its bias and ReLU in one call) runs in the same record: its one
    fusable conv counted, both layouts timed and agreeing with the dense model, and the better planned layout held
    against the faster of them; a model with no conv followed by a ReLU fuses nothing and times nothing more."""
    record = end_to_end.bench_end_to_end(model(), (3, 12, 10), 2, "fp32", torch.device("cpu"), 3, Plan(),
                                         ["dense_cpu"])
    assert record["dense_fused_convs"] == 1
    assert record["dense_fused_passes"] == record["dense_fused_nhwc_passes"] == 0  # chosen on CUDA only
    assert record["epilogue_passes"] == record["epilogue_passes_nhwc"] == []  # dense_cpu has no epilogue setting
    assert record["dense_fused_rel_error"] < 1e-5 and record["dense_fused_nhwc_rel_error"] < 1e-5
    assert record["dense_fused_graph_ms"] is record["dense_fused_nhwc_graph_ms"] is None  # no CUDA graphs on CPU
    assert record["dense_fused_graph_error"] == "no CUDA graphs on cpu"
    fused = {"nchw": record["dense_fused_ms"], "nhwc": record["dense_fused_nhwc_ms"]}
    assert min(fused.values()) > 0 and record["best_dense_fused_layout"] == min(fused, key=fused.get)
    best_planned = min(record["planned_ms"], record["planned_nhwc_ms"])
    assert record["best_speedup_vs_dense_fused"] == pytest.approx(min(fused.values()) / best_planned)
    torch.manual_seed(1)
    no_relu = bench.magnitude_prune_(nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 2, 1)).eval(), 0.5)
    plain = end_to_end.bench_end_to_end(no_relu, (3, 8, 8), 2, "fp32", torch.device("cpu"), 3, Plan(), ["dense_cpu"])
    assert plain["dense_fused_convs"] == 0 and plain["dense_fused_ms"] is plain["dense_fused_nhwc_ms"] is None
    assert plain["dense_fused_passes"] is None
    assert plain["best_dense_fused_layout"] is plain["best_speedup_vs_dense_fused"] is None
    assert {key for key in plain if key.startswith("dense_fused")} == {key for key in record
                                                                       if key.startswith("dense_fused")}


def pooled_model() -> nn.Module:
    torch.manual_seed(2)
    return bench.magnitude_prune_(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                                nn.Conv2d(8, 6, 3, padding=1), nn.ReLU()).eval(), 0.6)


def test_a_model_with_a_max_pool_is_also_timed_nchw_before_it_and_channels_last_after_it() -> None:
    """Planned and fused dense models both run switched after the first max pool, agree with the dense model and
    record the pool's name; a model without a max pool records no switch."""
    record = end_to_end.bench_end_to_end(pooled_model(), (3, 12, 10), 2, "fp32", torch.device("cpu"), 3, Plan(),
                                         ["dense_cpu"], fuse_relu=True)
    assert record["layout_switch"] == record["dense_fused_layout_switch"] == "2"
    assert record["planned_switched_ms"] > 0 and record["planned_switched_rel_error"] < 1e-5
    assert record["dense_fused_switched_ms"] > 0 and record["dense_fused_switched_rel_error"] < 1e-5
    assert record["dense_fused_switched_error"] is None
    for kind in ("planned", "dense", "dense_fused"):  # graphs are timed on CUDA only
        assert record[f"{kind}_switched_graph_ms"] is None
        assert record[f"{kind}_switched_graph_error"] == "no CUDA graphs on cpu"
    assert record["off_cudnn_switched"] == {"0": record["off_cudnn"]["0"], "3": record["off_cudnn_nhwc"]["3"]}
    assert sum(record["backend_counts_switched"].values()) == 2
    plain = end_to_end.bench_end_to_end(model(), (3, 12, 10), 2, "fp32", torch.device("cpu"), 3, Plan(),
                                        ["dense_cpu"])
    assert plain["layout_switch"] is plain["planned_switched_ms"] is plain["dense_fused_switched_ms"] is None
    assert plain["backend_counts_switched"] is plain["off_cudnn_switched"] is None


@pytest.mark.parametrize("fastest", ["planned", "dense", "dense fused"])
def test_the_switched_layout_is_a_third_layout_of_every_best_ratio(monkeypatch: pytest.MonkeyPatch,
                                                                   fastest: str) -> None:
    """Where a switched model times fastest (the others' switched times made slowest: CPU timings of the single
    layouts are noise), its ``best_*_layout`` says "switched" and the best ratios use its time;
    the eager dense model is timed switched too, so both sides of ``best_speedup`` had the same three layouts."""
    real = end_to_end._switched_timing

    def kind(model: nn.Module) -> str:
        if end_to_end.sparse_layers(model):
            return "planned"
        return "dense fused" if any(isinstance(m, dense_fusion.ConvBiasReLU) for m in model.modules()) else "dense"

    def faster(model: nn.Module, *args: object) -> end_to_end.SwitchedTiming:  # the others slowest, whatever the clock
        timing = real(model, *args)
        return timing._replace(eager=replace(timing.eager, median_ms=1e-6 if kind(model) == fastest else 1e6))

    monkeypatch.setattr(end_to_end, "_switched_timing", faster)
    record = end_to_end.bench_end_to_end(pooled_model(), (3, 12, 10), 2, "fp32", torch.device("cpu"), 3, Plan(),
                                         ["dense_cpu"], fuse_relu=True)
    assert record["dense_layout_switch"] == record["dense_fused_layout_switch"] == record["layout_switch"] == "2"
    assert record["dense_switched_rel_error"] < 1e-5 and record["dense_switched_error"] is None
    layouts = {"dense": "best_dense_layout", "planned": "best_planned_layout", "dense fused": "best_dense_fused_layout"}
    assert {name: record[field] == "switched" for name, field in layouts.items()} == {
        name: name == fastest for name in layouts}
    times = {kind: {layout: record[f"{prefix}{suffix}_ms"] for layout, suffix in
                    (("nchw", ""), ("nhwc", "_nhwc"), ("switched", "_switched"))}
             for kind, prefix in (("dense", "dense"), ("planned", "planned"), ("dense fused", "dense_fused"))}
    assert all(min(times[name].values()) == times[name][record[field]] for name, field in layouts.items())
    assert record["best_speedup"] == pytest.approx(min(times["dense"].values()) / min(times["planned"].values()))
    assert record["speedup_vs_best_dense"] == pytest.approx(min(times["dense"].values()) / record["planned_ms"])
    assert record["best_speedup_vs_dense_fused"] == pytest.approx(min(times["dense fused"].values())
                                                                  / min(times["planned"].values()))


def test_a_planned_model_with_its_pools_fused_switches_after_the_conv_that_fused_the_first() -> None:
    """With ``fuse_max_pool`` the planned copy calls no max pool: it switches after conv ``0``, which applies the pool
    the dense models switch after (``2``), and agrees with the dense model; its second conv reads the channels-last
    plan."""
    record = end_to_end.bench_end_to_end(pooled_model(), (3, 12, 10), 2, "fp32", torch.device("cpu"), 3, Plan(),
                                         ["dense_cpu"], fuse_relu=True, fuse_max_pool=True)
    assert record["fused_max_pool"] == 1
    assert (record["layout_switch"], record["dense_layout_switch"], record["dense_fused_layout_switch"]) == ("0", "2",
                                                                                                             "2")
    assert record["planned_switched_ms"] > 0 and record["planned_switched_rel_error"] < 1e-5
    assert record["off_cudnn_switched"] == {"0": record["off_cudnn"]["0"], "3": record["off_cudnn_nhwc"]["3"]}


def test_a_switched_sparse_model_feeds_nchw_before_the_pool_and_channels_last_after_it() -> None:
    """The sparse copy's layers (which hold no 4-D parameter) receive NCHW up to the pool and channels-last after it,
    so each reads the plan entry of that layout; a layer reads the label of the layout it received."""
    sparse = sparsify(pooled_model())
    x = torch.randn(2, 3, 12, 10)
    assert end_to_end.switched_input_layouts(sparse, "2", x) == {"0": "nchw", "3": "nhwc"}
    assert layout_of(sparse(x)) == "nchw"  # the switch is undone after the pass
    nchw = {"0": "direct", "3": "generated", "5": "direct"}
    nhwc = {"0": "cudnn", "3": "cudnn, converted to nchw"}
    assert end_to_end.switched_backends(nchw, nhwc, {"0": "nchw", "3": "nhwc", "5": "nhwc"}) == {
        "0": "direct", "3": "cudnn, converted to nchw"}


def test_the_switched_dense_model_takes_the_nchw_models_modules_before_the_pool() -> None:
    """Before the switch the NCHW model's modules (NCHW weights, epilogue choices made on NCHW), after it the
    channels-last model's; a fused module that reads its child conv's weight without calling the child (cuDNN's fused
    call on CUDA) counts as before the switch; neither model is modified."""

    class ReadsChildWeight(nn.Module):
        def __init__(self, conv: nn.Conv2d) -> None:
            super().__init__()
            self.conv = conv

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(nn.functional.conv2d(x, self.conv.weight, self.conv.bias, padding=1))

    dense = pooled_model()
    nchw = nn.Sequential(ReadsChildWeight(dense[0]), *list(dense)[2:])
    nchw[0].passes = "chosen on NCHW"
    nhwc = end_to_end.channels_last_copy(nchw)
    nhwc[0].passes = "chosen on NHWC"
    switched, switch = end_to_end._switched_dense(nchw, nhwc, torch.randn(2, 3, 12, 10))
    assert switch == "1" and switched[0].passes == "chosen on NCHW" and switched[0].conv.weight.is_contiguous()
    after = switched[2].weight
    assert after.is_contiguous(memory_format=torch.channels_last) and not after.is_contiguous()
    assert nhwc[0].passes == "chosen on NHWC" and not nhwc[0].conv.weight.is_contiguous()


def test_a_switched_dense_model_that_fails_keeps_the_single_layout_times(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object) -> None:
        raise RuntimeError("no engine\nmore")

    monkeypatch.setattr(end_to_end, "_switched_dense", refuse)
    record = end_to_end.bench_end_to_end(pooled_model(), (3, 12, 10), 2, "fp32", torch.device("cpu"), 3, Plan(),
                                         ["dense_cpu"], fuse_relu=True)
    assert record["dense_fused_switched_error"] == "RuntimeError: no engine"
    assert record["dense_fused_ms"] > 0 and record["dense_fused_nhwc_ms"] > 0 and record["dense_fused_error"] is None
    assert record["dense_fused_switched_ms"] is None and record["planned_switched_ms"] > 0


def test_a_one_channel_model_is_not_switched() -> None:
    torch.manual_seed(3)
    one_channel = bench.magnitude_prune_(nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                                       nn.Conv2d(4, 4, 3), nn.ReLU()).eval(), 0.5)
    record = end_to_end.bench_end_to_end(one_channel, (1, 12, 10), 2, "fp32", torch.device("cpu"), 3, Plan(),
                                         ["dense_cpu"], fuse_relu=True)
    assert record["layout_switch"] is record["dense_fused_layout_switch"] is None
    assert record["planned_switched_ms"] is record["dense_fused_switched_ms"] is None


def conv_stand_in(forward: Callable[[nn.Conv2d, torch.Tensor], torch.Tensor]) -> type[nn.Module]:
    """A stand-in for ``dense_fusion.ConvBiasReLU``: it holds the convolution and returns ``forward(conv, x)``."""

    class StandIn(nn.Module):
        def __init__(self, conv: nn.Conv2d) -> None:
            super().__init__()
            self.conv = conv

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return forward(self.conv, x)

    return StandIn


def test_a_fused_dense_model_that_disagrees_is_not_a_baseline(monkeypatch: pytest.MonkeyPatch) -> None:
    """If the fused dense model's output is off, its times are not used (as for the channels-last dense model)."""
    monkeypatch.setattr(dense_fusion, "ConvBiasReLU", conv_stand_in(lambda conv, x: torch.relu(conv(x)) + 1))
    record = end_to_end.bench_end_to_end(model(), (3, 12, 10), 2, "fp32", torch.device("cpu"), 3, Plan(),
                                         ["dense_cpu"])
    assert record["dense_fused_convs"] == 1 and record["dense_fused_rel_error"] > 1e-3
    assert record["dense_fused_ms"] is record["dense_fused_nhwc_ms"] is record["best_speedup_vs_dense_fused"] is None
    assert record["dense_fused_graph_ms"] is record["dense_fused_graph_error"] is None  # nothing to replay


def test_a_fused_dense_model_that_cudnn_refuses_is_recorded_not_fatal(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuDNN without a fused engine for a layer: the record says so and holds no fused time; the rest is timed."""
    def refused(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("cuDNN Frontend error: no valid engine configs\nmore")

    monkeypatch.setattr(dense_fusion, "ConvBiasReLU", conv_stand_in(refused))
    record = end_to_end.bench_end_to_end(model(), (3, 12, 10), 2, "fp32", torch.device("cpu"), 3, Plan(),
                                         ["dense_cpu"])
    assert record["dense_fused_error"] == "RuntimeError: cuDNN Frontend error: no valid engine configs"
    assert record["dense_fused_ms"] is record["best_speedup_vs_dense_fused"] is None and record["planned_ms"] > 0


def test_the_unfused_copy_leaves_the_timed_copy_its_own_entry_for_a_shared_key() -> None:
    """Two convs of the same shape, pattern and input, the first fused with its ReLU: once unfused, its key is the
    second conv's. Planning the unfused copy on the same choices must not put the fused layer's entry under that key
    in the active plan, which the timed sparse copy reads for its second conv."""
    from unsparse.runtime.plan import active_plan

    first = nn.Conv2d(4, 4, 3, padding=1)
    second = nn.Conv2d(4, 4, 3, padding=1)
    with torch.no_grad():
        first.weight.masked_fill_(torch.rand(first.weight.shape, generator=torch.Generator().manual_seed(1)) < 0.5, 0)
        second.weight.copy_(first.weight)
    dense = nn.Sequential(first, nn.ReLU(), second)
    fused = end_to_end.sparsify(dense, fuse_relu=True)
    comparator.plan_model(fused, torch.randn(2, 4, 6, 5), Plan(), ["dense_cpu"])
    keys = [layer.plan_key for layer in end_to_end.sparse_layers(fused).values()]
    assert without_epilogue(keys[0]) == keys[1] != keys[0]
    plan = Plan({keys[0]: PlanEntry("reference", {}), keys[1]: PlanEntry("dense_cpu", {})})
    end_to_end.bench_end_to_end(dense, (4, 6, 5), 2, "fp32", torch.device("cpu"), 3, plan, ["dense_cpu"],
                                fuse_relu=True)
    assert active_plan().entries[keys[1]].backend == "dense_cpu" and active_plan().entries[keys[0]].backend == (
        "reference")
