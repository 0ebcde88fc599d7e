"""Folding eval-mode BatchNorms into the convolutions before them (``unsparse.runtime.batch_norm_folding``), on the
CPU against the unfolded model in float64."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from unsparse.models import create_model
from unsparse.runtime import bench, end_to_end
from unsparse.runtime.batch_norm_folding import FOLDED_ATTRIBUTE, fold_batch_norm_
from unsparse.runtime.dense_fusion import ConvBiasReLU, fuse_dense_conv_relu
from unsparse.runtime.modules import SparseConv, sparse_layers, sparsify
from unsparse.runtime.plan import Plan
from unsparse.sparse.io import load_sparse, save_sparse


def randomise_statistics_(model: nn.Module, seed: int = 0) -> nn.Module:
    """Give every BatchNorm of ``model`` running statistics and affine parameters far from the identity."""
    generator = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            size = module.num_features
            if module.running_mean is None:
                continue
            module.running_mean.copy_(torch.rand(size, generator=generator) * 2 - 1)
            module.running_var.copy_(torch.rand(size, generator=generator) * 1.5 + 0.25)
            if module.affine:
                module.weight.data.copy_(torch.rand(size, generator=generator) + 0.5)
                module.bias.data.copy_(torch.rand(size, generator=generator) * 2 - 1)
    return model


class Block(nn.Module):
    """A residual block whose convs and BatchNorms are attributes (a ResNet's shape), not a Sequential: a grouped
    conv with a bias, a depthwise conv without one, and a projection shortcut."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(4, 8, 3, padding=1, groups=2)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=8, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.shortcut = nn.Sequential(nn.Conv2d(4, 8, 1, stride=2, bias=False), nn.BatchNorm2d(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))) + self.shortcut(x))


def pruned(model: nn.Module, sparsity: float = 0.6) -> nn.Module:
    torch.manual_seed(0)
    return randomise_statistics_(bench.magnitude_prune_(model, sparsity)).eval()


def float64_output(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``model`` (turned to float64 in place, so that a fold after it is exact to float64) on ``x`` in float64."""
    with torch.no_grad():
        return model.double()(x.double())


def test_a_residual_block_folds_every_batch_norm_and_computes_the_same() -> None:
    """Attribute convs (found by the FX trace), grouped and depthwise ones, with and without bias: each takes its
    BatchNorm, each BatchNorm's place is an Identity, and the sparse model equals the unfolded dense one in
    float64 (F.conv2d) on a fresh input of odd size."""
    dense = pruned(Block())
    x = torch.randn(3, 4, 11, 9)
    reference = float64_output(dense, x)
    sparse = sparsify(dense, fold_batch_norm=True)
    assert getattr(sparse, FOLDED_ATTRIBUTE) == ["conv1", "conv2", "shortcut.0"]
    assert not any(isinstance(module, nn.BatchNorm2d) for module in sparse.modules())
    assert all(layer.bias is not None for layer in sparse_layers(sparse).values())
    torch.testing.assert_close(float64_output(sparse, x), reference, rtol=1e-10, atol=1e-10)


def test_folding_keeps_each_rows_pattern_and_scales_its_values() -> None:
    """Row m of the stored values is the unfolded row times the BatchNorm's scale[m]; column indices, row length and
    the padding zeros stay."""
    dense = pruned(nn.Sequential(nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6)))
    before, after = sparsify(dense), sparsify(dense, fold_batch_norm=True)
    (unfolded,), (folded,) = sparse_layers(before).values(), sparse_layers(after).values()
    batch_norm = dense[1]
    scale = batch_norm.weight.double() / (batch_norm.running_var.double() + batch_norm.eps).sqrt()
    shift = batch_norm.bias.double() - batch_norm.running_mean.double() * scale
    assert torch.equal(folded.col_idx, unfolded.col_idx) and folded.values.shape == unfolded.values.shape
    assert torch.equal(folded.values == 0, unfolded.values == 0)
    torch.testing.assert_close(folded.values.double(), unfolded.values.double() * scale[:, None])
    torch.testing.assert_close(folded.bias.double(), unfolded.bias.double() * scale + shift)


@pytest.mark.parametrize("name", ["vgg_small", "resnet_small"])
def test_the_small_models_fold_and_then_fuse_their_relus(name: str) -> None:
    """In a conv, BatchNorm, ReLU Sequential the folded BatchNorm leaves an Identity the ReLU fusion steps over; so it
    does before a block's residual add."""
    dense = pruned(create_model(name, width=8))
    x = torch.randn(2, 1, 28, 28)
    reference = float64_output(dense, x)
    sparse = sparsify(dense, fold_batch_norm=True, fuse_relu=True)
    layers = sparse_layers(sparse)
    assert len(getattr(sparse, FOLDED_ATTRIBUTE)) == len(layers)
    assert sum(layer.relu for layer in layers.values()) == (6 if name == "vgg_small" else 7)
    assert sum(layer.residual for layer in layers.values()) == (0 if name == "vgg_small" else 3)  # block ends
    torch.testing.assert_close(float64_output(sparse, x), reference, rtol=1e-10, atol=1e-10)


def test_a_conv1d_takes_its_batch_norm1d_and_a_dense_conv_folds_too() -> None:
    dense = pruned(nn.Sequential(nn.Conv1d(3, 5, 3, padding=1), nn.BatchNorm1d(5), nn.ReLU()))
    x = torch.randn(2, 3, 17)
    reference = float64_output(dense, x)
    sparse = sparsify(dense, fold_batch_norm=True)
    assert getattr(sparse, FOLDED_ATTRIBUTE) == ["0"]
    torch.testing.assert_close(float64_output(sparse, x), reference, rtol=1e-10, atol=1e-10)
    plain = dense
    assert fold_batch_norm_(plain) == ["0"] and isinstance(plain[1], nn.Identity)
    torch.testing.assert_close(float64_output(plain, x), reference, rtol=1e-10, atol=1e-10)


class Shared(nn.Module):
    """conv_a's output read twice; bn_b applied twice; conv_c's BatchNorm without running statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.conv_a, self.bn_a = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.conv_b, self.bn_b = nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)
        self.conv_c, self.bn_c = nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4, track_running_stats=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.conv_a(x)
        y = self.bn_a(a) + a
        return self.bn_c(self.conv_c(self.bn_b(self.conv_b(y)) + self.bn_b(y)))


def test_what_cannot_fold_stays_a_separate_pass_with_a_logged_reason(caplog: pytest.LogCaptureFixture) -> None:
    """A conv output read elsewhere, a BatchNorm called twice or without running statistics: nothing folds and the
    model computes as before. The first two are no candidate pairs; the third reaches the checks and is logged."""
    dense = pruned(Shared())
    x = torch.randn(2, 3, 6, 7)
    reference = float64_output(dense, x)
    with caplog.at_level(logging.INFO, logger="unsparse.runtime.batch_norm_folding"):
        sparse = sparsify(dense, fold_batch_norm=True)
    assert getattr(sparse, FOLDED_ATTRIBUTE) == []
    assert "conv_c: its BatchNorm bn_c stays a separate pass: the BatchNorm keeps no running statistics" in caplog.text
    torch.testing.assert_close(float64_output(sparse, x), reference, rtol=1e-10, atol=1e-10)


def test_a_batch_norm_in_training_mode_or_after_a_fused_relu_is_not_folded(caplog: pytest.LogCaptureFixture) -> None:
    dense = pruned(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)))
    sparse = sparsify(dense)
    sparse[1].train()
    with caplog.at_level(logging.INFO, logger="unsparse.runtime.batch_norm_folding"):
        assert fold_batch_norm_(sparse) == []
        assert "the BatchNorm is in training mode" in caplog.text
        sparse[1].eval()
        sparse[0].relu = True
        assert fold_batch_norm_(sparse) == [] and isinstance(sparse[1], nn.BatchNorm2d)
    assert "applies a fused ReLU or max pool before the BatchNorm" in caplog.text


def test_a_fold_that_overflows_float16_is_refused() -> None:
    """A running variance near zero scales the weights past float16's range: the layer keeps its BatchNorm."""
    dense = pruned(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)))
    dense[1].running_var.fill_(1e-12)
    dense[1].eps = 1e-12
    sparse = sparsify(dense.half())
    values = sparse[0].values.clone()
    assert fold_batch_norm_(sparse) == [] and torch.equal(sparse[0].values, values)


