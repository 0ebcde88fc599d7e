"""``SparseConv2d`` / ``SparseConv1d`` modules and :func:`sparsify`, which swaps them in for dense convs."""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn.modules.conv import _ConvNd
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.modules.utils import _pair

from unsparse.modes import module_modes, restore_modes
from unsparse.prune.masks import squashed_copy
from unsparse.runtime.graph_fusion import LeafTracer, _has_hooks, fuse_following_relu, name_counts
from unsparse.runtime.plan import plan_generation
from unsparse.runtime.precision import tf32_flags
from unsparse.sparse.format import SparseFormatError, UniformCSR, tensor_version
from unsparse.sparse.functional import conv2d_input, dense_fallback_backend, prepare_sparse_conv_nd
from unsparse.sparse.geometry import ConvGeometry

log = logging.getLogger(__name__)


class PreparedForward(NamedTuple):
    """What :meth:`SparseConv.forward` prepared: the call, the signature and ``backend_params`` it was prepared for,
    and the tensors whose ``id`` the signature holds (kept alive so that no other tensor can take that ``id``)."""

    signature: tuple
    params: dict[str, Any]
    tensors: tuple[torch.Tensor | None, ...]
    call: Callable[..., torch.Tensor]


def _describe(residual: Any) -> tuple | None:
    """What a prepared call depends on of a residual: a tensor's shape, strides, dtype and device (another object's
    type: the add then follows Python's ``+``); None for none."""
    if residual is None:
        return None
    if isinstance(residual, torch.Tensor):
        return residual.shape, residual.stride(), residual.dtype, residual.device
    return (type(residual),)


