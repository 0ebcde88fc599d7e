"""Per-layer facts of an exported sparse model: shape, sparsity, nnz per row (L), bytes in the file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from unsparse.runtime.modules import sparse_layers
from unsparse.sparse.io import layer_file_bytes


def layer_rows(model: nn.Module, path: str | Path) -> list[dict[str, Any]]:
    """One row per SparseConv of ``model`` as stored in the file at ``path``.

    Row keys: ``layer``, ``kind`` (``conv1d``/``conv2d``), ``weight_shape``, ``stride``, ``padding``,
    ``dilation`` (one entry per spatial dimension: a Conv1d's length only), ``groups``, ``sparsity`` (fraction of
    zero weights), ``nnz``, ``row_length`` (L, UnSparse-Opt §5), ``padding_entries`` (stored zeros that pad rows
    to L), ``file_bytes`` (all of the layer's tensors in the file: values or their codec parts, col_idx, bias and a
    fixed-point activation quantizer's saturation; a layer shared under several names has one row, under its first
    name, counting its copy under every name: :func:`~unsparse.sparse.io.layer_file_bytes`) and
    ``dense_fp32_bytes`` (dense weight + bias at 4 bytes per element).
    """
    stored = layer_file_bytes(model, path)
    rows = []
    for name, layer in sparse_layers(model).items():
        csr, geometry = layer.csr, layer.geometry
        bias_elements = 0 if layer.bias is None else layer.bias.numel()
        rows.append({
            "layer": name, "kind": f"conv{geometry.spatial_dims}d", "weight_shape": list(csr.weight_shape),
            **{field: list(getattr(geometry, field))[-geometry.spatial_dims:]
               for field in ("stride", "padding", "dilation")}, "groups": geometry.groups, "sparsity": csr.sparsity,
            "nnz": csr.nnz, "row_length": csr.row_length,
            "padding_entries": csr.out_channels * csr.row_length - csr.nnz,
            "file_bytes": stored[name], "dense_fp32_bytes": 4 * (csr.out_channels * csr.columns + bias_elements),
        })
    return rows
