"""The architecture a sparse model file names, rebuilt on the ``meta`` device (no memory): the registry model, each
convolution replaced by a shape-only :class:`~unsparse.runtime.modules.SparseConv` of the file's row length and the
quantization modules restored, so that its state dict names every tensor the file must hold, with its exact shape,
before any of them is read (:func:`shell_model`); and the codec specs put back on the loaded model
(:func:`restore_codecs`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from unsparse.messages import quote
from unsparse.runtime.modules import SparseConv, replace_shared, sparse_layers
from unsparse.sparse.checks import check_entries
from unsparse.sparse.format import INDEX_DTYPE, SparseFormatError, UniformCSR
from unsparse.sparse.geometry import ConvGeometry
from unsparse.sparse.schema import LAYER_KEYS, SparseFileError, foreign, require


def _build_architecture(spec: dict[str, Any]) -> nn.Module:
    from unsparse.models import create_model

    name, kwargs = spec.get("name"), spec.get("kwargs")
    require(set(spec) == {"name", "kwargs"} and isinstance(name, str) and isinstance(kwargs, dict), "model",
            f"bad model spec {quote(spec)}: expected a name and kwargs")
    try:
        with torch.device("meta"):
            model = create_model(name, **kwargs)
    except (TypeError, ValueError, RuntimeError, OverflowError) as error:  # e.g. a negative, zero or huge width
        raise SparseFileError(f"model: cannot build {quote(name)} with {quote(kwargs)}: {foreign(error)}") from error
    return model


def shell_model(metadata: dict[str, Any]) -> nn.Module:
    """The architecture ``metadata["model"]`` names, on the ``meta`` device, each convolution replaced by its
    :func:`_sparse_shell` and the quantization modules restored; the declared tensors (``metadata["tensors"]``) are
    checked against its state dict (:func:`~unsparse.sparse.checks.check_entries`) before anything is decoded. A
    convolution the architecture holds under several names becomes one shell shared by all of them, as
    :func:`~unsparse.runtime.modules.sparsify` shares its SparseConv (the layer is described under its first name, its
    tensors are stored under every name).

    Raises:
        SparseFileError: naming the field that differs from the architecture.
    """
    from unsparse.quant.state import restore_quantization

    model = _build_architecture(metadata["model"])
    replace_shared(model, (nn.Conv1d, nn.Conv2d),
                   lambda name, conv: _sparse_shell(name, conv, metadata["layers"].get(name)))
    require(set(metadata["layers"]) == set(sparse_layers(model)), "layers",
            f"names differ from the architecture's convolutions: "
            f"{quote(sorted(set(metadata['layers']) ^ set(sparse_layers(model))))}")
    try:
        restore_quantization(model, metadata.get("quantization"))
    except SparseFormatError as error:
        raise SparseFileError(foreign(error)) from error
    # a shared layer's values are stored under each of its names
    coded = {f"{alias}.values" for aliases in layer_names(model).values() for alias in aliases}
    check_entries(metadata["tensors"], model.state_dict(), coded)
    return model


def _sparse_shell(name: str, conv: nn.Module, layer_meta: Any) -> SparseConv:
    """The :class:`SparseConv` that takes ``conv``'s place, on the ``meta`` device (shapes only, no data): the
    file's geometry and weight shape, both checked against the architecture's ``conv``, and its declared row
    length ``L`` (``0 <= L <= K``), so that the model's state dict names every tensor the file must hold, with
    its exact shape, before any of them is decoded."""
    field = f"layers.{name}"
    require(isinstance(layer_meta, dict), field, "missing from the file")
    require(set(layer_meta) == LAYER_KEYS, field, f"keys {quote(sorted(layer_meta))}, expected {sorted(LAYER_KEYS)}")
    try:
        geometry = ConvGeometry.from_dict(layer_meta.get("geometry"))
    except SparseFormatError as error:
        raise SparseFileError(f"{field}.{foreign(error)}") from error
    try:  # the architecture's own conv: torch checked its groups when it was built, not if an attribute changed since
        architecture = ConvGeometry.from_module(conv)
    except SparseFormatError as error:
        raise SparseFileError(f"{field}: the architecture's convolution: {error}") from error
    require(geometry == architecture, f"{field}.geometry",
            f"{geometry} differs from the architecture's {architecture}")
    weight_shape = tuple(conv.weight.shape)
    recorded = layer_meta["weight_shape"]
    require(isinstance(recorded, list) and all(type(size) is int for size in recorded)
            and recorded == list(weight_shape), f"{field}.weight_shape",
            f"{quote(layer_meta.get('weight_shape'))} differs from the architecture's {list(weight_shape)}")
    columns, row_length = math.prod(weight_shape[1:]), layer_meta.get("row_length")
    require(isinstance(row_length, int) and not isinstance(row_length, bool) and 0 <= row_length <= columns,
            f"{field}.row_length", f"expected an integer in [0, K = {columns}], got {quote(row_length)}")
    shape = (weight_shape[0], row_length)
    csr = UniformCSR(torch.empty(shape, dtype=conv.weight.dtype, device="meta"),
                     torch.empty(shape, dtype=INDEX_DTYPE, device="meta"), weight_shape)
    return SparseConv(csr, conv.bias, geometry)


def tensor_owner(model: nn.Module, key: str) -> tuple[nn.Module, str]:
    """The module of ``model`` that holds state-dict entry ``key``, and the entry's name there (``"conv.values"``:
    ``model.conv`` and ``"values"``).

    Raises:
        AttributeError: ``key`` names no submodule of ``model``.
    """
    module_name, _, tensor_name = key.rpartition(".")
    return (model.get_submodule(module_name) if module_name else model), tensor_name


def restore_codecs(model: nn.Module, entries: dict[str, dict[str, Any]]) -> None:
    """Put each non-raw codec spec back on its module (``unsparse_codecs``), so a reloaded model saves alike."""
    for key, entry in entries.items():
        codec = entry["codec"]
        if codec["name"] != "raw":
            module, tensor_name = tensor_owner(model, key)
            module.unsparse_codecs = {**getattr(module, "unsparse_codecs", {}), tensor_name: dict(codec)}


def layer_names(model: nn.Module) -> dict[str, list[str]]:
    """Every name under which ``model`` holds each of its :class:`SparseConv` layers.

    Returns:
        ``{first name: [every name, the first one first]}`` in module order, one entry per distinct layer, keyed as
        :func:`~unsparse.runtime.modules.sparse_layers` and the file's ``layers`` metadata name it. A layer shared
        by several names (``self.alias = self.conv``, or two parents holding it) lists each; its state-dict tensors,
        and so the file's, are stored under every one of them.
    """
    first_names = {layer: name for name, layer in sparse_layers(model).items()}
    names: dict[str, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, SparseConv):
            names.setdefault(first_names[module], []).append(name)
    return names
