"""load_sparse on systematically damaged files: every mutation of a valid file either loads as exactly the saved model
or raises SparseFileError (a ValueError) naming the field; never another exception type, a crash or another model.

Each valid file is written by save_sparse (Conv2d in float32 and float16, Conv1d with conv biases, grouped and
depthwise Conv2d and a grouped Conv1d, and the three quantization codecs: codebook, fixed point, float16); the
mutations are fixed (seeded), not random per run.
"""

from __future__ import annotations

import copy
import json
import os
import random
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save

from unsparse import SparseFileError, create_model, load_sparse, save_sparse, sparsify
from unsparse.models import registry
from unsparse.prune import MagnitudePruner
from unsparse.quant import ActivationSpec, FP16Quantizer, KMeansQuantizer, LinearQuantizer
from unsparse.quant.kmeans import FIT_SETTINGS
from unsparse.runtime import sparse_layers
from unsparse.sparse.io import HEADER_MAX_BYTES

FIELD = re.compile(r"^.+?: \S", re.DOTALL)
"""A SparseFileError message starts with the field it names (``layers.0.0.nnz: ...``, ``file: ...``; a stored key
may hold any character)."""
DELETE = object()
"""In a JSON edit: remove the entry instead of replacing its value."""
BAD_VALUES = [-1, 0, 2**31 - 1, 2**64, 1.5, float("nan"), "1", None, True, [], {}, [[1]], DELETE]
"""Values put in place of every kind of metadata and header field."""


class GroupedConvs(torch.nn.Module):
    """Grouped convolutions for 1 x 28 x 28 inputs (registered as ``grouped_convs`` while this file runs): a dense
    stem, a depthwise Conv2d (``groups == in_channels``, 9 weights per filter), a strided Conv2d of two groups without
    bias and a Conv1d of four groups over the rows' means."""

    def __init__(self, width: int = 3) -> None:  # not the width the files use: one without it describes another model
        super().__init__()
        channels = 2 * width
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(1, channels, 3, padding=1), torch.nn.BatchNorm2d(channels))
        self.depthwise = torch.nn.Conv2d(channels, channels, 3, padding=1, groups=channels)
        self.grouped = torch.nn.Conv2d(channels, 2 * channels, 3, stride=2, padding=1, groups=2, bias=False)
        self.rows = torch.nn.Conv1d(2 * channels, 2 * channels, 3, padding=1, groups=4)
        self.classifier = torch.nn.Linear(2 * channels, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.grouped(torch.relu(self.depthwise(torch.relu(self.stem(x))))))
        return self.classifier(torch.relu(self.rows(x.mean(2))).mean(2))


