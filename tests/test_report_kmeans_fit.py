"""``report.md`` says which fit settings a k-means model's codebooks were made with (paper 004 §4, Alg. 3 line 4),
each one "not recorded" where the file predates it: the page printed the description's ``weights`` as they were, so
an older file's page simply lacked the fit settings, without saying so."""

from __future__ import annotations

import pytest

from unsparse.quant import KMeansQuantizer
from unsparse.quant.kmeans import FIT_SETTINGS, KMEANS_ARGUMENTS, installed_sklearn_version
from unsparse.report import write_report
from unsparse.sparse.format import SparseFormatError
from unsparse.strict_json import loads_strict

VERSION = installed_sklearn_version()


def report_with(quantization: dict) -> dict:
    """The fields :func:`write_report` reads, with ``quantization`` as the model's description."""
    return {"run": {"data": "digits", "model": {"name": "vgg_small"}, "device": "cpu", "torch": "2", "weights": "w",
                    "commit": None, "metric": "top1", "metric_label": "top-1", "metric_trivial": 0.1,
                    "timing_runs": 20, "timing_warmup": 3},
            "accuracy": {"dense": 0.9, "pruned": 0.9, "sparse_run": 0.9},
            "pruning": {"method": "one_shot", "weighted_sparsity": 0.9, "wall_time_s": 1.0,
                        "layer_sparsity": {"conv": 0.9}},
            "quantization": quantization,
            "file": {"path": "model.safetensors", "bytes": 10, "dense_conv_fp32_bytes": 8, "sparse_conv_bytes": 4},
            "layers": [], "timings": [], "timing_baseline": "dense_alone", "timing_verdicts": []}


def page(tmp_path, quantization: dict) -> str:
    """report.md, checked to render the same again from the report.json beside it."""
    first = write_report(tmp_path / "first", report_with(quantization), {})
    again = write_report(tmp_path / "again", loads_strict(first["json"].read_text()), {})
    assert again["markdown"].read_text() == first["markdown"].read_text()
    return first["markdown"].read_text()


def description(*unrecorded: str) -> dict:
    weights = KMeansQuantizer(clusters=8, n_init=2, random_state=7, progress=False).settings()
    return {"scheme": "kmeans", "weights": {key: value for key, value in weights.items() if key not in unrecorded},
            "activations": {"format": "fp16"}}


def test_the_page_states_the_recorded_fit_settings(tmp_path):
    text = page(tmp_path, description())
    assert (f"| k-means fit settings | n_init=2, max_iter=300, tol=0.0001, init=k-means++, algorithm=lloyd, "
            f"random_state=7, sklearn_version={VERSION} |") in text
    assert "| weights | {'clusters': 8, 'index_bits': 3, 'centroid_bits': 8} |" in text


def test_a_file_before_the_fit_settings_says_they_were_not_recorded(tmp_path):
    text = page(tmp_path, description(*FIT_SETTINGS))
    assert "| k-means fit settings | " + ", ".join(f"{key}=not recorded" for key in FIT_SETTINGS) + " |" in text


def test_a_file_before_the_sklearn_version_says_it_was_not_recorded(tmp_path):
    text = page(tmp_path, description("sklearn_version"))
    assert "random_state=7, sklearn_version=not recorded |" in text


def test_other_schemes_keep_their_table(tmp_path):
    text = page(tmp_path, {"scheme": "fp16", "weights": {}, "activations": {"format": "fp16"}})
    assert "| weights | {} |" in text and "fit settings" not in text


@pytest.mark.parametrize("key", KMEANS_ARGUMENTS)
def test_a_malformed_record_is_refused_naming_the_field_and_nothing_is_written(tmp_path, key):
    damaged = description()
    damaged["weights"].pop(key)
    with pytest.raises(SparseFormatError, match=rf"^quantization\.weights\.{key}: missing"):
        write_report(tmp_path, report_with(damaged), {})
    assert not (tmp_path / "report.md").exists()
