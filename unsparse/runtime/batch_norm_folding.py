"""Folding an inference-mode BatchNorm into the convolution before it.

A ``BatchNorm`` in eval mode is a per-channel affine map of its input, ``y = (x - mean) * scale + beta`` with
``scale = gamma / sqrt(var + eps)``. Where it reads a convolution's output and nothing else does, the convolution can
compute it: each output channel's weights times ``scale[m]`` and the bias ``(bias - mean) * scale + beta``. The
BatchNorm's pass over the ofmap disappears; a backend that adds the bias in its epilogue (``direct``, ``generated``)
takes it for free, while PyTorch's cuDNN convolution adds the bias in a pass of its own (see
:func:`fold_batch_norm_`). For a sparse layer the scaling touches only the stored values of row ``m`` of its
UniformCSR (UnSparse-Opt paper 004 §5), so the sparsity pattern, the column indices and the row length stay as they
are (a padding zero stays zero). ResNet
and GoogLeNet follow every convolution with a BatchNorm; the papers' timings (Escoin paper 000 §5, paper 004 §6) are
of the convolutions alone.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.conv import _ConvNd
from torch.nn.utils.fusion import fuse_conv_bn_weights

from unsparse.runtime.backends import get_backend
from unsparse.runtime.graph_fusion import LeafTracer, module_calls, name_counts
from unsparse.runtime.modules import SparseConv, _computes_as_torch_conv, sparse_layers
from unsparse.runtime.plan import Plan
from unsparse.sparse.format import UniformCSR

log = logging.getLogger(__name__)

FOLDED_ATTRIBUTE = "unsparse_folded_batch_norm"
"""The model attribute :func:`fold_batch_norm_` appends the folded convolutions' names to (a copy keeps it), so that a
folded model is told apart where its missing BatchNorms matter (a sparse file holds the unfolded model)."""

FOLD_POLICIES = ("off", "all", "epilogue")
"""Where a whole-model benchmark folds BatchNorms into its sparse copies: nowhere, into every convolution
(:func:`fold_batch_norm_`), or into the layers whose planned backend adds the bias in its epilogue
(:func:`fold_batch_norm_into_epilogues_`)."""

_BATCH_NORM_OF_DIMS = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d}


@dataclass(frozen=True)
class _Pair:
    conv: str
    batch_norm: str


def _traced_pairs(model: nn.Module) -> list[_Pair]:
    """Every (module, module) call pair of ``model``'s FX graph in which the second call's only input is the first
    call's output, the first call's output goes nowhere else, each module is called once, and the graph reads no
    attribute of either module directly (``self.conv.weight`` in a forward, say). Raises what FX raises for an
    untraceable model."""
    graph = LeafTracer((SparseConv,)).trace(model)
    calls, read = module_calls(graph)
    pairs = []
    for node in graph.nodes:
        if node.op != "call_module" or len(node.users) != 1:
            continue
        (user,) = node.users
        if user.op == "call_module" and user.args == (node,):
            pair = _Pair(str(node.target), str(user.target))
            if calls[pair.conv] == calls[pair.batch_norm] == 1 and not {pair.conv, pair.batch_norm} & read:
                pairs.append(pair)
    return pairs


def _refusal(conv: nn.Module, batch_norm: nn.Module, uses: dict[nn.Module, int],
             owners: dict[int, int]) -> str | None:
    """Why ``batch_norm`` cannot fold into ``conv``, or None (``uses``: how many names each module has; ``owners``:
    per tensor ``id``, how many module attributes hold it)."""
    if isinstance(conv, SparseConv):
        dims = conv.geometry.spatial_dims
        if conv.relu or conv.max_pool:
            return "the layer applies a fused ReLU or max pool before the BatchNorm"
        out_channels = conv.weight_shape[0]
    elif type(conv) in (nn.Conv1d, nn.Conv2d) and _computes_as_torch_conv(conv):
        dims, out_channels = conv.weight.dim() - 2, conv.out_channels
    else:
        return f"{type(conv).__name__} is no plain convolution"
    if type(batch_norm) is not _BATCH_NORM_OF_DIMS[dims]:
        return f"{type(batch_norm).__name__} does not follow a {dims}-D convolution as {_BATCH_NORM_OF_DIMS[dims]} does"
    if batch_norm.training:
        return "the BatchNorm is in training mode (it normalises by the batch's statistics); call model.eval() first"
    if batch_norm.running_mean is None or batch_norm.running_var is None:
        return "the BatchNorm keeps no running statistics (track_running_stats=False)"
    if batch_norm.num_features != out_channels:
        return f"the BatchNorm has {batch_norm.num_features} features, the convolution {out_channels} channels"
    if uses[conv] != 1 or uses[batch_norm] != 1:
        return "the convolution or the BatchNorm is reachable under several names"
    tensors = [*conv.parameters(recurse=False), *conv.buffers(recurse=False)]
    if any(owners[id(tensor)] != 1 for tensor in tensors):
        return "a weight of the convolution is shared with another module"
    if any(module._forward_pre_hooks or module._forward_hooks for module in (conv, batch_norm)):
        return "the convolution or the BatchNorm has forward hooks"
    return None


def _fold(conv: nn.Module, batch_norm: nn.BatchNorm1d | nn.BatchNorm2d) -> str | None:
    """Fold ``batch_norm`` into ``conv`` (mutates ``conv``) with ``torch.nn.utils.fusion.fuse_conv_bn_weights`` on
    float64 copies, stored in the layer's dtype; the reason it did not, or None."""
    weight = conv.values if isinstance(conv, SparseConv) else conv.weight
    folded_weight, folded_bias = (tensor.detach().to(weight.dtype) for tensor in fuse_conv_bn_weights(
        weight.double(), _double(conv.bias), batch_norm.running_mean.double(), batch_norm.running_var.double(),
        batch_norm.eps, _double(batch_norm.weight), _double(batch_norm.bias)))
    if not (torch.isfinite(folded_weight).all() and torch.isfinite(folded_bias).all()):
        return f"the folded weights or bias do not fit {weight.dtype}"
    with torch.no_grad():
        if isinstance(conv, SparseConv):
            conv.set_csr(UniformCSR(folded_weight, conv.col_idx, conv.weight_shape))
        else:
            conv.weight.copy_(folded_weight)
        if conv.bias is None:
            conv.bias = nn.Parameter(folded_bias, requires_grad=weight.requires_grad)
        else:
            conv.bias.copy_(folded_bias)
    return None


