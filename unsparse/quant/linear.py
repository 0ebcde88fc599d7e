"""``quant=linear``: signed linear fixed-point weights and activations (paper 004 §4, eq. 19-21)."""

from __future__ import annotations

import math
from typing import Any

import torch

from unsparse.quant.activations import ActivationSpec
from unsparse.quant.finite import check_finite_weights
from unsparse.quant.fixed_point import check_bits, fake_quantize, fixed_point_step
from unsparse.quant.histogram import check_bins, saturation_level
from unsparse.quant.layerwise import LayerwiseQuantizer
from unsparse.settings import check_flag, check_quantile
from unsparse.sparse.format import SparseFormatError

EMPTY_LAYER_STEP = 1.0
"""Step recorded for a layer without nonzero weights (every code is 0, so the step is never used)."""


class LinearQuantizer(LayerwiseQuantizer):
    """Each sparse convolution's weights on a signed ``bits``-bit grid, one step per layer (eq. 19-21).

    The weight saturation level is the ``weight_quantile`` histogram level of the layer's nonzero weight
    magnitudes (1.0: ``max |w|``, nothing saturates with eq. 20's step; eq. 21's power-of-two step tops out at
    ``q_max·Δ = 2^ceil(log2 max |w|) - Δ``, so weights above that, ``max |w|`` itself when it is a power of two,
    saturate to it, off by at most ``Δ``); zeros map to code 0, so they stay exactly zero.
    Stored as bit-packed codes plus the step (codec ``fixed_point``); with ``power_of_two`` every layer's step is
    an exact power of two (a file whose step is not is refused, :meth:`check_layer`).

    Args:
        bits: weight bits in ``[2, 16]``.
        weight_quantile: saturation quantile of ``|w|`` over the nonzero weights, in ``(0, 1]``.
        bins: histogram bins for that quantile, in ``[1, 65536]`` (:data:`~unsparse.quant.histogram.MAX_BINS`).
        power_of_two: power-of-two steps (eq. 21) instead of ``x_sat / q_max`` (eq. 20); a bool.
        activations: default signed 8-bit fixed point at the 0.99 quantile (the paper's setting).
        progress: tqdm bars during calibration.

    Raises:
        ValueError: bits out of range, bad quantile or bins, a non-bool ``power_of_two``, naming the argument.
    """

    scheme = "linear"
    default_activations = ActivationSpec(format="fixed", bits=8, quantile=0.99)

    def __init__(self, bits: int = 8, weight_quantile: float = 1.0, bins: int = 2048, power_of_two: bool = False,
                 activations: ActivationSpec | None = None, progress: bool = True) -> None:
        super().__init__(activations, progress)
        self.bits = check_bits(bits)
        self.weight_quantile = check_quantile(weight_quantile, "weight_quantile")
        self.bins, self.power_of_two = check_bins(bins), check_flag(power_of_two, "power_of_two")

    def quantize_values(self, values: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        """``Q(values)`` (eq. 19) with the layer's step (eq. 20 or 21); a layer without nonzero weights stays all zero.

        Args:
            values: weights of any shape and float dtype (a layer's UniformCSR values ``(M, L)``).

        Returns:
            ``(quantized float32 of the shape of values, {"step": Δ})``, ``Δ`` a float32 value in the weights' unit.

        Raises:
            ValueError: NaN or infinite weights, counted (:func:`~unsparse.quant.finite.check_finite_weights`).
        """
        check_finite_weights(values)
        if not bool(values.any()):
            step = EMPTY_LAYER_STEP
        else:
            step = fixed_point_step(saturation_level(values, self.weight_quantile, self.bins), self.bits,
                                    self.power_of_two)
        return fake_quantize(values, step, self.bits), {"step": step}

    def values_codec(self) -> dict[str, Any]:
        return {"name": "fixed_point", "bits": self.bits}

    def check_layer(self, name: str, values: torch.Tensor, codec: dict[str, Any]) -> None:
        """With ``power_of_two``, the layer's step must be exactly ``2^-fl`` (eq. 21, applied as a shift): the
        quantizer's own steps, :data:`EMPTY_LAYER_STEP` included, always are. (The codec has already held the step to
        a float32 value > 0; a mantissa of exactly 0.5 also refuses 0, negatives, infinities and NaN.)

        Raises:
            SparseFormatError: naming ``<name>.values`` and its step.
        """
        step = codec.get("step")
        if self.power_of_two and not (isinstance(step, int | float) and math.frexp(step)[0] == 0.5):
            raise SparseFormatError(f"{name}.values: step {step!r} is not a power of two, which "
                                    "quantization.weights.power_of_two requires (eq. 21)")

    def settings(self) -> dict[str, Any]:
        return {"bits": self.bits, "weight_quantile": self.weight_quantile, "power_of_two": self.power_of_two}

    @classmethod
    def from_settings(cls, weights: dict[str, Any]) -> LinearQuantizer:
        return cls(bits=weights["bits"], weight_quantile=weights["weight_quantile"],
                   power_of_two=weights["power_of_two"], progress=False)
