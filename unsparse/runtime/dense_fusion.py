"""A stronger dense baseline: each convolution fused with its bias and the ReLU after it, by cuDNN.

The end-to-end figures hold a planned sparse model, whose generated kernels add the bias and apply the ReLU and the
2x2 max pool in their epilogue, against the dense model as PyTorch runs it eagerly: cuDNN's convolution, then a bias
pass, a ReLU pass and a pool pass. On the H200 those passes took 8.7 of the 14.8 ms of VGG16's FP16 channels-last
forward at batch 128 (``kernels/NOTES.md``, forty-first session), so part of a whole-model speedup is fusion that a
dense model could have too. cuDNN fuses convolution, bias and ReLU in one call (``torch.cudnn_convolution_relu``,
its runtime fusion of the three operations); :func:`fuse_dense_conv_relu` builds the dense model that makes that
call, to time beside the eager one (Escoin paper 000 §5 and UnSparse-Opt paper 004 §6 compare against cuDNN's
convolution alone; this is the dense model a deployment could run instead). It rewrites the model's FX graph
(:func:`~unsparse.runtime.graph_fusion.fuse_following_relu`), so besides VGG's ``nn.Sequential`` of conv and ReLU it
fuses ResNet's and GoogLeNet's conv, BatchNorm, ReLU calls once the BatchNorms are folded into the convolutions
(:func:`~unsparse.runtime.batch_norm_folding.fold_batch_norm_`).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn.modules.conv import _ConvNd

from unsparse.runtime.graph_fusion import LeafTracer, fuse_following_relu


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
    """A copy of ``model`` in which every ``nn.Conv2d`` whose output a ReLU reads, and nothing else, is a
    :class:`ConvBiasReLU` and that ReLU's call is gone, through the copy's FX graph
    (:func:`~unsparse.runtime.graph_fusion.fuse_following_relu`, each convolution one call, a subclass's too): an
    ``nn.ReLU`` module (ResNet's shared one included), ``F.relu`` as GoogLeNet's ``BasicConv2d`` calls it,
    ``torch.relu`` or the tensor method, after the convolution or after ``nn.Identity`` modules, which a BatchNorm
    folded by :func:`~unsparse.runtime.batch_norm_folding.fold_batch_norm_` leaves; ``model`` is not modified.
    Convolutions :func:`fusion_refusal` refuses, and those the graph rewrite leaves (called twice, read elsewhere too,
    with hooks; every one of a model FX cannot trace), stay as they are, with their ReLU.

    Returns:
        The copy (an ``fx.GraphModule`` where a convolution fused, holding the copy's modules under their qualified
        names) and how many convolutions it fuses (VGG16: 13; ResNet-18 with its BatchNorms folded: 9, the stem and
        each block's first convolution: the others feed the residual add).
    """
    def fuse(name: str, conv: nn.Module) -> nn.Module | None:
        return ConvBiasReLU(conv).train(conv.training) if fusion_refusal(conv) is None else None

    fused, names = fuse_following_relu(copy.deepcopy(model), LeafTracer((_ConvNd,)), fuse)
    return fused, len(names)
