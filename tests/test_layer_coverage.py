"""Which torch convolution layers :func:`sparsify` converts, and that each one either computes what the dense layer
computes (``F.conv1d``/``F.conv2d`` in float64 on fresh random inputs) or stays dense with a logged reason: padding
modes, string padding, asymmetric tuples, strides past the kernel, kernels past the input, groups, dilation,
unbatched inputs, other convolution kinds, parametrizations, shared and aliased modules."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from unsparse.prune.masks import attach_masks
from unsparse.runtime import SparseConv, sparse_layers, sparsify
from unsparse.runtime.modules import sparse_from_conv
from unsparse.sparse import SparseFormatError

BACKENDS = ["reference", "im2col_cusparse", "im2col_cublas", "dense_cpu"]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shapes and float64 values within rounding."""
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-10, atol=1e-12)


def converted(conv: nn.Conv1d | nn.Conv2d, backend: str, caplog: pytest.LogCaptureFixture) -> nn.Module:
    """``sparsify(Sequential(conv))[0]``: a SparseConv, or the dense conv with a 'left dense' reason logged."""
    with caplog.at_level(logging.WARNING):
        layer = sparsify(nn.Sequential(conv), backend)[0]
    assert isinstance(layer, SparseConv) or (type(layer) is type(conv) and "0: " in caplog.text
                                             and "left dense" in caplog.text)
    return layer


CONV2D = [
    ("reflect", dict(kernel_size=3, padding=1, padding_mode="reflect"), False),
    ("replicate", dict(kernel_size=3, padding=(2, 1), padding_mode="replicate"), False),
    ("circular", dict(kernel_size=3, padding=1, padding_mode="circular"), False),
    ("same, even kernel", dict(kernel_size=(2, 4), padding="same"), False),
    ("same, odd kernel", dict(kernel_size=(3, 5), padding="same"), True),
    ("same, dilated", dict(kernel_size=3, padding="same", dilation=(2, 3)), True),
    ("valid", dict(kernel_size=3, padding="valid"), True),
    ("asymmetric tuples", dict(kernel_size=(3, 2), stride=(2, 3), padding=(1, 2), dilation=(2, 1)), True),
    ("stride past the kernel", dict(kernel_size=2, stride=5), True),
    ("kernel past the input, padded", dict(kernel_size=5, padding=2), True),
    ("1x7", dict(kernel_size=(1, 7), padding=(0, 3)), True),
    ("7x1, no bias", dict(kernel_size=(7, 1), padding=(3, 0), bias=False), True),
    ("1x1", dict(kernel_size=1), True),
    ("depthwise", dict(kernel_size=3, padding=1, groups=4, out_channels=4), True),
    ("groups, M != C", dict(kernel_size=3, padding=1, groups=2, out_channels=10), True),
    ("dilated, strided", dict(kernel_size=3, dilation=3, padding=2, stride=2), True),
]


CONV1D = [
    ("reflect", dict(kernel_size=3, padding=1, padding_mode="reflect"), False),
    ("circular", dict(kernel_size=3, padding=2, padding_mode="circular"), False),
    ("same, even kernel", dict(kernel_size=4, padding="same"), False),
    ("same, dilated", dict(kernel_size=5, padding="same", dilation=2), True),
    ("strided, dilated", dict(kernel_size=3, stride=2, padding=1, dilation=2), True),
    ("stride past the kernel", dict(kernel_size=2, stride=4, bias=False), True),
    ("kernel past the input, padded", dict(kernel_size=7, padding=3), True),
    ("groups", dict(kernel_size=3, groups=4, out_channels=8), True),
]


INPUT_SHAPES = {nn.Conv2d: [(1, 4, 1, 1), (3, 4, 7, 5), (2, 4, 9, 12), (4, 6, 5)],
                nn.Conv1d: [(1, 4, 1), (3, 4, 11), (4, 10)]}
"""Per conv class: a 1x1 plane, odd and even planes, and an unbatched input."""


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("conv_class", "case", "kwargs", "sparse"),
                         [(nn.Conv2d, *case) for case in CONV2D] + [(nn.Conv1d, *case) for case in CONV1D],
                         ids=[f"2d {case}" for case, _, _ in CONV2D] + [f"1d {case}" for case, _, _ in CONV1D])
def test_every_conv_geometry_converts_exactly_or_stays_dense_with_a_reason(conv_class, case, kwargs, sparse, backend,
                                                                            caplog):
    kwargs = {"in_channels": 4, "out_channels": 6, **kwargs}
    conv = conv_class(**kwargs).double().eval()
    layer = converted(conv, backend, caplog)
    assert isinstance(layer, SparseConv) == sparse
    for shape in INPUT_SHAPES[conv_class]:
        x = torch.randn(shape, dtype=torch.float64)
        try:
            expected = conv(x)
        except RuntimeError:  # an input too small for the layer: the sparse layer says so too
            with pytest.raises(ValueError if isinstance(layer, SparseConv) else RuntimeError):
                layer(x)
            continue
        with torch.no_grad():
            assert same(layer(x), expected), (case, shape)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("groups", [1, 2])
def test_zero_dense_and_sparse_rows_and_an_all_zero_weight_compute_as_dense(groups, backend):
    conv = nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=groups).double()
    with torch.no_grad():
        conv.weight.mul_(torch.rand(conv.weight.shape) < 0.3)
        conv.weight[0] = 0  # an output channel with no entry
        conv.weight[2] = torch.randn_like(conv.weight[2])  # a fully dense row
    x = torch.randn(3, 4, 7, 6, dtype=torch.float64)
    for weight in (conv.weight.detach().clone(), torch.zeros_like(conv.weight)):
        with torch.no_grad():
            conv.weight.copy_(weight)
        layer = sparsify(conv, backend)
        with torch.no_grad():
            assert same(layer(x), F.conv2d(x, weight, conv.bias, 2, 1, 1, groups))


