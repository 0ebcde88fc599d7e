"""Activation layouts: every backend returns its input's layout, plans key and default by layout, and a model
planned on a channels-last input stays channels-last and computes the dense model's function."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from unsparse.runtime import sparsify
from unsparse.runtime.backends import available_backends, get_backend
from unsparse.runtime.comparator import LayerComparison, Measurement, plan_model, relative_error
from unsparse.runtime.layout import channels_last_after, in_layout, layout_of, layout_switch
from unsparse.runtime.modules import sparse_layers
from unsparse.runtime.plan import AutoBackend, Plan, PlanEntry, key_layout, layer_key, use_plan
from unsparse.runtime.timing import Timing
from unsparse.sparse import ConvGeometry, UniformCSR


def layer(channels: int = 5, out_channels: int = 7, seed: int = 0) -> tuple[torch.Tensor, UniformCSR, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_channels, channels, 3, 3, generator=gen)
    weight[torch.rand(weight.shape, generator=gen) < 0.8] = 0
    weight[0] = 0  # an all-zero row
    weight[1] = torch.randn(channels, 3, 3, generator=gen)  # a fully dense row
    x = torch.randn(3, channels, 11, 9, generator=gen)
    return x, UniformCSR.from_dense(weight), torch.randn(out_channels, generator=gen)


def test_layout_of_names_channels_last_and_counts_ambiguous_tensors_as_nchw() -> None:
    x = torch.randn(2, 3, 5, 4)
    assert layout_of(x) == "nchw" and layout_of(in_layout(x, "nhwc")) == "nhwc"
    assert layout_of(in_layout(torch.randn(2, 1, 5, 4), "nhwc")) == "nchw"  # one channel: same bytes
    assert layout_of(in_layout(torch.randn(2, 3, 1, 1), "nhwc")) == "nchw"  # one pixel: same bytes
    assert layout_of(torch.randn(2, 3, 5)) == "nchw"
    with pytest.raises(ValueError, match="layout"):
        in_layout(x, "nwhc")


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("stride", [1, 2])
def test_every_cpu_backend_returns_the_input_layout_and_the_reference_values(layout: str, stride: int) -> None:
    x, csr, bias = layer()
    geometry = ConvGeometry.of(stride, 1)
    ref = F.conv2d(x.double(), csr.to_conv2d_weight().double(), bias.double(), stride, 1)
    x = in_layout(x, layout)
    for name in available_backends("cpu"):
        backend = get_backend(name)
        for params in backend.tuning_space(x, csr, geometry):
            out = backend.run(x, csr, bias, geometry, **params)
            assert layout_of(out) == layout, (name, params)
            assert relative_error(out, ref) < 1e-5, (name, params)


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_dense_backend_computes_in_its_memory_format_and_run_converts_back(layout: str) -> None:
    x, csr, bias = layer()
    x = in_layout(x, layout)
    geometry = ConvGeometry.of(1, 1)
    backend = get_backend("dense_cpu")
    ref = F.conv2d(x.double(), csr.to_conv2d_weight().double(), bias.double(), 1, 1)
    for memory_format, computed in (("contiguous", "nchw"), ("channels_last", "nhwc"), (None, layout)):
        assert layout_of(backend.conv(x, csr, bias, geometry, memory_format=memory_format)) == computed
        out = backend.run(x, csr, bias, geometry, memory_format=memory_format)
        assert layout_of(out) == layout and relative_error(out, ref) < 1e-5
    with pytest.raises(ValueError, match="memory_format"):
        backend.conv(x, csr, bias, geometry, memory_format="nhwc")


def test_run_leaves_an_output_already_in_the_input_layout_as_the_backend_made_it() -> None:
    """The lowering backends return a transposed view of their GEMM result; on an NCHW input it is not copied (the
    im2col baselines are timed as before layouts), on an NHWC input it is converted."""
    x, csr, bias = layer()
    geometry = ConvGeometry.of(1, 1)
    backend = get_backend("im2col_cublas")
    view = backend.conv(x, csr, bias, geometry)
    assert not view.is_contiguous() and backend.run(x, csr, bias, geometry).stride() == view.stride()
    assert layout_of(backend.run(in_layout(x, "nhwc"), csr, bias, geometry)) == "nhwc"


def test_conv1d_layers_take_a_transposed_input_as_ncl() -> None:
    from unsparse.runtime.modules import sparse_from_conv

    torch.manual_seed(3)
    conv = nn.Conv1d(5, 7, 3, padding=1)
    layer_1d = sparse_from_conv(conv)
    x = torch.randn(2, 11, 5).transpose(1, 2)  # (N, C, L) with C innermost
    out = layer_1d(x)
    assert out.is_contiguous() and relative_error(out, conv(x).detach().double()) < 1e-5
    plan, _ = plan_model(nn.Sequential(layer_1d), x, backends=["dense_cpu"], runs=3)
    assert "fmt" not in layer_1d.plan_key and plan.get(layer_1d.plan_key) is not None
    assert get_backend("auto").resolve(layer_1d.conv2d_input(x), layer_1d.csr, layer_1d.geometry)[0] == "dense_cpu"


def test_dense_weight_is_decompressed_once_per_layout() -> None:
    _, csr, _ = layer()
    backend = get_backend("dense_cpu")
    nhwc = backend.dense_weight(csr, torch.float32, "nhwc")
    assert backend.dense_weight(csr, torch.float32, "nhwc") is nhwc and layout_of(nhwc) == "nhwc"
    assert layout_of(backend.dense_weight(csr, torch.float32)) == "nchw"


def test_plan_keys_name_the_channels_last_layout_only() -> None:
    x, csr, _ = layer()
    geometry = ConvGeometry.of(1, 1)
    nchw, nhwc = layer_key(x, csr, geometry), layer_key(in_layout(x, "nhwc"), csr, geometry)
    assert "fmt" not in nchw and nhwc == nchw + "|fmt=nhwc"
    assert key_layout(nchw) == "nchw" and key_layout(nhwc) == "nhwc"


def measured(backend: str, params: dict, ms: float) -> Measurement:
    return Measurement(backend, params, "ok", 0.0, timing=Timing(ms, ms, ms, 20, 1))


@pytest.mark.parametrize(("layout", "chosen"), [("nchw", "direct"), ("nhwc", "cudnn")])
def test_the_dense_default_a_plan_keeps_is_cudnn_in_the_input_layout(layout: str, chosen: str) -> None:
    """Direct at 0.98 ms beats NCHW cuDNN (1.2 ms) by more than the margin, not NHWC cuDNN (1.0 ms)."""
    comparison = LayerComparison("key", [measured("cudnn", {"memory_format": "contiguous"}, 1.2),
                                         measured("cudnn", {"memory_format": "channels_last"}, 1.0),
                                         measured("direct", {}, 0.98)], layout=layout)
    assert comparison.best.backend == "direct"
    entry = comparison.plan_entry()
    assert entry.backend == chosen
    if chosen == "cudnn":
        assert entry.params == {"memory_format": "channels_last"}


def small_model() -> nn.Module:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 6, 3, stride=2, padding=1),
                          nn.BatchNorm2d(6), nn.ReLU(), nn.Conv2d(6, 4, 1), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
                          nn.Linear(16, 5)).eval()
    with torch.no_grad():
        for conv in (model[0], model[2], model[5]):
            conv.weight[torch.rand(conv.weight.shape) < 0.6] = 0
    return model


def test_a_model_planned_in_channels_last_stays_in_it_and_matches_the_dense_model() -> None:
    model = small_model()
    x = torch.randn(2, 3, 13, 11)
    sparse = sparsify(model)
    plan, _ = plan_model(sparse, x, backends=["dense_cpu", "im2col_cublas"], runs=3)
    x_nhwc = in_layout(x, "nhwc")
    plan, comparisons = plan_model(sparse, x_nhwc, plan, backends=["dense_cpu", "im2col_cublas", "reference"],
                                   runs=3)
    assert len(comparisons) == 3 and len(plan.entries) == 6
    assert all(c.layout == "nhwc" and c.key.endswith("|fmt=nhwc") for c in comparisons)
    seen: list[tuple[str, str]] = []
    hooks = [module.register_forward_hook(lambda m, args, out: seen.append((layout_of(args[0]), layout_of(out))))
             for module in sparse_layers(sparse).values()]
    with torch.no_grad():
        out = sparse(x_nhwc)
    for hook in hooks:
        hook.remove()
    assert seen == [("nhwc", "nhwc")] * 3
    with torch.no_grad():
        assert relative_error(out.double(), model(x).double()) < 1e-5
        assert relative_error(sparse(x).double(), model(x).double()) < 1e-5


def test_auto_resolves_the_same_shape_per_layout_and_returns_the_input_layout() -> None:
    """Each layout's entry computes in the other layout, so only the conversion in ``run`` gets the layout right."""
    x, csr, bias = layer()
    geometry = ConvGeometry.of(1, 1)
    x_nhwc = in_layout(x, "nhwc")
    nchw_entry = ("dense_cpu", {"memory_format": "channels_last"})
    use_plan(Plan({layer_key(x, csr, geometry): PlanEntry(*nchw_entry, 1.0),
                   layer_key(x_nhwc, csr, geometry): PlanEntry("dense_cpu", {"memory_format": "contiguous"}, 1.0)}))
    auto = get_backend("auto")
    assert auto.resolve(x, csr, geometry) == nchw_entry
    assert auto.resolve(x_nhwc, csr, geometry) == ("dense_cpu", {"memory_format": "contiguous"})
    assert layout_of(auto.conv(x_nhwc, csr, bias, geometry)) == "nchw"
    assert layout_of(auto.run(x_nhwc, csr, bias, geometry)) == "nhwc"
    assert layout_of(auto.conv(x, csr, bias, geometry)) == "nhwc"
    assert layout_of(auto.run(x, csr, bias, geometry)) == "nchw"


