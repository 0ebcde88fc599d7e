"""save_sparse / load_sparse: exact round trip, atomic writes, and a clear error for every malformed file."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

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


def test_atomic_writes_keep_the_usual_permissions(tmp_path):
    """A new file gets what the umask gives (not mkstemp's owner-only 0600); a replaced file keeps its mode."""
    import os

    from unsparse.atomic import atomic_write_text

    umask = os.umask(0o022)
    try:
        path = atomic_write_text(tmp_path / "report.md", "one")
        assert path.stat().st_mode & 0o777 == 0o644
        path.chmod(0o640)
        atomic_write_text(path, "two")
        assert path.stat().st_mode & 0o777 == 0o640 and path.read_text() == "two"
    finally:
        os.umask(umask)


@pytest.mark.parametrize("interrupted_at", [1, 3])
def test_ctrl_c_during_a_checkpoint_write_stays_an_interruption(tmp_path, interrupted_at):
    """Ctrl-C inside ``torch.save`` made its zip writer's cleanup raise RuntimeError ("unexpected pos"), which
    replaced the KeyboardInterrupt: the interrupted job read as failed and a Hydra sweep went on with its next job.
    The interruption comes through, and the previous file is kept."""
    import io

    from unsparse.atomic import atomic_write

    class Interrupting(io.RawIOBase):
        """A file whose ``interrupted_at``-th write raises KeyboardInterrupt, as Ctrl-C there would."""

        def __init__(self, file) -> None:
            super().__init__()
            self.file, self.calls = file, 0

        def writable(self) -> bool:
            return True

        def write(self, data) -> int:
            self.calls += 1
            if self.calls == interrupted_at:
                raise KeyboardInterrupt
            return self.file.write(data)

    path = atomic_write(tmp_path / "dense.pt", lambda file: torch.save({"step": 1}, file))
    before = path.read_bytes()
    with pytest.raises(KeyboardInterrupt):
        atomic_write(path, lambda file: torch.save({"weight": torch.randn(1000)}, Interrupting(file)))
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["dense.pt"]
    with pytest.raises(BaseException) as raised:  # what torch itself raises: the case atomic_write undoes
        torch.save({"weight": torch.randn(1000)}, Interrupting(io.BytesIO()))
    assert raised.type is (KeyboardInterrupt if interrupted_at == 1 else RuntimeError)


def test_atomic_json_is_strict_json_with_null_for_nan_and_a_number_for_infinities(tmp_path):
    """Python's json wrote NaN and -Infinity (a diverged stage's metric, a pruning history's change), which
    loads_strict and other strict readers refuse; infinities were then written as null and read back as "not
    measured" (an infinite MSE); tuples still read as lists, finite values are kept."""
    from unsparse.atomic import atomic_write_json
    from unsparse.strict_json import loads_strict

    data = {"nan": math.nan, "values": [1.5, math.inf, -math.inf], "nested": {"pair": (2, math.nan)}, "flag": None}
    path = atomic_write_json(tmp_path / "report.json", data)
    assert loads_strict(path.read_text()) == {"nan": None, "values": [1.5, math.inf, -math.inf],
                                              "nested": {"pair": [2, None]}, "flag": None}
    assert math.isnan(data["nan"]) and isinstance(data["nested"]["pair"], tuple)  # the input is not modified
    with pytest.raises(TypeError):
        atomic_write_json(path, {"set": {1}})
    assert loads_strict(path.read_text())["values"] == [1.5, math.inf, -math.inf]  # a refused write leaves the file


def test_atomic_json_refuses_a_circular_reference_with_a_value_error(tmp_path):
    """dumps_strict said a circular reference raised ValueError (as json.dumps does), but its NaN-replacing walk
    recursed to Python's limit first and raised RecursionError; a list held twice, not inside itself, is no cycle."""
    from unsparse.atomic import atomic_write_json
    from unsparse.strict_json import loads_strict

    circular: list = [1.0]
    circular.append({"back": circular})
    with pytest.raises(ValueError, match="Circular reference"):
        atomic_write_json(tmp_path / "circular.json", {"data": circular})
    assert not (tmp_path / "circular.json").exists()
    shared = [math.nan, 2]
    path = atomic_write_json(tmp_path / "shared.json", {"a": shared, "b": (shared, shared)})
    assert loads_strict(path.read_text()) == {"a": [None, 2], "b": [[None, 2], [None, 2]]}


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
    (lambda t, m, layer: t.update({"extra.tensor": torch.zeros(2)}), "extra.tensor: a stored tensor the metadata does "
     "not declare"),
    (lambda t, m, layer: t[f"{layer}.values"].view(-1).__setitem__(0, float("nan")), "non-finite"),
    (lambda t, m, layer: t["0.1.running_var"].view(-1).__setitem__(0, -1.0), "0.1.running_var: negative"),
    (lambda t, m, layer: (t.update({"0.1.weight": t["0.1.weight"].half()}),
                          m["tensors"]["0.1.weight"].update(dtype="float16")), "several dtypes"),
    (lambda t, m, layer: m["tensors"]["0.1.weight"].update(dtype=["float32"]), r"0.1.weight: unknown dtype"),
    (lambda t, m, layer: t.update({"0.1.num_batches_tracked": t["0.1.num_batches_tracked"].int()}),
     "num_batches_tracked: dtype"),
    (lambda t, m, layer: m["layers"][layer].update(row_length=10**6), f"layers.{'0.0'}.row_length"),
    (lambda t, m, layer: m["layers"][layer].update(row_length="3"), "row_length"),
    (lambda t, m, layer: m["layers"][layer]["geometry"].update(stride=[float("inf"), 1]),
     r"layers.0.0.geometry: stride must be an integer, got inf"),
    # a recorded sparsity off by far less than a percent describes another model too (a mutation audit's find)
    (lambda t, m, layer: m["layers"][layer].update(sparsity=m["layers"][layer]["sparsity"] + 1e-6),
     "layers.0.0.sparsity: recorded"),
    (lambda t, m, layer: m["layers"][layer].update(sparsity=m["layers"][layer]["sparsity"] - 1e-6),
     "layers.0.0.sparsity: recorded"),
    # NaN is read (a run's metric in extra may be NaN), and every checked field refuses it
    (lambda t, m, layer: m["layers"][layer].update(sparsity=float("nan")), "layers.0.0.sparsity: recorded nan"),
    (lambda t, m, layer: m["layers"][layer]["geometry"].update(groups="1"),
     r"layers.0.0.geometry: groups must be an integer, got '1'"),
    (lambda t, m, layer: m["layers"][layer]["geometry"].update(padding=[1.0, 1]), "padding must be an integer"),
    (lambda t, m, layer: m["layers"][layer]["geometry"].update(dilation=[1, True]), "dilation must be an integer"),
    (lambda t, m, layer: m["layers"][layer]["geometry"].update(stride="11"), "stride must be a list of two"),
    (lambda t, m, layer: m.update(format_version=True), "format_version"),
    (lambda t, m, layer: m["layers"][layer].update(nnz=m["layers"][layer]["nnz"] + 1), "layers.0.0.nnz: recorded"),
    (lambda t, m, layer: m["layers"][layer].update(nnz=None), "layers.0.0.nnz"),
    (lambda t, m, layer: m["layers"][layer].update(sparsity=0.0), "layers.0.0.sparsity: recorded 0.0"),
    (lambda t, m, layer: m["layers"][layer].update(sparsity="0.9"), "layers.0.0.sparsity"),
    (lambda t, m, layer: t[f"{layer}.values"].view(-1).__setitem__(0, 0.0), "layers.0.0.nnz"),
    (lambda t, m, layer: m["model"]["kwargs"].update(width=-1), "model: cannot build"),
    (lambda t, m, layer: m["tensors"]["0.1.running_mean"].update(shape=[8.0]), "0.1.running_mean: bad entry"),
    (lambda t, m, layer: m["extra"].update(nested=json.loads("[" * 200 + "]" * 200)), None),
    # keys the format does not define were loaded and kept (a helper's finds)
    (lambda t, m, layer: m.update(comment="x"), r"metadata: unexpected keys \['comment'\]"),
    (lambda t, m, layer: m["layers"][layer].update(density=0.1), r"layers.0.0: keys \[.*'density'"),
    (lambda t, m, layer: m["tensors"]["0.1.running_mean"].update(note=1), "0.1.running_mean: bad entry"),
    (lambda t, m, layer: m["tensors"]["0.1.running_mean"].pop("codec"), "0.1.running_mean: bad entry"),
    (lambda t, m, layer: m["tensors"]["0.1.running_mean"]["codec"].update(bits=3),
     r"0.1.running_mean: codec params \['bits', 'name'\], expected \['name'\]"),
    (lambda t, m, layer: m["model"].update(version=2), "model: bad model spec"),
    (lambda t, m, layer: m["layers"][layer].update(weight_shape=[float(d) for d in m["layers"][layer]["weight_shape"]]),
     "layers.0.0.weight_shape"),
    # a stored part far larger than its tensor was read in full before any check
    (lambda t, m, layer: t.update({"0.1.running_mean::big": torch.zeros(2**19)}),
     r"0.1.running_mean: 2097184 stored bytes; a tensor of shape \[8\] needs at most 1048640"),
])
def test_malformed_files_raise_value_errors_naming_the_field(tmp_path, exported, mutate, field):
    tensors, metadata = read(exported[1])
    mutate(tensors, metadata, first_layer(exported))
    path = write(tmp_path / "bad.safetensors", tensors, metadata)
    if field is None:  # deep but valid JSON in the notes: loads
        load_sparse(path)
        return
    with pytest.raises(SparseFileError, match=field):
        load_sparse(path)


