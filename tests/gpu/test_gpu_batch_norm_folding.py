"""BatchNorms folded into sparse and dense convolutions, run on the GPU, against the unfolded model in float64 on the
CPU."""

from __future__ import annotations

import pytest
import torch
import torchvision
from torch import nn

from unsparse.models import create_model
from unsparse.runtime import bench, end_to_end
from unsparse.runtime.backends import get_backend
from unsparse.runtime.batch_norm_folding import FOLDED_ATTRIBUTE, fold_batch_norm_into_epilogues_
from unsparse.runtime.comparator import plan_model, relative_error, tolerance
from unsparse.runtime.dense_fusion import fuse_dense_conv_relu
from unsparse.runtime.end_to_end import dense_fused_timings
from unsparse.runtime.modules import set_backend, sparse_layers, sparsify
from unsparse.runtime.plan import Plan, active_plan
from unsparse.runtime.precision import precision_mode

CUDA = torch.device("cuda")


def trained_like(name: str) -> nn.Module:
    """``name`` at width 16, pruned to 0.8, with BatchNorm statistics and affine parameters far from the identity."""
    torch.manual_seed(3)
    model = bench.magnitude_prune_(create_model(name, width=16), 0.8)
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.uniform_(-1, 1)
            module.running_var.uniform_(0.25, 2)
            module.weight.data.uniform_(0.5, 1.5)
            module.bias.data.uniform_(-1, 1)
    return model.eval()


