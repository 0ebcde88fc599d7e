"""The interface every convolution backend implements, and the registry that names them.

A backend computes ``torch.nn.functional.conv2d(x, csr.to_dense(), bias, ...)`` its own way. The
comparator (DESIGN.md, Runtime and comparator) asks each backend whether it supports a layer, which tuning
parameters it has, and times :meth:`ConvBackend.run` for each.
"""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from typing import Any, ClassVar, TypeVar

import torch
import torch.nn.functional as F

from unsparse.runtime.layout import in_layout, layout_of
from unsparse.sparse.format import UniformCSR
from unsparse.sparse.geometry import ConvGeometry

EPILOGUE_PARAMETER = "epilogue"
"""The parameter under which :meth:`ConvBackend.epilogue_space` names a way to run a fused ReLU: a setting a layer has
only while fused (:meth:`~unsparse.runtime.plan.PlanEntry.unfused` drops it)."""


class ConvBackend(ABC):
    """One way to run a sparse convolution.

    Class attributes:
        name: registry name (``"reference"``, ``"cudnn"``, ``"direct"``, ``"im2col_cublas"``, ...).
        device_types: torch device types it runs on (``{"cpu"}``, ``{"cuda"}`` or both).
        sparse: True if it exploits the weight's sparsity (dense backends run ``csr.to_dense()``).
        graph_capturable: False if a call synchronises with the GPU (e.g. ``torch.unique``), so that it cannot be
            recorded as a CUDA graph and is timed eagerly.
        fuses_relu: True if :meth:`conv` takes ``relu=True`` and applies a following ReLU as it stores its output;
            :meth:`run` applies it in a separate pass for the others.
        fuses_max_pool: True if :meth:`conv` takes ``max_pool=True`` and applies a following 2x2, stride-2 max pool
            (after the ReLU) as it stores its output; :meth:`run` applies it in a separate pass for the others.
        fuses_residual_relu: True if :meth:`conv_call` takes ``residual=True`` with ``relu=True`` and returns a call
            ``f(x, residual)`` that adds the residual (a tensor of the output's shape and dtype) to the convolution
            and its bias and applies the ReLU as it stores (a residual block's ``relu(conv3(x) + identity)``);
            :meth:`run` adds it, then applies the ReLU, in passes after the convolution for the others.
        dtypes: the only input dtypes it runs, or None where it refuses a dtype per layer if at all: what a run of
            one precision may offer it (:func:`~unsparse.runtime.bench.plan_backends`).

    Where a backend adds the bias is :meth:`adds_bias_in_epilogue`.
    """

    name: ClassVar[str]
    device_types: ClassVar[frozenset[str]]
    sparse: ClassVar[bool] = True
    graph_capturable: ClassVar[bool] = True
    fuses_relu: ClassVar[bool] = False
    fuses_max_pool: ClassVar[bool] = False
    fuses_residual_relu: ClassVar[bool] = False
    dtypes: ClassVar[frozenset[torch.dtype] | None] = None

    def unsupported_reason(self, x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry) -> str | None:
        """Why this backend cannot run the layer on this input, or None if it can."""
        if x.device.type not in self.device_types:
            return f"{self.name} runs on {sorted(self.device_types)}, input is on {x.device.type}"
        if self.dtypes is not None and x.dtype not in self.dtypes:
            return f"{self.name} runs {', '.join(sorted(map(str, self.dtypes)))} inputs only, not {x.dtype}"
        if geometry.groups != 1 and self.sparse:
            return f"groups={geometry.groups} is not supported by sparse backends"
        return None

    def adds_bias_in_epilogue(self, params: Mapping[str, Any]) -> bool:
        """Whether :meth:`conv` with setting ``params`` (one entry of :meth:`settings`) adds the bias as it
        stores its output, so that a bias costs no pass of its own: what decides where folding a BatchNorm into the
        convolution pays (:func:`~unsparse.runtime.batch_norm_folding.fold_batch_norm_into_epilogues_`), for a layer
        that does not fuse a ReLU (a BatchNorm between a conv and its ReLU keeps the ReLU from fusing). False here:
        cuDNN's convolution as PyTorch calls it (``F.conv2d``), and the lowering backends' GEMMs, add the bias in a
        pass after; only cuDNN's fused convolution, bias and ReLU call takes it in the same call."""
        return False

    def tuning_space(self, x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry) -> list[dict[str, Any]]:
        """Parameter settings worth timing for this layer and input; ``[{}]`` when there is nothing to tune."""
        return [{}]

    def screen_space(self, x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry) -> list[dict[str, Any]]:
        """The entries of :meth:`tuning_space` the comparator times first, before it decides whether the rest are
        worth their cost (:func:`~unsparse.runtime.comparator.compare_layer`, ``screen_ratio``): here the whole space,
        so nothing waits; a backend whose other settings are dear to build (``generated``'s kernels of several
        programs, minutes of NVRTC) names its cheap ones."""
        return self.tuning_space(x, csr, geometry)

    def estimate_ms(self, inputs: Sequence[torch.Tensor], csr: UniformCSR, geometry: ConvGeometry,
                    settings: list[dict[str, Any]], relu: bool = False, max_pool: bool = False,
                    graphs: bool = False) -> list[float | None]:
        """Per entry of ``settings`` (of :meth:`screen_space`), the time (ms) a call with that setting and epilogue
        (``relu``, ``max_pool``) is expected to take on the layer's input, estimated before its build, or None where
        this backend does not estimate it; the comparator builds only the settings whose estimate comes near the
        backends timed before (:func:`~unsparse.runtime.comparator.compare_layer`, ``screen_ratio``). ``inputs``:
        the layer's input ``x`` (``(N, C, H, W)``) first, then the copies the comparator's timings rotate through
        past the L2 (:func:`~unsparse.runtime.timing.rotated_inputs`; ``[x]`` alone times on one input); ``graphs``:
        estimate the GPU time of CUDA graph replays, as the comparator's ``timing="graph"`` times. Here None for
        every one: building costs little; ``generated``, whose kernels take seconds each to compile, times one
        program's kernel per setting."""
        return [None] * len(settings)

    def release(self, csr: UniformCSR) -> None:
        """Drop what this backend holds for weight ``csr`` only while its settings are timed, once the comparator
        has timed them all (:func:`~unsparse.runtime.comparator.compare_layer`): a chosen setting builds it again on
        its first call. Nothing here; ``generated`` drops its ``graph`` settings' captures (device memory)."""
        return

    def epilogue_space(self, relu: bool) -> list[dict[str, Any]]:
        """How a backend may run the epilogue of a layer fused with the ReLU after it (``relu``), as parameters
        crossed with :meth:`tuning_space` by :meth:`settings`; ``[{}]`` (one way) here."""
        return [{}]

    def settings(self, x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry, relu: bool = False,
                 tuning: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """Every setting the comparator times and a plan may name for this layer and input: each entry of
        ``tuning`` (default :meth:`tuning_space`; :meth:`screen_space` for those timed first) with each of
        :meth:`epilogue_space` (``relu``: the layer is fused with its ReLU)."""
        tuning = self.tuning_space(x, csr, geometry) if tuning is None else tuning
        return [{**params, **epilogue} for params in tuning for epilogue in self.epilogue_space(relu)]

    @abstractmethod
    def conv(self, x: torch.Tensor, csr: UniformCSR, bias: torch.Tensor | None, geometry: ConvGeometry,
             **params: Any) -> torch.Tensor:
        """Run the convolution.

        Args:
            x: ``(N, C, H, W)`` input on a supported device (Conv1d: ``(N, C, 1, L)``).
            csr: weight on ``x``'s device, validated.
            bias: ``(M,)`` or None.
            geometry: stride, padding, dilation, groups.
            params: one entry of :meth:`settings`.

        Returns:
            ``(N, M, E, F)`` output of ``x``'s dtype, in the layout the backend computes in.
        """

    def conv_call(self, x: torch.Tensor, csr: UniformCSR, bias: torch.Tensor | None, geometry: ConvGeometry,
                  **params: Any) -> Callable[[torch.Tensor], torch.Tensor]:
        """:meth:`conv` with everything but the input bound: a call ``f(x2)`` equal to ``self.conv(x2, csr, bias,
        geometry, **params)`` for inputs ``x2`` of ``x``'s shape, dtype, device and layout, while ``csr`` and
        ``bias`` are unchanged (what :meth:`prepare` builds on). Here it calls :meth:`conv`; a backend whose
        :meth:`conv` resolves per call what a fixed input decides once (a cached weight, the bias's dtype) returns a
        call that resolved it here."""
        return lambda x: self.conv(x, csr, bias, geometry, **params)

    def prepare(self, x: torch.Tensor, csr: UniformCSR, bias: torch.Tensor | None, geometry: ConvGeometry,
                relu: bool = False, max_pool: bool = False, residual: torch.Tensor | None = None,
                **params: Any) -> Callable[..., torch.Tensor]:
        """:meth:`run` resolved once for inputs like ``x`` (and a residual like ``residual``): the weight checked
        (:meth:`UniformCSR.revalidate`), the bias checked, the fused and unfused parts of the epilogue decided and
        :meth:`conv_call` bound. The returned call ``f(x2, residual2=None)`` equals ``self.run(x2, csr, bias,
        geometry, relu, max_pool, residual2, **params)`` for inputs ``x2`` of ``x``'s shape, dtype, device and layout
        (and residuals of ``residual``'s, given where ``residual`` was) while ``csr`` and ``bias`` are unchanged; it
        does not re-check the weight, so whoever keeps it must prepare again once the weight's
        :meth:`UniformCSR.versions` or the bias change (``SparseConv`` does:
        :meth:`~unsparse.runtime.modules.SparseConv.forward`).

        Raises:
            ValueError: as :meth:`run`.
        """
        csr.revalidate()
        check_bias(bias, csr)
        adds = residual is not None
        in_place = (isinstance(residual, torch.Tensor) and residual.dtype == x.dtype and residual.device == x.device
                    and tuple(residual.shape) == (x.shape[0], csr.out_channels,
                                                  *geometry.output_size(*x.shape[2:], csr.kernel_size)))
        fused_residual = in_place and relu and not max_pool and self.fuses_residual_relu
        fused_relu = relu and self.fuses_relu and (fused_residual or not adds)  # a ReLU after the add
        fused_pool = max_pool and self.fuses_max_pool and not adds
        conv = self.conv_call(x, csr, bias, geometry, **params, **({"relu": True} if fused_relu else {}),
                              **({"max_pool": True} if fused_pool else {}),
                              **({"residual": True} if fused_residual else {}))
        layout = layout_of(x)

        def call(x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
            if fused_residual:
                out = conv(x, residual)
            else:
                out = conv(x)
                if adds:  # as the model's add: in place where the shapes and dtypes allow it
                    out = out.add_(residual) if in_place else out + residual
            if relu and not fused_relu:
                out = out.relu_()
            if max_pool and not fused_pool:
                out = F.max_pool2d(out, 2)
            return out if layout_of(out) == layout else in_layout(out, layout)

        return call

    def run(self, x: torch.Tensor, csr: UniformCSR, bias: torch.Tensor | None, geometry: ConvGeometry,
            relu: bool = False, max_pool: bool = False, residual: torch.Tensor | None = None,
            **params: Any) -> torch.Tensor:
        """:meth:`conv` with the output in ``x``'s layout (:func:`~unsparse.runtime.layout.layout_of`), followed by
        a ReLU where ``relu`` (a layer fused with the ``nn.ReLU`` after it, :func:`~unsparse.runtime.modules.sparsify`
        with ``fuse_relu``): inside :meth:`conv` for a backend that :attr:`fuses_relu`, else in place on the output;
        then by ``nn.MaxPool2d(2)`` where ``max_pool`` (``fuse_max_pool``; the output ``(N, M, E // 2, F // 2)``):
        inside :meth:`conv` for a backend that :attr:`fuses_max_pool`, else ``F.max_pool2d`` on the output (a ReLU
        and a max pool commute, so either may be fused without the other). With ``residual`` (a layer fused with the
        residual add after it and the ReLU after that, :func:`~unsparse.runtime.modules.fuse_relu`) the residual is
        added to the output before the ReLU: in the convolution's own call for a backend that
        :attr:`fuses_residual_relu` (a residual of the output's shape and dtype, with ``relu``, without
        ``max_pool``), else in a pass after it (a broadcast or promoting add as the model's ``+``), the ReLU and the
        pool then in passes of their own. It is :meth:`prepare` called on ``x``.

        What models, the comparator and the timings call: a model fed a channels-last input stays in
        channels-last, and a backend that computes in NCHW pays its conversions inside the measured call. An
        output already in that layout is returned as the backend made it (the lowering backends' transposed
        ``(N, M, E, F)`` view of their GEMM result counts as NCHW and stays a view, as it was timed before layouts).

        Every call re-checks a weight whose tensors changed in place since it was last validated
        (:meth:`UniformCSR.revalidate`), so an index written out of range after construction never reaches a kernel.

        Raises:
            ValueError: a bias that is not ``(M,)`` (:func:`check_bias`), ``SparseFormatError`` for such a weight,
                or the backend's own errors.
        """
        return self.prepare(x, csr, bias, geometry, relu, max_pool, residual, **params)(x, residual)


T = TypeVar("T")


class WeightCache:
    """What a backend derives from a weight (a dense copy, a lowered matrix, kernel index arrays, a prepared
    launch), cached per UniformCSR object and key. The entries of a weight whose tensors changed in place since
    they were built (:meth:`UniformCSR.versions`) are dropped and rebuilt, so that an edited weight never runs with
    an older copy; they go with their UniformCSR object (weak keys)."""

    def __init__(self) -> None:
        self._entries: weakref.WeakKeyDictionary[UniformCSR, tuple[tuple[int, int], dict[Hashable, Any]]] = (
            weakref.WeakKeyDictionary())

    def get(self, csr: UniformCSR, key: Hashable, build: Callable[[], T]) -> T:
        """The entry ``key`` of ``csr``, built by ``build()`` if absent or stale."""
        versions = csr.versions()
        cached = self._entries.get(csr)
        if cached is None or cached[0] != versions:
            cached = (versions, {})
            self._entries[csr] = cached
        entries = cached[1]
        if key not in entries:
            entries[key] = build()
        return entries[key]

    def drop(self, csr: UniformCSR, which: Callable[[Hashable], bool]) -> None:
        """Drop the entries of ``csr`` whose key ``which`` selects (none cached: nothing happens)."""
        cached = self._entries.get(csr)
        if cached is not None:
            for key in [key for key in cached[1] if which(key)]:
                del cached[1][key]


def check_bias(bias: torch.Tensor | None, csr: UniformCSR) -> None:
    """Raise ``ValueError`` unless ``bias`` is None or a tensor of shape ``(M,)``: the kernels read ``bias[m]`` for
    every output channel ``m``, so a shorter bias would be read past its end on the GPU."""
    if bias is not None and tuple(bias.shape) != (csr.out_channels,):
        raise ValueError(f"bias: shape {tuple(bias.shape)}, the layer has {csr.out_channels} output channels")


def kernel_input_reason(kernels: str, x: torch.Tensor, csr: UniformCSR,
                        dtypes: Collection[torch.dtype]) -> str | None:
    """Why the CuPy kernels ``kernels`` (a name for the message) cannot take ``x`` and ``csr``: ``x``'s dtype is not
    among ``dtypes`` (their storage types), the weight's dtype differs from ``x``'s, or CuPy is not installed; None
    if they can."""
    if x.dtype not in dtypes:
        return f"{kernels} kernels exist for {', '.join(map(str, dtypes))}, not {x.dtype}"
    if csr.values.dtype != x.dtype:
        return f"weight dtype {csr.values.dtype} differs from input dtype {x.dtype}"
    try:
        import cupy  # noqa: F401
    except ImportError:
        return "CuPy is not installed"
    return None


_REGISTRY: dict[str, Callable[[], ConvBackend]] = {}
_INSTANCES: dict[str, ConvBackend] = {}


def register_backend(factory: type[ConvBackend]) -> type[ConvBackend]:
    """Class decorator: make a backend available under ``factory.name``."""
    _REGISTRY[factory.name] = factory
    return factory


def get_backend(name: str) -> ConvBackend:
    """The backend instance registered under ``name`` (created once).

    Raises:
        KeyError: with the list of known names, if ``name`` is not registered.
    """
    if name not in _REGISTRY:
        raise KeyError(f"unknown backend {name!r}; known: {sorted(_REGISTRY)}")
    if name not in _INSTANCES:
        _INSTANCES[name] = _REGISTRY[name]()
    return _INSTANCES[name]


def backend_names() -> list[str]:
    """All registered backend names, sorted."""
    return sorted(_REGISTRY)


def available_backends(device: torch.device | str) -> list[str]:
    """Registered backends that run on ``device``'s type (and whose dependencies import)."""
    device_type = torch.device(device).type
    return [name for name in backend_names() if device_type in _REGISTRY[name].device_types]
