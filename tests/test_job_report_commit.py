"""report.md names the commit that ran, or says it is unknown: outside a git checkout (a copied tree without
``$UNSPARSE_COMMIT``) the page read "commit None", a Python null where a commit hash belongs."""

from __future__ import annotations

from unsparse.report import write_report


def report(commit: str | None) -> dict:
    return {"run": {"data": "d", "model": {"name": "m"}, "device": "cpu", "torch": "2", "weights": "w",
                    "commit": commit, "tree_modified": None, "metric": "top1", "metric_label": "top-1 (%)",
                    "metric_trivial": 10.0, "timing_runs": 20, "timing_warmup": 3},
            "accuracy": {"dense": 90.0},
            "pruning": {"method": "magnitude", "weighted_sparsity": 0.9, "wall_time_s": 1.0,
                        "layer_sparsity": {"c1": 0.9}, "history": []},
            "file": {"path": "model.safetensors", "bytes": 10, "dense_conv_fp32_bytes": 8, "sparse_conv_bytes": 4},
            "layers": [], "timings": [], "timing_baseline": "dense_alone", "timing_verdicts": []}


def test_an_unknown_commit_is_called_unknown(tmp_path) -> None:
    page = write_report(tmp_path / "a", report(None), {})["markdown"].read_text()
    assert "None" not in page and "; commit unknown (not run from a git checkout)." in page
    page = write_report(tmp_path / "b", report("abc123"), {})["markdown"].read_text()
    assert "; commit abc123." in page
