"""``sparse_conv2d`` / ``sparse_conv1d``: run a convolution whose weight is a UniformCSR on a named backend.

Layers a backend cannot run (``groups > 1``, a device it does not support, a dtype it lacks) fall back to the
dense convolution (cuDNN on CUDA, torch's CPU convolution otherwise) and the reason is logged once per
(backend, reason), never silently.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from unsparse.sparse.format import UniformCSR
from unsparse.sparse.geometry import ConvGeometry

log = logging.getLogger(__name__)
_LOGGED: set[tuple[str, str]] = set()


def dense_fallback_backend(device: torch.device) -> str:
    """Name of the dense backend used when a sparse backend declines a layer on ``device``."""
    return "cudnn" if device.type == "cuda" else "dense_cpu"


def sparse_conv(x: torch.Tensor, csr: UniformCSR, bias: torch.Tensor | None, geometry: ConvGeometry,
                backend: str = "reference", relu: bool = False, max_pool: bool = False,
                residual: torch.Tensor | None = None, **params: Any) -> torch.Tensor:
    """Convolution of an ``(N, C, H, W)`` input with a UniformCSR weight on ``backend``.

    Args:
        x: ``(N, C, H, W)`` float tensor, NCHW or channels-last (Conv1d inputs are passed as ``(N, C, 1, L)``).
        csr: weight ``(M, C/groups, R, S)`` in UniformCSR form, on ``x``'s device.
        bias: ``(M,)`` or None.
        geometry: stride/padding/dilation/groups.
        backend: a registered backend name (``unsparse.runtime.backends.backend_names()``).
        relu: apply ``torch.relu`` to the output (in the backend's epilogue where it fuses it).
        max_pool: then ``F.max_pool2d(out, 2)`` (likewise): the output is ``(N, M, E // 2, F // 2)``.
        residual: added to the convolution and its bias before the ReLU (a residual block's ``relu(conv(x) +
            identity)``; in the backend's call where it fuses it, :meth:`ConvBackend.run`), or None.
        params: tuning parameters for that backend (one entry of its tuning space).

    Returns:
        ``(N, M, E, F)`` in ``x``'s layout (``ConvBackend.run``), equal (within the dtype's rounding) to
        ``F.conv2d(x, csr.to_dense(), bias, ...)``, plus ``residual``, or to its ``torch.relu`` with ``relu``,
        max-pooled with ``max_pool``.

    Raises:
        KeyError: unknown backend name.
        ValueError: an input that is not a floating-point tensor (the backends cast the weight to the input's dtype,
            so an integer input cut the weights to integers and wrapped its sums around: ``F.conv2d`` refuses it too),
            input channels that do not match the weight; ``SparseFormatError`` (a ValueError) for ``groups`` that
            does not divide the weight's output channels (:meth:`ConvGeometry.check_channels`, before any backend: torch
            would raise a RuntimeError), or for a weight whose tensors were changed in place into an invalid one
            (:meth:`ConvBackend.run` re-checks it).
    """
    return prepare_sparse_conv(x, csr, bias, geometry, backend, relu, max_pool, residual, **params)(x, residual)


def prepare_sparse_conv(x: torch.Tensor, csr: UniformCSR, bias: torch.Tensor | None, geometry: ConvGeometry,
                        backend: str = "reference", relu: bool = False, max_pool: bool = False,
                        residual: torch.Tensor | None = None, **params: Any) -> Callable[..., torch.Tensor]:
    """:func:`sparse_conv` with its checks, the backend's choice (or its dense fallback) and the backend's own
    preparation (:meth:`~unsparse.runtime.backends.base.ConvBackend.prepare`) done once for ``x`` (and a residual
    like ``residual``): the returned call ``f(x2, residual2=None)`` equals ``sparse_conv(x2, csr, bias, geometry,
    backend, relu, max_pool, residual2, **params)`` for inputs ``x2`` of ``x``'s shape, dtype, device and layout
    (residuals like ``residual``) while ``csr`` and ``bias`` are unchanged and, for ``"auto"``, the plan too
    (:func:`~unsparse.runtime.plan.plan_generation`). It does not re-check the weight: what keeps it must prepare
    again when any of these change (``SparseConv.forward`` does).

    Raises:
        ValueError: as :func:`sparse_conv`.
    """
    from unsparse.runtime.backends import get_backend

    if not x.is_floating_point():
        raise ValueError(f"x: expected a floating-point tensor, got {x.dtype}")
    if x.dim() != 4:
        raise ValueError(f"x: expected (N, C, H, W), got shape {tuple(x.shape)}")
    if x.shape[1] != csr.in_channels_per_group * geometry.groups:
        raise ValueError(f"x: {x.shape[1]} channels, weight expects {csr.in_channels_per_group * geometry.groups}")
    geometry.check_channels(x.shape[1], csr.out_channels)
    chosen = get_backend(backend)
    reason = chosen.unsupported_reason(x, csr, geometry)
    if reason is not None:
        if (backend, reason) not in _LOGGED:
            _LOGGED.add((backend, reason))
            log.warning("backend %s falls back to dense convolution: %s", backend, reason)
        chosen, params = get_backend(dense_fallback_backend(x.device)), {}
    return chosen.prepare(x, csr, bias, geometry, relu=relu, max_pool=max_pool, residual=residual, **params)


def conv2d_input(x: torch.Tensor, spatial_dims: int) -> torch.Tensor:
    """The 4-D input the backends see for an input as ``nn.Conv1d``/``nn.Conv2d`` take it: ``(N, C, H, W)`` itself;
    ``(N, C, L)`` as ``(N, C, 1, L)``, contiguous (a 1-D input has no channels-last layout, so a transposed one is
    copied); an unbatched one, ``(C, *spatial)`` (which ``F.conv1d``/``F.conv2d`` accept too), with a batch of one
    first.

    Raises:
        ValueError: ``x`` has neither ``spatial_dims + 2`` nor ``spatial_dims + 1`` dimensions.
    """
    if x.dim() == spatial_dims + 1:
        x = x.unsqueeze(0)
    elif x.dim() != spatial_dims + 2:
        spatial = "H, W" if spatial_dims == 2 else "L"
        raise ValueError(f"x: expected (N, C, {spatial}) or unbatched (C, {spatial}), got shape {tuple(x.shape)}")
    return x.unsqueeze(2).contiguous() if spatial_dims == 1 else x


def sparse_conv_nd(x: torch.Tensor, csr: UniformCSR, bias: torch.Tensor | None, geometry: ConvGeometry,
                   backend: str = "reference", relu: bool = False, max_pool: bool = False,
                   residual: torch.Tensor | None = None, **params: Any) -> torch.Tensor:
    """:func:`sparse_conv` for an input as ``nn.Conv1d``/``nn.Conv2d`` take it (``geometry.spatial_dims`` says which):
    ``(N, C, H, W)`` -> ``(N, M, E, F)`` in the input's layout, ``(N, C, L)`` -> contiguous ``(N, M, L_out)``, and
    unbatched ``(C, ...)`` -> ``(M, ...)``, contiguous as torch returns it (:func:`conv2d_input`). ``max_pool``
    (2-D only) halves ``E`` and ``F``. A ``residual`` has the output's shape (or one that broadcasts to it).

    Raises:
        ValueError: ``max_pool`` for a 1-D convolution, or what :func:`sparse_conv` raises.
    """
    return prepare_sparse_conv_nd(x, csr, bias, geometry, backend, relu, max_pool, residual, **params)(x, residual)


def prepare_sparse_conv_nd(x: torch.Tensor, csr: UniformCSR, bias: torch.Tensor | None, geometry: ConvGeometry,
                           backend: str = "reference", relu: bool = False, max_pool: bool = False,
                           residual: torch.Tensor | None = None, **params: Any) -> Callable[..., torch.Tensor]:
    """:func:`sparse_conv_nd` prepared once for inputs like ``x``, as :func:`prepare_sparse_conv` is for
    :func:`sparse_conv` (the same conditions; an input of another number of dimensions is another input).

    Raises:
        ValueError: as :func:`sparse_conv_nd`.
    """
    if max_pool and geometry.spatial_dims != 2:
        raise ValueError("max_pool: a 2x2 max pool follows 2-D convolutions only")
    spatial_dims = geometry.spatial_dims
    unbatched = x.dim() == spatial_dims + 1
    if spatial_dims == 2 and x.dim() == 4:  # conv2d_input(x) is x, and the residual has the output's dimensions
        return prepare_sparse_conv(x, csr, bias, geometry, backend, relu, max_pool, residual, **params)
    adds = residual is not None  # then the add, the ReLU and the pool in this order, after the convolution
    conv = prepare_sparse_conv(conv2d_input(x, spatial_dims), csr, bias, geometry, backend,
                               relu=relu and not adds, max_pool=max_pool and not adds, **params)

    def call(x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        out = conv(conv2d_input(x, spatial_dims))
        if spatial_dims == 1:
            out = out.squeeze(2)
        out = out.squeeze(0).contiguous() if unbatched else out
        if adds:  # in the input's dimensions (no fusion makes such a layer: sparsify fuses residuals of 2-D ones)
            out = out + residual
            out = out.relu_() if relu else out
            out = F.max_pool2d(out, 2) if max_pool else out
        return out

    return call


def sparse_conv2d(x: torch.Tensor, csr: UniformCSR, bias: torch.Tensor | None = None,
                  stride: int | tuple[int, int] = 1, padding: str | int | tuple[int, int] = 0,
                  dilation: int | tuple[int, int] = 1, groups: int = 1, backend: str = "reference",
                  **params: Any) -> torch.Tensor:
    """Drop-in for ``torch.nn.functional.conv2d(x, csr.to_dense(), bias, stride, padding, dilation, groups)``.

    ``x`` is ``(N, C, H, W)``, or ``(C, H, W)`` unbatched; returns ``(N, M, E, F)`` (``(M, E, F)``). ``padding``
    takes ints, pairs or torch's ``'valid'``/``'same'`` (:meth:`ConvGeometry.of`, which raises for a string it
    cannot resolve). See :func:`sparse_conv` for backends and errors.
    """
    geometry = ConvGeometry.of(stride, padding, dilation, groups, 2, csr.kernel_size)
    return sparse_conv_nd(x, csr, bias, geometry, backend, **params)


def sparse_conv1d(x: torch.Tensor, csr: UniformCSR, bias: torch.Tensor | None = None, stride: int = 1,
                  padding: str | int = 0, dilation: int = 1, groups: int = 1, backend: str = "reference",
                  **params: Any) -> torch.Tensor:
    """Drop-in for ``torch.nn.functional.conv1d``: ``x`` ``(N, C, L)`` -> contiguous ``(N, M, L_out)``, or ``(C, L)``
    unbatched -> ``(M, L_out)`` (a 1-D input has no channels-last layout: a transposed one is copied to
    ``(N, C, L)`` first)."""
    geometry = ConvGeometry.of(stride, padding, dilation, groups, 1, csr.kernel_size[1:])
    return sparse_conv_nd(x, csr, bias, geometry, backend, **params)
