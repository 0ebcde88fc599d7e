"""The shared shape of the quantization schemes: every sparse convolution's weights and inputs, layer by layer.

A scheme (FP16, linear fixed point, k-means codebook) only says how one layer's UniformCSR ``values`` are
quantized and which codec stores them; this base class walks the SparseConv layers, re-packs each weight,
calibrates and attaches the activation quantizers (:mod:`unsparse.quant.activations`) and leaves the
description that :func:`unsparse.quant.state.restore_quantization` uses to rebuild the structure on load.

Scope: the SparseConv layers (the weights the sparse runtime executes) and their input activations.
BatchNorm, biases and Linear layers (the small classifier) stay float32 in every scheme.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from unsparse.quant.activations import ActivationSpec, attach_activation_quantizers, calibrate
from unsparse.quant.base import Quantizer
from unsparse.quant.state import describe_quantization, register_restorer
from unsparse.runtime.modules import sparse_layers
from unsparse.sparse.format import SparseFormatError, UniformCSR


def restore_layerwise(model: nn.Module, description: dict[str, Any]) -> None:
    """Restorer of every layer-wise scheme: re-attach the described activation quantizers (meta model).

    Raises:
        SparseFormatError: a malformed ``activations`` entry.
    """
    try:
        spec = ActivationSpec.from_dict(description.get("activations"))
    except (TypeError, ValueError) as error:
        raise SparseFormatError(f"quantization.activations: {error}") from error
    attach_activation_quantizers(model, spec)


class LayerwiseQuantizer(Quantizer):
    """Quantize each SparseConv's ``values`` with :meth:`quantize_values`, then its input activations.

    Subclasses set ``scheme`` (registered as a file restorer), ``default_activations`` and implement
    :meth:`quantize_values` and :meth:`settings`.

    Args:
        activations: the activation quantization (default: the scheme's ``default_activations``).
        progress: tqdm bars during calibration.
    """

    scheme: ClassVar[str]
    default_activations: ClassVar[ActivationSpec]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        register_restorer(cls.scheme)(restore_layerwise)

    def __init__(self, activations: ActivationSpec | None = None, progress: bool = True) -> None:
        self.activations = activations or self.default_activations
        self.progress = progress

    @abstractmethod
    def quantize_values(self, values: torch.Tensor, layer: str) -> tuple[torch.Tensor, dict[str, Any]]:
        """Quantize one layer's weights.

        Args:
            values: UniformCSR values ``(M, L)`` float32 on the CPU: each row's stored weights first, then
                exact-zero padding.
            layer: the layer's name, for error messages.

        Returns:
            ``(quantized (M, L) float32, codec spec)``; zeros must stay exactly zero and the codec must
            store the quantized tensor exactly (:mod:`unsparse.quant.codecs`).
        """

    @abstractmethod
    def settings(self) -> dict[str, Any]:
        """The weight settings (JSON-ready) recorded in the model's quantization description."""

    def quantize(self, model: nn.Module,
                 calibration: Iterable[tuple[torch.Tensor, torch.Tensor]] | None = None) -> nn.Module:
        """Quantize a float32 sparse model in place (see the module docstring); returns it.

        Activation saturation levels are calibrated on the float32 model first; each weight is re-packed
        with :meth:`UniformCSR.from_dense` (stored weights first, padding last: the layout
        :func:`unsparse.sparsify` produces, so a no-op on its output). Every layer is quantized before any is
        changed, so an error leaves the model as it was.

        Raises:
            ValueError: no SparseConv layer, a model already quantized, weights not float32, no calibration
                data for fixed-point activations, or a scheme's own errors (bits out of range, ...).
        """
        layers = sparse_layers(model)
        if not layers:
            raise ValueError("model: no SparseConv layer; call unsparse.sparsify(model) first")
        if describe_quantization(model) is not None:
            raise ValueError(f"model: already quantized ({describe_quantization(model)['scheme']})")
        for name, layer in layers.items():
            if layer.values.dtype != torch.float32:
                raise ValueError(f"{name}.values: quantization expects float32 weights, got {layer.values.dtype}")
        levels = calibrate(model, calibration, self.activations, self.progress) \
            if self.activations.format == "fixed" else {}
        packed = {name: UniformCSR.from_dense(layer.csr.to_dense().cpu()) for name, layer in layers.items()}
        quantized = {name: self.quantize_values(csr.values, name) for name, csr in packed.items()}
        for name, layer in layers.items():
            (values, codec), device = quantized[name], layer.values.device
            layer.set_csr(UniformCSR(values.to(device), packed[name].col_idx.to(device), layer.weight_shape))
            layer.unsparse_codecs = {**getattr(layer, "unsparse_codecs", {}), "values": codec}
        quantizers = attach_activation_quantizers(model, self.activations)
        for name, level in levels.items():
            quantizers[name].saturation.fill_(level)
        model.unsparse_quantization = {"scheme": self.scheme, "weights": self.settings(),
                                       "activations": self.activations.to_dict()}
        return model