def test_rows_padded_beyond_the_largest_rows_nnz_are_refused(tmp_path, exported):
    """Every row is padded to the largest row's nnz (UnSparse-Opt §5; DESIGN.md, The format): a file with one more
    padding entry in every row (value 0 at a column the row does not use; nnz and sparsity unchanged) loaded, and
    every kernel multiplied through the extra column."""
    tensors, metadata = read(exported[1])
    name, layer = next((name, layer) for name, layer in sparse_layers(exported[0]).items()
                       if layer.csr.row_length < layer.csr.columns)
    L, values, col_idx = layer.csr.row_length, tensors[f"{name}.values"], tensors[f"{name}.col_idx"]
    unused = [min(set(range(layer.csr.columns)) - set(row.tolist())) for row in col_idx]
    tensors[f"{name}.values"] = torch.cat([values, torch.zeros(len(unused), 1)], dim=1)
    tensors[f"{name}.col_idx"] = torch.cat([col_idx, torch.tensor(unused, dtype=torch.int32)[:, None]], dim=1)
    metadata["layers"][name]["row_length"] = L + 1
    for key in (f"{name}.values", f"{name}.col_idx"):
        metadata["tensors"][key]["shape"] = list(tensors[key].shape)
    with pytest.raises(SparseFileError, match=rf"layers.{name}.row_length: {L + 1}, but the fullest row holds {L} "):
        load_sparse(write(tmp_path / "padded.safetensors", tensors, metadata))