def stem_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(8, 6, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(6, 4, 1)).eval()


def test_the_layout_switch_is_the_first_max_pool_after_the_convs_called_before_it() -> None:
    model = stem_model()
    assert layout_switch(model, torch.randn(2, 3, 12, 10)) == ("3", ["0"])
    assert not any(module._forward_pre_hooks for module in model.modules())  # the hooks are gone
    no_pool = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 1))
    assert layout_switch(no_pool, torch.randn(1, 3, 8, 8)) == (None, [])
    indices = nn.Sequential(nn.Conv2d(3, 4, 3), nn.MaxPool2d(2, return_indices=True))
    assert layout_switch(indices, torch.randn(1, 3, 8, 8)) == (None, [])


def test_a_conv_with_its_max_pool_fused_is_the_switch_of_its_sparse_copy() -> None:
    """With its pools fused into the convs (VGG's sparse copy with ``fuse_max_pool``) a model calls no max pool; it
    switches after the first conv that applies one, where its dense model switches after that pool."""
    model = stem_model()
    fused = sparsify(nn.Sequential(model[0], model[2], model[3], model[4], model[5], model[6]), fuse_max_pool=True)
    assert layout_switch(fused, torch.randn(2, 3, 12, 10)) == ("0", [])
    unfused = sparsify(nn.Sequential(model[0], model[2], model[3], model[4]))
    assert layout_switch(unfused, torch.randn(2, 3, 12, 10)) == ("2", [])


