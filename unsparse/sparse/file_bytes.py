"""What a sparse model file spends on each stored tensor and on each sparse layer, read from its safetensors header
only (the reports' storage columns: :mod:`unsparse.report.layers`).
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from unsparse.runtime.modules import sparse_layers
from unsparse.sparse.architecture import layer_names
from unsparse.sparse.codecs import PART_SEPARATOR
from unsparse.sparse.safetensors_file import open_file


def file_tensor_bytes(path: str | Path) -> dict[str, int]:
    """Bytes each stored tensor (or codec part) occupies in a safetensors file, read from its header only (checked as
    :func:`~unsparse.sparse.safetensors_file.open_file` checks it: offsets that are integers and tile the data section
    exactly).

    Returns:
        ``{stored key: bytes}``; keys of codec parts keep their ``::part`` suffix.

    Raises:
        SparseFileError: unreadable file, not a regular file, a malformed header (duplicate keys included), a
            stored dtype outside :data:`~unsparse.sparse.schema.STORED_DTYPES`, or a file that changed while its header
            was read.
    """
    with open_file(Path(path)) as opened:
        return {key: stored.size for key, stored in opened.stored.items()}


def layer_file_bytes(model: nn.Module, path: str | Path) -> dict[str, int]:
    """Bytes each sparse convolution of ``model`` takes in the file at ``path`` (read from its header only,
    :func:`file_tensor_bytes`): every stored tensor or codec part of the layer's own state dict, that is its
    ``values`` (or their codec parts), ``col_idx`` and ``bias``, and where the model quantizes activations to fixed
    point (paper 004 §4), its ``input_quantizer.saturation`` (a float32 scalar, 4 bytes).

    A layer shared by several names (:func:`~unsparse.sparse.architecture.layer_names`) is stored once per name, and all
    those copies count, in its one entry: each stored byte of a sparse layer is counted once, so the entries add up to
    what the file spends on the sparse layers.

    Returns:
        ``{first name: bytes}`` for every distinct :class:`SparseConv` of ``model``, in its order (the keys of
        :func:`~unsparse.runtime.modules.sparse_layers`).

    Raises:
        SparseFileError: as :func:`file_tensor_bytes`.
    """
    stored = file_tensor_bytes(path)
    layers = sparse_layers(model)
    sizes = {}
    for name, aliases in layer_names(model).items():
        keys = {f"{alias}.{key}" for alias in aliases for key in layers[name].state_dict()}
        sizes[name] = sum(size for key, size in stored.items() if key.partition(PART_SEPARATOR)[0] in keys)
    return sizes
