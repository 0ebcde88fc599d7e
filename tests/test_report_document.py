"""``report.json`` and ``report.md`` of the main job (:func:`unsparse.report.write_report`) from a small report."""

from __future__ import annotations

import math

from unsparse.report import write_report
from unsparse.strict_json import loads_strict


def small_report(accuracy: dict[str, float], history: list[dict[str, float]]) -> dict:
    """The fields :func:`write_report` reads, for a reconstruction task without layers or timings."""
    return {"run": {"data": "co2", "model": {"name": "autoencoder1d"}, "device": "cpu", "torch": "2", "weights": "w",
                    "commit": None, "metric": "mse", "metric_label": "reconstruction MSE (lower is better)",
                    "metric_trivial": 0.5, "timing_runs": 20, "timing_warmup": 3},
            "accuracy": accuracy,
            "pruning": {"method": "evolutionary", "weighted_sparsity": 0.5, "wall_time_s": 1.0,
                        "layer_sparsity": {"conv": 0.5}, "history": history},
            "file": {"path": "model.safetensors", "bytes": 10, "dense_conv_fp32_bytes": 8, "sparse_conv_bytes": 4},
            "layers": [], "timings": [], "timing_baseline": "dense_alone", "timing_verdicts": []}


def test_an_infinite_mse_reads_back_from_report_json_as_infinite(tmp_path) -> None:
    """A diverged model's MSE overflows to infinity; report.json held null, which read back as "not measured"
    (NaN through ``nan_if_none``), and the page said n/a for a value that was measured. Now the file keeps the
    infinities (``1e999``), the page writes ``inf``, and the page made from the file read back is the same."""
    report = small_report({"dense": 0.1, "pruned": 0.2, "sparse_run": math.inf},
                          [{"relative_change": -math.inf}, {"relative_change": 0.25}])
    first = write_report(tmp_path / "first", report, {})
    back = loads_strict(first["json"].read_text())
    assert back["accuracy"] == {"dense": 0.1, "pruned": 0.2, "sparse_run": math.inf}
    assert back["pruning"]["history"] == [{"relative_change": -math.inf}, {"relative_change": 0.25}]
    page = first["markdown"].read_text()
    assert "| sparse_run | inf |" in page and "No better than that: `sparse_run`" in page
    again = write_report(tmp_path / "again", back, {})
    assert again["markdown"].read_text() == page and again["json"].read_text() == first["json"].read_text()


def test_a_nan_metric_is_still_null_and_not_a_number(tmp_path) -> None:
    paths = write_report(tmp_path, small_report({"dense": 0.1, "pruned": math.nan, "sparse_run": 0.2}, []), {})
    assert loads_strict(paths["json"].read_text())["accuracy"]["pruned"] is None
    assert "| pruned | n/a |" in paths["markdown"].read_text()
