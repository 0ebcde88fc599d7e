"""A ReLU fused into the convolution before it through the model's FX graph (``unsparse.runtime.graph_fusion``,
``sparsify(..., fuse_relu=True)``, ``fuse_dense_conv_relu``): ResNet's and GoogLeNet's call patterns fuse once their
BatchNorms are folded, only where fusing cannot change what the model computes, and the fused model computes the
unfused one in float64 on the CPU."""

from __future__ import annotations

import copy
import io
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from unsparse.runtime.batch_norm_folding import FOLDED_ATTRIBUTE, fold_batch_norm_
from unsparse.runtime.dense_fusion import ConvBiasReLU, fuse_dense_conv_relu
from unsparse.runtime.graph_fusion import FusedGraphModule, LeafTracer, fuse_following_relu
from unsparse.runtime.modules import SparseConv, fuse_relu, sparse_layers, sparsify


def randomised_(model: nn.Module, seed: int = 0) -> nn.Module:
    """``model`` in float64 and eval mode, every conv's smaller half of weights zeroed and every BatchNorm given
    running statistics and affine parameters far from the identity (so that a fold is no identity)."""
    generator = torch.Generator().manual_seed(seed)
    model.double().eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Conv2d):
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator, dtype=torch.float64))
                module.weight.mul_(module.weight.abs() > module.weight.abs().median())
            elif isinstance(module, nn.BatchNorm2d):
                size = module.num_features
                module.running_mean.copy_(torch.rand(size, generator=generator) * 2 - 1)
                module.running_var.copy_(torch.rand(size, generator=generator) * 1.5 + 0.25)
                module.weight.copy_(torch.rand(size, generator=generator) + 0.5)
                module.bias.copy_(torch.rand(size, generator=generator) * 2 - 1)
    return model


def output(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x.clone())


def relu_layers(model: nn.Module) -> list[str]:
    return [name for name, layer in sparse_layers(model).items() if layer.relu]


class Bottleneck(nn.Module):
    """torchvision's ``Bottleneck`` shape: one shared in-place ReLU module called after ``bn1``, ``bn2`` and the
    residual add."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(4, 3, 1, bias=False), nn.BatchNorm2d(3)
        self.conv2, self.bn2 = nn.Conv2d(3, 3, 3, padding=1, bias=False), nn.BatchNorm2d(3)
        self.conv3, self.bn3 = nn.Conv2d(3, 4, 1, bias=False), nn.BatchNorm2d(4)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += x
        return self.relu(out)


class BasicConv2d(nn.Module):
    """GoogLeNet's ``BasicConv2d``: ``F.relu(self.bn(self.conv(x)), inplace=True)``."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(out_channels, eps=0.001)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)), inplace=True)


class Inception(nn.Module):
    """Two ``BasicConv2d`` branches concatenated, as GoogLeNet's inception blocks are."""

    def __init__(self) -> None:
        super().__init__()
        self.branch1, self.branch2 = BasicConv2d(3, 4), nn.Sequential(BasicConv2d(3, 2), BasicConv2d(2, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.branch1(x), self.branch2(x)], 1)


def test_a_bottleneck_fuses_the_relus_after_its_first_two_convs_and_the_add_and_relu_after_its_third() -> None:
    model = randomised_(Bottleneck())
    x = torch.randn(2, 4, 7, 6, dtype=torch.float64)
    fused = sparsify(model, fold_batch_norm=True, fuse_relu=True)
    assert isinstance(fused, FusedGraphModule) and not fused.training
    assert relu_layers(fused) == ["conv1", "conv2", "conv3"]
    assert [name for name, layer in sparse_layers(fused).items() if layer.residual] == ["conv3"]
    assert getattr(fused, FOLDED_ATTRIBUTE) == ["conv1", "conv2", "conv3"]
    assert not [node for node in fused.graph.nodes if node.target == "relu" or node.op == "call_function"]
    (conv3,) = [node for node in fused.graph.nodes if node.target == "conv3"]
    assert [arg.op for arg in conv3.args] == ["call_module", "placeholder"]  # conv2's output and the block's input
    torch.testing.assert_close(output(fused, x), output(model, x), rtol=1e-12, atol=1e-12)
    unfused = sparsify(model, fold_batch_norm=True)
    refused, names = fuse_relu(unfused)
    assert names == ["conv1", "conv2", "conv3"] and refused.conv3 is not unfused.conv3  # a copy takes the residual
    assert not unfused.conv3.residual and not unfused.conv3.relu  # the model's own layer is called with one argument
    torch.testing.assert_close(output(unfused, x), output(model, x), rtol=1e-12, atol=1e-12)