@pytest.mark.parametrize("value", [None, 3e38])
def test_a_row_naming_a_column_twice_is_refused(tmp_path, exported, value):
    """A row never names a column twice (format.py; from_dense and save_sparse never write one), but a file whose row
    named one twice loaded, each entry summed into the weight: with two finite entries of 3e38 the layer's weight was
    infinite (past the non-finite check, which reads the stored entries), and with its own values the recorded nnz,
    sparsity and row length counted an entry the dense weight does not have."""
    tensors, metadata = read(exported[1])
    name = first_layer(exported)
    values, col_idx = tensors[f"{name}.values"], tensors[f"{name}.col_idx"]
    row = int(((values != 0).sum(dim=1) >= 2).nonzero()[0])
    col_idx[row, 1] = col_idx[row, 0]
    if value is not None:
        values[row, :2] = value
    with pytest.raises(SparseFileError, match=rf"^{name}\.col_idx: row {row} names column {int(col_idx[row, 0])} "
                       "more than once"):
        load_sparse(write(tmp_path / "repeated.safetensors", tensors, metadata))


def test_save_refuses_a_row_naming_a_column_twice(tmp_path):
    """save_sparse runs the loader's checks: a hand-made layer that repeats a column (which the backends accept in
    memory, summing the entries) would be written into a file load_sparse refuses."""
    model = pruned_sparse_model(width=8)
    model[0][0].col_idx[0, 1] = model[0][0].col_idx[0, 0]
    with pytest.raises(ValueError, match=r"model: load_sparse would refuse its file \(0\.0\.col_idx: row 0 names"):
        save_sparse(model, tmp_path / "m.safetensors")
    assert not (tmp_path / "m.safetensors").exists()


def test_metadata_nested_beyond_the_parser_raises_a_file_error(tmp_path, exported):
    tensors, _ = read(exported[1])
    path = tmp_path / "deep.safetensors"
    path.write_bytes(save(tensors, metadata={"unsparse": "[" * 100_000 + "]" * 100_000}))
    with pytest.raises(SparseFileError, match="metadata: invalid JSON"):
        load_sparse(path)


def test_conv_bias_must_have_the_architectures_shape_and_a_floating_dtype(tmp_path):
    """A conv bias is checked against the architecture, not against itself: a shorter one would be read past its
    end by the GPU kernels, which read ``bias[m]`` for every output channel."""
    model = pruned_sparse_model("autoencoder1d", width=4)
    good = save_sparse(model, tmp_path / "ae.safetensors")
    tensors, metadata = read(good)
    key = next(k for k in tensors if k.endswith(".bias") and k.rpartition(".")[0] in sparse_layers(model))
    M = tensors[key].shape[0]
    for bad, dtype, match in [(tensors[key][:1], "float32", rf"{key}: shape \[1\], architecture needs \[{M}\]"),
                              (tensors[key][:, None], "float32", f"{key}: shape"),
                              (tensors[key].int(), "int32", f"{key}: dtype torch.int32")]:
        metadata["tensors"][key].update(shape=list(bad.shape), dtype=dtype)
        path = write(tmp_path / "bad.safetensors", {**tensors, key: bad.contiguous()}, metadata)
        with pytest.raises(SparseFileError, match=match):
            load_sparse(path)


def test_a_model_saved_in_float16_loads_in_float16(tmp_path):
    """The one-floating-dtype rule rejects mixed files, not a whole model kept in another dtype."""
    model = pruned_sparse_model(width=8).half()
    loaded = load_sparse(save_sparse(model, tmp_path / "half.safetensors"))
    assert {t.dtype for t in [*loaded.parameters(), *loaded.buffers()] if t.is_floating_point()} == {torch.float16}
    for name, layer in sparse_layers(loaded).items():
        assert torch.equal(layer.values, sparse_layers(model)[name].values)


