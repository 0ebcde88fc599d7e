"""UniformCSR: a convolution weight as a CSR matrix whose rows all hold the same number of entries.

A convolution weight ``W`` of shape ``(M, C/groups, R, S)`` (Conv2d) or ``(M, C/groups, S)`` (Conv1d) is
read as an ``M x K`` matrix with ``K = C/groups * R * S`` (the lowered filter matrix of Escoin, paper 000
§2.2, Fig. 3). Each row is one output channel. UnSparse-Opt (paper 004 §5) pads every row to the same
number of stored entries ``L = max_m nnz(row m)`` by marking some zeros as "non-zero"; the row pointer is
then implicit (``rowptr[m] = m * L``), which removes the per-row length lookup from the kernel.

Padding entries have value 0 and a column index that is valid and not used by another entry of the same
row, so a row never names a column twice and ``to_dense`` is an exact inverse of ``from_dense``.
"""

from __future__ import annotations

import math
import operator
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import torch

INDEX_DTYPE = torch.int32
"""dtype of ``col_idx`` (the flat ``(c, r, s)`` filter index), as stored in files and passed to kernels."""
INDEX_LIMIT = 2**31
"""Bound of the int32 indices: column indices lie in ``[0, K)`` with ``K <= INDEX_LIMIT``, and the implicit row
pointer's last entry ``M * L`` stays below it."""

SIZE_LIMIT = 2**63
"""Bound of every size, element count and offset: torch indexes tensors with int64, so each lies in
``[0, SIZE_LIMIT)``. The file reader holds every stored shape to it (each size, and their product with a 0 read as 1:
:func:`bounded_product`), :class:`UniformCSR` its ``weight_shape``, and :class:`~unsparse.sparse.geometry.ConvGeometry`
its strides, paddings and dilations and the padded sizes and offsets derived from them."""

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""Value dtypes a UniformCSR may hold."""


class SparseFormatError(ValueError):
    """A UniformCSR (or a file holding one) is malformed; the message names the offending field."""


def bounded_product(sizes: Iterable[int]) -> int:
    """The product of ``sizes`` (non-negative integers, each 0 read as 1), or the first partial product of
    :data:`SIZE_LIMIT` or more: multiplied out in full, a shape of many huge sizes (a file's header may hold hundreds
    of thousands) takes time quadratic in their count, as each product is as long as all the sizes before it. A 0 is
    read as 1 because torch computes an empty tensor's strides from the other sizes, which must fit int64 too."""
    product = 1
    for size in sizes:
        product *= max(size, 1)
        if product >= SIZE_LIMIT:
            break
    return product


def _require_strided(tensor: object, name: str) -> None:
    # a nested tensor of torch's first kind reports the strided layout, and has no sizes to check
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided or tensor.is_nested:
        kind = (("a nested tensor" if tensor.is_nested else f"a tensor of layout {tensor.layout}")
                if isinstance(tensor, torch.Tensor) else type(tensor).__name__)
        raise SparseFormatError(f"{name}: expected a dense (strided) torch.Tensor, got {kind}")


def tensor_version(tensor: torch.Tensor) -> int:
    """``tensor``'s in-place version counter (torch's ``_version``, moved by every in-place edit); -1 for a tensor
    made under ``torch.inference_mode()``, which has none."""
    return -1 if tensor.is_inference() else tensor._version