def test_resnet18_fuses_the_stem_each_block_s_first_conv_and_its_second_with_the_residual_add() -> None:
    from torchvision.models import resnet18

    model = randomised_(resnet18(weights=None, num_classes=10))
    x = torch.randn(1, 3, 40, 40, dtype=torch.float64)
    fused = sparsify(model, fold_batch_norm=True, fuse_relu=True)
    blocks = [f"layer{stage}.{block}.conv{conv}" for stage in range(1, 5) for block in range(2) for conv in (1, 2)]
    assert relu_layers(fused) == ["conv1", *blocks]
    assert [name for name, layer in sparse_layers(fused).items() if layer.residual] == blocks[1::2]
    assert list(sparse_layers(fused)) == [name for name, module in model.named_modules()
                                          if isinstance(module, nn.Conv2d)]  # the qualified names stay
    torch.testing.assert_close(output(fused, x), output(model, x), rtol=1e-10, atol=1e-10)


def test_googlenet_s_functional_in_place_relu_fuses() -> None:
    model = randomised_(Inception())
    x = torch.randn(2, 3, 5, 6, dtype=torch.float64)
    fused = sparsify(model, fold_batch_norm=True, fuse_relu=True)
    assert relu_layers(fused) == ["branch1.conv", "branch2.0.conv", "branch2.1.conv"]
    assert not any(node.target is F.relu for node in fused.graph.nodes)
    torch.testing.assert_close(output(fused, x), output(model, x), rtol=1e-12, atol=1e-12)


class Calls(nn.Module):
    """Seven convs, each followed by one way of calling a ReLU."""

    relus = (lambda x: F.relu(x), lambda x: F.relu(x, True), lambda x: F.relu(x, inplace=False), torch.relu,
             torch.relu_, lambda x: x.relu(), lambda x: x.relu_())

    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(3, 3, 1) for _ in self.relus)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv, relu in zip(self.convs, self.relus, strict=True):
            x = relu(conv(x)) - 0.5
        return x


def test_every_way_of_calling_a_relu_fuses() -> None:
    model = randomised_(Calls())
    x = torch.randn(2, 3, 4, 5, dtype=torch.float64)
    fused, names = fuse_relu(sparsify(model))
    assert names == [f"convs.{index}" for index in range(7)] == relu_layers(fused)
    assert [node.op for node in fused.graph.nodes].count("call_method") == 0
    torch.testing.assert_close(output(fused, x), output(model, x), rtol=1e-12, atol=1e-12)