@pytest.fixture(scope="module")
def grouped_registered() -> Iterator[None]:
    """``grouped_convs`` in the model registry for this file's tests (load_sparse builds the architecture by name)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(registry._MODELS, "grouped_convs", GroupedConvs)
        yield


def pruned(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = create_model(name, width=4)
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm1d | torch.nn.BatchNorm2d):
            module.running_mean.uniform_(-1, 1)
            module.running_var.uniform_(0.5, 2)
    pruner = MagnitudePruner(0.9, scope="layer")
    pruner.prepare(model)
    pruner.step()
    return sparsify(model.eval())


def calibration() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(8, 1, 28, 28, generator=torch.Generator().manual_seed(1)), torch.zeros(8, dtype=torch.int64))]


BUILDERS: dict[str, Callable[[], torch.nn.Module]] = {
    "fp32": lambda: pruned("vgg_small"),
    "fp16": lambda: pruned("vgg_small").half(),
    "conv1d": lambda: pruned("autoencoder1d"),
    "codebook": lambda: KMeansQuantizer(centroid_bits=8, n_init=1, progress=False).quantize(pruned("vgg_small"),
                                                                                            calibration()),
    "fixed_point": lambda: LinearQuantizer(bits=4, power_of_two=True, progress=False, activations=ActivationSpec(
        format="fixed", bits=6, power_of_two=True)).quantize(pruned("vgg_small"), calibration()),
    "float16": lambda: FP16Quantizer(progress=False).quantize(pruned("vgg_small"), calibration()),
    "grouped": lambda: pruned("grouped_convs"),
    "grouped_codebook": lambda: KMeansQuantizer(centroid_bits=8, n_init=1, progress=False).quantize(
        pruned("grouped_convs"), calibration()),
}


class Saved:
    """A valid file: its bytes, stored tensors and metadata block, the model load_sparse makes of it, and the model
    it was saved from (``source``)."""

    def __init__(self, path: Path, source: torch.nn.Module) -> None:
        self.source = source
        self.data = path.read_bytes()
        self.header_length = int.from_bytes(self.data[:8], "little")
        self.header = json.loads(self.data[8:8 + self.header_length])
        with safe_open(str(path), "pt") as file:
            self.tensors = {key: file.get_tensor(key) for key in file.keys()}  # noqa: SIM118 (not a dict)
            self.metadata = json.loads(file.metadata()["unsparse"])
        self.model = load_sparse(path)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory, grouped_registered: None) -> dict[str, Saved]:
    folder = tmp_path_factory.mktemp("valid")
    models = {name: build() for name, build in BUILDERS.items()}
    return {name: Saved(save_sparse(model, folder / f"{name}.safetensors", extra={"note": "test"}), model)
            for name, model in models.items()}


class Loader:
    """Loads damaged bytes from one path and records every outcome the contract does not allow."""

    def __init__(self, path: Path) -> None:
        self.path, self.defects = path, []

    def check(self, data: bytes, original: Saved, label: str, may_load: bool = True) -> None:
        """``data`` must raise SparseFileError naming a field, or (``may_load``) load as ``original``'s model (its
        notes in ``extra`` aside: free text, a byte there is benign)."""
        self.path.write_bytes(data)
        try:
            model = load_sparse(self.path)
        except SparseFileError as error:
            if not FIELD.match(str(error)):
                self.defects.append(f"{label}: message names no field: {error}")
            return
        except Exception as error:  # any other type is the defect being looked for
            self.defects.append(f"{label}: {type(error).__name__}: {error}")
            return
        if not may_load:
            self.defects.append(f"{label}: loaded")
        elif not same_model(model, original.model):
            self.defects.append(f"{label}: loaded as another model")

    def check_metadata(self, metadata: Any, original: Saved, label: str, may_load: bool = True) -> None:
        text = metadata if isinstance(metadata, str) else json.dumps(metadata)
        self.check(save(original.tensors, metadata={"unsparse": text}), original, label, may_load)

    def check_header(self, header: Any, original: Saved, label: str) -> None:
        """The file with its safetensors header replaced by ``header`` (JSON, padded to 8 bytes), data unchanged."""
        text = json.dumps(header).encode()
        text = text.ljust(-(-len(text) // 8) * 8)
        self.check(len(text).to_bytes(8, "little") + text + original.data[8 + original.header_length:], original,
                   label)


@pytest.fixture
def loader(tmp_path: Path) -> Iterator[Loader]:
    checker = Loader(tmp_path / "damaged.safetensors")
    yield checker
    assert not checker.defects, f"{len(checker.defects)} defects:\n" + "\n".join(checker.defects[:30])


CALIBRATION = {"quantile", "bins", "calibration_batches", "rule"}
"""Fields of an activation description that record how its saturation (a stored tensor) was calibrated: free to
differ, as the notes are (``rule`` may be absent: files older than the field)."""


def described(metadata: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``metadata`` less the notes, calibration records, k-means fit settings (how the codebooks were made, not what
    they hold) and codec steps, and the steps by tensor key: a step is the weights' scale, data as much as the stored
    codes are, so a file whose step changed loads another model."""
    metadata = copy.deepcopy({key: value for key, value in metadata.items() if key != "extra"})
    quantization = metadata["quantization"] or {}
    activations, weights = quantization.get("activations"), quantization.get("weights")
    for key in CALIBRATION if isinstance(activations, dict) else ():
        activations.pop(key, None)
    for key in FIT_SETTINGS if quantization.get("scheme") == "kmeans" and isinstance(weights, dict) else ():
        weights.pop(key, None)
    return metadata, {key: entry["codec"].pop("step", None) for key, entry in metadata["tensors"].items()}


