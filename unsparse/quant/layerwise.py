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

from unsparse.messages import quote
from unsparse.quant.activations import ActivationSpec, attach_activation_quantizers, calibrate
from unsparse.quant.base import Quantizer
from unsparse.quant.finite import check_finite_weights
from unsparse.quant.state import describe_quantization, register_scheme
from unsparse.runtime.modules import SparseConv, sparse_layers
from unsparse.sparse.format import SparseFormatError, UniformCSR


class LayerwiseQuantizer(Quantizer):
    """Quantize each SparseConv's ``values`` with :meth:`quantize_values`, then its input activations.

    Subclasses set ``scheme`` (registered with the file loader, :func:`unsparse.quant.state.register_scheme`) and
    ``default_activations``, and implement :meth:`quantize_values`, :meth:`values_codec`, :meth:`settings` and
    :meth:`from_settings`; a scheme whose settings bound a layer beyond its codec spec overrides :meth:`check_layer`.

    Args:
        activations: the activation quantization (None: the scheme's ``default_activations``).
        progress: tqdm bars during calibration.

    Raises:
        ValueError: ``activations`` neither None nor an :class:`ActivationSpec`.
    """

    scheme: ClassVar[str]
    default_activations: ClassVar[ActivationSpec]
    optional_settings: ClassVar[tuple[frozenset[str], ...]] = ()
    """Groups of settings that descriptions written before the scheme recorded them lack, each group all together,
    in the order the scheme began to record them (e.g. k-means' ``KMeans`` arguments, then its ``sklearn_version``):
    a description that holds none of a group is read as not recording it (:meth:`from_settings` uses its defaults);
    one that holds some of a group but not all, or a group without an earlier one, is refused."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        register_scheme(cls.scheme, cls.restore, cls.described_values_codec, cls.check_described_layer)

    def __init__(self, activations: ActivationSpec | None = None, progress: bool = True) -> None:
        if activations is not None and not isinstance(activations, ActivationSpec):
            raise ValueError(f"activations: expected an ActivationSpec, or None for the scheme's default, got "
                             f"{activations!r}")
        self.activations = self.default_activations if activations is None else activations
        self.progress = progress

    @abstractmethod
    def quantize_values(self, values: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        """Quantize one layer's weights.

        Args:
            values: UniformCSR values ``(M, L)`` float32 on the CPU: each row's stored weights first, then
                exact-zero padding.

        Returns:
            ``(quantized (M, L) float32, the layer's own codec params)``: zeros stay exactly zero, and the codec
            ``{**values_codec(), **params}`` stores the quantized tensor exactly (:mod:`unsparse.quant.codecs`).

        Raises:
            ValueError: NaN or infinite weights, counted (:func:`~unsparse.quant.finite.check_finite_weights`,
                checked first by every scheme), or other weights the scheme cannot quantize (the caller adds the
                layer's name).
        """

    @abstractmethod
    def values_codec(self) -> dict[str, Any]:
        """The codec spec every layer's ``values`` take, less each layer's own params (e.g. its ``step``)."""

    def check_layer(self, name: str, values: torch.Tensor, codec: dict[str, Any]) -> None:
        """What :meth:`values_codec` cannot say: one layer's ``values`` (as decoded) and its codec's own params
        against this quantizer's settings; every layer this quantizer writes passes. Nothing to check here.

        Raises:
            SparseFormatError: naming ``<name>.values`` (or one of its stored parts) and the field.
        """

    @abstractmethod
    def settings(self) -> dict[str, Any]:
        """The weight settings (JSON-ready) recorded in the model's quantization description."""

    @classmethod
    @abstractmethod
    def from_settings(cls, weights: dict[str, Any]) -> LayerwiseQuantizer:
        """The quantizer with the weight settings ``weights`` (as :meth:`settings` writes them).

        Raises:
            KeyError: a setting missing (its key).
            ValueError: a setting out of range, naming it.
        """

    @classmethod
    def described(cls, description: dict[str, Any]) -> LayerwiseQuantizer:
        """The quantizer that a file's quantization description records: its ``weights`` must hold exactly the
        scheme's :meth:`settings`, each valid and of the type the scheme writes (e.g. ``index_bits`` the one that
        ``clusters`` gives), less each group of :attr:`optional_settings` of which it holds none (a file written
        before the group was recorded).

        Raises:
            SparseFormatError: naming ``quantization`` (keys other than ``scheme``, ``weights`` and
                ``activations``), ``quantization.weights`` or ``quantization.weights.<setting>``.
        """
        unexpected = sorted(set(description) - {"scheme", "weights", "activations"})
        if unexpected:
            raise SparseFormatError(f"quantization: unexpected {quote(unexpected)}, expected scheme, weights and "
                                    "activations")
        weights = description.get("weights")
        if not isinstance(weights, dict):
            raise SparseFormatError(f"quantization.weights: expected an object, got {quote(weights)}")
        try:
            quantizer = cls.from_settings(weights)
        except KeyError as error:
            raise SparseFormatError(f"quantization.weights.{error.args[0]}: missing") from error
        except ValueError as error:
            raise SparseFormatError(f"quantization.weights.{error}") from error
        settings = quantizer.settings()
        unrecorded: set[str] = set()
        for group in cls.optional_settings:  # recorded in this order: a later group only beside the earlier ones
            if not group & set(weights):
                unrecorded |= group
            elif unrecorded:
                raise SparseFormatError(f"quantization.weights.{min(unrecorded)}: missing beside {sorted(group)}, "
                                        "which no version recorded without it")
        settings = {key: value for key, value in settings.items() if key not in unrecorded}
        unexpected = sorted(set(weights) - set(settings))
        if unexpected:
            raise SparseFormatError(f"quantization.weights: unexpected {quote(unexpected)}, expected "
                                    f"{sorted(settings)}")
        missing = sorted(set(settings) - set(weights))  # not read by from_settings (index_bits), or optional ones
        if missing:
            raise SparseFormatError(f"quantization.weights.{missing[0]}: missing")
        for key, value in settings.items():
            if type(weights[key]) is not type(value) or weights[key] != value:
                raise SparseFormatError(f"quantization.weights.{key}: recorded {quote(weights[key])}, the scheme's "
                                        f"settings give {value!r}")
        return quantizer

    @classmethod
    def described_values_codec(cls, description: dict[str, Any]) -> dict[str, Any]:
        """The :meth:`values_codec` of the :meth:`described` quantizer. Raises ``SparseFormatError`` as it."""
        return cls.described(description).values_codec()

    @classmethod
    def check_described_layer(cls, description: dict[str, Any], name: str, values: torch.Tensor,
                              codec: dict[str, Any]) -> None:
        """The :meth:`check_layer` of the :meth:`described` quantizer (the scheme's
        :data:`~unsparse.quant.state.LayerCheck`). Raises ``SparseFormatError`` as they do."""
        cls.described(description).check_layer(name, values, codec)

    @classmethod
    def restore(cls, model: nn.Module, description: dict[str, Any]) -> None:
        """The scheme's file restorer: check the described weight settings and re-attach the described activation
        quantizers (``model`` on the ``meta`` device).

        Raises:
            SparseFormatError: a malformed ``weights`` or ``activations`` entry, naming the field.
        """
        cls.described(description)
        try:
            spec = ActivationSpec.from_dict(description.get("activations"))
        except (TypeError, ValueError) as error:
            raise SparseFormatError(f"quantization.activations: {error}") from error
        attach_activation_quantizers(model, spec)

    def quantize_layer(self, name: str, layer: SparseConv) -> tuple[UniformCSR, dict[str, Any]]:
        """One layer's quantized weight, on the CPU, and its ``values`` codec spec.

        The weight is re-packed with :meth:`UniformCSR.from_dense` before (stored weights first, padding last,
        no column twice: the layout :func:`unsparse.sparsify` produces) and after quantization, so that weights
        that quantize to zero leave the stored entries and ``L`` is again the largest nnz of any row.

        Raises:
            ValueError: the scheme's own errors, prefixed with ``<name>.values``. Errors of other kinds (e.g. torch's
                ``RuntimeError`` when memory runs out) keep their type and message and gain the note
                ``while quantizing layer <name>.values``, which the traceback shows.
        """
        packed = UniformCSR.from_dense(layer.csr.to_dense().cpu())
        try:
            values, params = self.quantize_values(packed.values)
        except ValueError as error:
            raise ValueError(f"{name}.values: {error}") from error
        except Exception as error:
            error.add_note(f"while quantizing layer {name}.values")
            raise
        quantized = UniformCSR(values, packed.col_idx, packed.weight_shape)
        return UniformCSR.from_dense(quantized.to_dense()), {**self.values_codec(), **params}

    def quantize(self, model: nn.Module,
                 calibration: Iterable[tuple[torch.Tensor, torch.Tensor]] | None = None) -> nn.Module:
        """Quantize a float32 sparse model in place (see the module docstring); returns it.

        Activation saturation levels are calibrated on the float32 model first; each weight is quantized and
        re-packed by :meth:`quantize_layer`. Every layer is quantized before any is changed, so an error leaves the
        model as it was.

        Raises:
            ValueError: no SparseConv layer, a model already quantized, weights not float32 or not finite (naming
                ``<layer>.values``), no calibration data for fixed-point activations, or a scheme's own errors
                (naming ``<layer>.values``).
        """
        layers = sparse_layers(model)
        if not layers:
            raise ValueError("model: no SparseConv layer; call unsparse.sparsify(model) first")
        if describe_quantization(model) is not None:
            raise ValueError(f"model: already quantized ({describe_quantization(model)['scheme']})")
        for name, layer in layers.items():
            if layer.values.dtype != torch.float32:
                raise ValueError(f"{name}.values: quantization expects float32 weights, got {layer.values.dtype}")
            try:
                check_finite_weights(layer.values)
            except ValueError as error:
                raise ValueError(f"{name}.values: {error}") from error
        levels = calibrate(model, calibration, self.activations, self.progress) \
            if self.activations.format == "fixed" else {}
        quantized = {name: self.quantize_layer(name, layer) for name, layer in layers.items()}
        for name, layer in layers.items():
            csr, codec = quantized[name]
            layer.set_csr(csr.to(layer.values.device))
            layer.unsparse_codecs = {**getattr(layer, "unsparse_codecs", {}), "values": codec}
        quantizers = attach_activation_quantizers(model, self.activations)
        for name, level in levels.items():
            quantizers[name].saturation.fill_(level)
        model.unsparse_quantization = {"scheme": self.scheme, "weights": self.settings(),
                                       "activations": self.activations.to_dict()}
        return model