def _double(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.detach().double()


def fold_batch_norm_(model: nn.Module, only: Collection[str] | None = None) -> list[str]:
    """Fold each eval-mode ``nn.BatchNorm1d``/``nn.BatchNorm2d`` that reads a convolution's output, and nothing else
    does, into that convolution (mutates ``model``): the convolution's weight rows (a :class:`SparseConv`'s stored
    values, ``(M, L)``; a plain ``nn.Conv1d``/``nn.Conv2d``'s ``(M, C/groups, ...)`` weight) are scaled per output
    channel and its bias becomes the BatchNorm's shift, computed in float64 and stored in the layer's dtype; the
    BatchNorm's place holds an ``nn.Identity``. The model computes the same eval-mode function, up to rounding.

    Which BatchNorm reads which output comes from an FX trace of ``model`` (each SparseConv one call), so a ResNet
    block's ``conv1``/``bn1`` fold as a VGG-BN ``Sequential``'s do; a model FX cannot trace (data-dependent control
    flow) folds nothing, with the reason logged. Not folded: a pair where either module is called twice, or its
    attributes are read in the forward, or the conv's output is read elsewhere; and, each with a logged reason, a
    BatchNorm in training mode or without running statistics, one whose size is not the convolution's output
    channels, a convolution that fuses a ReLU or pool before it, a module reachable under several names, a weight
    shared with another module, modules with forward hooks, convolutions of other kinds (a subclass or an instance
    with its own ``forward``/``_conv_forward``), and folds whose results overflow the layer's dtype (FP16).
    Call it before :func:`~unsparse.runtime.modules.fuse_relu`: a conv, BatchNorm, ReLU sequence then fuses the
    ReLU too. A folded model keeps the names in the attribute :data:`FOLDED_ATTRIBUTE`;
    :func:`~unsparse.sparse.save.save_sparse` refuses it (fold after loading instead).

    Where it pays: a backend that adds the bias in its epilogue (``direct``, ``generated``) takes the BatchNorm for
    free, but PyTorch's cuDNN convolution adds a bias in a pass of its own, which in FP16 channels-last took longer
    than the BatchNorm pass it replaced (ResNet-50 b128 on an H200, ``kernels/NOTES.md``, forty-second session:
    the all-cuDNN plan 9.19 ms folded, 8.09 unfolded; FP32 NCHW with 44 layers on ``direct`` 24.79 against 29.38).
    :func:`fold_batch_norm_into_epilogues_` folds a planned model only where the bias is free.

    Args:
        model: mutated in place.
        only: the qualified names of the convolutions that may take a BatchNorm (the others' BatchNorms stay,
            silently); every convolution if None.

    Returns:
        The qualified names of the convolutions that took a BatchNorm, in module order.
    """
    try:
        pairs = _traced_pairs(model)
    except Exception as error:  # FX raises TraceError, TypeError, NotImplementedError, ... for untraceable code
        log.info("fold_batch_norm_: FX cannot trace %s (%s: %s), so which BatchNorm reads which output is unknown; "
                 "nothing folded", type(model).__name__, type(error).__name__, error)
        pairs = []
    modules = dict(model.named_modules())
    uses = name_counts(model)
    owners = Counter(id(tensor) for _, module in model.named_modules(remove_duplicate=False)
                     for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)])
    folded = []
    for pair in (pair for pair in pairs if only is None or pair.conv in only):
        conv, batch_norm = modules.get(pair.conv), modules.get(pair.batch_norm)
        if not isinstance(batch_norm, _BatchNorm) or not isinstance(conv, _ConvNd | SparseConv):
            continue
        reason = _refusal(conv, batch_norm, uses, owners) or _fold(conv, batch_norm)
        if reason is not None:
            log.info("%s: its BatchNorm %s stays a separate pass: %s", pair.conv, pair.batch_norm, reason)
            continue
        model.set_submodule(pair.batch_norm, nn.Identity())
        folded.append(pair.conv)
    position = {name: index for index, name in enumerate(modules)}
    folded.sort(key=position.__getitem__)
    setattr(model, FOLDED_ATTRIBUTE, [*getattr(model, FOLDED_ATTRIBUTE, []), *folded])
    return folded