class SparseConv(nn.Module):
    """A convolution whose weight is stored as a UniformCSR (buffers ``values`` and ``col_idx``).

    Args:
        csr: the weight, ``(M, C/groups, R, S)`` (Conv2d) or ``(M, C/groups, S)`` (Conv1d).
        bias: ``(M,)`` or None; kept as a parameter.
        geometry: stride/padding/dilation/groups; ``geometry.spatial_dims`` decides 1-D or 2-D inputs.
        backend: backend name used by :meth:`forward` (see ``unsparse.runtime.backends``).
        backend_params: tuning parameters for that backend (e.g. chosen by the comparator).
        relu: apply the ReLU that followed the conv (:func:`fuse_relu`) to the output, in the epilogue of a
            backend that fuses it (``ConvBackend.fuses_relu``), else in place after the conv.
        max_pool: then apply the ``nn.MaxPool2d(2)`` that followed (:func:`fuse_max_pool_`; 2-D only), likewise in
            the epilogue of a backend that fuses it (``ConvBackend.fuses_max_pool``): the output is then
            ``(N, M, E // 2, F // 2)``.
        residual: the forward takes a second argument, the residual that a residual block added to the conv's output
            before its ReLU (:func:`fuse_relu`, which sets ``relu`` too), and adds it before the ReLU: in the
            backend's call where it fuses both (``ConvBackend.fuses_residual_relu``), else in passes after it.

    Forward: ``(N, C, H, W)`` (and, with ``residual``, a residual ``(N, M, E, F)`` or one that broadcasts to it) ->
    ``(N, M, E, F)`` for 2-D, in the input's layout (NCHW or channels-last);
    ``(N, C, L)`` -> ``(N, M, L_out)`` for 1-D, always contiguous (a transposed ``(N, L, C)`` input is copied).
    Unbatched inputs ``(C, H, W)`` / ``(C, L)``, as ``nn.Conv2d``/``nn.Conv1d`` accept, run as a batch of one.

    Raises:
        SparseFormatError: (a ``ValueError``) a weight whose rank is not ``geometry.spatial_dims + 2`` (a Conv1d
            weight under a 2-D geometry ran as a 1 x S kernel over an image, with no error), or ``groups`` that
            does not divide the weight's output channels (:meth:`ConvGeometry.check_channels`).
        ValueError: ``max_pool`` for a 1-D convolution.
    """

    def __init__(self, csr: UniformCSR, bias: torch.Tensor | None, geometry: ConvGeometry,
                 backend: str = "reference", backend_params: dict[str, Any] | None = None, relu: bool = False,
                 max_pool: bool = False, residual: bool = False) -> None:
        super().__init__()
        if max_pool and geometry.spatial_dims != 2:
            raise ValueError("max_pool: a 2x2 max pool follows 2-D convolutions only")
        if len(csr.weight_shape) != geometry.spatial_dims + 2:
            raise SparseFormatError(f"weight_shape: {csr.weight_shape} has {len(csr.weight_shape)} dimensions, a "
                                    f"{geometry.spatial_dims}-D convolution's weight has {geometry.spatial_dims + 2}")
        geometry.check_channels(csr.in_channels_per_group * geometry.groups, csr.out_channels)
        self.register_buffer("values", csr.values.detach().clone())
        self.register_buffer("col_idx", csr.col_idx.detach().clone())
        self.weight_shape = csr.weight_shape
        self.register_parameter("bias", None if bias is None else nn.Parameter(bias.detach().clone(),
                                                                                requires_grad=False))
        self.geometry = geometry
        self.backend = backend
        self.backend_params = dict(backend_params or {})
        self.relu = relu
        self.max_pool = max_pool
        self.residual = residual
        self._csr: UniformCSR | None = None
        self._prepared: PreparedForward | None = None

    @property
    def csr(self) -> UniformCSR:
        """The weight as a UniformCSR over the module's current buffers: a new object after ``.to()`` or another
        replacement of a buffer. An in-place change of a buffer (an in-place ``load_state_dict``, ``values.mul_``)
        keeps the object, re-checked here once changed (:meth:`UniformCSR.revalidate`: a column index written out of
        range raises ``SparseFormatError``), and its tensors' version counters tell the backends' per-weight caches
        (dense copies, lowered matrices, kernel entries) to rebuild. Changes that bypass the version counter (through
        ``.data``, or to buffers made under ``torch.inference_mode()``) are not seen: replace the buffers, or call
        :meth:`set_csr`, instead."""
        csr = self._csr
        if csr is None or csr.values is not self.values or csr.col_idx is not self.col_idx:
            csr = UniformCSR(self.values, self.col_idx, self.weight_shape)
            self._csr = csr
        csr.revalidate()
        return csr

    def set_csr(self, csr: UniformCSR) -> None:
        """Replace the stored weight (same ``weight_shape``); used by quantization and file loading.

        Raises:
            ValueError: if the shape differs.
        """
        if csr.weight_shape != self.weight_shape:
            raise ValueError(f"weight_shape: {csr.weight_shape} differs from the layer's {self.weight_shape}")
        self.values = csr.values
        self.col_idx = csr.col_idx
        self._csr = None

    def conv2d_input(self, x: torch.Tensor) -> torch.Tensor:
        """The 4-D input the backends see for ``x`` (:func:`~unsparse.sparse.functional.conv2d_input`)."""
        return conv2d_input(x, self.geometry.spatial_dims)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The convolution of ``x`` (plus ``residual`` before the ReLU, for a layer fused with a residual add: given
        exactly when :attr:`residual` is set) through a call prepared once per input signature and module state
        (:func:`~unsparse.sparse.functional.prepare_sparse_conv_nd`: the checks, the backend's or the plan's choice,
        the backend's weight copy and bias cast), so that an eager forward pays little more host time than
        ``nn.Conv2d`` does. It is prepared again, and the weight re-checked (:attr:`csr`), when any of these
        changed since: the input's (and the residual's) shape, strides, dtype or device; the buffers or the bias
        (replaced, or edited in place: their version counters); ``backend``, ``backend_params``, ``relu``,
        ``max_pool``, ``geometry``; the active plan (:func:`~unsparse.runtime.plan.plan_generation`) and, for a
        float32 CUDA input, the TF32 flags (both part of the plan's key, :func:`~unsparse.runtime.plan.precision_tag`).

        Raises:
            ValueError: a residual given to a layer without :attr:`residual` or missing for one with it, or as
                :func:`~unsparse.sparse.functional.sparse_conv_nd`.
        """
        if (residual is not None) != self.residual:
            raise ValueError(f"residual: {'missing for' if self.residual else 'given to'} a layer "
                             f"{'fused' if self.residual else 'not fused'} with a residual add")
        buffers = self._buffers
        values, col_idx, bias = buffers["values"], buffers["col_idx"], self._parameters["bias"]
        signature = (x.shape, x.stride(), x.dtype, x.device, self.backend, self.relu, self.max_pool, self.geometry,
                     id(values), id(col_idx), id(bias), tensor_version(values), tensor_version(col_idx),
                     None if bias is None else tensor_version(bias), _describe(residual))
        if self.backend == "auto":  # what the plan's entry depends on besides the input and the layer
            signature += (plan_generation(),)
            if x.is_cuda and x.dtype == torch.float32:  # the flags a float32 CUDA key has (precision_tag)
                signature += tf32_flags()
        prepared = self._prepared
        if prepared is None or prepared.signature != signature or prepared.params != self.backend_params:
            call = prepare_sparse_conv_nd(x, self.csr, bias, self.geometry, self.backend, self.relu, self.max_pool,
                                          residual, **self.backend_params)
            prepared = PreparedForward(signature, dict(self.backend_params), (values, col_idx, bias), call)
            self._prepared = prepared
        return prepared.call(x, residual)

    def __getstate__(self) -> dict[str, Any]:
        """The module's state without its prepared call (a copy prepares its own on its first forward)."""
        return {**super().__getstate__(), "_prepared": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """The state of :meth:`__getstate__`, or of a layer pickled before the prepared call and the residual: those
        attributes start empty, and a bias kept as a plain attribute (``None``) is registered as the parameter."""
        super().__setstate__(state)
        self.__dict__.setdefault("_prepared", None)
        self.__dict__.setdefault("residual", False)
        if "bias" not in self._parameters:
            self._parameters["bias"] = self.__dict__.pop("bias", None)

    def extra_repr(self) -> str:
        # the buffers, not self.csr: a model whose weight fails its re-check must still print
        total = math.prod(self.weight_shape)
        sparsity = 1.0 - int((self.values != 0).sum()) / total if total and not self.values.is_meta else 0.0
        return (f"weight_shape={self.weight_shape}, L={self.values.shape[1]}, sparsity={sparsity:.3f}, "
                f"{self.geometry}, backend={self.backend!r}" + (", residual=True" if self.residual else "")
                + (", relu=True" if self.relu else "")
                + (", max_pool=True" if self.max_pool else ""))


def sparse_from_conv(conv: nn.Conv1d | nn.Conv2d, backend: str = "reference") -> SparseConv:
    """A :class:`SparseConv` computing the same function as ``conv`` (its effective weight, masks applied).

    Raises:
        SparseFormatError: (a ``ValueError``) for a module that is no ``nn.Conv1d``/``nn.Conv2d`` (``nn.Conv3d``,
            the transposed convs: a transposed weight read as a plain conv's computed another function), for a
            subclass with its own ``forward`` (its weight alone does not say what it computes), and for a geometry
            the format does not hold (:meth:`ConvGeometry.from_module`).
    """
    if not isinstance(conv, nn.Conv1d | nn.Conv2d):
        raise SparseFormatError(f"{type(conv).__name__} is not an nn.Conv1d or nn.Conv2d")
    if not _computes_as_torch_conv(conv):
        raise SparseFormatError(f"{type(conv).__name__} has its own forward")
    return SparseConv(UniformCSR.from_dense(conv.weight), conv.bias, ConvGeometry.from_module(conv), backend)


def _computes_as_torch_conv(conv: nn.Conv1d | nn.Conv2d) -> bool:
    """Whether ``conv`` computes as ``nn.Conv1d``/``nn.Conv2d`` do (its class may add attributes, but neither
    ``forward`` nor ``_conv_forward`` is its own, nor replaced on the instance): only then does a
    :class:`SparseConv` of its weight compute the same function."""
    base = nn.Conv1d if isinstance(conv, nn.Conv1d) else nn.Conv2d
    return (type(conv).forward is base.forward and type(conv)._conv_forward is base._conv_forward
            and not {"forward", "_conv_forward"} & vars(conv).keys())


def sparsify(model: nn.Module, backend: str = "reference", fuse_relu: bool = False,
             fuse_max_pool: bool = False, fold_batch_norm: bool = False) -> nn.Module:
    """Copy ``model`` with every ``nn.Conv1d``/``nn.Conv2d`` replaced by a :class:`SparseConv` (``model`` itself
    where it is one).

    Pruning parametrizations (masks) are folded into the weights of the copy first, so the copy's convs hold
    exactly the masked weights (every parametrization as it computes in eval mode, the mode of the copy: a
    ``spectral_norm`` runs no power iteration); other modules (Linear, BatchNorm, ...) are copied unchanged. A
    conv subclass with its own ``forward`` (weight standardisation, a fused BatchNorm, fake quantization), or a conv
    whose ``forward`` was replaced on the instance, stays as it is, with a logged reason: its weight alone does not
    say what it computes; so does a conv whose geometry the sparse format does not hold (a padding mode other than
    zeros, an asymmetric ``'same'`` padding, :meth:`ConvGeometry.from_module`), and so does any other convolution
    (``nn.Conv3d``, the transposed convs). A conv reachable under several names becomes one layer shared by all of
    them, as the conv was. The input model is not modified. The copy keeps ``model.unsparse_spec`` (registry name
    and kwargs) if present. ``fold_batch_norm`` folds each eval-mode BatchNorm after a layer into it
    (:func:`~unsparse.runtime.batch_norm_folding.fold_batch_norm_`) before the fusions: ``fuse_max_pool`` fuses
    each 2x2 max pool after a layer in an ``nn.Sequential`` (:func:`fuse_max_pool_`, past a ReLU, with which it
    commutes), then ``fuse_relu`` each ReLU after a layer, through the model's FX graph (:func:`fuse_relu`: ResNet's
    and GoogLeNet's too, once their BatchNorms are folded), so that a VGG layer ends with both.

    Returns:
        The sparse copy, in eval mode: with ``fuse_relu``, an ``fx.GraphModule`` of it where a ReLU fused
        (:func:`fuse_relu`; the layers keep their qualified names), else the copy itself.

    Raises:
        KeyError: an unknown backend name, listing the known ones.
        TypeError: ``fold_batch_norm`` not a bool (the whole-model benchmark's policy strings belong to
            :func:`~unsparse.runtime.end_to_end.bench_end_to_end`).
        ValueError: naming the layer, for a lazy conv not initialised yet (``nn.LazyConv2d`` before its first
            forward pass), or for a conv with hooks: ``torch.nn.utils.prune`` and the older
            ``torch.nn.utils.weight_norm`` recompute the weight in a forward pre-hook, so its ``weight`` attribute
            may be stale, and a sparse copy would lose any hook; remove them first (``prune.remove``,
            ``remove_weight_norm``).
    """
    from unsparse.runtime.backends import get_backend

    get_backend(backend)  # an unknown name fails here, not at the first forward
    if not isinstance(fold_batch_norm, bool):  # a policy string such as "off" would read as true
        raise TypeError(f"fold_batch_norm: expected True or False, got {fold_batch_norm!r}")
    for name, module in model.named_modules():
        if (isinstance(module, nn.Conv1d | nn.Conv2d) and isinstance(module, LazyModuleMixin)
                and module.has_uninitialized_params()):  # other lazy modules are copied as they are
            raise ValueError(f"{name or type(module).__name__}: {type(module).__name__} has no weight yet; run one "
                             "forward pass first, which gives it its shape")
        if isinstance(module, nn.Conv1d | nn.Conv2d) and (module._forward_pre_hooks or module._forward_hooks):
            raise ValueError(f"{name or type(module).__name__}: a conv with forward hooks (torch.nn.utils.prune or "
                             "weight_norm keep the weight in one) cannot be sparsified; remove them first "
                             "(torch.nn.utils.prune.remove(module, 'weight'), torch.nn.utils.remove_weight_norm)")
    with _eval_mode(model):  # the parametrizations as the eval-mode copy computes them (spectral_norm: no update)
        sparse_model = squashed_copy(model)
    if isinstance(sparse_model, _ConvNd):  # the model is one conv
        return _sparse_or_dense(sparse_model, type(sparse_model).__name__, backend).eval()
    replace_shared(sparse_model, _ConvNd, lambda name, conv: _sparse_or_dense(conv, name, backend))
    if fold_batch_norm:
        from unsparse.runtime.batch_norm_folding import fold_batch_norm_

        fold_batch_norm_(sparse_model)
    if fuse_max_pool:
        fuse_max_pool_(sparse_model)
    if fuse_relu:
        sparse_model, _ = _fuse_relu(sparse_model)
    return sparse_model.eval()


def fuse_relu(model: nn.Module) -> tuple[nn.Module, list[str]]:
    """Fuse each :class:`SparseConv` whose output a ReLU reads, and nothing else, with that ReLU, through ``model``'s
    FX graph (:func:`~unsparse.runtime.graph_fusion.fuse_following_relu`, each SparseConv one call): the layer's
    ``relu`` is set (mutated, shared with ``model``) and the ReLU's call leaves the graph, so that a backend that
    fuses it (``ConvBackend.fuses_relu``) saves the ReLU's pass over the output; shapes and the function are
    unchanged. The ReLU: an ``nn.ReLU`` module (VGG's, one in an ``nn.Sequential``; ResNet's one shared module,
    whose other calls stay), ``F.relu`` (GoogLeNet's ``BasicConv2d``), ``torch.relu`` or the tensor method, in
    place or not, after the layer or after ``nn.Identity`` modules in between (a BatchNorm folded by
    :func:`~unsparse.runtime.batch_norm_folding.fold_batch_norm_`; fold first). Left as they are: a layer called
    twice or reachable under several names (its other uses have no ReLU after them), a layer whose output is read
    elsewhere too (an in-place ReLU would change what that reads), a layer with ``relu`` already set, a layer,
    Identity or ReLU module with hooks (they would see other tensors), a subclass of ``nn.ReLU`` that the trace keeps
    as one call (one defined outside ``torch.nn`` is traced through, and the ``F.relu`` its forward calls fuses), and
    every layer of a model FX cannot trace (data-dependent control flow; the reason logged).

    A layer whose output a residual add reads instead (``relu(conv3(x) + identity)`` at the end of ResNet's blocks,
    :func:`~unsparse.runtime.graph_fusion.fuse_following_relu`'s ``fuse_residual``) is replaced by a copy with
    ``residual`` and ``relu`` set, which the graph calls with the add's other operand; the add and the ReLU leave the
    graph, so that a backend that fuses both (``ConvBackend.fuses_residual_relu``) saves the bias, add and ReLU
    passes. ``model``'s own layer stays as it was (``model`` calls it with one argument). 2-D layers only.

    A fused model saved as a sparse file reads back unfused (the architecture's ReLUs and adds rebuilt, the layers'
    ``relu`` and ``residual`` off), which computes the same.

    Returns:
        The fused model, an ``fx.GraphModule`` holding ``model``'s layers under their qualified names and its public
        attributes (``unsparse_spec``), and the qualified names of the layers fused, in module order; ``model``
        itself and ``[]`` where nothing fuses. Use the returned model: ``model`` itself would apply each fused ReLU
        twice (the layer's, then its own), which computes the same but pays the pass again.
    """
    def fuse(name: str, layer: nn.Module) -> nn.Module | None:
        if not isinstance(layer, SparseConv) or layer.relu:
            return None
        layer.relu = True
        return layer

    def fuse_residual(name: str, layer: nn.Module) -> nn.Module | None:
        if (not isinstance(layer, SparseConv) or layer.relu or layer.max_pool or layer.residual
                or layer.geometry.spatial_dims != 2):  # a 1-D layer's plan would see a 4-D input, a 3-D residual
            return None
        fused = copy.deepcopy(layer)
        fused.residual = fused.relu = True
        return fused

    return fuse_following_relu(model, LeafTracer((SparseConv,)), fuse, fuse_residual)


_fuse_relu = fuse_relu  # for sparsify, whose flag of that name hides the function


def fuse_max_pool_(model: nn.Module) -> list[str]:
    """Fuse each 2-D :class:`SparseConv` that an ``nn.MaxPool2d(2)`` follows in an ``nn.Sequential`` (kernel 2,
    stride 2, no padding, dilation 1, floor mode, no indices: VGG's pools) with that pool (mutates ``model``): the
    layer's ``max_pool`` is set and the pool's place in the Sequential holds an ``nn.Identity``, so that a backend that
    fuses it (``ConvBackend.fuses_max_pool``) saves the pool's pass and most of the output's writes; the output is
    ``(N, M, E // 2, F // 2)`` as the pool's was. "Follows": the next module in the Sequential that is neither an
    ``nn.Identity`` nor a plain ``nn.ReLU``: a ReLU and a max pool commute, so in a conv, ReLU, pool sequence the pool
    fuses whether or not the ReLU does (:func:`fuse_relu`, after it in :func:`sparsify`; a ReLU left as a module then
    runs on the pooled output). Left as they are: a layer reachable under several names (its other uses have no pool
    after them), a layer with ``max_pool`` already set, a layer, pool or module stepped over with hooks (they would
    see other tensors), a pool of other settings, and a subclass of ``nn.MaxPool2d``.

    Returns:
        The qualified names of the layers fused, in module order.
    """
    uses = name_counts(model)
    fused = []
    for name, sequence in list(model.named_modules()):
        if not isinstance(sequence, nn.Sequential):
            continue
        items = list(sequence._modules.items())
        for index, (conv_name, conv) in enumerate(items):
            if (not isinstance(conv, SparseConv) or conv.max_pool or uses[conv] != 1 or _has_hooks(conv)
                    or conv.geometry.spatial_dims != 2):
                continue
            after = next(((key, module) for key, module in items[index + 1:]
                          if type(module) not in (nn.Identity, nn.ReLU) or _has_hooks(module)), None)
            if after is not None and _is_pool_2x2(after[1]) and not _has_hooks(after[1]):
                conv.max_pool = True
                sequence._modules[after[0]] = nn.Identity()
                fused.append(f"{name}.{conv_name}" if name else conv_name)
    return fused


def _is_pool_2x2(module: nn.Module) -> bool:
    return (type(module) is nn.MaxPool2d and _pair(module.kernel_size) == _pair(module.stride) == (2, 2)
            and _pair(module.padding) == (0, 0) and _pair(module.dilation) == (1, 1) and not module.ceil_mode
            and not module.return_indices)


def replace_shared(model: nn.Module, kind: type | tuple[type, ...],
                   replace: Callable[[str, nn.Module], nn.Module]) -> None:
    """Put ``replace(name, module)`` in the place of every submodule of ``model`` that is a ``kind``, under every
    name it has (mutates ``model``). ``replace`` is called once per distinct module, with its first name in
    ``model.named_modules()`` order, so a module reachable under several names (``self.alias = self.conv``, or two
    parents holding it) becomes one replacement shared by all of them, as it was; ``named_children`` would skip its
    second name in one parent. ``model`` itself is not replaced."""
    first_names = {module: name for name, module in model.named_modules()}  # named_modules names each module once
    replaced: dict[nn.Module, nn.Module] = {}
    for parent in list(first_names):
        for child_name, child in list(parent._modules.items()):
            if isinstance(child, kind):
                if child not in replaced:
                    replaced[child] = replace(first_names[child], child)
                setattr(parent, child_name, replaced[child])


@contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """Every module of ``model`` with ``training`` off inside the block and as it was afterwards (the flags alone:
    a module's own ``train()`` is not called)."""
    modes = module_modes(model)
    for module, _ in modes:
        module.training = False
    try:
        yield
    finally:
        restore_modes(modes)


def _sparse_or_dense(conv: _ConvNd, name: str, backend: str) -> nn.Module:
    """``conv``'s :class:`SparseConv`, or ``conv`` itself with a logged reason (see :func:`sparsify`)."""
    try:
        return sparse_from_conv(conv, backend)
    except SparseFormatError as error:
        log.warning("%s: %s; left dense", name, error)
        return conv


def sparse_layers(model: nn.Module) -> dict[str, SparseConv]:
    """Every :class:`SparseConv` in ``model`` by qualified name, in module order."""
    return {name: module for name, module in model.named_modules() if isinstance(module, SparseConv)}


@contextmanager
def temporary_backend(model: nn.Module, backend: str, **params: Any) -> Iterator[nn.Module]:
    """Every :class:`SparseConv` of ``model`` on ``backend`` inside the ``with`` block; each layer's own backend and
    parameters are put back afterwards, also when the block raises."""
    saved = {layer: (layer.backend, layer.backend_params) for layer in sparse_layers(model).values()}
    set_backend(model, backend, **params)
    try:
        yield model
    finally:
        for layer, (name, layer_params) in saved.items():
            layer.backend, layer.backend_params = name, layer_params


def visit_layer_inputs(model: nn.Module, example: torch.Tensor, visit: Callable[..., None]) -> None:
    """Run ``model(example)`` once without autograd, every layer on its dense default (:func:`temporary_backend`:
    each layer's own setting is put back), calling ``visit(layer, x)`` with each :class:`SparseConv`'s 4-D input
    (:meth:`SparseConv.conv2d_input`) before the layer runs, and ``visit(layer, x, residual)`` for a layer fused with a
    residual add (:attr:`SparseConv.residual`). In train mode the forward updates BatchNorm statistics: pass a model
    in eval mode."""
    def before(layer: SparseConv, args: tuple[torch.Tensor, ...]) -> None:
        visit(layer, layer.conv2d_input(args[0]), *args[1:2])

    handles = [layer.register_forward_pre_hook(before) for layer in sparse_layers(model).values()]
    try:
        with temporary_backend(model, dense_fallback_backend(example.device)), torch.no_grad():
            model(example)
    finally:
        for handle in handles:
            handle.remove()


def set_backend(model: nn.Module, backend: str, **params: Any) -> nn.Module:
    """Point every :class:`SparseConv` of ``model`` at ``backend`` (in place); returns ``model``.

    Raises:
        KeyError: an unknown backend name, listing the known ones (nothing is changed then).
    """
    from unsparse.runtime.backends import get_backend

    get_backend(backend)
    for layer in sparse_layers(model).values():
        layer.backend, layer.backend_params = backend, dict(params)
    return model
