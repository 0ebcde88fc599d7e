"""Lowering baselines (Escoin §2.2, Fig. 2-3): im2col with ``F.unfold``, then one matrix product.

``im2col_cublas`` multiplies the dense ``(M, K)`` weight (zeros included) with the ``(K, N*E*F)`` lowered
input; ``im2col_cusparse`` multiplies the UniformCSR as a torch CSR matrix. On CUDA torch calls cuBLAS and
cuSPARSE; on the CPU it calls its CPU BLAS and sparse kernels (the names keep Escoin's terms).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from unsparse.runtime.backends.base import ConvBackend, WeightCache, register_backend
from unsparse.sparse.format import UniformCSR
from unsparse.sparse.geometry import ConvGeometry


def lower_input(x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry) -> tuple[torch.Tensor, int, int]:
    """im2col: ``(N, C, H, W)`` -> ``(K, N * E * F)`` with rows ordered like UniformCSR columns.

    Returns:
        The lowered matrix and the output size ``(E, F)``.
    """
    N, _, H, W = x.shape
    E, F_ = geometry.output_size(H, W, csr.kernel_size)
    columns = F.unfold(x, csr.kernel_size, geometry.dilation, geometry.padding, geometry.stride)  # (N, K, E*F)
    return columns.transpose(0, 1).reshape(csr.columns, N * E * F_), E, F_


class LoweringBackend(ConvBackend):
    """im2col followed by ``weight_matrix @ lowered``; subclasses choose the weight matrix."""

    device_types = frozenset({"cpu", "cuda"})

    def __init__(self) -> None:
        self._matrices = WeightCache()

    def weight_matrix(self, csr: UniformCSR, dtype: torch.dtype) -> torch.Tensor:
        """The ``(M, K)`` weight of ``dtype`` in this backend's layout, cached per weight and dtype (rebuilt after an
        in-place edit of the weight: :class:`~unsparse.runtime.backends.base.WeightCache`)."""
        return self._matrices.get(csr, dtype, lambda: self.build_matrix(csr.to(dtype=dtype)))

    def build_matrix(self, csr: UniformCSR) -> torch.Tensor:
        """Dense ``(M, K)`` weight; overridden for the sparse product."""
        return csr.to_dense().reshape(csr.out_channels, csr.columns)

    def product(self, matrix: torch.Tensor, lowered: torch.Tensor) -> torch.Tensor:
        """``matrix @ lowered``: ``(M, K)`` times ``(K, N*E*F)``."""
        return matrix @ lowered

    def conv(self, x: torch.Tensor, csr: UniformCSR, bias: torch.Tensor | None, geometry: ConvGeometry,
             **params: Any) -> torch.Tensor:
        N = x.shape[0]
        lowered, E, F_ = lower_input(x, csr, geometry)
        out = self.product(self.weight_matrix(csr, x.dtype), lowered)  # (M, N*E*F)
        if bias is not None:
            out = out + bias.to(out.dtype)[:, None]
        return out.reshape(csr.out_channels, N, E, F_).transpose(0, 1)


@register_backend
class Im2colCublasBackend(LoweringBackend):
    """im2col + dense GEMM (cuBLAS on CUDA)."""

    name = "im2col_cublas"
    sparse = False

    def unsupported_reason(self, x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry) -> str | None:
        if geometry.groups != 1:
            return f"groups={geometry.groups}: im2col lowering here handles groups=1 only"
        return super().unsupported_reason(x, csr, geometry)


@register_backend
class Im2colCusparseBackend(LoweringBackend):
    """im2col + CSR SpMM (cuSPARSE on CUDA) on the UniformCSR arrays themselves."""

    name = "im2col_cusparse"

    def unsupported_reason(self, x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry) -> str | None:
        if x.dtype in (torch.float16, torch.bfloat16) and x.device.type == "cpu":
            return f"torch has no CPU sparse CSR product for {x.dtype}"
        return super().unsupported_reason(x, csr, geometry)

    def build_matrix(self, csr: UniformCSR) -> torch.Tensor:
        return csr.to_torch_csr()

    def product(self, matrix: torch.Tensor, lowered: torch.Tensor) -> torch.Tensor:
        """The CSR product in the input's dtype. On the CPU it runs with autocast off: torch has no CPU sparse CSR
        product in bfloat16 or float16, the dtypes CPU autocast picks, so under CPU autocast this backend returns
        float32 for a float32 input (as the direct kernels do under CUDA autocast)."""
        if lowered.device.type == "cpu":
            with torch.autocast("cpu", enabled=False):
                return matrix @ lowered
        return matrix @ lowered
