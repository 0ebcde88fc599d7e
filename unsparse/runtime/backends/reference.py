"""The CPU reference backend: :func:`unsparse.sparse.reference.reference_sparse_conv` (Escoin Alg. 2)."""

from __future__ import annotations

from typing import Any

import torch

from unsparse.runtime.backends.base import ConvBackend, register_backend
from unsparse.sparse.format import UniformCSR
from unsparse.sparse.geometry import ConvGeometry
from unsparse.sparse.reference import reference_sparse_conv


@register_backend
class ReferenceBackend(ConvBackend):
    """Direct sparse convolution with torch gathers; correct on any device, fast on none."""

    name = "reference"
    device_types = frozenset({"cpu", "cuda"})
    graph_capturable = False  # torch.unique of the column offsets waits for the GPU

    def conv(self, x: torch.Tensor, csr: UniformCSR, bias: torch.Tensor | None, geometry: ConvGeometry,
             **params: Any) -> torch.Tensor:
        return reference_sparse_conv(x, csr, bias, geometry, **params)