class Untraceable(nn.Module):
    """Data-dependent control flow: FX cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.body(x)
        return self.body[0](x) if y.sum() > 0 else y  # the Sequential's conv called on its own too


def test_an_untraceable_model_folds_nothing(caplog: pytest.LogCaptureFixture) -> None:
    """Without a trace, which BatchNorm reads which output is unknown (here the Sequential's conv is also called
    on its own, and its output returned unnormalised): nothing folds, and the log says why."""
    dense = pruned(Untraceable())
    x = torch.randn(2, 3, 7, 7).abs()
    reference = float64_output(dense, x)
    with caplog.at_level(logging.INFO, logger="unsparse.runtime.batch_norm_folding"):
        sparse = sparsify(dense, fold_batch_norm=True)
    assert "FX cannot trace Untraceable" in caplog.text and "nothing folded" in caplog.text
    assert getattr(sparse, FOLDED_ATTRIBUTE) == [] and isinstance(sparse.body[1], nn.BatchNorm2d)
    torch.testing.assert_close(float64_output(sparse, x), reference, rtol=1e-10, atol=1e-10)


class ReadsWeights(nn.Module):
    """conv_a's weight also read in the forward; conv_b's weight shared with conv_c (which no BatchNorm follows);
    conv_d reachable under a second name; conv_e with a forward hook. Attributes in an order other than the
    forward's calls (for the order of the names returned)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv_e, self.bn_e = nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)
        self.conv_a, self.bn_a = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.conv_b, self.bn_b = nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)
        self.conv_c = nn.Conv2d(4, 4, 1)
        self.conv_c.weight = self.conv_b.weight
        self.conv_d, self.bn_d = nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4, affine=False)
        self.alias = self.conv_d
        self.conv_f, self.bn_f = nn.Conv2d(4, 4, 1, bias=False), nn.BatchNorm2d(4, affine=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn_a(self.conv_a(x)) + F.conv2d(x, self.conv_a.weight, padding=1)
        y = self.bn_b(self.conv_b(y)) + self.conv_c(y)
        y = self.bn_d(self.conv_d(y))
        return self.bn_f(self.conv_f(self.bn_e(self.conv_e(y))))


def test_a_conv_whose_weights_are_read_elsewhere_keeps_its_batch_norm(caplog: pytest.LogCaptureFixture) -> None:
    """A weight read in the forward, a weight shared with another conv, a second name, a hook: each pair stays;
    an affine-free BatchNorm after a conv without bias folds, and the names come in module order."""
    dense = pruned(ReadsWeights())
    dense.conv_e.register_forward_hook(lambda module, args, out: None)
    x = torch.randn(2, 3, 6, 5)
    reference = float64_output(dense, x)
    with caplog.at_level(logging.INFO, logger="unsparse.runtime.batch_norm_folding"):
        assert fold_batch_norm_(dense) == ["conv_f"]
    for conv, reason in (("conv_b", "a weight of the convolution is shared with another module"),
                         ("conv_d", "the convolution or the BatchNorm is reachable under several names"),
                         ("conv_e", "the convolution or the BatchNorm has forward hooks")):
        assert f"{conv}: its BatchNorm bn_{conv[-1]} stays a separate pass: {reason}" in caplog.text
    assert "conv_a:" not in caplog.text  # its weight is read in the forward: the pair is no candidate
    torch.testing.assert_close(float64_output(dense, x), reference, rtol=1e-10, atol=1e-10)


def test_names_come_in_module_order() -> None:
    class Reordered(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.late, self.bn_late = nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)
            self.early, self.bn_early = nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.bn_late(self.late(self.bn_early(self.early(x))))

    assert fold_batch_norm_(pruned(Reordered())) == ["late", "early"]


def test_a_conv_with_its_own_conv_forward_is_not_folded(caplog: pytest.LogCaptureFixture) -> None:
    """An instance whose ``_conv_forward`` was replaced computes something its weight does not say: refused."""
    dense = pruned(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)))
    conv = dense[0]
    conv._conv_forward = lambda x, weight, bias: nn.Conv2d._conv_forward(conv, x, weight.abs(), bias)
    with caplog.at_level(logging.INFO, logger="unsparse.runtime.batch_norm_folding"):
        assert fold_batch_norm_(dense) == []
    assert "Conv2d is no plain convolution" in caplog.text


