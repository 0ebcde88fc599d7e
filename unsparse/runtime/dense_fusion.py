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
(:func:`~unsparse.runtime.batch_norm_folding.fold_batch_norm_`). A convolution whose output a residual add reads,
the add's sum then read by a ReLU (the end of each of ResNet's blocks), runs convolution, bias, add and ReLU in one
cuDNN call, ``torch.cudnn_convolution_add_relu``, as the planned model's ``cudnn`` layers do.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch
from torch import nn
from torch.nn.modules.conv import _ConvNd

from unsparse.runtime.backends.dense import cudnn_fused_call
from unsparse.runtime.graph_fusion import LeafTracer, fuse_following_relu
from unsparse.runtime.hooks import forward_with_pre_hooks
from unsparse.runtime.layout import in_layout, layout_of
from unsparse.runtime.timing import MIN_RUNS, time_fn


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
    ``relu(conv2d(x, weight) + bias)``), elsewhere the convolution then ``torch.relu`` (the same function). Called
    with a residual too, the convolution, a residual add and the ReLU after it: ``relu(conv2d(x, weight) + bias +
    residual)`` in one cuDNN call on CUDA (``torch.cudnn_convolution_add_relu``, the residual converted to ``x``'s
    layout; where cuDNN refuses it, logged once per message, and for a residual of another shape, dtype or device,
    or a number, the convolution, the add and the ReLU), elsewhere the same three in turn.

    Shapes as the convolution's: input ``(N, C, H, W)`` in either layout, output ``(N, M, E, F)``, a residual of the
    output's shape (or one that broadcasts to it); the weight and bias are the convolution's own parameters
    (shared, not copied).

    Attributes:
        passes: False (the default): cuDNN's fused call on CUDA. True: the convolution, then the add and the ReLU
            as passes, on CUDA too, where cuDNN's fused engine is the slower (:func:`choose_epilogues_` times both).

    Raises:
        ValueError: naming ``conv``, for a convolution :func:`fusion_refusal` refuses.
    """

    passes: bool = False  # a class attribute, so that a module pickled before it existed loads with the default

    def __init__(self, conv: nn.Conv2d) -> None:
        super().__init__()
        reason = fusion_refusal(conv)
        if reason is not None:
            raise ValueError(f"conv: {reason}")
        self.conv = conv

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        conv = self.conv
        if x.device.type == "cuda" and not self.passes:
            if residual is None:
                return torch.cudnn_convolution_relu(x, conv.weight, conv.bias, conv.stride, conv.padding,
                                                    conv.dilation, conv.groups)
            if _output_like(residual, x, conv):  # else a broadcast or promoting add, or a number: as the model's `+`
                fused = cudnn_fused_call("ConvBiasReLU", _REFUSALS, "residual, ReLU",
                                         torch.cudnn_convolution_add_relu, x, conv.weight,
                                         in_layout(residual, layout_of(x)), 1.0, conv.bias, conv.stride,
                                         conv.padding, conv.dilation, conv.groups)
                if fused is not None:
                    return fused
        return torch.relu(conv(x) if residual is None else conv(x) + residual)


def _output_like(residual: object, x: torch.Tensor, conv: nn.Conv2d) -> bool:
    """Whether ``residual`` is a tensor of ``conv(x)``'s shape, dtype and device (what cuDNN's fused add takes), from
    the convolution's attributes as they are now and without checking them, as torch's convolution reads them: the
    output-size formula is torch's, not :meth:`~unsparse.sparse.geometry.ConvGeometry.output_size`, which validates
    (an input smaller than the kernel, a padding of -1 must fail as the model's own convolution fails, with torch's
    RuntimeError, in the fallback; a review of the forty-sixth session found each case)."""
    if not isinstance(residual, torch.Tensor) or residual.dtype != x.dtype or residual.device != x.device:
        return False
    sizes = [(size + 2 * pad - dilation * (kernel - 1) - 1) // stride + 1 for size, pad, dilation, kernel, stride
             in zip(x.shape[2:], conv.padding, conv.dilation, conv.kernel_size, conv.stride, strict=True)]
    return tuple(residual.shape) == (x.shape[0], conv.out_channels, *sizes)


_REFUSALS: set[str] = set()
"""The messages of cuDNN's refusals :class:`ConvBiasReLU` has logged."""