@pytest.mark.parametrize("backend", ["direct", "generated", "cudnn"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", ["vgg_small", "resnet_small"])
def test_a_folded_and_fused_sparse_model_matches_the_unfolded_model(name: str, dtype: torch.dtype,
                                                                     backend: str) -> None:
    """Every BatchNorm folded and every ReLU after one fused (with the residual add before it at a block's end),
    each backend: the output within 10x the dtype's tolerance of the unfolded dense model in float64."""
    model = trained_like(name)
    x = torch.randn(5, 1, 28, 28)
    expected = model.double()(x.double()).detach()
    sparse = set_backend(sparsify(model.to(CUDA, dtype), fold_batch_norm=True, fuse_relu=True), backend)
    assert len(getattr(sparse, FOLDED_ATTRIBUTE)) == (6 if name == "vgg_small" else 9)
    assert sum(layer.relu for layer in sparse_layers(sparse).values()) == (6 if name == "vgg_small" else 7)
    assert sum(layer.residual for layer in sparse_layers(sparse).values()) == (0 if name == "vgg_small" else 3)
    with precision_mode(False), torch.no_grad():
        out = sparse(x.to(CUDA, dtype)).cpu()
    assert relative_error(out, expected) <= 10 * tolerance(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_resnets_shared_relu_fuses_into_direct_and_cudnn_after_folding(dtype: torch.dtype) -> None:
    """torchvision's ResNet-18 (one shared ``nn.ReLU`` per block, called after ``bn1``, ``bn2`` and the residual
    add), BatchNorms folded: the stem's and each block's ``conv1`` take their ReLU through the FX graph, in the
    ``direct`` kernels' epilogue, and each block's ``conv2`` the residual add and the ReLU after it (17 layers); the
    dense baseline's convolutions likewise in cuDNN's fused calls; both within 10x the dtype's tolerance of the
    unfolded model in float64."""
    torch.manual_seed(5)
    model = bench.magnitude_prune_(torchvision.models.resnet18(weights=None), 0.8)
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.uniform_(-1, 1)
            module.running_var.uniform_(0.25, 2)
            module.bias.data.uniform_(-1, 1)
    model.eval()
    x = torch.randn(3, 3, 64, 64)
    expected = model.double()(x.double()).detach()
    sparse = set_backend(sparsify(model.to(CUDA, dtype), fold_batch_norm=True, fuse_relu=True), "direct")
    fused = [name for name, layer in sparse_layers(sparse).items() if layer.relu]
    assert fused == ["conv1"] + [f"layer{stage}.{block}.conv{conv}" for stage in range(1, 5) for block in range(2)
                                 for conv in (1, 2)]
    assert [name for name in fused if sparse_layers(sparse)[name].residual] == fused[2::2]
    with precision_mode(False), torch.no_grad():
        out = sparse(x.to(CUDA, dtype)).cpu()
        dense_out = model(x.to(CUDA, dtype))
        record = dense_fused_timings(model, x.to(CUDA, dtype), dense_out, 3, 10 * tolerance(dtype), True)
    assert relative_error(out, expected) <= 10 * tolerance(dtype)
    assert record["dense_fused_convs"] == 17 and record["dense_fused_rel_error"] <= 10 * tolerance(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_folded_dense_baseline_fuses_its_relus_and_agrees(dtype: torch.dtype) -> None:
    model = trained_like("vgg_small")
    x = torch.randn(5, 1, 28, 28)
    expected = model.double()(x.double()).detach()
    dense = model.to(CUDA, dtype)
    with precision_mode(False), torch.no_grad():
        dense_out = dense(x.to(CUDA, dtype))
        record = dense_fused_timings(dense, x.to(CUDA, dtype), dense_out, 5, 10 * tolerance(dtype), True)
    assert record["dense_folded_batch_norm"] == 6 and record["dense_fused_convs"] == 6
    assert record["dense_fused_ms"] > 0 and record["dense_fused_rel_error"] <= 10 * tolerance(dtype)
    assert record["dense_fused_graph_ms"] > 0 and record["dense_fused_nhwc_graph_ms"] > 0  # replayed as CUDA graphs
    assert relative_error(dense_out.cpu(), expected) <= 10 * tolerance(dtype)
    assert fuse_dense_conv_relu(dense)[1] == 0  # the caller's model kept its BatchNorms


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_folding_into_the_planned_direct_layers_matches_the_unfolded_model(dtype: torch.dtype) -> None:
    """Planned on ``direct``, folded where its setting adds the bias in the epilogue (not split-K): those layers and
    only those take their BatchNorm (a layer ``direct`` cannot run is planned on the dense default and keeps it), and
    the model, run on its plan, agrees with the unfolded one in float64."""
    model = trained_like("resnet_small")
    x = torch.randn(6, 1, 28, 28)
    expected = model.double()(x.double()).detach()
    sparse = sparsify(model.to(CUDA, dtype))
    with precision_mode(False), torch.no_grad():
        plan, _ = plan_model(sparse, x.to(CUDA, dtype), Plan(), ["direct"])
        entries = {name: plan.get(layer.plan_key) for name, layer in sparse_layers(sparse).items()}
        epilogue = [name for name, entry in entries.items()
                    if entry.backend == "direct" and entry.params.get("splits", 1) == 1]
        folded = fold_batch_norm_into_epilogues_(sparse, plan)
        out = sparse(x.to(CUDA, dtype)).cpu()
    assert folded and folded == epilogue  # every conv of resnet_small has a BatchNorm after it
    assert relative_error(out, expected) <= 10 * tolerance(dtype)


def test_the_epilogue_policy_end_to_end_folds_by_the_plan_each_layer_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the GPU with ``cudnn`` and ``direct`` compared: the timed sparse copy's folded layers are exactly those whose
    entry in the active plan (the one its forward reads) adds the bias in its epilogue, and the model agrees with
    the dense one."""
    copies, sparsify_before = [], end_to_end.sparsify

    def kept(*args, **kwargs):
        copies.append(sparsify_before(*args, **kwargs))
        return copies[-1]

    monkeypatch.setattr(end_to_end, "sparsify", kept)
    model = trained_like("resnet_small").to(CUDA)
    record = end_to_end.bench_end_to_end(model, (1, 28, 28), 6, "fp32", CUDA, 5, Plan(), ["cudnn", "direct"],
                                         fold_batch_norm="epilogue")
    assert record["fold_batch_norm"] == "epilogue" and record["rel_error"] <= record["tolerance"]
    entries = {name: active_plan().get(layer.plan_key) for name, layer in sparse_layers(copies[0]).items()}
    in_epilogue = [name for name, entry in entries.items()
                   if get_backend(entry.backend).adds_bias_in_epilogue(entry.params)]
    assert getattr(copies[0], FOLDED_ATTRIBUTE) == in_epilogue and record["folded_batch_norm"] == len(in_epilogue)


def test_the_main_job_folds_by_its_plan_on_the_gpu(tmp_path) -> None:
    """``runtime.fold_batch_norm=epilogue`` on CUDA: the layers that took a BatchNorm are exactly those the checked
    plan runs on ``direct`` (``vgg_small``'s convs are all 3x3 with a BatchNorm after them: no split-K setting), and the
    folded model scores on the test set what the pruned one does."""
    from unsparse.data import digits
    from unsparse.pipeline import TimingSettings, TrainSettings, run_pipeline
    from unsparse.prune import MagnitudePruner

    torch.manual_seed(0)
    report = run_pipeline(digits(limit_train=300, limit_test=120), create_model("vgg_small", width=8),
                          MagnitudePruner(0.9, fine_tune_epochs=0), lambda model, loader: model, tmp_path,
                          TrainSettings(epochs=1, batch_size=64, eval_batch_size=120),
                          TimingSettings(batch_size=16, repeats=3, warmup=1, backends=["cudnn", "direct"]),
                          backend="auto", device=CUDA, progress=False, fold_batch_norm="epilogue")
    check = report["plan_check"]
    on_direct = {name for name, backend in check["layer_backends"].items() if backend == "direct"}
    assert set(check["batch_norm_folding"]["folded"]) == on_direct
    assert abs(report["accuracy"]["sparse_run"] - report["accuracy"]["pruned"]) <= 100 / 120 + 1e-9  # percent
    assert "BatchNorms folded (epilogue:" in (tmp_path / "report.md").read_text()
