"""save_sparse / load_sparse: exact round trip, atomic writes, and a clear error for every malformed file."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save

from unsparse import SparseFileError, create_model, load_sparse, save_sparse, sparsify
from unsparse.prune import MagnitudePruner
from unsparse.runtime import sparse_layers


def pruned_sparse_model(name="vgg_small", **kwargs):
    torch.manual_seed(0)
    model = create_model(name, **kwargs)
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.running_mean.uniform_(-1, 1)
            module.running_var.uniform_(0.5, 2)
    pruner = MagnitudePruner(0.9)
    pruner.prepare(model)
    pruner.step()
    return sparsify(model.eval())


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    path = tmp_path_factory.mktemp("export") / "model.safetensors"
    model = pruned_sparse_model(width=8)
    save_sparse(model, path, extra={"note": "test"})
    return model, path


def read(path):
    with safe_open(str(path), "pt") as file:
        return {key: file.get_tensor(key) for key in file.keys()}, json.loads(file.metadata()["unsparse"])  # noqa: SIM118 (safe_open is not a dict)


def write(path, tensors, metadata):
    path.write_bytes(save(tensors, metadata={"unsparse": json.dumps(metadata)}))
    return path


@pytest.mark.parametrize(("name", "kwargs", "shape"), [
    ("vgg_small", {"width": 8}, (5, 1, 28, 28)),
    ("resnet_small", {"width": 8}, (5, 1, 28, 28)),
    ("alexnet", {"num_classes": 10}, (1, 3, 96, 96)),
])
def test_round_trip_gives_identical_outputs(tmp_path, name, kwargs, shape):
    model = pruned_sparse_model(name, **kwargs)
    path = save_sparse(model, tmp_path / "m.safetensors")
    loaded = load_sparse(path)
    x = torch.randn(shape)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    assert set(sparse_layers(loaded)) == set(sparse_layers(model))
    assert loaded.unsparse_spec == {"name": name, "kwargs": kwargs}


def test_metadata_records_layers_and_extra(exported):
    model, path = exported
    loaded = load_sparse(path)
    layers = loaded.unsparse_metadata["layers"]
    for name, layer in sparse_layers(model).items():
        assert layers[name]["row_length"] == layer.csr.row_length
        assert layers[name]["nnz"] == layer.csr.nnz
    assert loaded.unsparse_metadata["extra"] == {"note": "test"}


def test_save_is_atomic_and_keeps_the_old_file_on_failure(tmp_path, exported):
    model, _ = exported
    path = save_sparse(model, tmp_path / "m.safetensors")
    before = path.read_bytes()
    broken = create_model("vgg_small", width=8)  # no SparseConv: encoding fails before anything is written
    with pytest.raises(ValueError, match="SparseConv"):
        save_sparse(broken, path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]


def test_truncated_file(tmp_path, exported):
    data = exported[1].read_bytes()
    path = tmp_path / "t.safetensors"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(SparseFileError, match="file"):
        load_sparse(path)


def test_not_a_safetensors_file(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes(b"\x00\x01not safetensors at all" * 10)
    with pytest.raises(SparseFileError, match="file"):
        load_sparse(path)
    with pytest.raises(SparseFileError, match="file"):
        load_sparse(tmp_path / "missing.safetensors")


def test_missing_metadata_block(tmp_path, exported):
    tensors, _ = read(exported[1])
    path = tmp_path / "m.safetensors"
    path.write_bytes(save(tensors))
    with pytest.raises(SparseFileError, match="metadata"):
        load_sparse(path)


def first_layer(exported):
    return next(iter(sparse_layers(exported[0])))


@pytest.mark.parametrize(("mutate", "field"), [
    (lambda t, m, layer: t.pop(f"{layer}.values"), "tensors"),
    (lambda t, m, layer: t.update({f"{layer}.col_idx": t[f"{layer}.col_idx"].long()}), "col_idx"),
    (lambda t, m, layer: t.update({f"{layer}.values": t[f"{layer}.values"].int()}), "values"),
    (lambda t, m, layer: t[f"{layer}.col_idx"].view(-1).__setitem__(0, 10_000), "col_idx"),
    (lambda t, m, layer: t[f"{layer}.col_idx"].view(-1).__setitem__(0, -1), "col_idx"),
    (lambda t, m, layer: t.update({f"{layer}.values": t[f"{layer}.values"][:, :-1].contiguous()}), "values"),
    (lambda t, m, layer: m["tensors"][f"{layer}.values"].update(shape=[3, 3]), "values"),
    (lambda t, m, layer: m.update(format_version=99), "format_version"),
    (lambda t, m, layer: m["model"].update(name="no_such_model"), "model"),
    (lambda t, m, layer: m["model"]["kwargs"].update(width=16), "shape"),
    (lambda t, m, layer: m["model"]["kwargs"].update(bogus=1), "model"),
    (lambda t, m, layer: m["layers"][layer]["geometry"].update(stride=[2, 2]), "geometry"),
    (lambda t, m, layer: m["layers"].pop(layer), "layers"),
    (lambda t, m, layer: m["tensors"][f"{layer}.values"].update(codec={"name": "zip"}), "codec"),
    (lambda t, m, layer: t.update({"extra.tensor": torch.zeros(2)}), "tensors"),
    (lambda t, m, layer: t[f"{layer}.values"].view(-1).__setitem__(0, float("nan")), "non-finite"),
])
def test_malformed_files_raise_value_errors_naming_the_field(tmp_path, exported, mutate, field):
    tensors, metadata = read(exported[1])
    mutate(tensors, metadata, first_layer(exported))
    path = write(tmp_path / "bad.safetensors", tensors, metadata)
    with pytest.raises(ValueError, match=field):
        load_sparse(path)
