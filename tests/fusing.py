"""What the fusion tests share: a small float64 layer and a CPU backend that fuses the ReLU, the 2x2 max pool or
both (its subclass's ``fuses_relu`` / ``fuses_max_pool``), recording the arguments its ``conv`` receives."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from unsparse.runtime.backends.base import ConvBackend
from unsparse.sparse.format import UniformCSR
from unsparse.sparse.geometry import ConvGeometry


def layer(seed: int, out_channels: int = 7, channels: int = 3) -> tuple[torch.Tensor, UniformCSR, torch.Tensor]:
    """A float64 input (2, ``channels``, 9, 11) (with padding 1, an odd 9x11 output plane, whose last row and column
    a 2x2 pool drops), a 3x3 weight about half zeros with one all-zero and one fully dense row, and a bias; the sums
    are of both signs."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_channels, channels, 3, 3, generator=generator, dtype=torch.float64)
    weight *= torch.rand(weight.shape, generator=generator, dtype=torch.float64) < 0.5
    weight[0] = 0
    weight[1] = torch.randn(channels, 3, 3, generator=generator, dtype=torch.float64)
    x = torch.randn(2, channels, 9, 11, generator=generator, dtype=torch.float64)
    return x, UniformCSR.from_dense(weight), torch.randn(out_channels, generator=generator, dtype=torch.float64)


class RecordingFusing(ConvBackend):
    """``F.conv2d`` (stride and padding of the geometry), then the ReLU and the pool it is asked for; ``calls``
    holds each call's flags of the operations the subclass fuses (False where not asked) and other parameters."""

    device_types = frozenset({"cpu"})

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def conv(self, x: torch.Tensor, csr: UniformCSR, bias: torch.Tensor | None, geometry: ConvGeometry,
             relu: bool = False, max_pool: bool = False, **params: Any) -> torch.Tensor:
        flags = {"relu": relu} if self.fuses_relu else {}
        self.calls.append({**flags, **({"max_pool": max_pool} if self.fuses_max_pool else {}), **params})
        out = F.conv2d(x, csr.to_dense(), bias, geometry.stride, geometry.padding)
        out = out.clamp_min(0) if relu else out
        return F.max_pool2d(out, 2) if max_pool else out
