"""Dense baselines: the weight decompressed once and run through ``torch.nn.functional.conv2d``.

On CUDA this is cuDNN (``torch.backends.cudnn.benchmark`` on, TF32 as the caller set it); on the CPU it is
torch's own CPU convolution, reported as ``dense_cpu`` so that no CPU figure is labelled cuDNN.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from unsparse.runtime.backends.base import EPILOGUE_PARAMETER, ConvBackend, WeightCache, register_backend
from unsparse.runtime.layout import in_layout, layout_of
from unsparse.sparse.format import UniformCSR
from unsparse.sparse.geometry import ConvGeometry

log = logging.getLogger(__name__)

MEMORY_FORMATS = {"contiguous": "nchw", "channels_last": "nhwc"}
"""The ``memory_format`` tuning parameter (torch's names) -> layout name (:mod:`unsparse.runtime.layout`)."""
EPILOGUES = ("fused", "passes")
"""The ``epilogue`` parameter of a layer fused with its ReLU: cuDNN's fused call (the default, also where the
parameter is left out), or its convolution alone with the bias, residual add and ReLU as passes after it."""


def cudnn_fused_call(owner: str, refusals: set[str], fused: str, function: Callable[..., torch.Tensor],
                     *arguments: Any) -> torch.Tensor | None:
    """``function(*arguments)``, one of cuDNN's fused calls (``torch.cudnn_convolution_relu``,
    ``torch.cudnn_convolution_add_relu``) that fuses the convolution and its bias with ``fused`` (``"ReLU"``,
    ``"residual, ReLU"``), or None where cuDNN refuses it (its runtime fusion covers fewer problems than its
    convolutions: no engine for a dtype or size), logged once per message under ``owner``'s name (the messages logged
    so far are ``refusals``, which this adds to); the caller then runs the convolution and those passes, the same
    function. Shared by the ``cudnn`` backend and the dense baseline's
    :class:`~unsparse.runtime.dense_fusion.ConvBiasReLU`."""
    try:
        return function(*arguments)
    except RuntimeError as error:
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        if message not in refusals:
            refusals.add(message)
            log.warning("%s: cuDNN's fused convolution, bias and %s refused (%s); the convolution, then the %s in "
                        "passes", owner, fused, message, fused)
        return None


class DenseBackend(ConvBackend):
    """``F.conv2d`` on the decompressed weight; the decompression is cached per weight, dtype and layout."""

    sparse = False

    def __init__(self) -> None:
        self._dense = WeightCache()
        self._refusals: set[str] = set()

    def dense_weight(self, csr: UniformCSR, dtype: torch.dtype, layout: str = "nchw") -> torch.Tensor:
        """``(M, C/groups, R, S)`` dense weight of ``dtype`` stored in ``layout`` on ``csr``'s device (Conv1d
        weights get R = 1), decompressed once per (weight, dtype, layout) and again after an in-place edit of the
        weight (:class:`~unsparse.runtime.backends.base.WeightCache`)."""
        return self._dense.get(csr, (dtype, layout), lambda: in_layout(csr.to_conv2d_weight().to(dtype), layout))

    def conv(self, x: torch.Tensor, csr: UniformCSR, bias: torch.Tensor | None, geometry: ConvGeometry,
             memory_format: str | None = None, relu: bool = False, **params: Any) -> torch.Tensor:
        """``F.conv2d`` on the cached dense weight, computed in ``memory_format``; with ``relu`` (passed only to a
        backend that :attr:`fuses_relu`, :class:`CudnnBackend`) the convolution, its bias and the ReLU that follows
        the layer in one cuDNN call, ``torch.cudnn_convolution_relu`` (cuDNN's runtime fusion), which saves the bias
        and ReLU passes of ``F.conv2d`` then ``relu``: 6.4 of the 14.8 ms of VGG16's dense FP16 channels-last forward
        at batch 128 on the H200 (``kernels/NOTES.md``, forty-first session). It is :meth:`conv_call` called on ``x``.

        Args:
            memory_format: ``"contiguous"`` (NCHW) or ``"channels_last"`` (NHWC): input and weight are converted
                to it (no copy where the input already is) and the output is left in it; None: ``x``'s layout.
                :meth:`~unsparse.runtime.backends.base.ConvBackend.run` converts the output back to ``x``'s
                layout, so a setting that differs from the model's layout is timed with both conversions.

        Raises:
            ValueError: for another ``memory_format``; ``SparseFormatError`` (a ValueError) for an input smaller
                than the dilated kernel (:meth:`ConvGeometry.output_size`, asked only once torch has refused it, so
                that no call pays for the check), as the sparse backends raise it.
        """
        return self.conv_call(x, csr, bias, geometry, memory_format, relu, **params)(x)

    def conv_call(self, x: torch.Tensor, csr: UniformCSR, bias: torch.Tensor | None, geometry: ConvGeometry,
                  memory_format: str | None = None, relu: bool = False, residual: bool = False,
                  epilogue: str = "fused", **params: Any) -> Callable[..., torch.Tensor]:
        """:meth:`conv` for inputs like ``x`` with the layout, the dense weight and the bias (cast to ``x``'s dtype)
        resolved once (:meth:`~unsparse.runtime.backends.base.ConvBackend.conv_call`); raises as :meth:`conv`.

        With ``residual`` (and ``relu``; passed only to a backend that
        :attr:`~unsparse.runtime.backends.base.ConvBackend.fuses_residual_relu`, :class:`CudnnBackend`) the call is
        ``f(x, residual)``: ``relu(conv2d(x, weight) + bias + residual)`` in one cuDNN call,
        ``torch.cudnn_convolution_add_relu`` (the residual, ``(N, M, E, F)`` of ``x``'s dtype, converted to the
        computing layout first), which saves a residual block's bias, add and ReLU passes; where cuDNN refuses it, the
        convolution, then the add and the ReLU in place, logged once per message.

        ``epilogue="passes"`` (:data:`EPILOGUES`) runs that fallback by choice: ``F.conv2d`` (convolution, then
        PyTorch's bias pass), then the add and the ReLU in place. cuDNN's fused engines are not always its fastest
        convolutions: on ResNet-50's two stride-2 3x3 layers at batch 128 in FP32 on the H200 the fused call took 1.11
        and 1.03 ms (a plan of the forty-sixth session), the convolution alone 0.91 and 0.90 ms (the forty-seventh's
        per-layer run; ``kernels/NOTES.md``), so the comparator times both (:meth:`epilogue_space`).

        Raises:
            ValueError: for an unknown ``memory_format`` or ``epilogue``.
        """
        layout = layout_of(x) if memory_format is None else MEMORY_FORMATS.get(memory_format)
        if layout is None:
            raise ValueError(f"memory_format: unknown {memory_format!r}, expected one of {sorted(MEMORY_FORMATS)}")
        if epilogue not in EPILOGUES:
            raise ValueError(f"epilogue: unknown {epilogue!r}, expected one of {EPILOGUES}")
        fuses = epilogue == "fused"
        arguments = (self.dense_weight(csr, x.dtype, layout), None if bias is None else bias.to(x.dtype),
                     geometry.stride, geometry.padding, geometry.dilation, geometry.groups)
        cuda = x.device.type == "cuda"
        if residual:
            def call_with_residual(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
                torch.backends.cudnn.benchmark = True
                x, residual = in_layout(x, layout), in_layout(residual, layout)
                fused = cudnn_fused_call(self.name, self._refusals, "residual, ReLU", torch.cudnn_convolution_add_relu,
                                         x, arguments[0], residual, 1.0, *arguments[1:]) if fuses else None
                return F.conv2d(x, *arguments).add_(residual).relu_() if fused is None else fused

            return call_with_residual

        def call(x: torch.Tensor) -> torch.Tensor:
            if cuda:
                torch.backends.cudnn.benchmark = True
            x = in_layout(x, layout)
            try:
                if relu and fuses:
                    fused = cudnn_fused_call(self.name, self._refusals, "ReLU", torch.cudnn_convolution_relu, x,
                                             *arguments)
                    if fused is not None:
                        return fused
                out = F.conv2d(x, *arguments)
                return out.relu_() if relu else out
            except RuntimeError:
                geometry.output_size(*x.shape[2:], csr.kernel_size)  # an input smaller than the kernel: as the others
                raise

        return call

    def tuning_space(self, x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry) -> list[dict[str, Any]]:
        """Both memory formats: either may be the faster one, and a plan may only name settings offered here."""
        return [{"memory_format": "contiguous"}, {"memory_format": "channels_last"}]

    def epilogue_space(self, relu: bool) -> list[dict[str, Any]]:
        """For a layer fused with its ReLU on a backend that :attr:`fuses_relu` (:class:`CudnnBackend`): cuDNN's
        fused call (the default, no parameter) and ``{"epilogue": "passes"}``, either of which may be the faster
        (:meth:`conv_call`); one way otherwise."""
        return [{}, {EPILOGUE_PARAMETER: "passes"}] if relu and self.fuses_relu else [{}]


@register_backend
class CudnnBackend(DenseBackend):
    """cuDNN through ``F.conv2d``, in NCHW (``memory_format="contiguous"``) or NHWC (``"channels_last"``); a layer
    fused with its ReLU runs convolution, bias and ReLU in one cuDNN call (:meth:`DenseBackend.conv`), one fused with
    a residual add and the ReLU after it convolution, bias, add and ReLU (:meth:`DenseBackend.conv_call`)."""

    name = "cudnn"
    device_types = frozenset({"cuda"})
    fuses_relu = True
    fuses_residual_relu = True


@register_backend
class DenseCpuBackend(DenseBackend):
    """torch's CPU convolution on the decompressed weight (the dense baseline on a machine without GPU)."""

    name = "dense_cpu"
    device_types = frozenset({"cpu"})