def same_model(model: torch.nn.Module, original: torch.nn.Module) -> bool:
    """``model`` computes as ``original`` does: the same tensors and description, but where a layer's step differs
    (:func:`described`), its values scaled by it."""
    (metadata, steps), (expected, saved_steps) = described(model.unsparse_metadata), described(
        original.unsparse_metadata)
    state, reference = model.state_dict(), original.state_dict()
    return (state.keys() == reference.keys() and metadata == expected
            and all(state[key].dtype == reference[key].dtype
                    and (torch.equal(state[key], reference[key]) or steps.get(key) != saved_steps.get(key))
                    for key in state))


def json_paths(value: Any, prefix: tuple = ()) -> Iterator[tuple]:
    """Every path into a JSON value, the root excluded, parents first."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        yield (*prefix, key)
        yield from json_paths(item, (*prefix, key))


def kind(path: tuple) -> tuple:
    """A path with its layer and tensor names reduced to what sets their checks (``tensors.3.0.values.shape.0`` ->
    ``tensors.values.shape.0``, ``layers.3.0.nnz`` -> ``layers.*.nnz``): one representative path of each kind is
    edited."""
    def reduced(key: Any) -> Any:
        if not isinstance(key, str) or "." not in key:
            return key
        last = key.rpartition(".")[2]
        return "*" if last.isdigit() else last

    return tuple(map(reduced, path))


def representatives(value: dict, skip: Callable[[tuple], bool], seed: str) -> list[tuple]:
    """One path of each :func:`kind` into ``value`` (not those ``skip`` names), chosen with ``seed``."""
    by_kind: dict[tuple, list[tuple]] = {}
    for path in json_paths(value):
        if not skip(path):
            by_kind.setdefault(kind(path), []).append(path)
    rng = random.Random(seed)
    return [rng.choice(paths) for paths in by_kind.values()]


def edited(value: Any, path: tuple, new: Any) -> Any:
    value = copy.deepcopy(value)
    parent = value
    for key in path[:-1]:
        parent = parent[key]
    if new is DELETE:
        del parent[path[-1]]
    else:
        parent[path[-1]] = new
    return value


def test_every_valid_file_loads_as_the_saved_model(saved, loader):
    """The oracle itself: an unchanged file loads as its model (else every mutation below would pass as refused)."""
    for name, original in saved.items():
        loader.check(original.data, original, name, may_load=True)
    assert {layer.values.dtype for layer in sparse_layers(saved["fp16"].model).values()} == {torch.float16}
    assert any(isinstance(module, torch.nn.Conv1d) for module in create_model("autoencoder1d").modules())
    for name in ("grouped", "grouped_codebook"):
        layers = sparse_layers(saved[name].model)
        assert {name: layer.geometry.groups for name, layer in layers.items()} == {
            "stem.0": 1, "depthwise": 8, "grouped": 2, "rows": 4}
        assert layers["depthwise"].weight_shape == (8, 1, 3, 3) and layers["rows"].geometry.spatial_dims == 1
        x = torch.randn(2, 1, 28, 28, generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            assert torch.equal(saved[name].model(x), saved[name].source(x))


@pytest.mark.parametrize("name", BUILDERS)
def test_a_file_cut_short_anywhere_is_refused(saved, loader, name):
    original = saved[name]
    size, data_start = len(original.data), 8 + original.header_length
    cuts = {*range(10), data_start - 1, data_start, data_start + 1, size - 1,
            *range(8, data_start, original.header_length // 12), *range(data_start, size, (size - data_start) // 12)}
    for cut in sorted(cuts):
        loader.check(original.data[:cut], original, f"{name} cut at {cut}", may_load=False)


@pytest.mark.parametrize("name", ["fp32", "codebook"])
def test_a_wrong_header_length_is_refused(saved, loader, name):
    original = saved[name]
    length, size = original.header_length, len(original.data)
    for claimed in [0, 1, 2, length - 8, length - 1, length + 1, length + 8, size - 8, size - 7, HEADER_MAX_BYTES + 1,
                    2**32, 2**63, 2**64 - 1]:
        loader.check(claimed.to_bytes(8, "little") + original.data[8:], original, f"{name} length {claimed}",
                     may_load=False)


@pytest.mark.parametrize("name", BUILDERS)
def test_any_byte_of_the_header_changed_loads_alike_or_is_refused(saved, loader, name):
    """A changed byte of the JSON header: most make invalid JSON, others another field value; padding spaces and
    the notes may change. 60 positions per file, each set to a random byte and to a JSON metacharacter."""
    original = saved[name]
    rng = random.Random(f"header {name}")
    for position in sorted(rng.sample(range(8, 8 + original.header_length), 60)):
        for byte in (rng.randrange(256), rng.choice(b'"{}[]:,\\0 ')):
            data = bytearray(original.data)
            data[position] = byte
            loader.check(bytes(data), original, f"{name} header byte {position} = {byte}")


@pytest.mark.parametrize("name", ["conv1d", "codebook", "grouped"])
def test_every_kind_of_safetensors_header_field_set_wrong_is_refused(saved, loader, name):
    """Each kind of entry of the safetensors header (a tensor's dtype, shape, data_offsets and their items, the
    entry itself) replaced by a wrong value or removed, plus offsets reversed, shared by two tensors, beyond the
    file, unknown entries and fields."""
    original = saved[name]
    header, keys = original.header, [key for key in original.header if key != "__metadata__"]
    for path in representatives(header, lambda path: path[0] == "__metadata__", seed=name):
        for value in [*BAD_VALUES, "F64", "I32", "F8_E4M3", [0, 2**64]]:
            loader.check_header(edited(header, path, value), original, f"{name} header {path} = {value!r}")
    first, second = keys[0], keys[1]
    start, end = header[first]["data_offsets"]
    data_size = len(original.data) - 8 - original.header_length
    for label, change in [
        ("reversed offsets", lambda h: h[first].update(data_offsets=[end, start])),
        ("shared offsets", lambda h: h[second].update(data_offsets=[start, end])),
        ("offsets beyond the file", lambda h: h[first].update(data_offsets=[data_size, data_size + end - start])),
        ("offsets shifted by one", lambda h: h[first].update(data_offsets=[start + 1, end + 1])),
        ("unknown field", lambda h: h[first].update(note=1)),
        ("unknown tensor", lambda h: h.update(extra={"dtype": "F32", "shape": [0], "data_offsets": [0, 0]})),
        ("a tensor renamed", lambda h: h.update({f"{first}::x": h.pop(first)})),
        ("metadata not strings", lambda h: h["__metadata__"].update(unsparse=original.metadata)),
        ("metadata deep", lambda h: h["__metadata__"].update(deep=json.loads("[" * 500 + "]" * 500))),
    ]:
        changed = copy.deepcopy(header)
        change(changed)
        loader.check_header(changed, original, f"{name} header: {label}")


@pytest.mark.parametrize("text", [b"", b"[]", b"1", b'"x"', b"null", b"{" * 100_000, b"[" * 100_000 + b"]" * 100_000,
                                  b'{"a": NaN}', b'{"a": ' + b"1" * 5000 + b"}", b"\xff\xfe{}", b'{"a": 1, "a": 1}',
                                  b"{}", b'{"__metadata__": {}}'])
def test_a_header_that_is_no_safetensors_header_is_refused(saved, loader, text):
    original = saved["fp32"]
    padded = text.ljust(-(-len(text) // 8) * 8)
    loader.check(len(padded).to_bytes(8, "little") + padded + original.data[8 + original.header_length:], original,
                 f"header {text[:20]!r}", may_load=False)


@pytest.mark.parametrize("name", ["conv1d", "codebook", "fixed_point", "grouped_codebook"])
def test_every_kind_of_metadata_field_set_wrong_loads_alike_or_is_refused(saved, loader, name):
    """Each kind of field of the JSON metadata (the notes aside) removed and replaced by two of the wrong values
    (chosen per field and file with a fixed seed; the whole list would take six times as long), and an unknown key
    added to each kind of object. A value that equals the saved one (0 where 0 was saved) may load, as the saved
    model."""
    original = saved[name]
    rng = random.Random(f"metadata {name}")
    paths = representatives(original.metadata, lambda path: path[0] == "extra", seed=name)
    for path in paths:
        for value in [DELETE, *rng.sample(BAD_VALUES[:-1], 2)]:
            loader.check_metadata(edited(original.metadata, path, value), original, f"{name} {path} = {value!r}")
    for path in [(), *paths]:
        target = original.metadata
        for key in path:
            target = target[key]
        if isinstance(target, dict):
            loader.check_metadata(edited(original.metadata, (*path, "unknown"), 1), original, f"{name} {path} + key",
                                  may_load=False)


def test_a_kmeans_description_without_index_bits_is_refused(saved, tmp_path):
    """Found by this file: LayerwiseQuantizer.described compared every setting of the scheme with the description's,
    and k-means' index_bits, which its from_settings does not read, raised KeyError when absent."""
    original = saved["codebook"]
    path = tmp_path / "no_index_bits.safetensors"
    metadata = edited(original.metadata, ("quantization", "weights", "index_bits"), DELETE)
    path.write_bytes(save(original.tensors, metadata={"unsparse": json.dumps(metadata)}))
    with pytest.raises(SparseFileError, match=r"quantization\.weights\.index_bits"):
        load_sparse(path)


