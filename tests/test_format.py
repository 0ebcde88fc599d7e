"""UniformCSR: exact round trip, uniform row length, validation of every field."""

from __future__ import annotations

import pytest
import torch

from unsparse.sparse import SparseFormatError, UniformCSR


def random_sparse_weight(shape, sparsity, generator, dtype=torch.float64):
    weight = torch.randn(shape, generator=generator, dtype=dtype)
    weight[torch.rand(shape, generator=generator) < sparsity] = 0
    return weight


@pytest.mark.parametrize("shape", [(8, 3, 3, 3), (5, 7, 1, 1), (4, 3, 11, 11), (6, 4, 5), (3, 2, 2, 5)])
@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.9, 0.99, 1.0])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16])
def test_round_trip_is_exact(shape, sparsity, dtype):
    generator = torch.Generator().manual_seed(hash((shape, sparsity)) % 2**31)
    weight = random_sparse_weight(shape, sparsity, generator, dtype)
    weight[0] = 0  # an all-zero row
    csr = UniformCSR.from_dense(weight)
    dense = csr.to_dense()
    assert dense.dtype == weight.dtype and dense.shape == weight.shape
    assert torch.equal(dense, weight)
    nnz_per_row = (weight.reshape(shape[0], -1) != 0).sum(dim=1)
    assert csr.row_length == int(nnz_per_row.max())
    assert csr.nnz == int(nnz_per_row.sum())
    assert csr.values.shape == csr.col_idx.shape == (shape[0], csr.row_length)
    assert csr.col_idx.dtype == torch.int32


def test_rows_list_nonzeros_first_then_distinct_padding():
    weight = torch.tensor([[[[0.0, 2.0, 0.0, 3.0]]], [[[1.0, 0.0, 0.0, 0.0]]], [[[0.0, 0.0, 0.0, 0.0]]]])
    csr = UniformCSR.from_dense(weight)
    assert csr.row_length == 2
    assert csr.col_idx.tolist() == [[1, 3], [0, 1], [0, 1]]
    assert csr.values.tolist() == [[2.0, 3.0], [1.0, 0.0], [0.0, 0.0]]
    assert csr.rowptr.tolist() == [0, 2, 4, 6]
    assert csr.sparsity == pytest.approx(1 - 3 / 12)
    for row in csr.col_idx.tolist():
        assert len(set(row)) == len(row)


def test_fully_dense_weight_keeps_every_column():
    weight = torch.randn(4, 3, 3, 3) + 10.0
    csr = UniformCSR.from_dense(weight)
    assert csr.row_length == 27 and csr.sparsity == 0.0
    assert torch.equal(csr.col_idx, torch.arange(27, dtype=torch.int32).expand(4, 27))


def test_torch_csr_matches_dense():
    weight = random_sparse_weight((6, 4, 3, 3), 0.8, torch.Generator().manual_seed(1))
    csr = UniformCSR.from_dense(weight)
    assert torch.equal(csr.to_torch_csr().to_dense(), weight.reshape(6, -1))


@pytest.mark.parametrize(("change", "field"), [
    (lambda v, c, s: (v, c.long(), s), "col_idx"),
    (lambda v, c, s: (v.int(), c, s), "values"),
    (lambda v, c, s: (v, c[:, :-1], s), "col_idx"),
    (lambda v, c, s: (v, torch.where(c == c.max(), 27, c), s), "col_idx"),
    (lambda v, c, s: (v, torch.where(c == c.min(), -1, c), s), "col_idx"),
    (lambda v, c, s: (v, c, (5, 3, 3, 3)), "values"),
    (lambda v, c, s: (v, c, (4, 3, 3)), "row length"),
    (lambda v, c, s: (v[0], c[0], s), "values"),
    (lambda v, c, s: (v, c, (4, 3, 3, 3, 1)), "weight_shape"),
    # sizes that are no integers were truncated ((4, 3.9, 3, 3) read as (4, 3, 3, 3)); None, True, inf, a string
    (lambda v, c, s: (v, c, (4, 3.9, 3, 3)), "weight_shape"),
    (lambda v, c, s: (v, c, (4, None, 3, 3)), "weight_shape"),
    (lambda v, c, s: (v, c, (4, 3, True, 3)), "weight_shape"),
    (lambda v, c, s: (v, c, (4, float("inf"), 3, 3)), "weight_shape"),
    (lambda v, c, s: (v, c, "4333"), "weight_shape"),
    (lambda v, c, s: (v, c, None), "weight_shape"),
    (lambda v, c, s: (v, c, (4, 2**62, 8, 3)), "weight_shape"),
    (lambda v, c, s: (v.to_sparse(), c, s), "values"),
    # a nested tensor reports the strided layout: it passed the layout check and ended in torch's RuntimeError
    (lambda v, c, s: (torch.nested.nested_tensor(list(v)), c, s), "values: expected a dense"),
    (lambda v, c, s: (v, torch.nested.nested_tensor(list(c)), s), "col_idx: expected a dense"),
    (lambda v, c, s: (v, c.tolist(), s), "col_idx"),
])
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_validation_names_the_field(change, field):
    csr = UniformCSR.from_dense(random_sparse_weight((4, 3, 3, 3), 0.5, torch.Generator().manual_seed(2)))
    values, col_idx, shape = change(csr.values, csr.col_idx, csr.weight_shape)
    with pytest.raises(SparseFormatError, match=field):
        UniformCSR(values, col_idx, shape)


def test_sizes_beyond_the_int32_indices_are_refused():
    """An implicit row pointer M * L of 2^31 or more wrapped around in int32 (and went to cuSPARSE unchecked), and a
    weight of no output channels skipped the size check with K = 2^70 (an audit's finds). Expanded views: no
    memory."""
    rows, length = 2**16, 2**15 + 1
    with pytest.raises(SparseFormatError, match=r"values: .* stored entries; the int32 row pointer"):
        UniformCSR(torch.zeros(1, 1).expand(rows, length), torch.zeros(1, 1, dtype=torch.int32).expand(rows, length),
                   (rows, 1, 1, length))
    with pytest.raises(SparseFormatError, match=r"weight_shape: K = 1180591620717411303424 columns"):
        UniformCSR(torch.zeros(0, 3), torch.zeros(0, 3, dtype=torch.int32), (0, 2**70, 1, 1))
    UniformCSR(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.int32), (2, 2**31, 1, 1))  # K at the bound


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_from_dense_rejects_bad_weights():
    with pytest.raises(SparseFormatError, match="weight"):
        UniformCSR.from_dense(torch.ones(3, 3))
    with pytest.raises(SparseFormatError, match="weight"):
        UniformCSR.from_dense(torch.ones(3, 3, 3, 3, dtype=torch.int64))
    with pytest.raises(SparseFormatError, match="weight: expected a dense"):
        UniformCSR.from_dense([[[[1.0]]]])
    with pytest.raises(SparseFormatError, match="weight: expected a dense"):
        UniformCSR.from_dense(torch.ones(2, 2, 2, 2).to_sparse())
    with pytest.raises(SparseFormatError, match="weight: expected a dense"):
        UniformCSR.from_dense(torch.nested.nested_tensor([torch.ones(2, 2, 2)] * 2))
