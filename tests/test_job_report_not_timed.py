"""report.md's "Not timed" line names a backend on a layer only where none of its settings was timed there: a
backend with one failed setting and others timed read as not timed on that layer, next to its times in the table."""

from __future__ import annotations

from unsparse.report import timing_verdicts, write_report


def report(timings: list[dict], not_timed: list[dict]) -> dict:
    return {"run": {"data": "d", "model": {"name": "m"}, "device": "cuda", "torch": "2", "weights": "w",
                    "commit": None, "metric": "top1", "metric_label": "top-1 (%)", "metric_trivial": 10.0,
                    "timing_runs": 20, "timing_warmup": 3},
            "accuracy": {"dense": 90.0},
            "pruning": {"method": "magnitude", "weighted_sparsity": 0.9, "wall_time_s": 1.0,
                        "layer_sparsity": {"c1": 0.9}, "history": []},
            "file": {"path": "model.safetensors", "bytes": 10, "dense_conv_fp32_bytes": 8, "sparse_conv_bytes": 4},
            "layers": [], "timings": timings, "not_timed": not_timed, "timing_baseline": "dense_alone",
            "timing_verdicts": timing_verdicts(timings, "dense_alone")}


def row(layer: str, backend: str, time_ms: float | None, status: str = "ok", reason: str | None = None) -> dict:
    return {"layer": layer, "backend": backend, "sparse": backend == "direct", "params": {}, "status": status,
            "input_shape": [8, 16, 14, 14], "time_ms": time_ms, "rel_error": 1e-7, "reason": reason}


def test_a_backend_timed_in_another_setting_is_not_called_not_timed(tmp_path) -> None:
    timings = [row("c1", "dense_alone", 1.0), row("c1", "direct", 0.5), row("c2", "dense_alone", 1.0)]
    not_timed = [row("c1", "direct", None, "error", "graph capture: RuntimeError: x"),
                 row("c1", "dense_alone", None, "wrong", "relative error 1 > 0.001"),
                 row("c2", "direct", None, "error", "graph capture: RuntimeError: x")]
    page = write_report(tmp_path, report(timings, not_timed), {})["markdown"].read_text()
    (line,) = [line for line in page.splitlines() if line.startswith("Not timed")]
    assert line == "Not timed: `direct` on `c2` (error: graph capture: RuntimeError: x)."
