"""Convolution backends, registered by name on import (see :mod:`unsparse.runtime.backends.base`)."""

from unsparse.runtime.backends import dense, direct, generated, lowering, reference
from unsparse.runtime.backends.base import (
    ConvBackend,
    available_backends,
    backend_names,
    get_backend,
    register_backend,
)

__all__ = ["ConvBackend", "available_backends", "backend_names", "dense", "direct", "generated", "get_backend",
           "lowering", "reference", "register_backend"]
