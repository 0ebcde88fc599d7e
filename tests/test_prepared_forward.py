"""``SparseConv.forward`` keeps a call prepared for its input signature and state: everything that can change what
that call computes (the input, the weight and bias, the module's settings, the active plan) must make it prepare
again, and the result must always equal torch's convolution of the current weight, in float64."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from unsparse.runtime import modules
from unsparse.runtime.modules import sparse_from_conv
from unsparse.runtime.plan import Plan, PlanEntry, PlanError, layer_key, use_plan
from unsparse.sparse.format import SparseFormatError
from unsparse.sparse.geometry import ConvGeometry


def sparse_conv2d_layer(backend: str = "dense_cpu", seed: int = 0, out_channels: int = 5,
                        in_channels: int = 3) -> tuple[modules.SparseConv, torch.Tensor]:
    """A float64 3x3 layer (about half its weights zero, one row all zero, one fully dense) and an odd-sized input."""
    gen = torch.Generator().manual_seed(seed)
    conv = nn.Conv2d(in_channels, out_channels, 3, padding=1, dtype=torch.float64)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=gen, dtype=torch.float64))
        conv.weight.mul_(torch.rand(conv.weight.shape, generator=gen) < 0.5)
        conv.weight[0].zero_()
        conv.weight[1].copy_(torch.randn(conv.weight[1].shape, generator=gen, dtype=torch.float64))
    return sparse_from_conv(conv, backend), torch.randn(2, in_channels, 9, 7, generator=gen, dtype=torch.float64)


def expected(layer: modules.SparseConv, x: torch.Tensor) -> torch.Tensor:
    """torch's convolution of ``x`` with the layer's current weight and bias, with its ReLU and max pool."""
    g = layer.geometry
    bias = None if layer.bias is None else layer.bias.to(x.dtype)
    out = F.conv2d(x, layer.csr.to_dense(), bias, g.stride, g.padding, g.dilation, g.groups)
    out = out.relu() if layer.relu else out
    return F.max_pool2d(out, 2) if layer.max_pool else out


def test_in_place_edits_of_the_weight_and_the_bias_after_a_forward_are_computed() -> None:
    layer, x = sparse_conv2d_layer()
    assert torch.allclose(layer(x), expected(layer, x))
    with torch.no_grad():
        layer.values.mul_(-2)
    assert torch.allclose(layer(x), expected(layer, x))
    layer.bias = nn.Parameter(layer.bias.float(), requires_grad=False)  # cast to the input's dtype by the backend
    before = layer(x)
    with torch.no_grad():
        layer.bias.add_(1)
    assert torch.allclose(layer(x), expected(layer, x)) and torch.allclose(layer(x), before + 1)


def test_an_index_written_out_of_range_after_a_forward_is_refused() -> None:
    """The prepared call does not re-check the weight, so an in-place write must make the next forward prepare (and
    validate) again: an index past the input channels would read outside the input on a GPU."""
    layer, x = sparse_conv2d_layer()
    layer(x)
    layer.col_idx[1, 0] = 10**6
    with pytest.raises(SparseFormatError, match="col_idx"):
        layer(x)


def test_replaced_buffers_and_bias_after_a_forward_are_computed() -> None:
    layer, x = sparse_conv2d_layer()
    layer(x)
    layer.bias = nn.Parameter(torch.randn(5, dtype=torch.float64), requires_grad=False)
    assert torch.allclose(layer(x), expected(layer, x))
    layer.bias = None
    assert torch.allclose(layer(x), expected(layer, x))
    layer.col_idx = layer.col_idx.roll(1, dims=0)  # each row's values at another row's columns
    assert torch.allclose(layer(x), expected(layer, x))
    other, _ = sparse_conv2d_layer(seed=1)
    layer.set_csr(other.csr)
    assert torch.allclose(layer(x), F.conv2d(x, other.csr.to_dense(), None, padding=1))


def test_changed_settings_after_a_forward_are_computed() -> None:
    layer, x = sparse_conv2d_layer()
    layer(x)
    layer.relu = True
    assert torch.allclose(layer(x), expected(layer, x)) and (layer(x) >= 0).all()
    layer.max_pool = True
    assert layer(x).shape == (2, 5, 4, 3) and torch.allclose(layer(x), expected(layer, x))
    layer.relu = layer.max_pool = False
    layer.geometry = ConvGeometry.of(2, 0)
    assert layer(x).shape == (2, 5, 4, 3) and torch.allclose(layer(x), expected(layer, x))
    layer.backend = "reference"
    assert torch.allclose(layer(x), expected(layer, x))
    layer.backend = "dense_cpu"
    layer.backend_params["memory_format"] = "channels_last"  # in place: the dict is the same object
    assert torch.allclose(layer(x), expected(layer, x))
    layer.backend_params["memory_format"] = "no such format"
    with pytest.raises(ValueError, match="memory_format"):
        layer(x)


def test_a_new_plan_after_a_forward_is_resolved_again() -> None:
    """A layer on ``auto`` runs its plan's entry: a plan given after a forward (its key was absent, so the layer ran
    dense) must be looked up again, which this entry's setting, one the backend does not offer, makes visible."""
    layer, x = sparse_conv2d_layer("auto", out_channels=7, in_channels=2)
    x = x[:, :2].contiguous()
    assert torch.allclose(layer(x), expected(layer, x))
    use_plan(Plan({layer_key(x, layer.csr, layer.geometry): PlanEntry("dense_cpu", {"memory_format": "bogus"}, 1.0)}))
    with pytest.raises(PlanError, match="bogus"):
        layer(x)
    use_plan(Plan({layer_key(x, layer.csr, layer.geometry): PlanEntry("reference", {}, 1.0)}))
    assert torch.allclose(layer(x), expected(layer, x))


