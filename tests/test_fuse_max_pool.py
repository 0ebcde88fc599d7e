"""A conv fused with the 2x2 max pool after it (``sparsify(..., fuse_max_pool=True)``, ``SparseConv.max_pool``): the
same function as conv (ReLU) then pool on every path (a backend that fuses it, one that does not, the plan's
dispatch, both layouts), and only where fusing cannot change what the model computes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.fusing import RecordingFusing, layer
from unsparse import create_model, load_sparse, save_sparse, sparsify
from unsparse.runtime import sparse_layers
from unsparse.runtime.bench import magnitude_prune_
from unsparse.runtime.modules import SparseConv, fuse_max_pool_, fuse_relu
from unsparse.sparse.format import UniformCSR
from unsparse.sparse.functional import sparse_conv, sparse_conv_nd
from unsparse.sparse.geometry import ConvGeometry


def expected(x: torch.Tensor, csr: UniformCSR, bias: torch.Tensor, relu: bool) -> torch.Tensor:
    out = F.conv2d(x, csr.to_dense(), bias, 1, 1)
    return F.max_pool2d(F.relu(out) if relu else out, 2)


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("backend", ["reference", "dense_cpu", "auto"])
def test_a_backend_that_does_not_fuse_pools_after_the_conv(backend: str, relu: bool,
                                                            layout: torch.memory_format) -> None:
    x, csr, bias = layer(seed=1)
    x = x.contiguous(memory_format=layout)
    out = sparse_conv(x, csr, bias, ConvGeometry.of(1, 1), backend, relu=relu, max_pool=True)
    assert out.shape == (2, 7, 4, 5) and out.is_contiguous(memory_format=layout)
    assert torch.allclose(out, expected(x, csr, bias, relu), rtol=1e-12, atol=1e-12)


class Fusing(RecordingFusing):
    """A CPU backend that fuses the pool (not the ReLU)."""

    name = "fusing_pool_test"
    fuses_max_pool = True


def test_a_backend_that_fuses_the_pool_gets_the_flag_and_the_relu_runs_after_it() -> None:
    """The pool inside ``conv``, the ReLU it does not fuse in a pass after it: the same function, since the two
    commute."""
    x, csr, bias = layer(seed=2)
    backend = Fusing()
    out = backend.run(x, csr, bias, ConvGeometry.of(1, 1), relu=True, max_pool=True, rows=4)
    assert backend.calls == [{"max_pool": True, "rows": 4}]
    assert torch.allclose(out, expected(x, csr, bias, relu=True), rtol=1e-12, atol=1e-12)
    assert backend.run(x, csr, bias, ConvGeometry.of(1, 1), rows=4).shape == (2, 7, 9, 11)
    assert backend.calls[-1] == {"max_pool": False, "rows": 4}


def test_the_pool_keeps_nan_as_torch_does() -> None:
    x, csr, bias = layer(seed=3)
    x[0, :, 4, 5] = float("nan")
    out = sparse_conv(x, csr, bias, ConvGeometry.of(1, 1), "reference", relu=True, max_pool=True)
    reference = expected(x, csr, bias, relu=True)
    assert torch.equal(out.isnan(), reference.isnan()) and out.isnan().any()


def test_a_one_dimensional_conv_takes_no_max_pool() -> None:
    csr = UniformCSR.from_dense(torch.randn(4, 3, 3))
    geometry = ConvGeometry.of(1, 1, 1, 1, 1)
    with pytest.raises(ValueError, match="max_pool: a 2x2 max pool follows 2-D convolutions only"):
        SparseConv(csr, None, geometry, max_pool=True)
    with pytest.raises(ValueError, match="max_pool: a 2x2 max pool follows 2-D convolutions only"):
        sparse_conv_nd(torch.randn(2, 3, 10), csr, None, geometry, max_pool=True)


def conv_pool_model() -> nn.Module:
    torch.manual_seed(0)
    hooked = nn.MaxPool2d(2)
    hooked.register_forward_hook(lambda module, inputs, output: None)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2, 2),            # both fused
        nn.Conv2d(4, 4, 3, padding=1), nn.Identity(), nn.MaxPool2d((2, 2)),     # fused past the Identity
        nn.Conv2d(4, 4, 3, padding=1), nn.MaxPool2d(3),                         # another window: left
        nn.Conv2d(4, 4, 3, padding=1), nn.MaxPool2d(2, ceil_mode=True),         # ceil mode: left
        nn.Conv2d(4, 4, 3, padding=1), hooked,                                  # a pool with a hook: left
        nn.Conv2d(4, 4, 3, padding=1), nn.LeakyReLU(), nn.MaxPool2d(2),         # an activation between: left
        nn.Conv2d(4, 4, 1), nn.MaxPool2d(2))                                    # fused, no ReLU


def test_sparsify_fuses_only_a_conv_followed_by_a_2x2_max_pool() -> None:
    model = conv_pool_model().double().eval()
    x = torch.randn(2, 3, 288, 264, dtype=torch.float64)
    fused = sparsify(model, fuse_relu=True, fuse_max_pool=True)
    layers = sparse_layers(fused)
    assert [name for name, layer in layers.items() if layer.max_pool] == ["0", "3", "15"]
    assert [name for name, layer in layers.items() if layer.relu] == ["0"]
    called = [node.target for node in fused.graph.nodes if node.op == "call_module"]
    assert "1" not in called  # the fused ReLU's call is gone from the graph, the pools' places hold Identities
    assert all(isinstance(fused.get_submodule(name), nn.Identity) for name in ("2", "5", "16"))
    assert type(fused.get_submodule("7")) is nn.MaxPool2d and fused.get_submodule("9").ceil_mode
    assert type(fused.get_submodule("14")) is nn.MaxPool2d and "max_pool=True" in repr(fused.get_submodule("0"))
    with torch.no_grad():
        assert torch.allclose(fused(x), model(x), rtol=1e-10, atol=1e-12)
    assert fuse_max_pool_(fused) == [] and fuse_relu(fused) == (fused, [])  # fusing again finds nothing left
    assert not any(layer.max_pool for layer in sparse_layers(sparsify(model, fuse_relu=True)).values())
    pools_only = sparsify(model, fuse_max_pool=True)  # past the ReLU it does not fuse, which then pools nothing
    assert [name for name, layer in sparse_layers(pools_only).items() if layer.max_pool] == ["0", "3", "15"]
    assert type(pools_only[1]) is nn.ReLU and not any(layer.relu for layer in sparse_layers(pools_only).values())
    with torch.no_grad():
        assert torch.allclose(pools_only(x), model(x), rtol=1e-10, atol=1e-12)


def test_pool_fusion_leaves_shared_hooked_and_one_dimensional_layers() -> None:
    """A conv used twice, a conv whose path to the pool passes a module with a hook (an Identity, a ReLU), and a
    Conv1d before a pool are left as they are."""
    shared = nn.Conv2d(4, 4, 3, padding=1)
    hooked_identity, hooked_relu = nn.Identity(), nn.ReLU()
    for module in (hooked_identity, hooked_relu):
        module.register_forward_hook(lambda module, inputs, output: None)
    model = nn.Sequential(shared, nn.MaxPool2d(2), shared,
                          nn.Conv2d(4, 4, 3, padding=1), hooked_identity, nn.MaxPool2d(2),
                          nn.Conv2d(4, 4, 3, padding=1), hooked_relu, nn.MaxPool2d(2),
                          nn.Sequential(nn.Conv1d(4, 4, 3), nn.MaxPool2d(2)))
    fused = sparsify(model, fuse_max_pool=True)
    assert not any(layer.max_pool for layer in sparse_layers(fused).values())
    assert [type(fused[index]) for index in (1, 5, 8)] == [nn.MaxPool2d] * 3 and type(fused[9][1]) is nn.MaxPool2d


def test_vgg16_fuses_every_relu_and_five_pools_and_reads_back_unfused(tmp_path) -> None:
    """torchvision's VGG16 as the benchmark times it: all 13 convs carry their ReLU, features.2, .7, .14, .21 and .28
    the pool too, and the fused model computes what the dense one does; the file holds the architecture, so the
    model reads back with its ReLUs and pools as modules and computes the same."""
    torch.manual_seed(0)
    model = magnitude_prune_(create_model("vgg16", num_classes=10), 0.95).eval()
    fused = sparsify(model, fuse_relu=True, fuse_max_pool=True)
    layers = sparse_layers(fused)
    assert [name for name, layer in layers.items() if layer.max_pool] == [f"features.{index}"
                                                                           for index in (2, 7, 14, 21, 28)]
    assert all(layer.relu for layer in layers.values())
    assert not any(isinstance(module, nn.MaxPool2d | nn.ReLU) for module in fused.features.children())
    loaded = load_sparse(save_sparse(fused, tmp_path / "m.safetensors"))
    assert not any(layer.relu or layer.max_pool for layer in sparse_layers(loaded).values())
    assert sum(isinstance(module, nn.MaxPool2d) for module in loaded.features) == 5
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        out = fused(x)
        assert torch.allclose(out, model(x), rtol=1e-4, atol=1e-5)
        assert torch.allclose(loaded(x), out, rtol=1e-5, atol=1e-6)
