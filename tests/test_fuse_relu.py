"""A conv fused with the ReLU after it (``sparsify(..., fuse_relu=True)``, ``SparseConv.relu``): the same function as
conv then ReLU on every path (a backend that fuses it, one that does not, the dense fallback, the plan's dispatch),
and only where fusing cannot change what the model computes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.fusing import RecordingFusing, layer
from unsparse import create_model, load_sparse, save_sparse, sparsify
from unsparse.runtime import sparse_layers
from unsparse.runtime.backends import get_backend
from unsparse.runtime.bench import magnitude_prune_
from unsparse.runtime.modules import SparseConv, fuse_relu
from unsparse.sparse.format import UniformCSR
from unsparse.sparse.functional import sparse_conv
from unsparse.sparse.geometry import ConvGeometry


def expected(x: torch.Tensor, csr: UniformCSR, bias: torch.Tensor, geometry: ConvGeometry) -> torch.Tensor:
    return F.relu(F.conv2d(x, csr.to_dense(), bias, geometry.stride, geometry.padding))


@pytest.mark.parametrize("backend", ["reference", "dense_cpu", "auto"])
def test_a_backend_that_does_not_fuse_applies_the_relu_after_the_conv(backend: str) -> None:
    x, csr, bias = layer(seed=1)
    geometry = ConvGeometry.of(1, 1)
    out = sparse_conv(x, csr, bias, geometry, backend, relu=True)
    assert (out < 0).sum() == 0
    assert torch.allclose(out, expected(x, csr, bias, geometry), rtol=1e-12, atol=1e-12)
    unfused = sparse_conv(x, csr, bias, geometry, backend)
    assert (unfused < 0).any()  # the case has negative sums, which the ReLU zeroes


class Fusing(RecordingFusing):
    """A CPU backend that fuses the ReLU."""

    name = "fusing_test"
    fuses_relu = True


def test_a_backend_that_fuses_gets_the_flag_and_no_second_pass() -> None:
    x, csr, bias = layer(seed=2)
    geometry = ConvGeometry.of(1, 1)
    backend = Fusing()
    out = backend.run(x, csr, bias, geometry, relu=True, rows=4)
    assert backend.calls == [{"relu": True, "rows": 4}]
    assert torch.allclose(out, expected(x, csr, bias, geometry), rtol=1e-12, atol=1e-12)
    backend.run(x, csr, bias, geometry, rows=4)
    assert backend.calls[-1] == {"relu": False, "rows": 4}


def test_the_relu_keeps_nan_as_torch_relu_does() -> None:
    x, csr, bias = layer(seed=3)
    x[0, :, 4, 5] = float("nan")
    geometry = ConvGeometry.of(1, 1)
    out = sparse_conv(x, csr, bias, geometry, "reference", relu=True)
    reference = expected(x, csr, bias, geometry)
    assert torch.equal(out.isnan(), reference.isnan()) and out.isnan().any()


def conv_relu_model() -> nn.Module:
    torch.manual_seed(0)
    shared = nn.Conv2d(4, 4, 3, padding=1)
    hooked = nn.ReLU()
    hooked.register_forward_hook(lambda module, args, out: None)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(inplace=True),                   # fused
        nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU()),                # fused, nested
        nn.Conv2d(4, 4, 3, padding=1), nn.LeakyReLU(),                          # another activation: left
        nn.Conv2d(4, 4, 3, padding=1), hooked,                                  # a ReLU with a hook: left
        shared, nn.ReLU(), shared,                                              # a conv used twice: left
        nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())            # not directly after: left


def test_sparsify_fuses_only_a_conv_directly_followed_by_a_plain_relu() -> None:
    model = conv_relu_model().double().eval()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    fused = sparsify(model, fuse_relu=True)
    assert [name for name, layer in sparse_layers(fused).items() if layer.relu] == ["0", "2.0"]
    called = [node.target for node in fused.graph.nodes if node.op == "call_module"]
    assert "1" not in called and "2.1" not in called  # the fused ReLUs' calls are gone from the graph
    assert [type(fused.get_submodule(name)) for name in ("4", "6", "8")] == [nn.LeakyReLU, nn.ReLU, nn.ReLU]
    assert "relu=True" in repr(fused.get_submodule("0"))
    with torch.no_grad():
        assert torch.allclose(fused(x), model(x), rtol=1e-10, atol=1e-12)
    assert [layer.relu for layer in sparse_layers(sparsify(model)).values()] == [False] * 6  # off by default
    assert fuse_relu(fused) == (fused, [])  # fusing again finds nothing left


def test_a_fused_model_saved_reads_back_unfused_with_the_same_outputs(tmp_path) -> None:
    torch.manual_seed(0)
    model = magnitude_prune_(create_model("alexnet", num_classes=10), 0.9)  # the convs only: the pruner's 11 s
    fused = sparsify(model.eval(), fuse_relu=True)
    assert sum(layer.relu for layer in sparse_layers(fused).values()) == 5
    loaded = load_sparse(save_sparse(fused, tmp_path / "m.safetensors"))
    assert not any(layer.relu for layer in sparse_layers(loaded).values())
    x = torch.randn(1, 3, 96, 96)
    with torch.no_grad():
        assert torch.allclose(loaded(x), fused(x), rtol=1e-5, atol=1e-6)


def test_a_sparse_conv_with_relu_runs_on_the_plan_s_dispatch() -> None:
    x, csr, bias = layer(seed=4)
    conv = SparseConv(csr, bias, ConvGeometry.of(1, 1), backend="auto", relu=True)
    assert torch.allclose(conv(x), expected(x, csr, bias, ConvGeometry.of(1, 1)), rtol=1e-12, atol=1e-12)
    assert get_backend("auto").fuses_relu is False  # it hands the flag to the planned backend's run


def test_the_benchmark_refuses_a_flag_that_is_not_a_bool() -> None:
    from unsparse.runtime import bench

    with pytest.raises(bench.BenchRefusedError, match="end_to_end_fuse_relu: expected true or false, got 'yes'"):
        bench.check_run_settings(end_to_end_fuse_relu="yes")
    bench.check_run_settings(end_to_end_fuse_relu=True)
    with pytest.raises(bench.BenchRefusedError, match="end_to_end_channels_last: expected true or false, got 0"):
        bench.check_run_settings(end_to_end_channels_last=0)
    bench.check_run_settings(end_to_end_channels_last=False)
    with pytest.raises(bench.BenchRefusedError, match="compile_shared_kernels: expected true or false, got 'yes'"):
        bench.check_run_settings(compile_shared_kernels="yes")
    bench.check_run_settings(compile_shared_kernels=True)
