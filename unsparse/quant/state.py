"""How a model's quantization is described in, and restored from, the sparse file's metadata.

A quantizer that changes a model's structure (e.g. inserts activation quantizers) records
``model.unsparse_quantization = {"scheme": name, ...}`` and registers a restorer for ``name`` with
:func:`register_restorer`. :func:`restore_quantization` calls it on the freshly built architecture (on the
``meta`` device, before tensors are loaded), so that the state dict of the file and the model match.
Weight encodings themselves travel as tensor codecs (:mod:`unsparse.sparse.codecs`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from unsparse.sparse.format import SparseFormatError

_RESTORERS: dict[str, Callable[[nn.Module, dict[str, Any]], None]] = {}


def register_restorer(scheme: str) -> Callable[[Callable[[nn.Module, dict[str, Any]], None]],
                                                Callable[[nn.Module, dict[str, Any]], None]]:
    """Decorator: ``restore(model, description)`` rebuilds scheme ``scheme``'s structure on ``model``."""
    def decorate(restore: Callable[[nn.Module, dict[str, Any]], None]) -> Callable[[nn.Module, dict[str, Any]], None]:
        _RESTORERS[scheme] = restore
        return restore
    return decorate


def describe_quantization(model: nn.Module) -> dict[str, Any] | None:
    """The JSON description a quantizer left on ``model`` (``unsparse_quantization``), or None."""
    return getattr(model, "unsparse_quantization", None)


def restore_quantization(model: nn.Module, description: Any) -> None:
    """Re-apply a described quantization scheme to ``model`` (mutated); None means unquantized.

    Raises:
        SparseFormatError: if the description is not an object with a known ``scheme``.
    """
    if description is None:
        return
    if not isinstance(description, dict):
        raise SparseFormatError(f"quantization: expected an object with a 'scheme', got {type(description).__name__}")
    scheme = description.get("scheme")
    if not isinstance(scheme, str) or scheme not in _RESTORERS:
        raise SparseFormatError(f"quantization: unknown scheme {scheme!r}; known: {sorted(_RESTORERS)}")
    _RESTORERS[scheme](model, description)
    model.unsparse_quantization = description
