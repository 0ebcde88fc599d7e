"""The quantizer interface: applied to a sparsified model after pruning (paper 004 §4)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

import torch
from torch import nn


class Quantizer(ABC):
    """Quantizes a sparse model in place, after :func:`unsparse.runtime.sparsify`.

    A scheme rewrites each :class:`unsparse.runtime.SparseConv`'s ``values`` (and may insert activation
    quantizers); what the file needs to restore it exactly is left on the model (``unsparse_quantization``,
    ``unsparse_codecs``; see :mod:`unsparse.quant.state` and :mod:`unsparse.sparse.codecs`).
    """

    @abstractmethod
    def quantize(self, model: nn.Module,
                 calibration: Iterable[tuple[torch.Tensor, torch.Tensor]] | None = None) -> nn.Module:
        """Quantize ``model`` (mutated and returned).

        Args:
            model: a sparse model (``SparseConv`` layers, CPU).
            calibration: batches ``(images (N, C, H, W) float32, labels (N,) int64)`` for activation ranges.
        """