def test_a_module_that_reads_its_childs_weight_without_calling_it_is_before_the_switch() -> None:
    """cuDNN's fused conv module passes its child conv's weight to one call and never calls the child; it is named
    (the container holding the pool is not)."""

    class ReadsChildWeight(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.conv2d(x, self.conv.weight, self.conv.bias)

    model = nn.Sequential(nn.Sequential(ReadsChildWeight(), nn.MaxPool2d(2)), nn.Conv2d(4, 4, 1))
    assert layout_switch(model, torch.randn(1, 3, 10, 10)) == ("0.1", ["0.0"])


def test_a_model_switched_after_its_first_pool_runs_nchw_before_and_nhwc_after_with_the_same_outputs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A planned model fed NCHW with its first pool's output in channels-last runs its first layer on the NCHW
    plan entry (here ``dense_cpu``) and the later ones on their channels-last entries (here ``im2col_cublas``; the
    plan holds both), and computes the dense model's function; outside the context the model runs NCHW throughout
    again."""
    dense = stem_model()
    x = torch.randn(2, 3, 12, 10)
    sparse = sparsify(dense)
    plan, _ = plan_model(sparse, x, Plan(), ["dense_cpu"])
    plan, _ = plan_model(sparsify(dense), in_layout(x, "nhwc"), plan, ["dense_cpu"])
    for key in plan.entries:
        if key_layout(key) == "nhwc":
            plan.entries[key] = PlanEntry("im2col_cublas")
    use_plan(plan)
    ran: list[tuple[str, str]] = []
    resolve = AutoBackend.resolve

    def recorded(self: AutoBackend, x: torch.Tensor, *args: object, **kwargs: object) -> tuple[str, dict]:
        chosen = resolve(self, x, *args, **kwargs)
        ran.append((chosen[0], layout_of(x)))
        return chosen

    monkeypatch.setattr(AutoBackend, "resolve", recorded)
    switch, _ = layout_switch(dense, x)  # the same module names as the sparse copy's
    with channels_last_after(sparse, switch):
        out = sparse(x)
    assert ran == [("dense_cpu", "nchw"), ("im2col_cublas", "nhwc"), ("im2col_cublas", "nhwc")]
    assert layout_of(out) == "nhwc" and relative_error(out.double(), dense(x).double()) < 1e-5
    unswitched = sparse(x)
    assert layout_of(unswitched) == "nchw" and all(entry == ("dense_cpu", "nchw") for entry in ran[3:])
    assert relative_error(unswitched.double(), dense(x).double()) < 1e-5