@pytest.mark.parametrize("name", ["fp32", "codebook"])
def test_metadata_text_that_is_no_format_metadata_is_refused(saved, loader, name):
    original = saved[name]
    text = json.dumps(original.metadata)
    layer = next(iter(original.metadata["layers"]))
    for label, damaged in [
        ("not an object", "[]"), ("null", "null"), ("a string", '"x"'), ("empty", ""), ("not JSON", "{"),
        ("deep", "[" * 100_000 + "]" * 100_000), ("huge integer", "1" * 5000), ("Infinity", "Infinity"),
        ("duplicate layer", text.replace(f'"layers": {{"{layer}": ', f'"layers": {{"{layer}": {{}}, "{layer}": ', 1)),
        ("duplicate nnz", text.replace('"nnz": ', '"nnz": 0, "nnz": ', 1)),
        ("duplicate shape", text.replace('"shape": ', '"shape": [1], "shape": ', 1)),
        ("duplicate format_version", text.replace('"format_version": 1', '"format_version": 1, "format_version": 1')),
        ("lone surrogate", text.replace('"note": "test"', '"note": "\\ud800"')[:-1] + ', "pad": "\\ud800"}'),
    ]:
        assert damaged != text
        loader.check_metadata(damaged, original, f"{name} metadata {label}", may_load=False)