def test_a_folded_model_is_not_saved_and_a_loaded_one_folds(tmp_path) -> None:
    """The file holds the architecture's BatchNorms: saving a folded model is refused before anything is written;
    the unfolded file loads and then folds to the same function."""
    dense = pruned(create_model("resnet_small", width=8))
    x = torch.randn(2, 1, 28, 28)
    with pytest.raises(ValueError, match=r"model: BatchNorms folded into 0\.0, "):
        save_sparse(sparsify(dense, fold_batch_norm=True), tmp_path / "folded.safetensors")
    assert not any(tmp_path.iterdir())
    save_sparse(sparsify(dense), tmp_path / "model.safetensors")
    loaded = load_sparse(tmp_path / "model.safetensors")
    assert len(fold_batch_norm_(loaded)) == len(sparse_layers(loaded)) == 9
    assert all(isinstance(layer, SparseConv) for layer in sparse_layers(loaded).values())
    # folded in float32 (the file's dtype): rounding of the scaled weights
    torch.testing.assert_close(float64_output(loaded, x), float64_output(dense, x), rtol=1e-5, atol=1e-5)


def test_the_dense_fusion_steps_over_a_folded_batch_norm() -> None:
    dense = pruned(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 1)))
    fold_batch_norm_(dense)
    fused, count = fuse_dense_conv_relu(dense)
    assert count == 1 and isinstance(fused.get_submodule("0"), ConvBiasReLU)
    assert isinstance(fused.get_submodule("1"), nn.Identity) and not hasattr(fused, "2")  # the ReLU's call is gone


