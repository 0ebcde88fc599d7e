"""How a model's quantization is described in, and restored from, the sparse file's metadata.

A quantizer records ``model.unsparse_quantization = {"scheme": name, ...}`` and registers the scheme with
:func:`register_scheme`: a restorer, which :func:`restore_quantization` calls on the freshly built architecture
(on the ``meta`` device, before tensors are loaded) so that the state dict of the file and the model match, the
codec that the description gives every sparse layer's ``values``, and a check of what that codec spec cannot say
(a layer's values and own codec params, e.g. its ``step``). Weight encodings themselves travel as tensor codecs
(:mod:`unsparse.sparse.codecs`); :func:`check_values_codecs` holds them to the description, so a
file whose description and weights disagree (a scheme relabelled, bits changed, raw values under ``linear``, a
layer's codebook beyond the described ``clusters``, a step that is no power of two under ``power_of_two``)
cannot load as a model that misdescribes itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from unsparse.messages import quote
from unsparse.runtime.modules import sparse_layers
from unsparse.sparse.format import SparseFormatError

Restorer = Callable[[nn.Module, dict[str, Any]], None]
"""``restore(model, description)``: rebuild a scheme's structure on a ``meta`` model; raises SparseFormatError."""
ValuesCodec = Callable[[dict[str, Any]], dict[str, Any]]
"""``values_codec(description)``: the codec spec every sparse layer's ``values`` must match (its name and the
scheme-wide params; a layer's own params, e.g. its ``step``, left out); raises SparseFormatError."""
LayerCheck = Callable[[dict[str, Any], str, torch.Tensor, dict[str, Any]], None]
"""``check_layer(description, name, values, codec)``: what the scheme-wide codec spec cannot say, a sparse layer's
``values`` and its codec's own params (e.g. its ``step``) against the described settings; raises SparseFormatError
naming ``<name>.values`` (or one of its stored parts) and the field."""

RAW_CODEC = {"name": "raw"}
"""The codec of an unquantized model's values (``quantization: null`` in the file)."""

_SCHEMES: dict[str, tuple[Restorer, ValuesCodec, LayerCheck]] = {}


def _no_layer_check(description: dict[str, Any], name: str, values: torch.Tensor, codec: dict[str, Any]) -> None:
    """The :data:`LayerCheck` of a scheme whose codec spec says all."""


def register_scheme(scheme: str, restore: Restorer, values_codec: ValuesCodec,
                    check_layer: LayerCheck = _no_layer_check) -> None:
    """Make ``scheme`` known to the file loader (see the module docstring)."""
    _SCHEMES[scheme] = (restore, values_codec, check_layer)


def describe_quantization(model: nn.Module) -> dict[str, Any] | None:
    """The JSON description a quantizer left on ``model`` (``unsparse_quantization``), or None."""
    return getattr(model, "unsparse_quantization", None)


def _scheme(description: Any) -> tuple[Restorer, ValuesCodec, LayerCheck]:
    """The registered functions of a (non-None) description's scheme.

    Raises:
        SparseFormatError: if the description is not an object with a known ``scheme``.
    """
    if not isinstance(description, dict):
        raise SparseFormatError(f"quantization: expected an object with a 'scheme', got {type(description).__name__}")
    scheme = description.get("scheme")
    if not isinstance(scheme, str) or scheme not in _SCHEMES:
        raise SparseFormatError(f"quantization: unknown scheme {quote(scheme)}; known: {sorted(_SCHEMES)}")
    return _SCHEMES[scheme]


def expected_values_codec(description: Any) -> dict[str, Any]:
    """The codec spec, less per-layer params, that ``description`` gives every sparse layer's ``values``:
    ``raw`` for None (unquantized); e.g. ``{"name": "fixed_point", "bits": 8}`` for 8-bit ``linear``.

    Raises:
        SparseFormatError: a malformed description, naming the field.
    """
    return dict(RAW_CODEC) if description is None else _scheme(description)[1](description)


def check_values_codecs(model: nn.Module) -> None:
    """Every SparseConv's ``values`` codec (``unsparse_codecs``, raw when absent) against the codec that the model's
    quantization description gives it (:func:`expected_values_codec`), then the layer's values and its codec's own
    params against the described settings (the scheme's :data:`LayerCheck`).

    Raises:
        SparseFormatError: naming ``<layer>.values`` (or one of its stored parts) for a layer whose codec or values
            disagree, or the description's field.
    """
    description = describe_quantization(model)
    expected = expected_values_codec(description)
    check_layer = _no_layer_check if description is None else _scheme(description)[2]
    for name, layer in sparse_layers(model).items():
        codec = getattr(layer, "unsparse_codecs", {}).get("values", RAW_CODEC)
        if any(key not in codec or type(codec[key]) is not type(value) or codec[key] != value
               for key, value in expected.items()):
            scheme = "none" if description is None else description["scheme"]
            raise SparseFormatError(f"{name}.values: codec {quote(codec)} contradicts the quantization description "
                                    f"(scheme {scheme!r}), which gives {expected}")
        check_layer(description, name, layer.values, codec)


def restore_quantization(model: nn.Module, description: Any) -> None:
    """Re-apply a described quantization scheme to ``model`` (mutated); None means unquantized. The file loader
    checks the layers' ``values`` codecs against the description once they are loaded (:func:`check_values_codecs`,
    called by :func:`unsparse.sparse.io.load_sparse`).

    Raises:
        SparseFormatError: if the description is not null or an object with a known ``scheme`` that its
            restorer accepts.
    """
    if description is None:
        return
    restore = _scheme(description)[0]
    restore(model, description)
    model.unsparse_quantization = description
