"""A benchmark page renders an end-to-end run whose relative error was not finite (NaN or infinite, null in
``bench.json``) instead of failing on it."""

from __future__ import annotations

from unsparse.report.benchmark import evaluate_targets, markdown_report


def test_an_end_to_end_run_with_a_null_relative_error_renders() -> None:
    """``for_json`` writes a NaN error (an output that overflowed) as null; the page's ``:.2e`` raised TypeError,
    so run_bench failed at its very end and render_bench.py could not render the file."""
    result = {"environment": {"gpu": "test", "driver": "0", "torch": "x", "cuda": "x", "cudnn": 1, "cupy": "x",
                              "commit": "abc", "date_utc": "today"},
              "weights": "synthetic", "runs": 20, "layers": [],
              "end_to_end": [{"model": "vgg16", "weights": "synthetic", "batch": 128, "precision": "fp16",
                              "dense_ms": 10.0, "planned_ms": 9.0, "speedup": 10 / 9, "rel_error": None}]}
    result["targets"] = evaluate_targets(result)
    row = next(line for line in markdown_report(result).splitlines() if line.startswith("| vgg16 |"))
    assert "| not finite |" in row