def with_header(data: bytes, change) -> bytes:
    """``data`` (a safetensors file) with its JSON header changed in place by ``change(header)``, re-padded to 8
    bytes."""
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    change(header)
    text = json.dumps(header).encode()
    text = text.ljust(-(-len(text) // 8) * 8)
    return len(text).to_bytes(8, "little") + text + data[8 + length:]


def first_tensor(header: dict) -> dict:
    return header[next(k for k in header if k != "__metadata__")]


FIRST = r"^0\.1\.num_batches_tracked: "
"""A message naming the stored key of :func:`first_tensor` (keys are stored sorted)."""


@pytest.mark.parametrize(("change", "match"), [
    (lambda h: h.update(__metadata__=None), "metadata: no 'unsparse' string"),
    (lambda h: h.update(__metadata__=[1, 2]), r"^header\.__metadata__: \[1, 2\]: expected an object of strings"),
    (lambda h: h["__metadata__"].update(other=1), r"^header\.__metadata__: .*: expected an object of strings"),
    (lambda h: h.update(__metadata__=[]), r"^header\.__metadata__: \[\]: expected an object of strings"),
    (lambda h: h.pop("__metadata__"), "metadata: no 'unsparse' string"),
    (lambda h: h["__metadata__"].pop("unsparse"), "metadata: no 'unsparse' string"),
    (lambda h: first_tensor(h).update(dtype="F4"), FIRST + r"stored dtype 'F4', expected one of"),
    (lambda h: first_tensor(h).update(dtype=7), FIRST + r"stored dtype 7, expected one of"),
    (lambda h: first_tensor(h).update(dtype="F8_E4M3"), FIRST + r"stored dtype 'F8_E4M3', expected one of"),
    (lambda h: first_tensor(h).update(shape=[-1]), FIRST + r"shape \[-1\]: expected a list of integers"),
    (lambda h: first_tensor(h).update(note=1), FIRST + r"header entry .*: expected the keys"),
    (lambda h: first_tensor(h).update(data_offsets=[8, 4]), FIRST + r"data_offsets \[8, 4\]: expected"),
    (lambda h: first_tensor(h).update(data_offsets=[0, 4]), FIRST + r"data_offsets \[0, 4\] hold 4 bytes"),
    (lambda h: h.update(extra={"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}),
     r"data_offsets start at \d+, where the tensors before it \(in offset order\) end at"),
    (lambda h: h.update(extra={"dtype": "U8", "shape": [0], "data_offsets": [2**40, 2**40]}),
     r"^extra: data_offsets start at 1099511627776, where"),
    (lambda h: h.update(empty={"dtype": "F32", "shape": [0, 2**62, 4], "data_offsets": [0, 0]}),
     r"^empty: shape \[0, 4611686018427387904, 4\]: expected"),  # zero bytes, but a stride beyond int64
    (lambda h: h.update({"0.1.running_mean::x": {"dtype": "F32", "shape": [0, 2**62, 4], "data_offsets": [0, 0]}}),
     r"^0\.1\.running_mean::x: shape \[0, 4611686018427387904, 4\]: expected"),  # the same, under a declared key
    (lambda h: h.update({"0.1.running_mean::x": {"dtype": "F32", "shape": [2**62, 2**62, 0], "data_offsets": [0, 0]}}),
     r"^0\.1\.running_mean::x: shape \[4611686018427387904, 4611686018427387904, 0\]: expected"),  # numel overflows
    (lambda h: h.update({"0.1.running_mean::x": {"dtype": "F32", "shape": [2**40, 2**40, 0], "data_offsets": [0, 0]}}),
     r"^0\.1\.running_mean::x: shape \[1099511627776, 1099511627776, 0\]: expected"),
    (lambda h: h.update(empty={"dtype": "F32", "shape": [0, 2**70], "data_offsets": [0, 0]}),
     r"^empty: shape \[0, 1180591620717411303424\]: expected a list of integers in \[0, 2\^63\)"),  # zero bytes
    (lambda h: h.update({"0.1.running_mean::x": {"dtype": "F32", "shape": [0, 2**64 - 1], "data_offsets": [0, 0]}}),
     r"^0\.1\.running_mean::x: shape \[0, 18446744073709551615\]: expected"),  # safetensors' usize, beyond int64
])
def test_malformed_safetensors_headers_raise_naming_the_field(tmp_path, exported, change, match):
    """Found by fuzzing the loader: a null metadata block raised AttributeError, an unknown dtype name KeyError, and
    empty tensors of shapes beyond int64 RuntimeError or TypeError (one of 2^64 - 1, which safetensors' header reader
    took, still TypeError in torch's reshape; one of sizes below 2^63 whose product overflows int64 before its 0,
    [2^62, 2^62, 0], RuntimeError 'numel: integer multiplication overflow' when a declared key's part was read).
    The header is checked by the loader (safetensors' reader memory-maps the file), each problem naming the stored
    key."""
    path = tmp_path / "bad.safetensors"
    path.write_bytes(with_header(exported[1].read_bytes(), change))
    with pytest.raises(SparseFileError, match=match):
        load_sparse(path)


def test_a_shape_of_many_huge_sizes_is_refused_without_multiplying_them_out(tmp_path, exported):
    """The header's shapes were multiplied out in full (Python integers, a multiplication per size, each as long as
    the product so far): a 1 MB header with one shape of 50,000 sizes of 2^62 took 9 s, and the 12 MiB a header may
    hold about 20 minutes. The product stops once it passes 2^63."""
    import time

    path = tmp_path / "long.safetensors"
    shape = [2**62] * 50_000 + [0]
    path.write_bytes(with_header(exported[1].read_bytes(), lambda h: h.update(
        {"0.1.running_mean::x": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}})))
    start = time.perf_counter()
    with pytest.raises(SparseFileError, match=r"^0\.1\.running_mean::x: shape \[4611686018427387904, "):
        load_sparse(path)
    assert time.perf_counter() - start < 2.0


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")
def test_an_architecture_with_empty_layers_is_refused(tmp_path, exported):
    """Found by fuzzing: a zero width built a model whose layers have no channels, which loaded and then failed in
    the forward pass (batch norm's IndexError)."""
    tensors, metadata = read(exported[1])
    metadata["model"]["kwargs"]["width"] = 0
    path = write(tmp_path / "w0.safetensors", tensors, metadata)
    with pytest.raises(SparseFileError, match=r"model: cannot build 'vgg_small' .*model.width: expected an integer"):
        load_sparse(path)


def test_file_tensor_bytes_rejects_headers_beyond_the_file(tmp_path, exported):
    from unsparse.sparse.io import file_tensor_bytes

    data = exported[1].read_bytes()
    sizes = file_tensor_bytes(exported[1])
    assert sum(sizes.values()) == len(data) - 8 - int.from_bytes(data[:8], "little")
    path = tmp_path / "h.safetensors"
    path.write_bytes((2**36).to_bytes(8, "little") + data[8:])
    with pytest.raises(SparseFileError, match="header"):
        file_tensor_bytes(path)
    header_length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + header_length])
    key = next(k for k in header if k != "__metadata__")
    header[key]["data_offsets"] = header[key]["data_offsets"][::-1]
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= header_length  # safetensors writes compact JSON, padded with spaces
    path.write_bytes(data[:8] + text.ljust(header_length) + data[8 + header_length:])
    with pytest.raises(SparseFileError, match=rf"^{re.escape(key)}: data_offsets \[\d+, 0\]: expected \[start, end\]"):
        file_tensor_bytes(path)


def test_a_path_that_is_no_regular_file_is_refused_without_reading_it(tmp_path, exported):
    """A FIFO blocked the loader for good and a link to /dev/zero read until memory ran out (a helper's finds)."""
    import os
    import threading

    fifo, device_link = tmp_path / "fifo", tmp_path / "device.safetensors"
    os.mkfifo(fifo)
    device_link.symlink_to("/dev/null")
    errors = []

    def load_all():
        for path in (fifo, device_link, tmp_path):
            try:
                load_sparse(path)
            except SparseFileError as error:
                errors.append(str(error))

    worker = threading.Thread(target=load_all, daemon=True)  # a blocked read cannot hang the test run
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive() and len(errors) == 3
    assert all("is not a regular file" in error for error in errors)


def test_the_file_checked_is_the_file_read(tmp_path, monkeypatch, exported):
    """The loader checked the path with a stat and then opened the path again: a file put there in between (here a
    valid one with other notes; a FIFO or a device would block it or read without end) was read unchecked."""
    import os

    from unsparse.sparse import safetensors_file

    checked, other = tmp_path / "checked.safetensors", tmp_path / "other.safetensors"
    checked.write_bytes(exported[1].read_bytes())
    save_sparse(exported[0], other, extra={"note": "other"})
    real_check_header = safetensors_file._check_header

    def check_then_swap(*args, **kwargs):  # after the open file's checks, before its tensors are read
        checked_header = real_check_header(*args, **kwargs)
        if other.exists():
            os.replace(other, checked)
        return checked_header

    monkeypatch.setattr(safetensors_file, "_check_header", check_then_swap)
    assert load_sparse(checked).unsparse_metadata["extra"] == {"note": "test"}
    assert load_sparse(checked).unsparse_metadata["extra"] == {"note": "other"}  # the path names the other file now


TRUNCATED_WHILE_OPEN = """
import os, sys
from unsparse import SparseFileError, load_sparse
from unsparse.sparse import safetensors_file
path, cut = sys.argv[1], int(sys.argv[2])
real_check_header = safetensors_file._check_header

def check_then_truncate(*args, **kwargs):  # after the header's checks, before any tensor is read
    checked_header = real_check_header(*args, **kwargs)
    os.truncate(path, cut)
    return checked_header

safetensors_file._check_header = check_then_truncate
try:
    load_sparse(path)
except SparseFileError as error:
    print("refused:", error)
"""


def test_a_file_truncated_while_it_is_read_is_refused_not_a_crash(tmp_path, exported):
    """safetensors memory-maps the file; a file cut short after the checks (another process rewriting it in place)
    killed the loader with SIGBUS as it read a tensor past the new end. The child process is the one that would
    die. (The file is cut after its header was read: the header is at the length it was, its tensors are not.)"""
    import subprocess
    import sys

    data = exported[1].read_bytes()
    path = tmp_path / "cut.safetensors"
    path.write_bytes(data)
    data_start = 8 + int.from_bytes(data[:8], "little")
    done = subprocess.run([sys.executable, "-c", TRUNCATED_WHILE_OPEN, str(path), str(data_start + 4)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"exit status {done.returncode}: {done.stderr[-2000:]}"
    assert done.stdout.startswith("refused: file: ") and "ended before" in done.stdout


def test_a_file_rewritten_in_place_while_it_is_read_is_refused(tmp_path, monkeypatch, exported):
    """Another process rewriting the file in place (the same inode) while the loader reads it: the loader read its
    first tensor from one model and the rest from another (here the same model with every sparse weight doubled, so
    the header is the same byte for byte) and loaded the mix. A file whose size or modification time changed between
    its open and its last read is refused. (A rewrite that keeps the size within the file system's timestamp
    granularity of the open, a clock tick of some ms, is not seen: here the rewrite's time is a second later.)"""
    import copy
    import os

    from unsparse.sparse import safetensors_file

    model, source = exported
    path, other = tmp_path / "read.safetensors", tmp_path / "other.safetensors"
    path.write_bytes(source.read_bytes())
    doubled = copy.deepcopy(model)
    for layer in sparse_layers(doubled).values():
        layer.values.mul_(2)
    save_sparse(doubled, other, extra={"note": "test"})
    data, rewritten = path.read_bytes(), other.read_bytes()
    data_start = 8 + int.from_bytes(data[:8], "little")
    assert rewritten[:data_start] == data[:data_start] and rewritten != data
    real_tensor = safetensors_file.OpenFile.tensor

    def read_then_rewrite(self, stored_key):
        tensor = real_tensor(self, stored_key)
        if other.exists():  # after the first tensor
            with open(path, "r+b") as file:
                file.write(other.read_bytes())
            other.unlink()
            modified = path.stat().st_mtime_ns + 10**9
            os.utime(path, ns=(modified, modified))
        return tensor

    monkeypatch.setattr(safetensors_file.OpenFile, "tensor", read_then_rewrite)
    with pytest.raises(SparseFileError, match=r"^file: .* changed while it was read"):
        load_sparse(path)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads Linux's /proc/self/maps")
def test_no_byte_of_the_file_is_read_through_a_memory_map(tmp_path, monkeypatch, exported):
    """A memory-mapped file cut short by another process (rewriting it in place) kills the reader with SIGBUS at its
    first access past the new end, where a read returns fewer bytes. safetensors' safe_open mapped the file and
    parsed its header in the map (up to 12 MB of JSON: time enough for a rewrite to land); a process rewriting a
    file of a 3 MB header in place in a loop killed a loop of load_sparse (exit status -7, in safe_open) within a few
    hundred loads. So the file is not mapped while it is open for loading."""
    from unsparse.sparse import load

    path = tmp_path / "m.safetensors"
    path.write_bytes(exported[1].read_bytes())
    maps = []
    real_read_parts = load._read_parts

    def read_parts_seeing_the_maps(*args, **kwargs):  # the file open, its header parsed, its tensors to be read
        maps.append(Path("/proc/self/maps").read_text())
        return real_read_parts(*args, **kwargs)

    monkeypatch.setattr(load, "_read_parts", read_parts_seeing_the_maps)
    load_sparse(path)
    assert len(maps) == 1 and str(path.resolve()) not in maps[0]


def safetensors_by_hand(tensors: dict[str, torch.Tensor], metadata: str, twice: str = "") -> bytes:
    """A safetensors file written byte by byte: the 8-byte little-endian header length, the JSON header, the data
    (``tensors`` in order). The header holds ``metadata`` (the text of the ``__metadata__`` object, so that a key
    may repeat), an entry per tensor, and the entry of tensor ``twice`` once more."""
    from unsparse.sparse.io import STORED_DTYPES

    names = {dtype: name for name, dtype in STORED_DTYPES.items()}
    entries, data = [f'"__metadata__":{metadata}'], b""
    for key, tensor in tensors.items():
        raw = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        entry = json.dumps(key) + ":" + json.dumps({"dtype": names[tensor.dtype], "shape": list(tensor.shape),
                                                    "data_offsets": [len(data), len(data) + len(raw)]})
        entries += [entry, entry] if key == twice else [entry]
        data += raw
    header = ("{" + ",".join(entries) + "}").encode()
    return len(header).to_bytes(8, "little") + header + data


@pytest.mark.parametrize(("twice", "match"), [
    ("", r"header: duplicate keys \['unsparse'\]"),
    ("0.1.running_mean", r"header: duplicate keys \['0.1.running_mean'\]"),
])
def test_a_safetensors_header_with_duplicate_keys_is_refused(tmp_path, exported, twice, match):
    """safetensors keeps the last of duplicate keys: a second "unsparse" metadata entry replaced the first, and a
    tensor's second entry its first, unseen by the loader and by every other reader of the header."""
    from unsparse.sparse.io import file_tensor_bytes

    tensors, metadata = read(exported[1])
    first, second = json.dumps(metadata), json.dumps({**metadata, "extra": {"note": "second"}})
    block = f'{{"unsparse":{json.dumps(first)}' + ("}" if twice else f',"unsparse":{json.dumps(second)}}}')
    path = tmp_path / "once.safetensors"
    path.write_bytes(safetensors_by_hand(tensors, json.dumps({"unsparse": first})))
    assert load_sparse(path).unsparse_metadata == metadata  # written by hand, each key once: a valid file
    path.write_bytes(safetensors_by_hand(tensors, block, twice))
    with pytest.raises(SparseFileError, match=match):
        load_sparse(path)
    with pytest.raises(SparseFileError, match=match):
        file_tensor_bytes(path)


def test_a_header_longer_than_the_loader_parses_is_refused_on_load_and_on_save(tmp_path, monkeypatch, exported):
    from unsparse.sparse import safetensors_file, save

    length = int.from_bytes(exported[1].read_bytes()[:8], "little")
    for module in (safetensors_file, save):  # the reader's bound and the writer's, one constant of the schema
        monkeypatch.setattr(module, "HEADER_MAX_BYTES", length - 1)
    with pytest.raises(SparseFileError, match=rf"header: {length} bytes, more than {length - 1}"):
        load_sparse(exported[1])
    with pytest.raises(ValueError, match=rf"model: a safetensors header of {length} bytes .* more than the "
                       rf"{length - 1} load_sparse reads"):
        save_sparse(exported[0], tmp_path / "m.safetensors", extra={"note": "test"})


@pytest.mark.parametrize(("edit", "match"), [
    (lambda raw: raw[:-1] + ', "layers": {}}', r"duplicate keys \['layers'\]"),  # the last one won, unchecked
    (lambda raw: raw[:-1] + ', "pad": "' + "x" * 4 * 2**20 + '"}', r"metadata: \d+ characters, more than 4194304"),
])
def test_metadata_that_python_reads_but_the_format_does_not_allow_is_refused(tmp_path, exported, edit, match):
    tensors, metadata = read(exported[1])
    path = tmp_path / "bad.safetensors"
    path.write_bytes(save(tensors, metadata={"unsparse": edit(json.dumps(metadata))}))
    with pytest.raises(SparseFileError, match=match):
        load_sparse(path)


def test_notes_with_nan_metrics_round_trip_and_notes_json_cannot_hold_are_refused_on_save(tmp_path):
    """The main job stores its metrics in extra; a NaN metric (a diverged autoencoder) was saved and then refused by
    the strict loader, after all the training (a reread's find)."""
    model = pruned_sparse_model(width=8)
    loaded = load_sparse(save_sparse(model, tmp_path / "m.safetensors", extra={"accuracy": {"pruned": math.nan}}))
    assert math.isnan(loaded.unsparse_metadata["extra"]["accuracy"]["pruned"])
    with pytest.raises(ValueError, match=r"extra: not JSON the loader reads back \(duplicate keys \['1'\]\)"):
        save_sparse(model, tmp_path / "n.safetensors", extra={1: "a", "1": "b"})
    with pytest.raises(ValueError, match="extra: metadata of"):
        save_sparse(model, tmp_path / "n.safetensors", extra={"pad": "x" * 4 * 2**20})
    nested: list = []
    for _ in range(3000):  # deeper than json.dumps goes: its RecursionError escaped save_sparse
        nested = [nested]
    with pytest.raises(ValueError, match=r"extra: not JSON \(maximum recursion depth"):
        save_sparse(model, tmp_path / "n.safetensors", extra={"nested": nested})
    with pytest.raises(ValueError, match=r"extra: not JSON \(Object of type int64"):
        save_sparse(model, tmp_path / "n.safetensors", extra={"epochs": torch.tensor(2).numpy()[()]})
    assert not (tmp_path / "n.safetensors").exists()


def test_a_tensor_stored_in_more_parts_than_any_codec_writes_is_refused(tmp_path, exported):
    """Parts of zero bytes pass the byte bound; 200,000 of them took 173 MB before the codec refused them."""
    tensors, metadata = read(exported[1])
    tensors.update({f"0.1.running_mean::p{index}": torch.zeros(0) for index in range(3)})
    with pytest.raises(SparseFileError, match=r"0.1.running_mean: more than 3 stored parts"):
        load_sparse(write(tmp_path / "bad.safetensors", tensors, metadata))


@pytest.mark.parametrize("offsets", [["0", "4"], [0.0, 4.0], [True, 4]])
def test_file_tensor_bytes_refuses_offsets_that_are_no_integers(tmp_path, exported, offsets):
    """They were converted with int() and gave sizes adding up to more than the data (a helper's find)."""
    from unsparse.sparse.io import file_tensor_bytes

    def change(header):
        first_tensor(header)["data_offsets"] = offsets

    path = tmp_path / "h.safetensors"
    path.write_bytes(with_header(exported[1].read_bytes(), change))
    with pytest.raises(SparseFileError, match=FIRST + r"data_offsets .*: expected \[start, end\], integers"):
        file_tensor_bytes(path)


@pytest.mark.parametrize(("change", "match"), [
    (lambda model: model[0][0].values.view(-1).__setitem__(0, float("nan")), r"0.0.values: non-finite values"),
    (lambda model: model[0][1].running_var.fill_(-1.0), r"0.1.running_var: negative running variance"),
    (lambda model: model[0][0].values[:, -1].zero_(), r"layers.0.0.row_length: \d+, but the fullest row holds"),
])
def test_save_refuses_values_the_loader_would_refuse(tmp_path, change, match):
    """The file was written, and load_sparse then refused it (a helper's find)."""
    model = pruned_sparse_model(width=8)
    change(model)
    with pytest.raises(ValueError, match=f"model: load_sparse would refuse its file .*{match}"):
        save_sparse(model, tmp_path / "m.safetensors")
    assert not (tmp_path / "m.safetensors").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize(("device", "match"), [("bogus", "device: 'bogus' is not a device"),
                                               ("cuda", "device: 'cuda', but CUDA is not available")])
def test_a_device_the_model_cannot_go_to_is_refused_before_the_file_is_read(tmp_path, device, match):
    with pytest.raises(ValueError, match=match):
        load_sparse(tmp_path / "absent.safetensors", device=device)


class SharedConvs(torch.nn.Module):
    """One conv under two names in different parents (``first.0``, ``second.0``) and one under two names of one
    parent (``head``, ``head_alias``), each called twice per forward."""

    def __init__(self) -> None:
        super().__init__()
        conv = torch.nn.Conv2d(1, 4, 3, padding=1)
        self.first, self.second = torch.nn.Sequential(conv, torch.nn.ReLU()), torch.nn.Sequential(conv)
        self.head = self.head_alias = torch.nn.Conv2d(4, 4, 3, padding=1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head_alias(torch.relu(self.head(self.second(self.first(x).mean(1, keepdim=True)))))


@pytest.mark.parametrize("quantizer", [None, "linear"])
def test_a_model_with_shared_convs_round_trips_with_its_layers_shared(tmp_path, monkeypatch, quantizer):
    """sparsify keeps a conv reachable under several names one shared SparseConv (as the dense model has it); the
    loader's shell gave each name in another parent its own layer and left a second name in one parent dense, so
    save_sparse refused every such model ("load_sparse would refuse its file"), where a conv shared by two parents
    saved and loaded before sparsify shared it."""
    from unsparse.models import registry
    from unsparse.quant import LinearQuantizer

    monkeypatch.setitem(registry._MODELS, "shared_convs", SharedConvs)
    torch.manual_seed(0)
    model = create_model("shared_convs")
    pruner = MagnitudePruner(0.5)
    pruner.prepare(model)
    pruner.step()
    sparse = sparsify(model.eval())
    x = torch.randn(2, 1, 8, 8)
    if quantizer:
        sparse = LinearQuantizer(progress=False).quantize(sparse, [(x, torch.zeros(2, dtype=torch.int64))])
    loaded = load_sparse(save_sparse(sparse, tmp_path / "shared.safetensors"))
    assert loaded.first[0] is loaded.second[0] and loaded.head is loaded.head_alias
    with torch.no_grad():
        assert torch.equal(loaded(x), sparse(x))


def test_a_shared_layers_file_bytes_count_its_copies_under_every_name(tmp_path, monkeypatch):
    """The file stores a layer reachable under several names once per name (safetensors holds no shared tensors);
    layer_file_bytes counted only its first name's copy, so the report's rows left the others unattributed (their sum
    was half of what the file spends on these layers). Now one entry per layer, under its first name, counts every
    copy: each stored byte of a layer is counted once, in one entry; layer_names lists the names."""
    from unsparse.models import registry
    from unsparse.report.layers import layer_rows
    from unsparse.sparse.io import file_tensor_bytes, layer_file_bytes, layer_names

    monkeypatch.setitem(registry._MODELS, "shared_convs", SharedConvs)
    torch.manual_seed(0)
    model = sparsify(create_model("shared_convs"))
    path = save_sparse(model, tmp_path / "shared.safetensors")
    stored = file_tensor_bytes(path)
    names = {"first.0": ["first.0", "second.0"], "head": ["head", "head_alias"]}
    assert layer_names(model) == names
    expected = {name: sum(size for key, size in stored.items() for alias in aliases if key.startswith(f"{alias}."))
                for name, aliases in names.items()}
    assert expected["first.0"] == 2 * stored["first.0.values"] + 2 * stored["first.0.col_idx"] + 2 * 16  # 4 biases
    assert layer_file_bytes(model, path) == expected and sum(expected.values()) == sum(stored.values())
    assert {row["layer"]: row["file_bytes"] for row in layer_rows(model, path)} == expected
