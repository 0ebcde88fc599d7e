"""A convolution fused with the residual add after it and the ReLU after that (``relu(conv(x) + identity)``, the end
of ResNet's blocks): which graphs fuse, what every backend computes with a residual, cuDNN's fused call and its
fallback (stood in for on the CPU), and the planning of such layers, against torch in float64."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.fusing import RecordingFusing, layer
from unsparse.runtime.backends import get_backend
from unsparse.runtime.backends.dense import CudnnBackend, DenseCpuBackend
from unsparse.runtime.comparator import compare_layer, plan_model
from unsparse.runtime.dense_fusion import ConvBiasReLU
from unsparse.runtime.modules import sparse_layers, sparsify
from unsparse.runtime.plan import EPILOGUE_PART
from unsparse.sparse.geometry import ConvGeometry


class Block(nn.Module):
    """A conv whose output meets the block's input in an add chosen by ``form``, then a ReLU (``act``)."""

    def __init__(self, form: str, act: str = "relu") -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1, dtype=torch.float64)
        self.form, self.act = form, act

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        out = self.conv(x)
        summed = {"plus": lambda: out + x, "swapped": lambda: x + out, "torch_add": lambda: torch.add(out, x),
                  "in_place": lambda: out.add_(x), "in_place_on_input": lambda: x.clone().add_(out),
                  "alpha": lambda: torch.add(out, x, alpha=2.0), "constant": lambda: out + 1.0,
                  "read_twice": lambda: out + x}[self.form]()
        result = torch.sigmoid(summed) if self.act == "sigmoid" else F.relu(summed)
        return (result, out) if self.form == "read_twice" else result