def content_edits(saved: dict[str, Saved]) -> Iterator[tuple[str, str, Callable[[dict, dict], None]]]:
    """(file, label, edit of the stored tensors and metadata) of tensor contents the loader must refuse."""
    fp32 = saved["fp32"]
    for file in ("fp32", "grouped"):
        for name, layer in sparse_layers(saved[file].model).items():
            K = layer.csr.columns  # C / groups * R * S: an index up to groups * K - 1 would be valid in a dense conv
            for value in {-1, K, K + 1, max(layer.geometry.groups * K - 1, K), 2**31 - 1, -(2**31)}:
                for index in (0, -1):
                    yield file, f"{name}.col_idx[{index}] = {value}", \
                        lambda t, m, key=f"{name}.col_idx", v=value, i=index: t[key].view(-1).__setitem__(i, v)
    for file, key in [("fp32", "0.0.values"), ("fp16", "3.0.values"), ("fp32", "0.1.running_mean"),
                      ("conv1d", next(k for k in saved["conv1d"].tensors if k.endswith(".bias"))),
                      ("fp32", next(k for k in fp32.tensors if k.endswith(".weight"))),
                      ("fixed_point", "0.0.input_quantizer.saturation")]:
        for value in (float("nan"), float("inf"), -float("inf")):
            yield file, f"{key} = {value}", lambda t, m, k=key, v=value: t[k].view(-1).__setitem__(0, v)
    yield "fp32", "negative running_var", lambda t, m: t["0.1.running_var"].view(-1).__setitem__(0, -1.0)
    yield "fixed_point", "saturation <= 0", lambda t, m: t["0.0.input_quantizer.saturation"].fill_(0.0)
    indices, row_nnz, centroids = "3.0.values::indices", "3.0.values::row_nnz", "3.0.values::centroids"
    codes, half = "3.0.values::codes", "3.0.values::half"
    yield "codebook", "index beyond the 11 centroids", lambda t, m: t["1.0.values::indices"].view(-1).__setitem__(
        0, 0xFF)
    yield "codebook", "row_nnz padding bits", lambda t, m: t["1.0.values::row_nnz"].view(-1).__setitem__(-1, 0xF0)
    yield "codebook", "row_nnz beyond L", lambda t, m: t[row_nnz].fill_(255)
    yield "codebook", "row_nnz 0", lambda t, m: t[row_nnz].zero_()
    yield "codebook", "indices of padding not 0", lambda t, m: t[indices].fill_(0x11)
    yield "codebook", "centroids cut", lambda t, m: t.update({centroids: t[centroids][:1]})
    yield "codebook", "centroid -128", lambda t, m: t[centroids].view(-1).__setitem__(0, -128)
    yield "codebook", "centroids twice", lambda t, m: t[centroids].view(-1).__setitem__(1, int(t[centroids][0]))
    yield "codebook", "centroids int16", lambda t, m: t.update({centroids: t[centroids].short()})
    yield "codebook", "part missing", lambda t, m: t.pop(row_nnz)
    yield "fixed_point", "code -8", lambda t, m: t[codes].view(-1).__setitem__(0, 0x88)
    yield "fixed_point", "codes short", lambda t, m: t.update({codes: t[codes][:-1]})
    yield "fixed_point", "codes long", lambda t, m: t.update({codes: torch.cat([t[codes], t[codes][:1]])})
    yield "float16", "half stored as float32", lambda t, m: t.update({half: t[half].float()})
    yield "fp32", "a row one entry longer", lambda t, m: (
        t.update({"3.0.values": torch.nn.functional.pad(t["3.0.values"], (0, 1)),
                  "3.0.col_idx": torch.nn.functional.pad(t["3.0.col_idx"], (0, 1))}),
        m["tensors"]["3.0.values"]["shape"].__setitem__(1, t["3.0.values"].shape[1]),
        m["tensors"]["3.0.col_idx"]["shape"].__setitem__(1, t["3.0.values"].shape[1]),
        m["layers"]["3.0"].update(row_length=t["3.0.values"].shape[1]))
    yield "fp32", "a weight zeroed (nnz disagrees)", lambda t, m: t["3.0.values"].view(-1).__setitem__(
        int(t["3.0.values"].view(-1).nonzero()[0]), 0.0)
    yield "fp32", "col_idx int64", lambda t, m: t.update({"3.0.col_idx": t["3.0.col_idx"].long()})
    yield "fp32", "values float64", lambda t, m: t.update({"3.0.values": t["3.0.values"].double()})