@dataclass(frozen=True, eq=False)
class UniformCSR:
    """Uniform-nnz CSR form of one convolution weight (UnSparse-Opt §5; Escoin §2.3, Fig. 4).

    Attributes:
        values: ``(M, L)`` tensor of the layer dtype (float16/bfloat16/float32/float64). Row ``m`` holds the
            nonzero weights of output channel ``m`` in ascending column order, then zero padding.
        col_idx: ``(M, L)`` int32 tensor, each entry in ``[0, K)``: the flat filter index
            ``k = (c * R + r) * S + s`` of the matching value (``R = 1`` for Conv1d). :meth:`from_dense` never
            repeats a column within a row; a hand-made matrix that does is accepted, and :meth:`to_dense` and
            every backend sum the repeated entries.
        weight_shape: shape of the dense weight, ``(M, C/groups, R, S)`` or ``(M, C/groups, S)``.

    Raises:
        SparseFormatError: from :meth:`validate` (called by the constructor, and by :meth:`revalidate` after an
            in-place change) when shapes, dtypes, devices or index ranges are inconsistent.
    """

    values: torch.Tensor
    col_idx: torch.Tensor
    weight_shape: tuple[int, ...]

    def __post_init__(self) -> None:
        try:  # integers only (operator.index): 1.9, "4" or True would silently read as another shape
            shape = tuple(map(operator.index, self.weight_shape))
            if any(isinstance(size, bool) for size in self.weight_shape):
                raise TypeError("a boolean size")
        except TypeError as error:
            raise SparseFormatError(f"weight_shape: expected integers, got {self.weight_shape!r}") from error
        object.__setattr__(self, "weight_shape", shape)
        self.validate()
        object.__setattr__(self, "_validated_versions", self.versions())

    @classmethod
    def from_dense(cls, weight: torch.Tensor) -> UniformCSR:
        """Compress a dense convolution weight.

        Args:
            weight: ``(M, C/groups, R, S)`` or ``(M, C/groups, S)`` float tensor, any device. Entries equal
                to zero (including ``-0.0``) are dropped; NaN and inf are kept as nonzeros.

        Returns:
            A UniformCSR on ``weight``'s device with ``L = max_m nnz(row m)`` entries per row.

        Raises:
            SparseFormatError: if ``weight`` is not a strided tensor, is on the ``meta`` device (shapes only: no
                values to export), not 3-D/4-D or not a float dtype.
        """
        _require_strided(weight, "weight")
        if weight.is_meta:
            raise SparseFormatError(f"weight: a meta tensor (shape {tuple(weight.shape)}) has no values to export; "
                                    "move the model to a real device (or load its weights) first")
        if weight.dim() not in (3, 4):
            raise SparseFormatError(f"weight: expected 3-D (Conv1d) or 4-D (Conv2d), got shape {tuple(weight.shape)}")
        if weight.dtype not in FLOAT_DTYPES:
            raise SparseFormatError(f"weight: dtype {weight.dtype} is not a float dtype")
        weight = weight.detach()
        M = weight.shape[0]
        rows = weight.reshape(M, math.prod(weight.shape[1:]))  # -1 cannot be inferred for M = 0
        nonzero = rows != 0
        L = int(nonzero.sum(dim=1).max().item()) if M > 0 and rows.shape[1] > 0 else 0
        # A stable sort on "is zero" puts each row's nonzero columns first (ascending), then its zero
        # columns (ascending): the first L columns are the nonzeros plus distinct, unused padding columns.
        order = torch.sort((~nonzero).to(torch.int8), dim=1, stable=True).indices[:, :L]
        values = torch.gather(rows, 1, order)
        return cls(values=values.contiguous(), col_idx=order.to(INDEX_DTYPE).contiguous(),
                   weight_shape=tuple(weight.shape))

    def to_dense(self) -> torch.Tensor:
        """Rebuild the dense weight, shape :attr:`weight_shape`, dtype and device of :attr:`values`.

        Entries are accumulated, so a (hand-made) matrix that names a column twice sums them, the same
        semantics the convolution backends use.
        """
        M, K = self.out_channels, self.columns
        dense = torch.zeros(M, K, dtype=self.values.dtype, device=self.values.device)
        dense.scatter_add_(1, self.col_idx.long(), self.values)
        return dense.reshape(self.weight_shape)

    def to_conv2d_weight(self) -> torch.Tensor:
        """:meth:`to_dense` shaped as ``F.conv2d`` takes it: ``(M, C / groups, R, S)`` (a Conv1d weight gets
        ``R = 1``), dtype and device of :attr:`values`."""
        R, S = self.kernel_size
        return self.to_dense().reshape(self.out_channels, self.in_channels_per_group, R, S)

    def validate(self) -> None:
        """Check every field before anything reads through ``col_idx``.

        Raises:
            SparseFormatError: naming the field: non-tensor fields, wrong rank, wrong dtype, mismatched
                shapes or devices, a ``weight_shape`` whose sizes multiply (a 0 read as 1) to :data:`SIZE_LIMIT` or
                more (as the file reader bounds a stored shape), sizes the int32 indices cannot address (``K`` above
                :data:`INDEX_LIMIT`, or ``M * L`` at or above it), or a column index outside ``[0, K)`` (not checked
                on the ``meta`` device, whose tensors hold no data: file loading shapes a model there before reading its
                tensors).
        """
        if len(self.weight_shape) not in (3, 4) or any(d < 0 for d in self.weight_shape):
            raise SparseFormatError(f"weight_shape: expected 3 or 4 non-negative dims, got {self.weight_shape}")
        if self.columns > INDEX_LIMIT:  # checked on its own: a weight of 0 output channels has no entries at all
            raise SparseFormatError(f"weight_shape: K = {self.columns} columns per row, more than int32 column "
                                    f"indices address ({INDEX_LIMIT})")
        if bounded_product(self.weight_shape) >= SIZE_LIMIT:  # bounds each size too: an empty axis reads as 1
            raise SparseFormatError(f"weight_shape: {self.weight_shape} has sizes whose product (a 0 read as 1) is "
                                    f"2^63 or more: torch cannot shape a tensor so, even an empty one")
        for name in ("values", "col_idx"):
            _require_strided(getattr(self, name), name)
        if self.values.dtype not in FLOAT_DTYPES:
            raise SparseFormatError(f"values: dtype {self.values.dtype} is not one of {FLOAT_DTYPES}")
        if self.col_idx.dtype != INDEX_DTYPE:
            raise SparseFormatError(f"col_idx: dtype {self.col_idx.dtype}, expected {INDEX_DTYPE}")
        if self.values.dim() != 2:
            raise SparseFormatError(f"values: expected 2-D (M, L), got shape {tuple(self.values.shape)}")
        if self.col_idx.shape != self.values.shape:
            raise SparseFormatError(
                f"col_idx: shape {tuple(self.col_idx.shape)} differs from values {tuple(self.values.shape)}")
        if self.values.shape[0] != self.weight_shape[0]:
            raise SparseFormatError(
                f"values: {self.values.shape[0]} rows, weight_shape says {self.weight_shape[0]} output channels")
        if self.values.shape[1] > self.columns:
            raise SparseFormatError(f"values: row length {self.values.shape[1]} exceeds K = {self.columns}")
        if self.values.numel() >= INDEX_LIMIT:
            raise SparseFormatError(f"values: {self.values.numel()} stored entries; the int32 row pointer (M * L) "
                                    f"holds fewer than {INDEX_LIMIT}")
        if self.col_idx.device != self.values.device:
            raise SparseFormatError(f"col_idx: on {self.col_idx.device}, values on {self.values.device}")
        if self.col_idx.numel() > 0 and not self.col_idx.is_meta:  # a meta tensor has shapes only, no indices
            low, high = int(self.col_idx.min()), int(self.col_idx.max())
            if low < 0 or high >= self.columns:
                raise SparseFormatError(f"col_idx: entries must lie in [0, {self.columns}), found [{low}, {high}]")

    def versions(self) -> tuple[int, int]:
        """The in-place version counters of ``values`` and ``col_idx`` (torch's ``_version``; -1 for a tensor made
        under ``torch.inference_mode()``, which has none). Every in-place edit moves them, so whatever was derived
        from the weight before (a backend's dense copy or kernel arrays) can be seen to be stale."""
        return tensor_version(self.values), tensor_version(self.col_idx)

    def revalidate(self) -> None:
        """:meth:`validate` again if ``values`` or ``col_idx`` changed in place since the last check (their
        :meth:`versions` moved), so that a column index written out of range after construction is refused before a
        kernel reads through it; called by every backend call (``ConvBackend.run``) and by ``SparseConv.csr``.
        Changes that bypass the version counters (through ``.data``, or to tensors made under
        ``torch.inference_mode()``) are not seen.

        Raises:
            SparseFormatError: as :meth:`validate`.
        """
        versions = self.versions()
        if versions != getattr(self, "_validated_versions", None):  # absent: unpickled from an older version
            self.validate()
            object.__setattr__(self, "_validated_versions", versions)

    @property
    def out_channels(self) -> int:
        """``M``, the number of rows (output channels)."""
        return self.weight_shape[0]

    @property
    def in_channels_per_group(self) -> int:
        """``C / groups``."""
        return self.weight_shape[1]

    @property
    def kernel_size(self) -> tuple[int, int]:
        """``(R, S)``; ``R = 1`` for a Conv1d weight."""
        return (1, self.weight_shape[2]) if len(self.weight_shape) == 3 else tuple(self.weight_shape[2:])

    @property
    def columns(self) -> int:
        """``K = C/groups * R * S``, the number of matrix columns."""
        return math.prod(self.weight_shape[1:])

    @property
    def row_length(self) -> int:
        """``L``, the stored entries per row (UnSparse-Opt §5: the largest nnz of any row)."""
        return self.values.shape[1]

    @property
    def rowptr(self) -> torch.Tensor:
        """Implicit CSR row pointer ``m * L`` for ``m`` in ``[0, M]``, int32, on the values' device."""
        return torch.arange(self.out_channels + 1, dtype=INDEX_DTYPE, device=self.values.device) * self.row_length

    @property
    def nnz(self) -> int:
        """Number of stored values that are nonzero (padding excluded): the dense weight's nonzero count, unless a
        hand-made row repeats a column (then each stored entry counts, as each is a product the kernels compute)."""
        return int((self.values != 0).sum())

    @property
    def sparsity(self) -> float:
        """``1 - nnz / (M * K)`` (paper 004 eq. 6): the fraction of the dense weight's entries that are zero, unless
        a hand-made row repeats a column (:attr:`nnz`)."""
        total = self.out_channels * self.columns
        return 1.0 - self.nnz / total if total else 0.0

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> UniformCSR:
        """Copy to another device and/or value dtype; ``col_idx`` stays int32."""
        return UniformCSR(values=self.values.to(device=device, dtype=dtype), col_idx=self.col_idx.to(device=device),
                          weight_shape=self.weight_shape)

    def to_torch_csr(self) -> torch.Tensor:
        """The ``(M, K)`` matrix as a ``torch.sparse_csr_tensor`` (int32 indices), padding stored as zeros."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta state")
            # torch 2.11 warns even though check_invariants is passed (pytorch/pytorch#178274, fixed later).
            warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled")
            return torch.sparse_csr_tensor(self.rowptr, self.col_idx.reshape(-1), self.values.reshape(-1),
                                           size=(self.out_channels, self.columns), check_invariants=False)