@pytest.mark.parametrize("conv", [nn.Conv3d(3, 4, 3), nn.ConvTranspose2d(3, 4, 3, stride=2),
                                  nn.ConvTranspose1d(3, 4, 3)], ids=lambda conv: type(conv).__name__)
def test_other_convolution_kinds_stay_dense_with_a_logged_reason(conv, caplog):
    """Conv3d and the transposed convs were copied dense with nothing in the log, so a user saw fewer sparse layers
    than convolutions and no reason (the rule: unsupported layers fall back with a logged reason)."""
    conv = conv.double()
    x = torch.randn((2, 3) + (5,) * (conv.weight.dim() - 2), dtype=torch.float64)
    with caplog.at_level(logging.WARNING):
        sparse = sparsify(nn.Sequential(nn.Identity(), conv))
    assert type(sparse[1]) is type(conv)
    assert f"1: {type(conv).__name__} is not an nn.Conv1d or nn.Conv2d" in caplog.text
    assert "left dense" in caplog.text
    with torch.no_grad():
        assert same(sparse(x), conv(x))


def test_sparse_from_conv_refuses_a_transposed_conv_instead_of_computing_a_plain_one():
    """``sparse_from_conv(nn.ConvTranspose2d(...))`` read the transposed weight as a plain conv's and returned a layer
    computing a different function (2x4x4x4 where the layer gives 2x4x8x8 at stride 1), silently."""
    conv = nn.ConvTranspose2d(4, 4, 3)
    with pytest.raises(SparseFormatError, match=r"ConvTranspose2d is not an nn\.Conv1d or nn\.Conv2d"):
        sparse_from_conv(conv)


class Aliased(nn.Module):
    """One conv reachable under three names (``conv``, ``alias`` and ``block.0``) and called twice per forward."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.alias = self.conv
        self.block = nn.Sequential(self.conv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(torch.relu(self.alias(x)))


def test_a_conv_under_several_names_becomes_one_shared_sparse_layer(caplog):
    """A conv registered under a second name in the same parent stayed dense with nothing logged (named_children
    skips repeats), and its other names got separate SparseConvs, so the copy no longer shared one weight: a layer
    quantized or replaced under one name kept the old weight under the other."""
    model = Aliased().double()
    x = torch.randn(2, 3, 6, 5, dtype=torch.float64)
    with caplog.at_level(logging.WARNING):
        sparse = sparsify(model)
    assert "left dense" not in caplog.text
    assert isinstance(sparse.conv, SparseConv) and sparse.alias is sparse.conv and sparse.block[0] is sparse.conv
    with torch.no_grad():
        assert same(sparse(x), model(x))


def test_a_conv_called_twice_and_on_other_input_sizes_computes_as_dense():
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 3, stride=2, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.conv(torch.relu(self.conv(x)))

    model = Twice().double()
    sparse = sparsify(model)
    for shape in [(2, 3, 8, 8), (1, 3, 5, 7), (3, 3, 16, 9), (2, 3, 8, 8), (3, 4, 4)]:
        x = torch.randn(shape, dtype=torch.float64)
        with torch.no_grad():
            assert same(sparse(x), model(x)), shape


def test_a_spectral_norm_model_in_train_mode_folds_the_weight_it_computes_in_eval():
    """The copy is in eval mode, but its parametrizations were folded in the model's train mode, where spectral_norm
    runs one more power iteration first: the sparse layer divided by another sigma than the dense model in eval
    mode (5.6e-4 relative off in float64 for this seed), silently. The model's own modes are left as they were."""
    torch.manual_seed(5)
    model = nn.Sequential(nn.utils.parametrizations.spectral_norm(nn.Conv2d(3, 4, 3))).double().train()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    sparse = sparsify(model)
    assert model.training and model[0].training and not sparse.training
    with torch.no_grad():
        expected = model.eval()(x)
        assert same(sparse(x), expected)


def test_masked_and_weight_normed_convs_fold_their_effective_weight_and_hooks_are_refused_naming_the_fix():
    torch.manual_seed(6)
    model = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 4, 3, stride=2),
                          nn.utils.parametrizations.weight_norm(nn.Conv2d(4, 4, 1))).double()
    for mask in attach_masks(model, ["0", "2"]).values():
        mask.set(torch.rand(mask.mask.shape) < 0.3)
    x = torch.randn(2, 3, 9, 8, dtype=torch.float64)
    sparse = sparsify(model)
    assert len(sparse_layers(sparse)) == 3
    with torch.no_grad():
        assert same(sparse(x), model(x))
    hooked = nn.Sequential(nn.utils.spectral_norm(nn.Conv2d(3, 4, 3)))  # the older, hook-based API
    with pytest.raises(ValueError, match=r"^0: a conv with forward hooks .* remove them first"):
        sparsify(hooked)


def test_a_conv_whose_forward_was_replaced_on_the_instance_stays_dense_with_a_logged_reason(caplog):
    """Only the class's forward was compared, so a conv whose instance forward was replaced (as wrappers such as
    accelerate's hooks do) became a SparseConv of its weight and dropped what the new forward adds, silently."""
    conv = nn.Conv2d(3, 4, 3).double()
    plain_forward = conv.forward
    conv.forward = lambda x: 2 * plain_forward(x)
    model = nn.Sequential(conv)
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    with caplog.at_level(logging.WARNING):
        sparse = sparsify(model)
    assert type(sparse[0]) is nn.Conv2d and "0: Conv2d has its own forward; left dense" in caplog.text
    with torch.no_grad():
        assert same(sparse(x), model(x))
