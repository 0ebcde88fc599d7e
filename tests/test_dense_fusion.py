"""The fused dense baseline (``unsparse.runtime.dense_fusion``) on the CPU: which convolutions it fuses, and that the
fused model computes the dense one (its CUDA path, cuDNN's fused call, is checked in ``tests/gpu``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from unsparse.runtime.dense_fusion import ConvBiasReLU, fuse_dense_conv_relu, fusion_refusal


class Conv2dSubclass(nn.Conv2d):
    pass


def block() -> nn.Sequential:
    """conv+ReLU (fused), conv+ReLU in a nested Sequential (fused), a reflect-padded conv+ReLU, a subclass conv+ReLU,
    a conv followed by a pool (none of them fused), float64."""
    torch.manual_seed(3)
    return nn.Sequential(
        nn.Conv2d(3, 5, 3, padding=1), nn.ReLU(inplace=True),
        nn.Sequential(nn.Conv2d(5, 6, 3, padding=(1, 0), stride=(1, 2)), nn.ReLU()),
        nn.Conv2d(6, 6, 3, padding=1, padding_mode="reflect"), nn.ReLU(),
        Conv2dSubclass(6, 4, 1), nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding="same"), nn.ReLU(),
        nn.Conv2d(4, 3, 1), nn.MaxPool2d(2)).double().eval()


def test_only_plain_zero_padded_convs_followed_by_a_plain_relu_are_fused() -> None:
    model = block()
    before = [type(m) for m in model.modules()]
    fused, count = fuse_dense_conv_relu(model)
    assert count == 2 and [type(m) for m in model.modules()] == before  # the model itself is left alone
    modules = dict(fused.named_modules())
    assert isinstance(modules["0"], ConvBiasReLU) and isinstance(modules["2.0"], ConvBiasReLU)
    assert "1" not in modules and "2.1" not in modules  # the fused ReLUs' calls are gone, and so are the modules
    assert [type(modules[str(i)]) for i in range(3, 11)] == [nn.Conv2d, nn.ReLU, Conv2dSubclass, nn.ReLU, nn.Conv2d,
                                                             nn.ReLU, nn.Conv2d, nn.MaxPool2d]
    x = torch.randn(2, 3, 9, 12, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x), rtol=0, atol=0)


def test_a_fused_conv_computes_relu_of_conv_plus_bias_and_shares_its_parameters() -> None:
    torch.manual_seed(4)
    conv = nn.Conv2d(4, 7, 3, stride=2, padding=2, dilation=2, bias=True).double()
    fused = ConvBiasReLU(conv)
    assert fused.conv.weight is conv.weight
    x = torch.randn(3, 4, 11, 10, dtype=torch.float64)
    with torch.no_grad():
        out = fused(x)
        expected = torch.relu(torch.nn.functional.conv2d(x, conv.weight, conv.bias, 2, 2, 2))
    assert (expected == 0).any() and (expected > 0).any()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize(("conv", "reason"), [
    (Conv2dSubclass(2, 2, 1), "plain nn.Conv2d, not Conv2dSubclass"),
    (nn.Conv2d(2, 2, 3, padding="same"), "padding='same'"),
    (nn.Conv2d(2, 2, 3, padding=1, padding_mode="circular"), "padding_mode='circular'"),
    (nn.Conv1d(2, 2, 3), "not Conv1d")])
def test_refused_convolutions_are_named(conv: nn.Module, reason: str) -> None:
    assert reason in fusion_refusal(conv)
    with pytest.raises(ValueError, match="conv: "):
        ConvBiasReLU(conv)


def test_the_residual_shape_check_reads_the_conv_as_torch_does_without_validating_it() -> None:
    """``ConvBiasReLU`` decides whether cuDNN's fused add can take a residual from the conv's current attributes and
    never raises there: an input smaller than the kernel, or a padding torch accepts at construction, fail (or not)
    in the conv's own call, with torch's error, as in the unfused model (a review of the forty-sixth session found a
    validating check raising its own error first, and a copy of the attributes going stale)."""
    from unsparse.runtime.dense_fusion import _output_like

    conv = nn.Conv2d(2, 3, 5, padding=0)
    assert not _output_like(torch.randn(1, 3, 1, 1), torch.randn(1, 2, 3, 3), conv)  # smaller than the kernel
    x = torch.randn(2, 2, 9, 9)
    assert _output_like(torch.randn(2, 3, 5, 5), x, conv)
    conv.padding = (2, 2)  # changed after the module was built: read now
    assert _output_like(torch.randn(2, 3, 9, 9), x, conv) and not _output_like(torch.randn(2, 3, 5, 5), x, conv)
    assert not _output_like(torch.randn(2, 3, 9, 9).double(), x, conv) and not _output_like(1.0, x, conv)
    odd = nn.Sequential(nn.Conv2d(2, 3, 3, padding=-1), nn.ReLU())  # torch builds it and refuses it when called
    fused, count = fuse_dense_conv_relu(odd)
    assert count == 1
    with pytest.raises(RuntimeError):
        fused(x)


def test_a_hooked_conv_is_not_fused() -> None:
    model = nn.Sequential(nn.Conv2d(2, 2, 1), nn.ReLU())
    model[0].register_forward_hook(lambda module, args, out: None)
    assert fusion_refusal(model[0]) == "it has forward hooks"
    fused, count = fuse_dense_conv_relu(model)
    assert count == 0 and type(fused[0]) is nn.Conv2d


def test_vgg16_fuses_all_thirteen_convolutions() -> None:
    from torchvision.models import vgg16

    fused, count = fuse_dense_conv_relu(vgg16())
    assert count == 13 and sum(isinstance(m, nn.ReLU) for m in fused.features.children()) == 0
    assert sum(isinstance(m, nn.ReLU) for m in fused.classifier.children()) == 2  # they follow Linears


def test_the_baseline_script_times_only_variants_that_agree(load_script) -> None:
    """``scripts/time_dense_baselines.py``'s measurement on the CPU: a variant within the bound is timed, one outside
    it is recorded with its error and no time."""
    measure = load_script("time_dense_baselines").measure
    reference = torch.ones(2, 3)
    good = measure("eager", lambda: reference.clone(), reference, 1e-5, torch.device("cpu"), runs=2, graphs=False)
    assert good["rel_error"] == 0 and good["eager_ms"] > 0 and good["graph_ms"] is None
    bad = measure("off", lambda: 2 * reference, reference, 1e-5, torch.device("cpu"), runs=2, graphs=False)
    assert bad["eager_ms"] is None and bad["reason"] == "relative error 1 > 1e-05"


def test_the_cudnn_backend_runs_a_fused_relu_in_one_call_and_falls_back_where_cudnn_refuses(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """On the CPU with ``torch.cudnn_convolution_relu`` stood in for: the backend's output is the fused call's; where
    the call raises (no fused engine), the convolution and a ReLU pass give the same function, and the refusal is
    logged once."""
    import logging

    from tests.fusing import layer
    from unsparse.runtime.backends.dense import CudnnBackend
    from unsparse.sparse.geometry import ConvGeometry

    x, csr, bias = layer(5)
    geometry = ConvGeometry.of(1, 1)
    expected = torch.relu(torch.nn.functional.conv2d(x, csr.to_dense(), bias, 1, 1))
    calls = []

    def fused(*arguments):
        calls.append(arguments[3:])
        return torch.relu(torch.nn.functional.conv2d(*arguments))

    monkeypatch.setattr(torch, "cudnn_convolution_relu", fused)
    backend = CudnnBackend()
    assert backend.fuses_relu
    torch.testing.assert_close(backend.run(x, csr, bias, geometry, relu=True), expected, rtol=0, atol=0)
    assert calls == [((1, 1), (1, 1), (1, 1), 1)]  # stride, padding, dilation, groups

    def refused(*arguments):
        raise RuntimeError("cuDNN Frontend error: no valid engine configs\\nmore detail")

    monkeypatch.setattr(torch, "cudnn_convolution_relu", refused)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            torch.testing.assert_close(backend.run(x, csr, bias, geometry, relu=True), expected, rtol=0, atol=0)
    assert caplog.text.count("fused convolution, bias and ReLU refused (cuDNN Frontend error: no valid engine") == 1


def test_the_cudnn_backend_runs_the_epilogue_as_passes_when_the_setting_says_so(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``epilogue="passes"``: the convolution, then the bias, the residual add and the ReLU as passes, never cuDNN's
    fused calls (stood in for on the CPU), the same function; the default setting still makes the fused call."""
    from tests.fusing import layer
    from unsparse.runtime.backends.dense import CudnnBackend
    from unsparse.sparse.geometry import ConvGeometry

    x, csr, bias = layer(11)
    geometry = ConvGeometry.of(1, 1)
    residual = torch.randn(2, 7, 9, 11, dtype=torch.float64)
    conv = torch.nn.functional.conv2d(x, csr.to_dense(), bias, 1, 1)
    calls = []

    def fused_relu(x, weight, bias, *rest):
        calls.append("relu")
        return torch.relu(torch.nn.functional.conv2d(x, weight, bias, *rest))

    def fused_add_relu(x, weight, residual, alpha, bias, *rest):
        calls.append("add_relu")
        return torch.relu(torch.nn.functional.conv2d(x, weight, bias, *rest) + alpha * residual)

    monkeypatch.setattr(torch, "cudnn_convolution_relu", fused_relu)
    monkeypatch.setattr(torch, "cudnn_convolution_add_relu", fused_add_relu)
    backend = CudnnBackend()
    for epilogue, expected_calls in (("passes", []), ("fused", ["relu", "add_relu"])):
        calls.clear()
        torch.testing.assert_close(backend.run(x, csr, bias, geometry, relu=True, epilogue=epilogue),
                                   torch.relu(conv), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(backend.run(x, csr, bias, geometry, relu=True, residual=residual,
                                               epilogue=epilogue), torch.relu(conv + residual), rtol=1e-12, atol=1e-12)
        assert calls == expected_calls
    with pytest.raises(ValueError, match="epilogue: unknown 'later'"):
        backend.run(x, csr, bias, geometry, relu=True, epilogue="later")


def test_cudnn_offers_both_epilogues_only_to_a_layer_fused_with_its_relu() -> None:
    """The settings a comparator times and a plan may name: memory formats crossed with the epilogues, which exist only
    where a ReLU is fused and the backend fuses it (not ``dense_cpu``, whose ReLU is always a pass)."""
    from tests.fusing import layer
    from unsparse.runtime.backends import get_backend
    from unsparse.sparse.geometry import ConvGeometry

    x, csr, _ = layer(12)
    geometry = ConvGeometry.of(1, 1)
    cudnn, cpu = get_backend("cudnn"), get_backend("dense_cpu")
    formats = [{"memory_format": "contiguous"}, {"memory_format": "channels_last"}]
    assert cudnn.settings(x, csr, geometry) == formats
    assert cudnn.settings(x, csr, geometry, relu=True) == [
        formats[0], {**formats[0], "epilogue": "passes"}, formats[1], {**formats[1], "epilogue": "passes"}]
    assert cpu.settings(x, csr, geometry, relu=True) == cpu.tuning_space(x, csr, geometry) == formats


def test_a_plan_may_name_the_passes_only_for_a_layer_fused_with_its_relu(monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto`` checks an entry against the settings of the layer as keyed: ``epilogue`` on a layer without a fused
    ReLU is a setting cuDNN does not offer there (cuDNN let onto the CPU, where its settings are the same)."""
    from tests.fusing import layer
    from unsparse.runtime.backends import get_backend
    from unsparse.runtime.backends.dense import CudnnBackend
    from unsparse.runtime.plan import Plan, PlanEntry, PlanError, layer_key, use_plan
    from unsparse.sparse.geometry import ConvGeometry

    monkeypatch.setattr(CudnnBackend, "device_types", frozenset({"cpu"}))
    x, csr, _ = layer(13)
    geometry = ConvGeometry.of(1, 1)
    passes = {"memory_format": "contiguous", "epilogue": "passes"}
    use_plan(Plan({layer_key(x, csr, geometry, relu=True): PlanEntry("cudnn", passes, 1.0),
                   layer_key(x, csr, geometry): PlanEntry("cudnn", passes, 1.0)}))
    try:
        auto = get_backend("auto")
        assert auto.resolve(x, csr, geometry, relu=True) == ("cudnn", passes)
        with pytest.raises(PlanError, match="epilogue"):
            auto.resolve(x, csr, geometry)
    finally:
        use_plan(Plan())


def test_choosing_epilogues_off_cuda_times_and_changes_nothing() -> None:
    """The choice between cuDNN's fused call and passes is made on CUDA only (on the CPU both run the same code)."""
    from unsparse.runtime.dense_fusion import choose_epilogues_

    fused, _ = fuse_dense_conv_relu(block())
    assert choose_epilogues_(fused, torch.randn(2, 3, 8, 8, dtype=torch.float64)) == 0
    assert not any(module.passes for module in fused.modules() if isinstance(module, ConvBiasReLU))


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
def test_the_probe_adds_the_bias_as_rows_and_computes_the_same(load_script, memory_format) -> None:
    """``time_dense_baselines.py``'s bias-rows variant: each conv with a bias runs without it and adds it over the
    output's rows, in either layout, with the function unchanged; a model with BatchNorms folds them first."""
    script = load_script("time_dense_baselines")
    torch.manual_seed(4)
    model = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 5, 3, stride=2, bias=False),
                          nn.BatchNorm2d(5)).eval()
    model[3].running_mean.uniform_(-1, 1)
    x = torch.randn(2, 3, 9, 7).contiguous(memory_format=memory_format)
    folded, folds = script.folded_copy(model)
    rows, with_bias = script.bias_rows_copy(folded)
    assert folds == 1 and with_bias == 2 and isinstance(model[3], nn.BatchNorm2d)
    assert isinstance(rows[0], script.ConvThenBiasRows) and isinstance(rows[2], script.ConvThenBiasRows)
    with torch.no_grad():
        torch.testing.assert_close(rows(x), model(x), rtol=1e-5, atol=1e-5)
    reflect = nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect")
    with torch.no_grad():
        torch.testing.assert_close(script.ConvThenBiasRows(reflect)(x), reflect(x), rtol=1e-5, atol=1e-5)
