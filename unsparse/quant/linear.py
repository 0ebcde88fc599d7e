"""``quant=linear``: signed linear fixed-point weights and activations (paper 004 §4, eq. 19-21)."""

from __future__ import annotations

from typing import Any

import torch

from unsparse.quant.activations import ActivationSpec
from unsparse.quant.fixed_point import check_bits, fake_quantize, fixed_point_step
from unsparse.quant.histogram import check_count, check_quantile, saturation_level
from unsparse.quant.layerwise import LayerwiseQuantizer

EMPTY_LAYER_STEP = 1.0
"""Step recorded for a layer without nonzero weights (every code is 0, so the step is never used)."""


class LinearQuantizer(LayerwiseQuantizer):
    """Each sparse convolution's weights on a signed ``bits``-bit grid, one step per layer (eq. 19-21).

    The weight saturation level is the ``weight_quantile`` histogram level of the layer's nonzero weight
    magnitudes (1.0: ``max |w|``, nothing saturates); zeros map to code 0, so they stay exactly zero.
    Stored as bit-packed codes plus the step (codec ``fixed_point``).

    Args:
        bits: weight bits in ``[2, 16]``.
        weight_quantile: saturation quantile of ``|w|`` over the nonzero weights, in ``(0, 1]``.
        bins: histogram bins for that quantile.
        power_of_two: power-of-two steps (eq. 21) instead of ``x_sat / q_max`` (eq. 20).
        activations: default signed 8-bit fixed point at the 0.99 quantile (the paper's setting).
        progress: tqdm bars during calibration.

    Raises:
        ValueError: bits out of range, bad quantile or bins.
    """

    scheme = "linear"
    default_activations = ActivationSpec(format="fixed", bits=8, quantile=0.99)

    def __init__(self, bits: int = 8, weight_quantile: float = 1.0, bins: int = 2048, power_of_two: bool = False,
                 activations: ActivationSpec | None = None, progress: bool = True) -> None:
        super().__init__(activations, progress)
        self.bits = check_bits(bits)
        self.weight_quantile = check_quantile(weight_quantile)
        self.bins, self.power_of_two = check_count(bins, "bins"), bool(power_of_two)

    def quantize_values(self, values: torch.Tensor, layer: str) -> tuple[torch.Tensor, dict[str, Any]]:
        """``Q(values)`` (eq. 19) with the layer's step; a layer without nonzero weights stays all zero."""
        nonzero = values[values != 0]
        if nonzero.numel() == 0:
            step = EMPTY_LAYER_STEP
        else:
            step = fixed_point_step(saturation_level(nonzero, self.weight_quantile, self.bins), self.bits,
                                    self.power_of_two)
        return fake_quantize(values, step, self.bits), {"name": "fixed_point", "bits": self.bits, "step": step}

    def settings(self) -> dict[str, Any]:
        return {"bits": self.bits, "weight_quantile": self.weight_quantile, "power_of_two": self.power_of_two}