def choose_epilogues_(model: nn.Module, x: torch.Tensor, runs: int = MIN_RUNS) -> int:
    """Set :attr:`ConvBiasReLU.passes` of each :class:`ConvBiasReLU` in ``model`` to the faster way to run it on the
    input (and residual) that ``model(x)`` gives it: cuDNN's fused call or the convolution and passes, each timed by
    :func:`~unsparse.runtime.timing.time_fn` (CUDA events after warm-up, median of ``runs``; the same input in every
    call), so that the fused dense baseline is not slowed by a fused engine slower than cuDNN's convolution (the
    planned model's ``cudnn`` layers choose the same way, :meth:`~unsparse.runtime.backends.dense.DenseBackend.
    epilogue_space`). ``model`` is mutated (only those flags); on a device other than CUDA nothing is timed or set.

    Memory: one forward's inputs and residuals of every such module are held at once (ResNet-50 at batch 128 in
    float32: at most about 8 GB, 5.5 of them inputs).

    Args:
        model: a model from :func:`fuse_dense_conv_relu`, in eval mode. x: its ``(N, C, H, W)`` input.

    Returns:
        How many modules run as passes.
    """
    if x.device.type != "cuda":
        return 0
    modules = [module for module in model.modules() if isinstance(module, ConvBiasReLU)]
    calls: dict[ConvBiasReLU, tuple[tuple[Any, ...], dict[str, Any]]] = {}

    def keep(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        calls.setdefault(module, (args, kwargs))

    forward_with_pre_hooks(model, x, [(module, keep) for module in modules], with_kwargs=True)
    saved = {module: module.passes for module in modules}
    try:
        with torch.no_grad():
            for module, (args, kwargs) in calls.items():
                call = functools.partial(module, *args, **kwargs)
                medians = {}
                for passes in (False, True):
                    module.passes = passes
                    medians[passes] = time_fn(lambda i, call=call: call(), x.device, runs=runs).median_ms
                module.passes = medians[True] < medians[False]
    except BaseException:  # a failed timing (out of memory, Ctrl-C) leaves every flag as it found it
        for module, passes in saved.items():
            module.passes = passes
        raise
    return sum(module.passes for module in modules)


def fuse_dense_conv_relu(model: nn.Module) -> tuple[nn.Module, int]:
    """A copy of ``model`` in which every ``nn.Conv2d`` whose output a ReLU reads, and nothing else, is a
    :class:`ConvBiasReLU` and that ReLU's call is gone, through the copy's FX graph
    (:func:`~unsparse.runtime.graph_fusion.fuse_following_relu`, each convolution one call, a subclass's too): an
    ``nn.ReLU`` module (ResNet's shared one included), ``F.relu`` as GoogLeNet's ``BasicConv2d`` calls it,
    ``torch.relu`` or the tensor method, after the convolution or after ``nn.Identity`` modules, which a BatchNorm
    folded by :func:`~unsparse.runtime.batch_norm_folding.fold_batch_norm_` leaves; ``model`` is not modified.
    Convolutions :func:`fusion_refusal` refuses, and those the graph rewrite leaves (called twice, read elsewhere too,
    with hooks; every one of a model FX cannot trace), stay as they are, with their ReLU. So is every convolution
    whose output (past such Identity modules) is one operand of a residual add whose sum a ReLU alone reads: it
    becomes a :class:`ConvBiasReLU` called with the add's other operand (the graph rewrite's ``fuse_residual``).

    Returns:
        The copy (an ``fx.GraphModule`` where a convolution fused, holding the copy's modules under their qualified
        names) and how many convolutions it fuses (VGG16: 13; ResNet-18 with its BatchNorms folded: 17, the stem,
        each block's first convolution and, with the residual add, each block's second: the downsample convolutions
        feed the add as the residual).
    """
    def fuse(name: str, conv: nn.Module) -> nn.Module | None:
        return ConvBiasReLU(conv).train(conv.training) if fusion_refusal(conv) is None else None

    fused, names = fuse_following_relu(copy.deepcopy(model), LeafTracer((_ConvNd,)), fuse, fuse)
    return fused, len(names)
