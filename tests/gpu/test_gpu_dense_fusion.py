"""cuDNN's fused convolution, bias and ReLU (``ConvBiasReLU`` on CUDA) against a float64 CPU reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from unsparse.runtime.batch_norm_folding import fold_batch_norm_
from unsparse.runtime.comparator import relative_error, tolerance
from unsparse.runtime.dense_fusion import ConvBiasReLU, choose_epilogues_, fuse_dense_conv_relu
from unsparse.runtime.precision import precision_mode

CUDA = torch.device("cuda")


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("stride", "padding", "dilation"), [(1, 1, 1), (2, 0, 1), (1, 2, 2)])
def test_the_fused_call_matches_relu_of_the_float64_convolution(dtype: torch.dtype, memory_format: torch.memory_format,
                                                                stride: int, padding: int, dilation: int) -> None:
    """Odd shapes (13 x 11 input, 7 output channels), sums of both signs; TF32 off, so float32 is held to 1e-5."""
    torch.manual_seed(stride * 10 + padding + dilation)
    conv = nn.Conv2d(5, 7, 3, stride=stride, padding=padding, dilation=dilation)
    x = torch.randn(3, 5, 13, 11)
    expected = torch.relu(F.conv2d(x.to(dtype).double(), conv.weight.to(dtype).double(),
                                   conv.bias.to(dtype).double(), stride, padding, dilation))
    fused = ConvBiasReLU(conv).to(CUDA, dtype).to(memory_format=memory_format)
    with precision_mode(False), torch.no_grad():
        out = fused(x.to(CUDA, dtype).contiguous(memory_format=memory_format)).cpu()
    assert (expected == 0).any() and (expected > 0).any()
    assert relative_error(out, expected) <= tolerance(dtype)
    assert (out[expected == 0] == 0).all() and (out >= 0).all()


def test_a_fused_vgg_block_computes_the_dense_block_in_channels_last_fp16() -> None:
    torch.manual_seed(9)
    block = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(16, 8, 3, padding=1),
                          nn.ReLU(inplace=True), nn.MaxPool2d(2)).eval()
    fused, count = fuse_dense_conv_relu(block)
    assert count == 2
    x = torch.randn(4, 3, 18, 15)
    expected = block.double()(x.double())
    with torch.no_grad():
        out = fused.to(CUDA, torch.float16).to(memory_format=torch.channels_last)(
            x.to(CUDA, torch.float16).contiguous(memory_format=torch.channels_last)).cpu()
    assert relative_error(out, expected) <= 10 * tolerance(torch.float16)


def test_choosing_epilogues_keeps_the_function_of_every_block() -> None:
    """ResNet-18 with its BatchNorms folded: each of its 17 fused convolutions (8 with a residual) gets the faster of
    cuDNN's fused call and the passes, timed on the GPU; whichever each takes, and all of either, the model computes the
    float64 model (TF32 off)."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(17)
    model = torchvision.models.resnet18(num_classes=10).eval()
    fold_batch_norm_(model)
    x = torch.randn(2, 3, 64, 48)
    with torch.no_grad():
        expected = model.double()(x.double())
    fused, count = fuse_dense_conv_relu(model.float())
    fused = fused.to(CUDA)
    modules = [module for module in fused.modules() if isinstance(module, ConvBiasReLU)]
    assert count == len(modules) == 17
    with precision_mode(False), torch.no_grad():
        chosen = choose_epilogues_(fused, x.to(CUDA), runs=3)
        assert chosen == sum(module.passes for module in modules) and 0 <= chosen <= 17
        outputs = [fused(x.to(CUDA)).cpu()]
        for passes in (False, True):
            for module in modules:
                module.passes = passes
            outputs.append(fused(x.to(CUDA)).cpu())
    for out in outputs:
        assert relative_error(out, expected) <= tolerance(torch.float32)


def test_a_failed_choice_leaves_every_flag_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    """A timing that fails part way (out of memory, say) leaves each module's ``passes`` as it was before."""
    from unsparse.runtime import dense_fusion

    torch.manual_seed(18)
    block = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU()).eval()
    fused, count = fuse_dense_conv_relu(block)
    fused = fused.to(CUDA)
    modules = [module for module in fused.modules() if isinstance(module, ConvBiasReLU)]
    assert count == len(modules) == 2
    modules[1].passes = True
    timings = []
    time_fn = dense_fusion.time_fn

    def fails_third(*args, **kwargs):
        timings.append(1)
        if len(timings) == 3:
            raise torch.OutOfMemoryError("stand-in")
        return time_fn(*args, **kwargs)

    monkeypatch.setattr(dense_fusion, "time_fn", fails_third)
    with pytest.raises(torch.OutOfMemoryError):
        choose_epilogues_(fused, torch.randn(2, 3, 9, 7, device=CUDA), runs=3)
    assert [module.passes for module in modules] == [False, True]
