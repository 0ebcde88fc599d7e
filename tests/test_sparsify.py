"""``sparsify`` on models it must not silently change: conv subclasses, hooks, foreign parametrizations, and layers
made under ``torch.inference_mode()``; each compared with the dense model in float64."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
import torch.nn.utils.prune as torch_prune
from torch import nn

from unsparse.runtime import SparseConv, sparse_layers, sparsify


class WeightStandardisedConv2d(nn.Conv2d):
    """A conv whose forward changes its weight (BiT / NFNet style): its weight alone does not say what it computes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        weight = (weight - weight.mean((1, 2, 3), keepdim=True)) / (weight.std((1, 2, 3), keepdim=True) + 1e-5)
        return self._conv_forward(x, weight, self.bias)


class NamedConv2d(nn.Conv2d):
    """A subclass that only adds an attribute: it computes as nn.Conv2d does."""

    tag = "named"


def test_a_conv_subclass_with_its_own_forward_stays_dense_with_a_logged_reason(caplog):
    torch.manual_seed(0)
    model = nn.Sequential(WeightStandardisedConv2d(3, 4, 3), nn.ReLU(), NamedConv2d(4, 5, 3)).double().eval()
    x = torch.randn(2, 3, 9, 9, dtype=torch.float64)
    with caplog.at_level(logging.WARNING):
        sparse = sparsify(model)
    assert isinstance(sparse[0], WeightStandardisedConv2d) and isinstance(sparse[2], SparseConv)
    assert "0: WeightStandardisedConv2d has its own forward; left dense" in caplog.text
    with torch.no_grad():
        assert torch.allclose(sparse(x), model(x), rtol=1e-10, atol=1e-12)


def test_a_conv_with_hooks_is_refused_naming_it():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3))
    torch_prune.l1_unstructured(model[2], "weight", amount=0.5)
    with pytest.raises(ValueError, match=r"^2: a conv with forward hooks .*torch.nn.utils.prune.remove"):
        sparsify(model)
    torch_prune.remove(model[2], "weight")
    assert isinstance(sparsify(model)[2], SparseConv)
    torch_prune.l1_unstructured(model[0], "weight", amount=0.5)
    with pytest.raises(ValueError, match=r"^Conv2d: a conv with forward hooks"):  # a model that is one conv
        sparsify(model[0])


def test_a_lazy_conv_is_refused_until_its_first_forward_then_sparsified():
    """An uninitialised ``nn.LazyConv2d`` has a setup hook: it was refused as "a conv with forward hooks
    (torch.nn.utils.prune ...)", which sent the user to the wrong fix (a helper's find)."""
    model = nn.Sequential(nn.LazyConv2d(4, 3, padding=1), nn.ReLU()).double()
    with pytest.raises(ValueError, match=r"^0: LazyConv2d has no weight yet; run one forward pass first"):
        sparsify(model)
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    with torch.no_grad():
        expected = model(x)
        sparse = sparsify(model)
        assert isinstance(sparse[0], SparseConv) and torch.allclose(sparse(x), expected, rtol=1e-10, atol=1e-12)


def test_another_uninitialised_lazy_module_is_copied_as_it_is():
    """Only lazy convs are refused: an uninitialised LazyLinear was sparsified before that check (a reread's find)."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.LazyLinear(10))
    sparse = sparsify(model)
    assert isinstance(sparse[0], SparseConv) and sparse(torch.randn(2, 3, 6, 6)).shape == (2, 10)


def test_a_foreign_parametrization_is_folded_into_the_weight():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1)).double()
    torch.nn.utils.parametrizations.weight_norm(model[0])  # original0 / original1, no "original"
    x = torch.randn(2, 3, 7, 7, dtype=torch.float64)
    sparse = sparsify(model)
    with torch.no_grad():
        expected = F.conv2d(x, model[0].weight, model[0].bias, padding=1)
        assert torch.allclose(sparse(x), expected, rtol=1e-10, atol=1e-12)


def test_layers_made_under_inference_mode_run_inside_and_outside_it():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1)).eval()
    x = torch.randn(1, 3, 8, 8)
    with torch.inference_mode():
        sparse = sparsify(model)
        inside = sparse(x)
    outside = sparse(x)
    with torch.no_grad():
        expected = model(x)
    assert torch.allclose(inside, expected, atol=1e-5) and torch.allclose(outside, expected, atol=1e-5)


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths")
def test_string_padding_is_resolved_and_other_padding_modes_stay_dense(caplog):
    """'valid' and symmetric 'same' padding become ints; a reflect padding mode or an asymmetric 'same' stays a
    dense layer with a logged reason (the whole model was refused); the model computes what the dense one does."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding="same"), nn.Conv2d(4, 4, 3, padding="valid"),
                          nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect"),
                          nn.Conv2d(4, 4, 2, padding="same")).double()
    x = torch.randn(2, 3, 11, 11, dtype=torch.float64)
    with caplog.at_level(logging.WARNING):
        sparse = sparsify(model)
    assert isinstance(sparse[0], SparseConv) and isinstance(sparse[1], SparseConv)
    assert type(sparse[2]) is nn.Conv2d and type(sparse[3]) is nn.Conv2d
    assert "2: padding_mode: 'reflect' is not supported, only 'zeros'; left dense" in caplog.text
    assert "3: padding: 'same' with kernel (2, 2)" in caplog.text
    with torch.no_grad():
        assert torch.allclose(sparse(x), model(x), rtol=1e-10, atol=1e-12)


