"""Writing a sparse model file (layout: :mod:`unsparse.sparse.schema`): a sparsified model's tensors, each through
its codec, and its metadata, checked as :func:`~unsparse.sparse.load.load_sparse` checks them before a byte is
written, then written atomically.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as safetensors_save
from torch import nn

from unsparse.atomic import atomic_write_bytes
from unsparse.runtime.batch_norm_folding import FOLDED_ATTRIBUTE
from unsparse.runtime.modules import sparse_layers
from unsparse.sparse.architecture import shell_model, tensor_owner
from unsparse.sparse.checks import check_distinct_columns, check_row_length, check_values
from unsparse.sparse.codecs import get_codec, stored_name
from unsparse.sparse.format import SparseFormatError
from unsparse.sparse.schema import FORMAT_VERSION, HEADER_MAX_BYTES, METADATA_KEY, METADATA_MAX_CHARACTERS, require
from unsparse.strict_json import loads_strict


def _codec_spec(model: nn.Module, key: str) -> dict[str, Any]:
    module, tensor_name = tensor_owner(model, key)
    return dict(getattr(module, "unsparse_codecs", {}).get(tensor_name, {"name": "raw"}))


def describe_layers(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Per sparse conv of ``model``: weight shape, geometry, L, nnz, sparsity (JSON-ready)."""
    layers = {}
    for name, layer in sparse_layers(model).items():
        csr = layer.csr
        layers[name] = {"weight_shape": list(csr.weight_shape), "geometry": layer.geometry.to_dict(),
                        "row_length": csr.row_length, "nnz": csr.nnz, "sparsity": csr.sparsity}
    return layers


def encode_model(model: nn.Module, extra: dict[str, Any] | None = None) -> bytes:
    """The file's bytes for a sparsified model (see the module docstring).

    Raises:
        ValueError: if the model has no ``unsparse_spec`` (build it with ``create_model``), no sparse layer, a
            convolution :func:`~unsparse.runtime.modules.sparsify` left dense (the loader rebuilds every convolution of
            the architecture as a sparse one, so such a file could not be read back), BatchNorms folded into the
            convolutions (:func:`~unsparse.runtime.batch_norm_folding.fold_batch_norm_`; the loader rebuilds them), or
            layers or tensors that differ
            from the architecture ``unsparse_spec`` names (e.g. a replaced classifier), or values the loader refuses
            (NaN or infinite, a negative BatchNorm variance, a layer whose row length is more than its largest row's
            nnz, e.g. after values were zeroed in place, a row naming a column twice, quantized values that contradict
            the model's quantization description: :func:`~unsparse.quant.state.check_values_codecs`), or an ``extra``
            that is no JSON (a numpy value, nesting deeper than the encoder goes) or whose JSON the loader refuses (keys
            that become one, such as ``1`` and ``"1"``; nesting deeper than the parser reads; more than
            :data:`~unsparse.sparse.schema.METADATA_MAX_CHARACTERS` in all), or a safetensors header of more than
            :data:`~unsparse.sparse.schema.HEADER_MAX_BYTES`: :func:`~unsparse.sparse.load.load_sparse` would refuse the
            file, and the same checks run before it is written; a tensor its codec cannot encode (values off a
            fixed-point grid, e.g. edited after quantization) or whose codec is unknown, naming the tensor's key
            (``<layer>.values: ...``).
    """
    from unsparse.quant.state import check_values_codecs, describe_quantization

    spec = getattr(model, "unsparse_spec", None)
    if spec is None:
        raise ValueError("model: no unsparse_spec; build the model with unsparse.models.create_model")
    if not sparse_layers(model):
        raise ValueError("model: no SparseConv layer; call unsparse.sparsify(model) first")
    dense = [name for name, module in model.named_modules() if isinstance(module, nn.Conv1d | nn.Conv2d)]
    if dense:
        raise ValueError(f"model: convolutions left dense ({', '.join(dense)}; see sparsify's log) cannot be "
                         "stored: the file holds every convolution as a UniformCSR")
    folded = getattr(model, FOLDED_ATTRIBUTE, None)
    if folded:
        raise ValueError(f"model: BatchNorms folded into {', '.join(folded)}; the file holds the model its "
                         "architecture builds, BatchNorms included: save it before folding (sparsify without "
                         "fold_batch_norm) and fold after load_sparse (unsparse.runtime.batch_norm_folding)")
    tensors: dict[str, torch.Tensor] = {}
    entries: dict[str, dict[str, Any]] = {}
    storages: set[int] = set()  # a layer under several names has its tensors under each: safetensors stores each once
    for key, tensor in model.state_dict().items():
        codec = _codec_spec(model, key)
        encoder = get_codec(codec["name"], key)  # names the key itself
        try:
            parts = encoder.encode(tensor.detach(), codec)
        except ValueError as error:
            raise ValueError(f"{key}: {error}") from error
        for part, data in parts.items():
            data = data.detach().cpu().contiguous()
            storage = data.untyped_storage().data_ptr()
            tensors[stored_name(key, part)] = data.clone() if storage in storages else data
            storages.add(storage)
        entries[key] = {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."),
                        "codec": codec}
    metadata = {"format_version": FORMAT_VERSION, "model": spec, "layers": describe_layers(model),
                "tensors": entries, "quantization": describe_quantization(model), "extra": extra or {}}
    try:
        check_values(shell_model(metadata), model.state_dict())
        for name, layer in sparse_layers(model).items():
            check_distinct_columns(name, layer.csr)
            check_row_length(name, layer.csr)
        check_values_codecs(model)
    except SparseFormatError as error:
        raise ValueError(f"model: load_sparse would refuse its file ({error}): it checks the layers and tensors "
                         f"against the architecture unsparse_spec names ({spec}), and their values") from error
    try:  # extra is the caller's: values JSON cannot hold, or nesting deeper than the encoder goes
        text = json.dumps(metadata)
    except (TypeError, ValueError, RecursionError) as error:
        raise ValueError(f"extra: not JSON ({error})") from error
    require(len(text) <= METADATA_MAX_CHARACTERS, "extra", f"metadata of {len(text)} characters, more than "
            f"{METADATA_MAX_CHARACTERS}")
    try:  # int and str keys of extra can become one JSON key ({1: .., "1": ..}), which the loader refuses
        loads_strict(text, constants=True)
    except (ValueError, RecursionError) as error:  # RecursionError: nested deeper than the parser reads
        raise ValueError(f"extra: not JSON the loader reads back ({error})") from error
    data = safetensors_save(tensors, metadata={METADATA_KEY: text})
    header_bytes = int.from_bytes(data[:8], "little")
    if header_bytes > HEADER_MAX_BYTES:
        raise ValueError(f"model: a safetensors header of {header_bytes} bytes ({len(tensors)} stored tensors), more "
                         f"than the {HEADER_MAX_BYTES} load_sparse reads")
    return data


def save_sparse(model: nn.Module, path: str | Path, extra: dict[str, Any] | None = None) -> Path:
    """Write a sparsified model to ``path`` atomically (an existing file is replaced only by a complete one).

    Args:
        model: output of :func:`unsparse.sparsify` on a model from ``create_model``.
        path: destination, conventionally ``*.safetensors``.
        extra: JSON-serialisable notes stored in the metadata (e.g. accuracy, data set).

    Returns:
        ``path``. Raises ``ValueError`` as :func:`encode_model`.
    """
    return atomic_write_bytes(path, encode_model(model, extra))