def fold_batch_norm_into_epilogues_(model: nn.Module, plan: Plan) -> list[str]:
    """Fold BatchNorms (:func:`fold_batch_norm_`, mutates ``model``) only into the :class:`SparseConv` layers of a
    planned ``model`` whose planned backend adds the bias as it stores its output
    (:meth:`~unsparse.runtime.backends.base.ConvBackend.adds_bias_in_epilogue` of the entry's backend and setting):
    only there does a pass over the ofmap disappear. A layer planned on cuDNN keeps its BatchNorm, since PyTorch adds
    a cuDNN convolution's bias in a pass of its own; on the H200 that pass took longer than the channels-last FP16
    BatchNorm it replaced (ResNet-50 b128, forty-third session's profile in ``kernels/NOTES.md``: 53 bias adds
    3.9 ms of GPU time per forward against 2.5 ms for the 53 BatchNorms they replace).

    The layers keep their plan keys (a key holds no bias or weight values, :func:`~unsparse.runtime.plan.layer_key`),
    so their entries hold; the caller re-plans where folding exposed a fusion (a ReLU after the BatchNorm,
    :func:`~unsparse.runtime.modules.fuse_relu`).

    Args:
        model: planned by :func:`~unsparse.runtime.comparator.plan_model` (each layer's ``plan_key`` set).
        plan: the plan holding those keys.

    Returns:
        The qualified names of the layers that took a BatchNorm, in module order.
    """
    epilogues = set()
    for name, layer in sparse_layers(model).items():
        entry = plan.get(getattr(layer, "plan_key", ""))
        if entry is not None and get_backend(entry.backend).adds_bias_in_epilogue(entry.params):
            epilogues.add(name)
    return fold_batch_norm_(model, only=epilogues)