def test_the_end_to_end_record_counts_the_folds_of_the_plan_and_of_the_fused_dense_baseline() -> None:
    """With ``fold_batch_norm`` the sparse copies and the fused dense baseline fold, the eager dense model does not,
    and all agree; the fused dense baseline is timed even where no conv is followed by a ReLU."""
    dense = pruned(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Conv2d(8, 4, 3, stride=2),
                                 nn.BatchNorm2d(4)))
    record = end_to_end.bench_end_to_end(dense, (3, 12, 10), 2, "fp32", torch.device("cpu"), 3, Plan(),
                                         ["dense_cpu"], fold_batch_norm="all")
    assert record["folded_batch_norm"] == record["dense_folded_batch_norm"] == 2
    assert record["dense_fused_convs"] == 0 and record["dense_fused_ms"] > 0
    assert record["rel_error"] < 1e-5 and record["dense_fused_rel_error"] < 1e-5
    assert isinstance(dense[1], nn.BatchNorm2d)  # the caller's model keeps its BatchNorms
    plain = end_to_end.bench_end_to_end(dense, (3, 12, 10), 2, "fp32", torch.device("cpu"), 3, Plan(), ["dense_cpu"])
    assert plain["folded_batch_norm"] == plain["dense_folded_batch_norm"] == 0 and plain["dense_fused_ms"] is None