def run(model: nn.Module, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
    with torch.no_grad():
        return model(x.clone())


@pytest.mark.parametrize(("form", "act", "fuses"), [
    ("plus", "relu", True), ("swapped", "relu", True), ("torch_add", "relu", True), ("in_place", "relu", True),
    ("in_place_on_input", "relu", False), ("alpha", "relu", False), ("constant", "relu", False),
    ("read_twice", "relu", False), ("plus", "sigmoid", False)])
def test_which_adds_fuse_and_every_model_computes_as_before(form: str, act: str, fuses: bool) -> None:
    """Fused: an add of the conv's output and another tensor (either order out of place, in place only on the conv's
    output) whose sum a ReLU alone reads. Not fused: an in-place add on the other operand (it would no longer be
    changed), ``alpha``, a constant operand, a conv output read elsewhere too, another activation."""
    model = Block(form, act).eval()
    x = torch.randn(2, 3, 7, 5, dtype=torch.float64)
    fused = sparsify(model, backend="dense_cpu", fuse_relu=True)
    (conv,) = sparse_layers(fused).values()
    assert conv.residual == fuses and conv.relu == fuses
    expected, got = run(model, x), run(fused, x)
    for want, have in zip(expected if isinstance(expected, tuple) else (expected,),
                          got if isinstance(got, tuple) else (got,), strict=True):
        torch.testing.assert_close(have, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", ["dense_cpu", "reference"])
@pytest.mark.parametrize("channels_last", [False, True])
def test_every_backend_adds_the_residual_before_the_relu(backend: str, channels_last: bool) -> None:
    x, csr, bias = layer(3)
    geometry = ConvGeometry.of(1, 1)
    conv = F.conv2d(x, csr.to_dense(), bias, 1, 1)
    residual = torch.randn(conv.shape, dtype=torch.float64)
    if channels_last:
        x, residual = x.contiguous(memory_format=torch.channels_last), residual.contiguous(
            memory_format=torch.channels_last)
    chosen = get_backend(backend)
    out = chosen.run(x, csr, bias, geometry, relu=True, residual=residual)
    torch.testing.assert_close(out, torch.relu(conv + residual), rtol=1e-12, atol=1e-12)
    assert out.is_contiguous(memory_format=torch.channels_last) == channels_last
    assert (out == 0).any() and (out > 0).any()
    broadcast = torch.randn(1, csr.out_channels, 1, 1, dtype=torch.float64)  # as a model's `+` would broadcast it
    torch.testing.assert_close(chosen.run(x, csr, bias, geometry, relu=True, residual=broadcast),
                               torch.relu(conv + broadcast), rtol=1e-12, atol=1e-12)
    promoted = chosen.run(x.float(), type(csr)(csr.values.float(), csr.col_idx, csr.weight_shape), bias.float(),
                          geometry, relu=True, residual=residual)  # a float64 residual: `+` promotes
    assert promoted.dtype == torch.float64
    torch.testing.assert_close(promoted, torch.relu(conv + residual), rtol=1e-5, atol=1e-5)


class FusesReLU(RecordingFusing):
    name = "test_fuses_relu"
    fuses_relu = fuses_max_pool = True


def test_a_backend_that_fuses_the_relu_but_not_the_residual_applies_the_relu_after_the_add() -> None:
    """Its epilogue would apply the ReLU before the add: it must get neither the ReLU nor the pool then."""
    x, csr, bias = layer(4)
    backend = FusesReLU()
    residual = -torch.rand(2, csr.out_channels, 9, 11, dtype=torch.float64)
    out = backend.run(x, csr, bias, ConvGeometry.of(1, 1), relu=True, max_pool=True, residual=residual)
    conv = F.conv2d(x, csr.to_dense(), bias, 1, 1)
    torch.testing.assert_close(out, F.max_pool2d(torch.relu(conv + residual), 2), rtol=1e-12, atol=1e-12)
    assert backend.calls == [{"relu": False, "max_pool": False}]
    backend.run(x, csr, bias, ConvGeometry.of(1, 1), relu=True, max_pool=True)
    assert backend.calls[-1] == {"relu": True, "max_pool": True}


def test_the_cudnn_backend_fuses_the_residual_in_one_call_and_falls_back_where_cudnn_refuses(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """On the CPU with ``torch.cudnn_convolution_add_relu`` stood in for: the output is the fused call's, which gets
    the residual in the computing layout and alpha 1; where it raises, the convolution, the add and the ReLU, the
    refusal logged once."""
    x, csr, bias = layer(6)
    geometry = ConvGeometry.of(1, 1)
    conv = F.conv2d(x, csr.to_dense(), bias, 1, 1)
    residual = torch.randn(conv.shape, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    expected = torch.relu(conv + residual)
    calls = []

    def fused(x, weight, z, alpha, bias, *rest):
        calls.append((z.is_contiguous(), alpha, rest))
        return torch.relu(F.conv2d(x, weight, bias, *rest) + alpha * z)

    monkeypatch.setattr(torch, "cudnn_convolution_add_relu", fused)
    monkeypatch.setattr(CudnnBackend, "device_types", frozenset({"cpu"}))
    backend = CudnnBackend()
    assert backend.fuses_residual_relu and not DenseCpuBackend.fuses_residual_relu
    torch.testing.assert_close(backend.run(x, csr, bias, geometry, relu=True, residual=residual), expected,
                               rtol=1e-12, atol=1e-12)
    assert calls == [(True, 1.0, ((1, 1), (1, 1), (1, 1), 1))]  # NCHW like x; stride, padding, dilation, groups
    torch.testing.assert_close(backend.run(x, csr, bias, geometry, residual=residual), conv + residual,
                               rtol=1e-12, atol=1e-12)  # no ReLU: no fused call
    assert len(calls) == 1

    def refused(*arguments):
        raise RuntimeError("cuDNN Frontend error: no valid engine configs\nmore detail")

    monkeypatch.setattr(torch, "cudnn_convolution_add_relu", refused)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            torch.testing.assert_close(backend.run(x, csr, bias, geometry, relu=True, residual=residual), expected,
                                       rtol=1e-12, atol=1e-12)
    assert caplog.text.count("bias and residual, ReLU refused (cuDNN Frontend error: no valid engine") == 1


def test_the_dense_baseline_module_adds_the_residual_before_the_relu() -> None:
    conv = nn.Conv2d(3, 4, 3, padding=1, dtype=torch.float64)
    x = torch.randn(2, 3, 6, 5, dtype=torch.float64)
    residual = torch.randn(2, 4, 6, 5, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(ConvBiasReLU(conv)(x, residual), torch.relu(conv(x) + residual))
        torch.testing.assert_close(ConvBiasReLU(conv)(x), torch.relu(conv(x)))


def test_a_layer_refuses_a_residual_it_was_not_fused_with_and_one_missing() -> None:
    fused = sparsify(Block("plus").eval(), backend="dense_cpu", fuse_relu=True)
    plain = sparsify(Block("plus").eval(), backend="dense_cpu")
    x = torch.randn(1, 3, 5, 5, dtype=torch.float64)
    with pytest.raises(ValueError, match="residual: missing"):
        sparse_layers(fused)["conv"](x)
    with pytest.raises(ValueError, match="residual: given"):
        sparse_layers(plain)["conv"](x, x)


def test_planning_times_and_checks_each_setting_with_the_residual(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan key says ``residual+relu``; the planned model computes as the original; and the comparison's check
    includes the residual: a backend that drops it is wrong."""
    model = Block("plus").eval()
    x = torch.randn(2, 3, 7, 5, dtype=torch.float64)
    fused = sparsify(model, fuse_relu=True)
    comparisons = plan_model(fused, x, backends=["dense_cpu", "reference"], runs=2)[1]
    (comparison,) = comparisons
    assert comparison.key.endswith(EPILOGUE_PART + "residual+relu")
    assert {m.status for m in comparison.measurements} == {"ok"}
    torch.testing.assert_close(run(fused, x), run(model, x), rtol=1e-12, atol=1e-12)
    csr, bias = sparse_layers(fused)["conv"].csr, sparse_layers(fused)["conv"].bias
    residual = torch.randn(2, 3, 7, 5, dtype=torch.float64)
    reference = get_backend("reference")
    dropped = reference.prepare

    def dropping(x, csr, bias, geometry, relu=False, max_pool=False, residual=None, **params):
        call = dropped(x, csr, bias, geometry, relu, max_pool, **params)
        return lambda x, residual=None: call(x)

    monkeypatch.setattr(reference, "prepare", dropping)
    checked = compare_layer(x, csr, bias, ConvGeometry.of(1, 1), ["reference", "dense_cpu"], runs=2, relu=True,
                            residual=residual)
    assert {m.backend: m.status for m in checked.measurements} == {"reference": "wrong", "dense_cpu": "ok"}


class ReLUOnInputBetween(nn.Module):
    """An in-place ReLU of the conv's input after the conv read it, whose result is the residual: moving the conv
    after it would read the changed input."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1, dtype=torch.float64)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * 1.0
        out = self.conv(x)
        return F.relu(out + self.act(x))


class ResidualChangedBetween(nn.Module):
    """A residual changed in place between the conv and the add: the fused call would read it unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x * 1.0
        out = self.conv(x)
        identity.mul_(3.0)
        return F.relu(out + identity)


class BroadcastShift(nn.Module):
    """A residual that broadcasts: a ``(1, M, 1, 1)`` parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1, dtype=torch.float64)
        self.shift = nn.Parameter(torch.randn(1, 4, 1, 1, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(x) + self.shift)


@pytest.mark.parametrize("model_class", [ReLUOnInputBetween, ResidualChangedBetween])
def test_an_in_place_operation_between_the_conv_and_the_add_stops_the_fusion(model_class: type[nn.Module]) -> None:
    model = model_class().eval()
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    fused = sparsify(model, backend="dense_cpu", fuse_relu=True)
    assert [layer.residual for layer in sparse_layers(fused).values()] == [False]
    torch.testing.assert_close(run(fused, x), run(model, x), rtol=1e-12, atol=1e-12)
    from unsparse.runtime.dense_fusion import fuse_dense_conv_relu

    dense, count = fuse_dense_conv_relu(model)
    assert count == 0
    torch.testing.assert_close(run(dense, x), run(model, x), rtol=1e-12, atol=1e-12)


def test_a_broadcast_residual_fuses_and_plans() -> None:
    model = BroadcastShift().eval()
    x = torch.randn(3, 3, 6, 5, dtype=torch.float64)
    fused = sparsify(model, fuse_relu=True)
    assert [layer.residual for layer in sparse_layers(fused).values()] == [True]
    plan_model(fused, x, backends=["dense_cpu", "reference"], runs=2)
    torch.testing.assert_close(run(fused, x), run(model, x), rtol=1e-12, atol=1e-12)


def test_a_conv1d_does_not_take_a_residual() -> None:
    class Block1d(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv1d(3, 3, 3, padding=1, dtype=torch.float64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.relu(self.conv(x) + x)

    model = Block1d().eval()
    x = torch.randn(2, 3, 9, dtype=torch.float64)
    fused = sparsify(model, fuse_relu=True)
    assert [layer.residual for layer in sparse_layers(fused).values()] == [False]
    plan_model(fused, x, backends=["dense_cpu"], runs=2)
    torch.testing.assert_close(run(fused, x), run(model, x), rtol=1e-12, atol=1e-12)


def test_an_unbatched_input_adds_before_the_relu_and_the_pool() -> None:
    x, csr, bias = layer(8)
    conv = F.conv2d(x, csr.to_dense(), bias, 1, 1)
    residual = torch.randn(conv.shape, dtype=torch.float64)
    from unsparse.runtime.modules import SparseConv

    fused = SparseConv(csr, bias, ConvGeometry.of(1, 1), "dense_cpu", relu=True, max_pool=True, residual=True)
    expected = F.max_pool2d(torch.relu(conv + residual), 2)
    torch.testing.assert_close(run_layer(fused, x, residual), expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(run_layer(fused, x[0], residual[0]), expected[0], rtol=1e-12, atol=1e-12)


def run_layer(layer: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return layer(x, residual)


def test_a_layer_pickled_before_residuals_and_prepared_calls_still_runs() -> None:
    """A state as 6217104 pickled it: no ``residual``, no ``_prepared``, a missing bias as a plain attribute."""
    from unsparse.runtime.modules import SparseConv

    x, csr, _ = layer(9)
    current = SparseConv(csr, None, ConvGeometry.of(1, 1), "dense_cpu")
    state = current.__getstate__()
    state = {**state, "_parameters": {}, "bias": None}
    del state["residual"], state["_prepared"]
    old = SparseConv.__new__(SparseConv)
    old.__setstate__(state)
    with torch.no_grad():
        torch.testing.assert_close(old(x), F.conv2d(x, csr.to_dense(), None, 1, 1), rtol=1e-12, atol=1e-12)
