"""A stronger dense baseline: each convolution fused with its bias and the ReLU after it, by cuDNN.

The end-to-end figures hold a planned sparse model, whose generated kernels add the bias and apply the ReLU and the
2x2 max pool in their epilogue, against the dense model as PyTorch runs it eagerly: cuDNN's convolution, then a bias
pass, a ReLU pass and a pool pass. On the H200 those passes took 8.7 of the 14.8 ms of VGG16's FP16 channels-last
forward at batch 128 (``kernels/NOTES.md``, forty-first session), so part of a whole-model speedup is fusion that a
dense model could have too. cuDNN fuses convolution, bias and ReLU in one call (``torch.cudnn_convolution_relu``,
its runtime fusion of the three operations); :func:`fuse_dense_conv_relu` builds the dense model that makes that
call, to time beside the eager one (Escoin paper 000 §5 and UnSparse-Opt paper 004 §6 compare against cuDNN's
convolution alone; this is the dense model a deployment could run instead).
"""

from __future__ import annotations

import copy
import itertools

import torch
from torch import nn


def fusion_refusal(conv: nn.Module) -> str | None:
    """Why :class:`ConvBiasReLU` cannot take ``conv``, or None: it must be a plain ``nn.Conv2d`` (a subclass's forward
    may differ) without hooks (the fused module would skip them), with zero padding given as numbers (not
    ``padding="same"``)."""
    if type(conv) is not nn.Conv2d:
        return f"a plain nn.Conv2d, not {type(conv).__name__}"
    if conv._forward_hooks or conv._forward_pre_hooks:
        return "it has forward hooks"
    if conv.padding_mode != "zeros" or isinstance(conv.padding, str):
        return f"zero padding given as numbers, not padding={conv.padding!r} padding_mode={conv.padding_mode!r}"
    return None


class ConvBiasReLU(nn.Module):
    """An ``nn.Conv2d`` and the ``nn.ReLU`` after it as one cuDNN call on CUDA (``torch.cudnn_convolution_relu``:
    ``relu(conv2d(x, weight) + bias)``), elsewhere the convolution then ``torch.relu`` (the same function).

    Shapes as the convolution's: input ``(N, C, H, W)`` in either layout, output ``(N, M, E, F)``; the weight and
    bias are the convolution's own parameters (shared, not copied).

    Raises:
        ValueError: naming ``conv``, for a convolution :func:`fusion_refusal` refuses.
    """

    def __init__(self, conv: nn.Conv2d) -> None:
        super().__init__()
        reason = fusion_refusal(conv)
        if reason is not None:
            raise ValueError(f"conv: {reason}")
        self.conv = conv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        conv = self.conv
        if x.device.type != "cuda":
            return torch.relu(conv(x))
        return torch.cudnn_convolution_relu(x, conv.weight, conv.bias, conv.stride, conv.padding, conv.dilation,
                                            conv.groups)


def fuse_dense_conv_relu(model: nn.Module) -> tuple[nn.Module, int]:
    """A copy of ``model`` in which every ``nn.Conv2d`` followed by a plain ``nn.ReLU`` in an ``nn.Sequential`` is a
    :class:`ConvBiasReLU` and the ReLU's place an ``nn.Identity``; ``model`` is not modified. "Followed": the next
    module that is not an ``nn.Identity`` (a BatchNorm folded by
    :func:`~unsparse.runtime.batch_norm_folding.fold_batch_norm_` leaves one). Convolutions :func:`fusion_refusal`
    refuses stay as they are, with their ReLU.

    Returns:
        The copy and how many convolutions it fuses (VGG16: 13).
    """
    fused = copy.deepcopy(model)
    count = 0
    for sequential in [m for m in fused.modules() if isinstance(m, nn.Sequential)]:
        names = [name for name, module in sequential._modules.items() if type(module) is not nn.Identity]
        for name, following in itertools.pairwise(names):
            conv, relu = sequential._modules[name], sequential._modules[following]
            if type(relu) is nn.ReLU and fusion_refusal(conv) is None:
                sequential._modules[name] = ConvBiasReLU(conv)
                sequential._modules[following] = nn.Identity()
                count += 1
    return fused, count
