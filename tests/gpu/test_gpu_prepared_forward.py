"""``SparseConv.forward``'s prepared call on the GPU: a planned float32 layer's entry depends on the TF32 flags
(its plan key's precision), so a forward under other flags must run the other entry, with torch's float64
convolution on the CPU as the reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from unsparse.runtime.backends.dense import CudnnBackend
from unsparse.runtime.backends.direct import DirectBackend
from unsparse.runtime.comparator import relative_error, tolerance
from unsparse.runtime.modules import sparse_from_conv
from unsparse.runtime.plan import Plan, PlanEntry, layer_key, use_plan
from unsparse.runtime.precision import precision_mode

CUDA = torch.device("cuda")


def test_a_planned_float32_layer_follows_the_tf32_flags_between_forwards(monkeypatch) -> None:
    gen = torch.Generator().manual_seed(21)
    conv = nn.Conv2d(6, 10, 3, padding=1, dtype=torch.float64)
    with torch.no_grad():
        conv.weight.mul_(torch.rand(conv.weight.shape, generator=gen) < 0.3)
    x = torch.randn(3, 6, 13, 11, generator=gen, dtype=torch.float64)
    reference = F.conv2d(x, conv.weight, conv.bias, padding=1).detach()
    layer = sparse_from_conv(conv.float(), "auto").to(CUDA)
    x_cuda = x.float().to(CUDA)
    keys = {}
    for tf32 in (False, True):
        with precision_mode(tf32):
            keys[tf32] = layer_key(x_cuda, layer.csr, layer.geometry)
    assert keys[False] != keys[True]
    use_plan(Plan({keys[False]: PlanEntry("direct", {}, 1.0), keys[True]: PlanEntry("cudnn", {}, 1.0)}))
    ran: list[str] = []
    for cls in (DirectBackend, CudnnBackend):
        def recording(backend, *args, conv_call=cls.conv_call, **params):
            call = conv_call(backend, *args, **params)
            return lambda x: ran.append(backend.name) or call(x)
        monkeypatch.setattr(cls, "conv_call", recording)
    for tf32 in (False, True, False):
        with precision_mode(tf32), torch.no_grad():
            out = layer(x_cuda)
        assert relative_error(out.cpu(), reference) <= tolerance(torch.float32, tf32)
    assert ran == ["direct", "cudnn", "direct"]
