"""Folding BatchNorms only where the planned backend adds the bias in its epilogue
(``fold_batch_norm_into_epilogues_``, the whole-model benchmark's ``"epilogue"`` policy), on the CPU against the
unfolded model in float64."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from tests.test_fold_batch_norm import float64_output, pruned
from unsparse.report.benchmark import evaluate_targets, markdown_report
from unsparse.report.end_to_end_summary import summary_markdown, summary_row
from unsparse.runtime import end_to_end
from unsparse.runtime.backends import get_backend
from unsparse.runtime.backends.dense import DenseCpuBackend
from unsparse.runtime.batch_norm_folding import FOLDED_ATTRIBUTE, fold_batch_norm_, fold_batch_norm_into_epilogues_
from unsparse.runtime.comparator import plan_model
from unsparse.runtime.modules import sparse_layers, sparsify
from unsparse.runtime.plan import Plan, PlanEntry


def three_blocks() -> nn.Module:
    """Three conv, BatchNorm, ReLU blocks in a Sequential (names "0", "3", "6"), odd sizes."""
    return pruned(nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(),
                                nn.Conv2d(6, 5, 1, bias=False), nn.BatchNorm2d(5), nn.ReLU(),
                                nn.Conv2d(5, 4, 3, stride=2), nn.BatchNorm2d(4), nn.ReLU()))


def test_only_the_named_convolutions_take_their_batch_norm() -> None:
    dense = three_blocks()
    x = torch.randn(2, 3, 9, 7)
    expected = float64_output(dense, x)  # dense in float64 from here, so that the folds are exact to float64
    sparse = sparsify(dense)
    assert fold_batch_norm_(sparse, only={"3", "not a layer"}) == ["3"]
    assert isinstance(sparse[4], nn.Identity) and isinstance(sparse[1], nn.BatchNorm2d)
    assert isinstance(sparse[7], nn.BatchNorm2d) and getattr(sparse, FOLDED_ATTRIBUTE) == ["3"]
    torch.testing.assert_close(float64_output(sparse, x), expected, rtol=1e-9, atol=1e-9)


def test_which_backends_add_the_bias_in_their_epilogue() -> None:
    """The direct kernels and the generated ones do, except the direct kernel's split-K settings (their partial sums
    take the bias in a pass after); cuDNN as PyTorch calls it and the lowering backends add it in a pass."""
    assert get_backend("direct").adds_bias_in_epilogue({"kernel": "tile"})
    assert not get_backend("direct").adds_bias_in_epilogue({"kernel": "pointwise", "splits": 2})
    assert get_backend("direct_half2").adds_bias_in_epilogue({"accumulate": "half2"})
    assert get_backend("generated").adds_bias_in_epilogue({"rows": 4})
    for name in ("cudnn", "dense_cpu", "im2col_cublas", "im2col_cusparse", "reference"):
        assert not get_backend(name).adds_bias_in_epilogue({})


def test_a_planned_model_folds_only_into_layers_whose_backend_adds_the_bias() -> None:
    """Entries on direct (a split-K one among them), generated and cuDNN: the first two kinds fold, the split-K and
    the cuDNN layers keep their BatchNorms; the model still computes the unfolded function (run on the CPU backend,
    the plan's choices only decide where to fold)."""
    dense = three_blocks()
    x = torch.randn(2, 3, 9, 7)
    expected = float64_output(dense, x)
    sparse = sparsify(dense)
    plan, _ = plan_model(sparse, x.double(), Plan(), ["dense_cpu"])
    layers = sparse_layers(sparse)
    choices = {"0": PlanEntry("direct", {"kernel": "tile"}), "3": PlanEntry("direct", {"splits": 2}),
               "6": PlanEntry("generated", {"rows": 4})}
    chosen = Plan()
    chosen.entries.update({layers[name].plan_key: entry for name, entry in choices.items()})
    assert fold_batch_norm_into_epilogues_(sparse, chosen) == ["0", "6"]
    assert isinstance(sparse[4], nn.BatchNorm2d)
    chosen.entries[layers["3"].plan_key] = PlanEntry("cudnn", {})
    assert fold_batch_norm_into_epilogues_(sparse, chosen) == []
    assert fold_batch_norm_into_epilogues_(sparsify(dense), plan) == []  # planned on dense_cpu: nothing folds
    torch.testing.assert_close(float64_output(sparse, x), expected, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("epilogue", [True, False])
def test_the_epilogue_policy_folds_by_the_checked_plan_and_keeps_every_key(
        monkeypatch: pytest.MonkeyPatch, epilogue: bool) -> None:
    """With ``fold_batch_norm="epilogue"`` the end-to-end benchmark plans, checks, then folds where the planned
    backend adds the bias (here the CPU dense backend, made to claim it); the ReLU after a folded BatchNorm is not
    fused, so every layer keeps the key (and the entry) its fold was decided on; the unfused copy takes the same
    folds. Where the backend adds the bias in a pass, nothing folds. Every copy computes the eager dense model's
    function."""
    monkeypatch.setattr(DenseCpuBackend, "adds_bias_in_epilogue", lambda self, params: epilogue)
    copies, sparsify_before = [], end_to_end.sparsify

    def kept(*args, **kwargs):
        copies.append(sparsify_before(*args, **kwargs))
        return copies[-1]

    monkeypatch.setattr(end_to_end, "sparsify", kept)
    dense = three_blocks()
    plan = Plan()
    record = end_to_end.bench_end_to_end(dense, (3, 9, 7), 2, "fp32", torch.device("cpu"), 3, plan,
                                         ["dense_cpu"], fuse_relu=True, fold_batch_norm="epilogue")
    folded = 3 if epilogue else 0
    assert record["fold_batch_norm"] == "epilogue"
    assert record["folded_batch_norm"] == record["folded_batch_norm_nhwc"] == folded
    assert record["fused_relu"] == 0 and record["dense_folded_batch_norm"] == 3
    assert [len(getattr(copy, FOLDED_ATTRIBUTE, [])) for copy in copies] == [folded] * 3
    assert record["rel_error"] < 1e-5 and record["planned_nhwc_rel_error"] < 1e-5
    assert not any("epilogue=" in key for key in plan.entries)
    x = torch.randn(2, 3, 9, 7)
    with torch.no_grad():
        for copy in copies:
            torch.testing.assert_close(copy(x), dense(x), rtol=1e-5, atol=1e-5)


def test_a_reused_plan_decides_the_folds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Entries reused from an earlier plan count as the plan: where they name a backend that adds the bias in a pass
    (the reference backend standing in for cuDNN), nothing folds, though a fresh comparison would have folded."""
    monkeypatch.setattr(DenseCpuBackend, "adds_bias_in_epilogue", lambda self, params: True)
    plan, dense = Plan(), three_blocks()
    first = end_to_end.bench_end_to_end(dense, (3, 9, 7), 2, "fp32", torch.device("cpu"), 3, plan,
                                        ["dense_cpu"], fold_batch_norm="epilogue")
    assert first["folded_batch_norm"] == 3
    for key in plan.entries:
        plan.entries[key] = PlanEntry("reference", {})
    again = end_to_end.bench_end_to_end(dense, (3, 9, 7), 2, "fp32", torch.device("cpu"), 3, plan,
                                        ["dense_cpu"], fold_batch_norm="epilogue")
    assert again["plan_entries_reused"] == 6 and again["layers_planned_now"] == 0
    assert again["folded_batch_norm"] == again["folded_batch_norm_nhwc"] == 0
    assert again["backend_counts"] == {"reference": 3} and again["rel_error"] < 1e-5


def test_sparsify_takes_a_bool_not_a_policy() -> None:
    with pytest.raises(TypeError, match="fold_batch_norm: expected True or False, got 'off'"):
        sparsify(three_blocks(), fold_batch_norm="off")


def epilogue_record(**fields: object) -> dict:
    return {"model": "resnet50", "weights": "synthetic", "batch": 128, "precision": "fp32_generated",
            "dense_ms": 35.0, "dense_nhwc_ms": 30.0, "planned_ms": 25.0, "planned_nhwc_ms": 28.0, "speedup": 1.4,
            "rel_error": 1e-4, "fold_batch_norm": "epilogue", "folded_batch_norm": 44, "folded_batch_norm_nhwc": 2,
            "backend_counts": {"direct": 44, "cudnn": 9}, "off_cudnn": {"conv1": "direct"},
            "backend_counts_nhwc": {"cudnn": 51, "direct": 2}, "off_cudnn_nhwc": {"conv1": "direct"}, **fields}


def test_the_page_and_the_summary_say_each_plan_folds_by_its_own_backends() -> None:
    record = epilogue_record()
    environment = {"torch": "x", "cuda": "x", "commit": "abc", "date_utc": "today"}
    result = {"environment": environment, "weights": "synthetic", "runs": 20, "layers": [], "end_to_end": [record]}
    text = markdown_report({**result, "targets": evaluate_targets(result)})
    assert "in the rows that say 'epilogue' only into the layers whose planned backend adds the bias" in text
    assert "; BatchNorm folded into 44 convs (epilogue)" in text
    assert "; BatchNorm folded into 2 convs (epilogue) |" in text
    row = summary_row(record, "r.json")
    assert row["folded"] == 44 and row["planned_layout"] == "NCHW"
    assert "| 44 (epilogue) / 0+0 |" in summary_markdown([row], "made")
    nhwc = summary_row(epilogue_record(planned_ms=29.0), "r.json")
    assert nhwc["folded"] == 2 and nhwc["planned_layout"] == "NHWC"
    unplanned_nhwc = epilogue_record(backend_counts_nhwc={}, off_cudnn_nhwc={}, folded_batch_norm_nhwc=0)
    text = markdown_report({**result, "end_to_end": [unplanned_nhwc], "targets": evaluate_targets(result)})
    assert "(epilogue) | - |" in text and "{}" not in text  # no counts, no fold for a layout that was not planned
    nothing = epilogue_record(fold_batch_norm="all", folded_batch_norm=0, folded_batch_norm_nhwc=0)
    text = markdown_report({**result, "end_to_end": [nothing], "targets": evaluate_targets(result)})
    assert "BatchNorm folded" not in text  # "all" on a model without BatchNorms says nothing of them
    before_policies = {key: value for key, value in record.items()
                       if key not in ("fold_batch_norm", "folded_batch_norm_nhwc")}  # a record of the "all" days
    assert "| 44 / 0+0 |" in summary_markdown([summary_row(before_policies, "r.json")], "made")


def test_a_layer_the_check_sets_back_keeps_its_batch_norm(monkeypatch: pytest.MonkeyPatch) -> None:
    """The folds follow the plan as it stands after the end-to-end check: where the check sets the layers back to a
    backend that adds the bias in a pass (here the reference backend stands in for cuDNN), nothing folds."""
    monkeypatch.setattr(DenseCpuBackend, "adds_bias_in_epilogue", lambda self, params: True)
    check_before = end_to_end.check_plan

    def setting_back(model, x, plan, comparisons, *args, **kwargs):
        check = check_before(model, x, plan, comparisons, *args, **kwargs)
        for comparison in comparisons:
            plan.entries[comparison.key] = PlanEntry("reference", {})
        return replace(check, reverted=tuple(comparison.key for comparison in comparisons))

    monkeypatch.setattr(end_to_end, "check_plan", setting_back)
    record = end_to_end.bench_end_to_end(three_blocks(), (3, 9, 7), 2, "fp32", torch.device("cpu"), 3, Plan(),
                                         ["dense_cpu"], fold_batch_norm="epilogue")
    assert record["folded_batch_norm"] == record["folded_batch_norm_nhwc"] == 0
    assert len(record["plan_check"]["reverted"]) == 3 and record["rel_error"] < 1e-5