def test_the_end_to_end_unfused_copy_is_folded_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """With both flags, the unfused copy timed for what fusing buys holds the same folds, so the two differ by the
    fusion alone; all three sparse copies agree with the eager dense model."""
    copies, sparsify_before = [], end_to_end.sparsify

    def kept(*args, **kwargs):
        copies.append(sparsify_before(*args, **kwargs))
        return copies[-1]

    monkeypatch.setattr(end_to_end, "sparsify", kept)
    dense = pruned(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3)))
    record = end_to_end.bench_end_to_end(dense, (3, 12, 10), 2, "fp32", torch.device("cpu"), 3, Plan(),
                                         ["dense_cpu"], fuse_relu=True, fold_batch_norm="all")
    assert [getattr(copy, FOLDED_ATTRIBUTE) for copy in copies] == [["0"]] * 3
    assert record["fused_relu"] == 1 and record["folded_batch_norm"] == 1 and record["planned_unfused_ms"] > 0
    assert record["dense_fused_convs"] == 1 and record["dense_folded_batch_norm"] == 1
    x = torch.randn(2, 3, 12, 10)
    with torch.no_grad():
        for copy in copies:
            torch.testing.assert_close(copy(x), dense(x), rtol=1e-5, atol=1e-5)


def test_a_dense_baseline_that_only_folds_is_named_so() -> None:
    """The page calls a dense baseline with BatchNorms folded and no ReLU fused what it is, and tells "off" and
    "refused" from "none fused" for it."""
    from unsparse.report.benchmark import _dense_fused_cell, dense_fused_name

    record = {"dense_fused_convs": 0, "dense_folded_batch_norm": 53, "dense_fused_error": None,
              "dense_fused_rel_error": 0.5}
    assert dense_fused_name(record) == "the dense model with its BatchNorms folded into its convolutions"
    assert _dense_fused_cell(record) == "off"
    assert _dense_fused_cell(record | {"dense_fused_error": "RuntimeError: no engine"}) == "refused"
    assert _dense_fused_cell(record | {"dense_folded_batch_norm": 0}) == "none fused"
    assert dense_fused_name(record | {"dense_fused_convs": 13}) == (
        "the dense model fused by cuDNN (convolution, bias and ReLU in one call; its BatchNorms folded into its "
        "convolutions)")
    assert dense_fused_name({"dense_fused_convs": 13}) == (
        "the dense model fused by cuDNN (convolution, bias and ReLU in one call)")


@pytest.mark.parametrize("setting", [True, 1, "some", None])
def test_the_benchmark_refuses_a_fold_setting_that_is_no_policy(setting: object) -> None:
    with pytest.raises(bench.BenchRefusedError, match=r"end_to_end_fold_batch_norm: .* not among off, all, epilogue"):
        bench.check_run_settings(end_to_end_fold_batch_norm=setting)
    with pytest.raises(ValueError, match=r"fold_batch_norm: .* not among"):
        end_to_end.bench_end_to_end(nn.Conv2d(1, 1, 1), (1, 2, 2), 1, "fp32", torch.device("cpu"), 3, Plan(),
                                    ["dense_cpu"], fold_batch_norm=setting)
    for policy in ("off", "all", "epilogue"):
        bench.check_run_settings(end_to_end_fold_batch_norm=policy)


def test_the_report_says_where_batch_norms_were_folded() -> None:
    from unsparse.report.benchmark import evaluate_targets, markdown_report

    record = {"model": "resnet50", "weights": "synthetic", "batch": 128, "precision": "fp16", "dense_ms": 10.0,
              "planned_ms": 9.0, "speedup": 10 / 9, "rel_error": 1e-3, "folded_batch_norm": 53,
              "backend_counts": {"cudnn": 52, "direct": 1}, "off_cudnn": {"layer1.0.conv2": "direct"}}
    environment = {"torch": "x", "cuda": "x", "commit": "abc", "date_utc": "today"}
    result = {"environment": environment, "weights": "synthetic", "runs": 20, "layers": [], "end_to_end": [record]}
    text = markdown_report({**result, "targets": evaluate_targets(result)})
    assert "BatchNorm folded into K convs: each eval-mode BatchNorm after a conv is folded" in text
    assert "; BatchNorm folded into 53 convs |" in text
    record["folded_batch_norm"] = 0
    assert "BatchNorm folded" not in markdown_report({**result, "targets": evaluate_targets(result)})
