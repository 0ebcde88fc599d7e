"""``quant=fp16``: weights and activations in half precision, the 16b/16b configuration of paper 004 Table 5."""

from __future__ import annotations

from typing import Any

import torch

from unsparse.quant.activations import ActivationSpec
from unsparse.quant.finite import check_finite_weights
from unsparse.quant.float16 import to_float16
from unsparse.quant.layerwise import LayerwiseQuantizer


class FP16Quantizer(LayerwiseQuantizer):
    """Round each sparse convolution's weights to float16 (stored as float16: 2 bytes per value) and, by
    default, its input activations too (fake quantization on the CPU; see :mod:`unsparse.quant.layerwise`).

    Weights below float16's subnormal range round to zero and leave the UniformCSR (the layer is re-packed).
    """

    scheme = "fp16"
    default_activations = ActivationSpec(format="fp16")

    def quantize_values(self, values: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        """``values`` rounded once to the nearest float16 (:func:`~unsparse.quant.float16.to_float16`, float64 too), as
        float32 (round to nearest even: ``|w| < 65520`` rounds to at most 65504, float16's largest value). Weights
        beyond that are refused rather than saturated, as activations are (:mod:`unsparse.quant.activations`): they
        are known when quantizing, and a weight clipped by orders of magnitude would change the model unseen.

        Args:
            values: weights of any shape and float dtype (a layer's UniformCSR values ``(M, L)``).

        Returns:
            ``(quantized float32 of the shape of values, {})``: FP16 has no per-layer codec params.

        Raises:
            ValueError: NaN or infinite weights, counted (:func:`~unsparse.quant.finite.check_finite_weights`);
                a finite weight that rounds beyond float16's range (``|w| >= 65520``).
        """
        check_finite_weights(values)
        quantized = to_float16(values).to(torch.float32)
        if not bool(torch.isfinite(quantized).all()):
            beyond = int(torch.isinf(quantized).sum())
            raise ValueError(f"weights exceed float16's range ({beyond} of {values.numel()} with |w| >= 65520, which "
                             "rounds to infinity)")
        return quantized, {}

    def values_codec(self) -> dict[str, Any]:
        return {"name": "float16"}

    def settings(self) -> dict[str, Any]:
        return {"format": "float16"}

    @classmethod
    def from_settings(cls, weights: dict[str, Any]) -> FP16Quantizer:
        return cls(progress=False)