def test_tensor_contents_the_format_forbids_are_refused(saved, loader):
    """Column indices outside [0, K) (what a kernel would read through), non-finite values, negative variances,
    codebook indices beyond the codebook, row counts beyond the row, codes out of range, parts missing or of the
    wrong dtype or length, padding beyond the largest row, counts that disagree with the values."""
    for file, label, change in content_edits(saved):
        original = saved[file]
        tensors = {key: tensor.clone() for key, tensor in original.tensors.items()}
        metadata = copy.deepcopy(original.metadata)
        change(tensors, metadata)
        tensors = {key: tensor.contiguous() for key, tensor in tensors.items()}
        loader.check(save(tensors, metadata={"unsparse": json.dumps(metadata)}), original, f"{file} {label}",
                     may_load=False)


def test_paths_that_are_no_sparse_model_file_are_refused(saved, tmp_path, loader):
    """The loader follows a symbolic link (the file it names is what is checked and read), so a link to a valid
    file loads it; a directory, a missing path, a dangling link and files of other kinds are refused."""
    original = saved["fp32"]
    valid = tmp_path / "valid.safetensors"
    valid.write_bytes(original.data)
    link = tmp_path / "link.safetensors"
    link.symlink_to(valid)
    assert same_model(load_sparse(link), original.model)
    folder, dangling, linked_folder = tmp_path / "folder", tmp_path / "dangling", tmp_path / "linked_folder"
    folder.mkdir()
    dangling.symlink_to(tmp_path / "absent")
    linked_folder.symlink_to(folder)
    for path in (folder, dangling, linked_folder, tmp_path / "absent"):
        with pytest.raises(SparseFileError, match=r"^file: "):
            load_sparse(path)
    for label, data in [("empty", b""), ("text", b"not a model\n" * 100), ("zeros", bytes(4096)),
                        ("pickle", b"\x80\x04\x95" + os.urandom(0) + bytes(range(256)) * 4),
                        ("zip", b"PK\x03\x04" + bytes(range(256)))]:
        loader.check(data, original, label, may_load=False)


