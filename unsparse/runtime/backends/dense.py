"""Dense baselines: the weight decompressed once and run through ``torch.nn.functional.conv2d``.

On CUDA this is cuDNN (``torch.backends.cudnn.benchmark`` on, TF32 as the caller set it); on the CPU it is
torch's own CPU convolution, reported as ``dense_cpu`` so that no CPU figure is labelled cuDNN.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F

from unsparse.runtime.backends.base import ConvBackend, register_backend
from unsparse.sparse.format import UniformCSR
from unsparse.sparse.geometry import ConvGeometry


class DenseBackend(ConvBackend):
    """``F.conv2d`` on the decompressed weight; the decompression is cached per UniformCSR object."""

    sparse = False

    def __init__(self) -> None:
        self._dense: weakref.WeakKeyDictionary[UniformCSR, torch.Tensor] = weakref.WeakKeyDictionary()

    def dense_weight(self, csr: UniformCSR, dtype: torch.dtype) -> torch.Tensor:
        """``(M, C/groups, R, S)`` dense weight of ``dtype`` on ``csr``'s device (Conv1d weights get R = 1)."""
        weight = self._dense.get(csr)
        if weight is None or weight.dtype != dtype:
            weight = csr.to_conv2d_weight().to(dtype)
            self._dense[csr] = weight
        return weight

    def conv(self, x: torch.Tensor, csr: UniformCSR, bias: torch.Tensor | None, geometry: ConvGeometry,
             memory_format: str = "contiguous", **params: Any) -> torch.Tensor:
        """``F.conv2d`` on the cached dense weight; NCHW in and out.

        With ``memory_format="channels_last"`` the input is converted to NHWC, cuDNN runs in NHWC and the output
        is converted back to NCHW, so the measured time includes both conversions and a planned model keeps
        one layout between layers (a layer's channels-last output fed to NCHW neighbours and concatenations
        made whole models slower than their per-layer times promised).
        """
        weight = self.dense_weight(csr, x.dtype)
        channels_last = memory_format == "channels_last"
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
            weight = weight.contiguous(memory_format=torch.channels_last)
        if x.device.type == "cuda":
            torch.backends.cudnn.benchmark = True
        out = F.conv2d(x, weight, None if bias is None else bias.to(x.dtype), geometry.stride, geometry.padding,
                       geometry.dilation, geometry.groups)
        return out.contiguous() if channels_last else out


@register_backend
class CudnnBackend(DenseBackend):
    """cuDNN through ``F.conv2d`` (NCHW, or channels-last with ``memory_format="channels_last"``)."""

    name = "cudnn"
    device_types = frozenset({"cuda"})

    def tuning_space(self, x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry) -> list[dict[str, Any]]:
        return [{"memory_format": "contiguous"}, {"memory_format": "channels_last"}]


@register_backend
class DenseCpuBackend(DenseBackend):
    """torch's CPU convolution on the decompressed weight (the dense baseline on a machine without GPU)."""

    name = "dense_cpu"
    device_types = frozenset({"cpu"})
