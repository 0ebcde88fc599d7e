"""k-means codebooks record how they were made: ``clusters``, scikit-learn's fit settings and its version travel in
the file's quantization description, are validated on load like the other settings, and older files without them
still load, reading them as not recorded."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save

from unsparse import create_model, load_sparse, save_sparse, sparsify
from unsparse.prune import MagnitudePruner
from unsparse.quant import ActivationSpec, KMeansQuantizer, LinearQuantizer
from unsparse.quant.kmeans import FIT_SETTINGS, KMEANS_ARGUMENTS, installed_sklearn_version, recorded_fit
from unsparse.runtime import sparse_layers
from unsparse.sparse.format import SparseFormatError

FIT = {"n_init": 2, "max_iter": 50, "init": "random", "random_state": 7}
"""Fit settings other than the defaults, so that a record of the defaults cannot pass for them."""
FIXED = {"tol": 1e-4, "algorithm": "lloyd", "sklearn_version": installed_sklearn_version()}
"""The fit settings the quantizer does not take: scikit-learn's defaults and its version, recorded as well."""
DEFAULT_FIT = {"n_init": 4, "max_iter": 300, "tol": 1e-4, "init": "k-means++", "algorithm": "lloyd", "random_state": 0,
               "sklearn_version": installed_sklearn_version()}
NO_ACTIVATIONS = ActivationSpec(format="none")


def pruned_sparse_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = create_model("vgg_small", width=4)
    pruner = MagnitudePruner(0.5, scope="layer")  # enough weights per layer to run k-means, not just copy them
    pruner.prepare(model)
    pruner.step()
    return sparsify(model.eval())


def quantized(**fit) -> torch.nn.Module:
    return KMeansQuantizer(clusters=8, centroid_bits=8, activations=NO_ACTIVATIONS, progress=False,
                           **fit).quantize(pruned_sparse_model())


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[torch.nn.Module, object]:
    model = quantized(**FIT)
    return model, save_sparse(model, tmp_path_factory.mktemp("kmeans") / "m.safetensors")


def rewritten(path, tmp_path, change):
    """A copy of file ``path`` whose quantization ``weights`` went through ``change``."""
    with safe_open(str(path), "pt") as file:
        tensors = {key: file.get_tensor(key) for key in file.keys()}  # noqa: SIM118 (safe_open is not a dict)
        metadata = json.loads(file.metadata()["unsparse"])
    change(metadata["quantization"]["weights"])
    copy = tmp_path / "changed.safetensors"
    copy.write_bytes(save(tensors, metadata={"unsparse": json.dumps(metadata)}))
    return copy


def test_the_description_records_the_fit_settings_and_they_survive_the_file(saved):
    model, path = saved
    weights = model.unsparse_quantization["weights"]
    assert {key: weights[key] for key in FIT_SETTINGS} == {**FIT, **FIXED} and weights["clusters"] == 8
    assert json.loads(json.dumps(model.unsparse_quantization)) == model.unsparse_quantization  # JSON-safe
    loaded = load_sparse(path)
    assert loaded.unsparse_quantization == model.unsparse_quantization
    assert recorded_fit(loaded.unsparse_quantization) == {"clusters": 8, **FIT, **FIXED}


def test_the_defaults_are_recorded_too():
    description = quantized().unsparse_quantization
    assert recorded_fit(description) == {"clusters": 8, **DEFAULT_FIT}


def test_the_record_remakes_the_codebooks(saved):
    """What the file records is what made it: a quantizer built from the record alone gives the same weights."""
    model, path = saved
    record = recorded_fit(load_sparse(path).unsparse_quantization)
    clusters = record.pop("clusters")
    assert {key: record.pop(key) for key in FIXED} == FIXED  # the version is the installed one: it made them
    again = KMeansQuantizer(clusters=clusters, centroid_bits=8, activations=NO_ACTIVATIONS, progress=False,
                            **record).quantize(pruned_sparse_model())
    for name, layer in sparse_layers(model).items():
        assert torch.equal(sparse_layers(again)[name].values, layer.values)


def test_a_file_written_before_the_fit_settings_were_recorded_loads_reading_them_as_not_recorded(saved, tmp_path):
    model, path = saved
    old = rewritten(path, tmp_path, lambda weights: [weights.pop(key) for key in FIT_SETTINGS])
    loaded = load_sparse(old)
    assert not set(FIT_SETTINGS) & set(loaded.unsparse_quantization["weights"])
    assert recorded_fit(loaded.unsparse_quantization) == {"clusters": 8, **dict.fromkeys(FIT_SETTINGS)}
    inputs = torch.randn(3, 1, 28, 28, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(inputs), model(inputs))