def test_inputs_of_other_shapes_and_layouts_in_turn() -> None:
    layer, x = sparse_conv2d_layer()
    channels_last = x.to(memory_format=torch.channels_last)
    for source in (x, x[:1], channels_last, x[0], x, channels_last):
        out = layer(source)
        reference = F.conv2d(source, layer.csr.to_dense(), layer.bias, padding=1)
        assert out.shape == reference.shape and torch.allclose(out, reference)
        assert out.is_contiguous(memory_format=torch.channels_last) == (source is channels_last)


def test_conv1d_batched_and_unbatched_inputs_in_turn() -> None:
    gen = torch.Generator().manual_seed(4)
    conv = nn.Conv1d(3, 4, 3, stride=2, padding=1, dtype=torch.float64)
    with torch.no_grad():
        conv.weight.mul_(torch.rand(conv.weight.shape, generator=gen) < 0.5)
    layer = sparse_from_conv(conv, "dense_cpu")
    x = torch.randn(2, 3, 11, generator=gen, dtype=torch.float64)
    for source in (x, x[0], x, x.transpose(1, 2).contiguous().transpose(1, 2)):
        out = layer(source)
        reference = conv(source)
        assert out.shape == reference.shape and out.is_contiguous() and torch.allclose(out, reference.detach())


def test_a_module_copied_or_pickled_after_a_forward_computes_with_its_own_weight() -> None:
    layer, x = sparse_conv2d_layer()
    before = layer(x)
    for copied in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert torch.allclose(copied(x), before)
        with torch.no_grad():
            copied.values.zero_()
        assert torch.allclose(copied(x), copied.bias.view(1, -1, 1, 1).expand_as(before))
        assert torch.allclose(layer(x), before)


def test_forward_prepares_once_per_input_signature(monkeypatch) -> None:
    prepared: list[tuple[int, ...]] = []
    prepare = modules.prepare_sparse_conv_nd

    def counting(x, *args, **params):
        prepared.append(tuple(x.shape))
        return prepare(x, *args, **params)

    monkeypatch.setattr(modules, "prepare_sparse_conv_nd", counting)
    layer, x = sparse_conv2d_layer()
    for source in (x, x, x.clone(), x[:1], x[:1]):
        layer(source)
    assert prepared == [(2, 3, 9, 7), (1, 3, 9, 7)]
