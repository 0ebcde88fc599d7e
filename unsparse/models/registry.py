"""A model registry in the manner of timm: ``@register_model`` on a factory, ``create_model(name, **kwargs)``.

``create_model`` records ``model.unsparse_spec = {"name": ..., "kwargs": ...}`` so that an exported file can
rebuild the architecture without pickling code (DESIGN.md, File).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

from unsparse.settings import check_integer

_MODELS: dict[str, Callable[..., nn.Module]] = {}


def register_model(factory: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """Decorator: register ``factory`` under its function name."""
    _MODELS[factory.__name__] = factory
    return factory


def list_models() -> list[str]:
    """Registered model names, sorted."""
    return sorted(_MODELS)


def create_model(name: str, **kwargs: Any) -> nn.Module:
    """Build a registered model with randomly initialised weights (nothing is downloaded).

    Args:
        name: a name from :func:`list_models`.
        kwargs: JSON-serialisable keyword arguments of the factory (e.g. ``num_classes``).

    Raises:
        ValueError: unknown name (the message lists the known ones), an argument the factory does not take, an
            integer setting (one whose default is an integer: widths, channel and class counts) that is not a
            positive integer, or arguments that build layers without weights (the forward would fail deep inside
            torch).
    """
    if name not in _MODELS:
        raise ValueError(f"model: unknown name {name!r}; known: {list_models()}")
    parameters = inspect.signature(_MODELS[name]).parameters
    unknown = sorted(set(kwargs) - set(parameters))
    if unknown:
        raise ValueError(f"model: {name!r} takes no {unknown}; it takes {sorted(parameters)}")
    for key, value in kwargs.items():
        default = parameters[key].default
        if isinstance(default, int) and not isinstance(default, bool):
            check_integer(value, f"model.{key}")
    model = _MODELS[name](**kwargs)
    empty = [key for key, tensor in model.state_dict().items() if tensor.numel() == 0]
    if empty:
        raise ValueError(f"model: {name!r} with {kwargs} has empty tensors {empty[:3]} (a zero width?)")
    model.unsparse_spec = {"name": name, "kwargs": dict(kwargs)}
    return model
