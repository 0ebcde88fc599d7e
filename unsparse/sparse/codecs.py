"""Tensor codecs of the file format: how one state-dict tensor is stored in the safetensors file.

A module may carry ``module.unsparse_codecs = {tensor_name: {"name": codec, **params}}`` (set by the
quantizers). On save, such a tensor is stored as the codec's parts ``"<key>::<part>"`` plus the spec in the
JSON metadata; on load the codec validates the parts and decodes them to the exact tensor that was saved.
Tensors without a spec use the ``raw`` codec (stored as they are).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from unsparse.sparse.format import SparseFormatError

PART_SEPARATOR = "::"


def stored_name(key: str, part: str) -> str:
    """The name a file stores part ``part`` of state-dict tensor ``key`` under: ``<key>::<part>``, or ``key`` itself
    for the unnamed part ``""`` (a raw tensor's only one)."""
    return f"{key}{PART_SEPARATOR}{part}" if part else key


class TensorCodec(ABC):
    """Encodes a tensor into named parts and decodes them back exactly.

    ``decode`` receives untrusted parts: it must check their dtypes, shapes and ranges and raise
    :class:`SparseFormatError` naming the field before building the tensor.
    """

    name: ClassVar[str]

    @abstractmethod
    def encode(self, tensor: torch.Tensor, params: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Parts (part name -> tensor) that :meth:`decode` turns back into ``tensor``."""

    @abstractmethod
    def decode(self, parts: dict[str, torch.Tensor], params: dict[str, Any], shape: tuple[int, ...],
               field: str) -> torch.Tensor:
        """Rebuild the tensor of ``shape``; ``field`` names it in error messages.

        Raises:
            SparseFormatError: missing/extra parts, wrong dtype or shape, out-of-range codes.
        """


_CODECS: dict[str, TensorCodec] = {}


def register_codec(codec: type[TensorCodec]) -> type[TensorCodec]:
    """Class decorator: make ``codec`` available under ``codec.name``."""
    _CODECS[codec.name] = codec()
    return codec


def get_codec(name: str, field: str) -> TensorCodec:
    """The codec called ``name``.

    Raises:
        SparseFormatError: unknown codec (named with ``field``).
    """
    if name not in _CODECS:
        raise SparseFormatError(f"{field}: unknown codec {name!r}; known: {sorted(_CODECS)}")
    return _CODECS[name]


def expect_params(params: dict[str, Any], names: set[str], field: str) -> None:
    """Raise :class:`SparseFormatError` unless the codec spec ``params`` has exactly ``"name"`` and ``names``."""
    if set(params) != names | {"name"}:
        raise SparseFormatError(f"{field}: codec params {sorted(params)}, expected {sorted(names | {'name'})}")


def expect_parts(parts: dict[str, torch.Tensor], names: set[str], field: str) -> None:
    """Raise :class:`SparseFormatError` unless ``parts`` has exactly the part ``names``."""
    if set(parts) != names:
        raise SparseFormatError(f"{field}: expected parts {sorted(names)}, found {sorted(parts)}")


@register_codec
class RawCodec(TensorCodec):
    """The tensor itself, one part named ``""`` (stored under its plain key)."""

    name = "raw"

    def encode(self, tensor: torch.Tensor, params: dict[str, Any]) -> dict[str, torch.Tensor]:
        return {"": tensor}

    def decode(self, parts: dict[str, torch.Tensor], params: dict[str, Any], shape: tuple[int, ...],
               field: str) -> torch.Tensor:
        expect_params(params, set(), field)
        expect_parts(parts, {""}, field)
        tensor = parts[""]
        if tuple(tensor.shape) != tuple(shape):
            raise SparseFormatError(f"{field}: shape {tuple(tensor.shape)}, expected {tuple(shape)}")
        return tensor