def test_a_file_written_before_the_sklearn_version_was_recorded_loads_reading_it_as_not_recorded(saved, tmp_path):
    """The version is recorded since after the ``KMeans`` arguments (7b62af3): such files hold them without it."""
    model, path = saved
    loaded = load_sparse(rewritten(path, tmp_path, lambda weights: weights.pop("sklearn_version")))
    assert recorded_fit(loaded.unsparse_quantization) == {"clusters": 8, **FIT, **FIXED, "sklearn_version": None}
    inputs = torch.randn(3, 1, 28, 28, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(inputs), model(inputs))


def test_a_file_of_another_sklearn_version_loads_and_says_which(saved, tmp_path):
    loaded = load_sparse(rewritten(saved[1], tmp_path, lambda weights: weights.update(sklearn_version="0.24.2")))
    assert recorded_fit(loaded.unsparse_quantization)["sklearn_version"] == "0.24.2"
    again = KMeansQuantizer.described(loaded.unsparse_quantization)
    assert again.settings()["sklearn_version"] == "0.24.2"
    with pytest.raises(ValueError, match=rf"^sklearn_version: this quantizer records codebooks of scikit-learn "
                                         rf"0\.24\.2, but {re.escape(installed_sklearn_version())} is installed"):
        again.quantize_values(torch.linspace(-1, 1, 20).reshape(2, 10))


@pytest.mark.parametrize("key", KMEANS_ARGUMENTS)
def test_a_description_that_records_some_fit_settings_but_not_all_is_refused(saved, tmp_path, key):
    damaged = rewritten(saved[1], tmp_path, lambda weights: weights.pop(key))
    with pytest.raises(ValueError, match=rf"^quantization\.weights\.{key}: missing"):
        load_sparse(damaged)


def test_a_version_without_the_kmeans_arguments_is_refused(saved, tmp_path):
    """The version is recorded since after the arguments, so no file holds it without them (a review's find: such a
    description loaded, the arguments read as not recorded)."""
    damaged = rewritten(saved[1], tmp_path, lambda weights: [weights.pop(key) for key in KMEANS_ARGUMENTS])
    with pytest.raises(ValueError, match=r"^quantization\.weights\.algorithm: missing beside \['sklearn_version'\]"):
        load_sparse(damaged)


@pytest.mark.parametrize(("key", "value"), [
    ("n_init", 0), ("n_init", "2"), ("n_init", 2.0), ("n_init", True), ("n_init", None),
    ("max_iter", -1), ("max_iter", 50.5), ("max_iter", [50]),
    ("tol", 1e-3), ("tol", -1e-4), ("tol", "0.0001"), ("tol", 0), ("tol", False), ("tol", {}),
    ("init", "kmeans"), ("init", 1), ("init", None),
    ("algorithm", "elkan"), ("algorithm", "auto"), ("algorithm", ["lloyd"]), ("algorithm", None),
    ("random_state", -1), ("random_state", 2**32), ("random_state", 7.0), ("random_state", None),
    ("sklearn_version", ""), ("sklearn_version", 1.5), ("sklearn_version", None), ("sklearn_version", ["1.5.2"]),
    ("sklearn_version", "v1.5"), ("sklearn_version", "1.5 2"), ("sklearn_version", "1." + "9" * 64),
])
def test_a_malformed_fit_setting_is_refused_naming_it(saved, tmp_path, key, value):
    damaged = rewritten(saved[1], tmp_path, lambda weights: weights.update({key: value}))
    with pytest.raises(ValueError, match=rf"^quantization\.weights\.{key}: "):
        load_sparse(damaged)


def test_recorded_fit_refuses_what_is_no_kmeans_description():
    linear = LinearQuantizer(activations=NO_ACTIVATIONS, progress=False).quantize(pruned_sparse_model())
    with pytest.raises(SparseFormatError, match=r"^quantization\.scheme: expected 'kmeans', got 'linear'$"):
        recorded_fit(linear.unsparse_quantization)
    with pytest.raises(SparseFormatError, match=r"^quantization: expected an object, got NoneType$"):
        recorded_fit(None)
    description = quantized().unsparse_quantization
    description["weights"]["n_init"] = 0
    with pytest.raises(SparseFormatError, match=r"^quantization\.weights\.n_init: "):
        recorded_fit(description)
