"""BatchNorms folded into sparse and dense convolutions, run on the GPU, against the unfolded model in float64 on the
CPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from unsparse.models import create_model
from unsparse.runtime import bench
from unsparse.runtime.batch_norm_folding import FOLDED_ATTRIBUTE
from unsparse.runtime.comparator import relative_error, tolerance
from unsparse.runtime.dense_fusion import fuse_dense_conv_relu
from unsparse.runtime.end_to_end import dense_fused_timings
from unsparse.runtime.modules import set_backend, sparsify
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
    """Every BatchNorm folded and every ReLU after one fused, each backend: the output within 10x the dtype's
    tolerance of the unfolded dense model in float64."""
    model = trained_like(name)
    x = torch.randn(5, 1, 28, 28)
    expected = model.double()(x.double()).detach()
    sparse = set_backend(sparsify(model.to(CUDA, dtype), fold_batch_norm=True, fuse_relu=True), backend)
    assert len(getattr(sparse, FOLDED_ATTRIBUTE)) == (6 if name == "vgg_small" else 9)
    with precision_mode(False), torch.no_grad():
        out = sparse(x.to(CUDA, dtype)).cpu()
    assert relative_error(out, expected) <= 10 * tolerance(dtype)


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
    assert relative_error(dense_out.cpu(), expected) <= 10 * tolerance(dtype)
    assert fuse_dense_conv_relu(dense)[1] == 0  # the caller's model kept its BatchNorms