class Refused(nn.Module):
    """Convs that a ReLU follows where fusing would change the function or skip a hook: an output read twice (the
    in-place ReLU would change the other read), an unfolded BatchNorm between, a hooked ReLU, a hooked Identity
    between, a conv called twice; and one that fuses, whose ReLU's output is read twice."""

    def __init__(self) -> None:
        super().__init__()
        self.read_twice, self.before_batch_norm, self.before_hooked = (nn.Conv2d(3, 3, 1) for _ in range(3))
        self.before_hooked_identity, self.twice, self.fused = (nn.Conv2d(3, 3, 1) for _ in range(3))
        self.batch_norm = nn.BatchNorm2d(3)
        self.hooked, self.hooked_identity, self.relu = nn.ReLU(), nn.Identity(), nn.ReLU()
        for module in (self.hooked, self.hooked_identity):
            module.register_forward_hook(lambda module, args, out: None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.read_twice(x)
        x = torch.relu_(y) + y
        x = self.relu(self.batch_norm(self.before_batch_norm(x)))
        x = self.hooked(self.before_hooked(x)) - 0.5
        x = self.relu(self.hooked_identity(self.before_hooked_identity(x))) - 0.5
        x = self.relu(self.twice(self.twice(x))) - 0.5
        x = F.relu(self.fused(x), inplace=False)
        return torch.max(self.relu(x) - 0.5, torch.relu(x - 1.0))


def test_a_conv_read_elsewhere_or_behind_a_batch_norm_or_a_hook_is_not_fused() -> None:
    model = randomised_(Refused())
    x = torch.randn(2, 3, 4, 5, dtype=torch.float64)
    fused = sparsify(model, fuse_relu=True)
    assert relu_layers(fused) == ["fused"]
    assert isinstance(fused.get_submodule("batch_norm"), nn.BatchNorm2d)
    torch.testing.assert_close(output(fused, x), output(model, x), rtol=1e-12, atol=1e-12)


class ReLUSubclass(nn.ReLU):
    pass


def test_a_relu_subclass_fuses_only_where_the_trace_sees_the_relu_it_calls() -> None:
    """Traced through, a subclass is the ``F.relu`` call of its forward, which fuses; kept as one call (a leaf of the
    tracer), its forward is not known to be a ReLU's, and it stays."""
    model = randomised_(nn.Sequential(nn.Conv2d(3, 3, 1), ReLUSubclass()))
    x = torch.randn(2, 3, 4, 5, dtype=torch.float64)
    sparse = sparsify(model)
    kept = fuse_following_relu(sparse, LeafTracer((SparseConv, ReLUSubclass)), lambda name, module: module)
    assert kept == (sparse, [])
    fused, names = fuse_relu(sparse)
    assert names == ["0"] and not any(node.target is F.relu for node in fused.graph.nodes)
    torch.testing.assert_close(output(fused, x), output(model, x), rtol=1e-12, atol=1e-12)


def test_a_refused_fusion_changes_nothing_and_a_hooked_container_stops_the_rewrite(
        caplog: pytest.LogCaptureFixture) -> None:
    model = randomised_(Bottleneck())
    fold_batch_norm_(model)
    assert fuse_following_relu(model, LeafTracer(()), lambda name, module: None) == (model, [])
    model.register_forward_pre_hook(lambda module, args: None)
    with caplog.at_level(logging.INFO, logger="unsparse.runtime.graph_fusion"):
        assert fuse_following_relu(model, LeafTracer(()), lambda name, module: module) == (model, [])
    assert "Bottleneck has hooks, which a GraphModule would not run" in caplog.text


class Doubled(nn.Module):
    """A module of its own without submodules: FX traces through it, so the GraphModule never calls it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def test_a_hook_on_a_module_the_trace_goes_through_stops_the_rewrite(caplog: pytest.LogCaptureFixture) -> None:
    """Its hook would never run again in the rewritten model, so nothing fuses and the hook keeps firing."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), Doubled()).eval()
    seen = []
    model[2].register_forward_hook(lambda module, inputs, out: seen.append(out.shape))
    with caplog.at_level(logging.INFO, logger="unsparse.runtime.graph_fusion"):
        sparse = sparsify(model, fuse_relu=True)
    assert "2 has hooks, which a GraphModule would not run" in caplog.text and relu_layers(sparse) == []
    seen.clear()
    output(sparse, torch.randn(1, 3, 5, 5))
    assert seen == [torch.Size([1, 4, 5, 5])]


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return torch.relu(self.conv(x))
        return -x


def test_an_untraceable_model_fuses_nothing_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    model = randomised_(DataDependent())
    x = torch.rand(2, 3, 4, 5, dtype=torch.float64)
    sparse = sparsify(model)
    with caplog.at_level(logging.INFO, logger="unsparse.runtime.graph_fusion"):
        fused, names = fuse_relu(sparse)
    assert fused is sparse and names == [] and relu_layers(sparse) == []
    assert "FX cannot trace DataDependent" in caplog.text
    torch.testing.assert_close(output(fused, x), output(model, x), rtol=1e-12, atol=1e-12)


def test_the_spec_and_the_folded_names_survive_the_rewrite_a_deep_copy_and_torch_save() -> None:
    model = randomised_(Bottleneck())
    model.unsparse_spec = {"name": "bottleneck", "kwargs": {}}
    fused = sparsify(model, fold_batch_norm=True, fuse_relu=True)
    buffer = io.BytesIO()
    torch.save(fused, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)  # retraced with the graph's tracer class
    for kept in (fused, copy.deepcopy(fused), loaded):
        assert kept.unsparse_spec == {"name": "bottleneck", "kwargs": {}}
        assert getattr(kept, FOLDED_ATTRIBUTE) == ["conv1", "conv2", "conv3"]
    x = torch.randn(1, 4, 5, 5, dtype=torch.float64)
    for copied in (copy.deepcopy(fused), loaded):
        assert relu_layers(copied) == ["conv1", "conv2", "conv3"] and copied.conv1 is not fused.conv1
        assert copied.conv3.residual
        torch.testing.assert_close(output(copied, x), output(model, x), rtol=1e-12, atol=1e-12)


def test_a_model_with_nothing_to_fuse_comes_back_as_it_is() -> None:
    sparse = sparsify(randomised_(nn.Sequential(nn.Conv2d(3, 3, 1), nn.Tanh(), nn.Conv2d(3, 3, 1))))
    fused, names = fuse_relu(sparse)
    assert fused is sparse and names == []


def test_the_dense_baseline_fuses_a_folded_resnet18_and_leaves_the_model_alone() -> None:
    from torchvision.models import resnet18

    model = randomised_(resnet18(weights=None, num_classes=10))
    x = torch.randn(1, 3, 40, 40, dtype=torch.float64)
    reference = output(model, x)
    folded = copy.deepcopy(model)
    fold_batch_norm_(folded)
    before = [type(module) for module in folded.modules()]
    fused, count = fuse_dense_conv_relu(folded)
    assert count == 17 and [type(module) for module in folded.modules()] == before
    assert [name for name, module in fused.named_modules() if isinstance(module, ConvBiasReLU)] == [
        "conv1", *(f"layer{stage}.{block}.conv{conv}" for stage in range(1, 5) for block in range(2)
                   for conv in (1, 2))]
    assert not any(isinstance(module, SparseConv) for module in fused.modules())
    torch.testing.assert_close(output(fused, x), reference, rtol=1e-10, atol=1e-10)
    assert fuse_dense_conv_relu(model)[1] == 0  # unfolded, a BatchNorm reads each conv's output