def test_same_padding_of_a_dilated_conv1d_is_resolved():
    torch.manual_seed(4)
    model = nn.Sequential(nn.Conv1d(3, 4, 3, padding="same", dilation=2)).double()
    x = torch.randn(2, 3, 17, dtype=torch.float64)
    sparse = sparsify(model)
    assert isinstance(sparse[0], SparseConv)
    with torch.no_grad():
        assert torch.allclose(sparse(x), model(x), rtol=1e-10, atol=1e-12)


def test_a_model_with_a_conv_left_dense_is_not_saved(tmp_path):
    """The loader rebuilds every conv of the architecture as sparse, so a file holding a dense one could be written
    but not read back (``layers.0.0: missing from the file``); saving refuses it, naming the layer."""
    from unsparse import create_model, save_sparse

    model = create_model("vgg_small", width=4)
    next(module for module in model.modules() if isinstance(module, nn.Conv2d)).padding_mode = "reflect"
    with pytest.raises(ValueError, match=r"convolutions left dense \(0\.0; see sparsify's log\)"):
        save_sparse(sparsify(model), tmp_path / "model.safetensors")
    assert not (tmp_path / "model.safetensors").exists()


@pytest.mark.parametrize("change", ["classifier", "conv"])
def test_a_model_that_differs_from_its_spec_is_not_saved(tmp_path, change):
    """The loader rebuilds the architecture ``unsparse_spec`` names; a model whose layers were replaced after
    ``create_model`` was written and then refused on loading. Saving now runs the loader's structural checks first."""
    from unsparse import create_model, save_sparse

    model = create_model("vgg_small", width=4)
    if change == "classifier":
        name = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)][-1]
        parent, attribute = model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
        setattr(parent, attribute, nn.Linear(getattr(parent, attribute).in_features, 5))
        field = rf"{name}\.weight: shape \[5, "
    else:
        name, conv = next((n, m) for n, m in model.named_modules() if isinstance(m, nn.Conv2d))
        conv.stride = (2, 2)
        field = rf"layers\.{name}\.geometry"
    with pytest.raises(ValueError, match=rf"model: load_sparse would refuse its file \({field}.*unsparse_spec"):
        save_sparse(sparsify(model), tmp_path / "model.safetensors")
    assert not (tmp_path / "model.safetensors").exists()


@pytest.mark.parametrize("conv", [nn.Conv2d(3, 4, 3, padding=1), nn.Conv1d(3, 4, 3, stride=2)])
def test_a_bare_conv_is_sparsified_itself(conv):
    """Only children used to be replaced, so a model that is one conv came back as a dense copy, silently."""
    x = torch.randn(2, 3, 9, 9) if isinstance(conv, nn.Conv2d) else torch.randn(2, 3, 9)
    sparse = sparsify(conv)
    assert isinstance(sparse, SparseConv) and isinstance(conv, nn.Conv1d | nn.Conv2d)
    with torch.no_grad():
        assert torch.allclose(sparse(x), conv(x), atol=1e-6)


def test_an_unknown_backend_name_is_refused_up_front(tmp_path):
    """A typo used to be accepted by sparsify, set_backend and load_sparse and fail only at the first forward."""
    from unsparse import create_model, load_sparse, save_sparse
    from unsparse.runtime import set_backend

    model = sparsify(create_model("vgg_small", width=4))
    save_sparse(model, tmp_path / "model.safetensors")
    for call in (lambda: sparsify(nn.Conv2d(2, 2, 3), "refrence"), lambda: set_backend(model, "refrence"),
                 lambda: load_sparse(tmp_path / "model.safetensors", backend="refrence")):
        with pytest.raises(KeyError, match=r"unknown backend 'refrence'; known: \[.*'reference'"):
            call()
    assert {layer.backend for layer in sparse_layers(model).values()} == {"reference"}


@pytest.mark.parametrize(("shape", "spatial_dims"), [((4, 3, 5), 2), ((4, 3, 1, 5), 1)])
def test_a_weight_of_the_wrong_rank_for_its_geometry_is_refused(shape, spatial_dims):
    """A Conv1d weight (M, C, S) under a 2-D geometry ran as a 1 x S kernel over an image, silently (an audit's
    find)."""
    from unsparse.sparse import ConvGeometry, SparseFormatError, UniformCSR

    csr = UniformCSR.from_dense(torch.randn(shape))
    with pytest.raises(SparseFormatError, match=r"weight_shape: .* dimensions"):
        SparseConv(csr, None, ConvGeometry.of(spatial_dims=spatial_dims))
