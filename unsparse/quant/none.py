"""``quant=none``: keep FP32 weights and activations."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from unsparse.quant.base import Quantizer


class NoQuantization(Quantizer):
    """The identity scheme: the model is returned unchanged (FP32, raw codec in the file)."""

    def quantize(self, model: nn.Module,
                 calibration: Iterable[tuple[torch.Tensor, torch.Tensor]] | None = None) -> nn.Module:
        return model