@pytest.mark.parametrize("name", ["grouped", "grouped_codebook"])
def test_a_grouped_layers_groups_or_weight_shape_set_wrong_is_refused(saved, tmp_path, name):
    """Every layer's ``groups`` set to each other value, among them ones that do not divide its channels (3 of 8
    output channels; before the geometry was checked against the architecture's, torch's RuntimeError), and its
    weight shape set to another grouping's (the input channels per group of groups=1 or of twice the groups), with
    the rest of the file alike: refused naming the layer's field, never loaded."""
    original, path = saved[name], tmp_path / "grouped.safetensors"
    for layer_name, layer in sparse_layers(original.model).items():
        field = re.escape(f"layers.{layer_name}")
        groups, shape = layer.geometry.groups, list(layer.weight_shape)
        for value in sorted({1, 2, 3, 4, 8, 16, 2 * groups} - {groups}):
            metadata = edited(original.metadata, ("layers", layer_name, "geometry", "groups"), value)
            path.write_bytes(save(original.tensors, metadata={"unsparse": json.dumps(metadata)}))
            with pytest.raises(SparseFileError, match=rf"^{field}\.geometry: .*groups={value},"):
                load_sparse(path)
        for per_group in {shape[1] * groups, max(shape[1] // 2, 2)} - {shape[1]}:
            metadata = edited(original.metadata, ("layers", layer_name, "weight_shape", 1), per_group)
            path.write_bytes(save(original.tensors, metadata={"unsparse": json.dumps(metadata)}))
            with pytest.raises(SparseFileError, match=rf"^{field}\.weight_shape: "):
                load_sparse(path)
