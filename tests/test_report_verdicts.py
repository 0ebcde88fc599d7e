"""The pipeline report's per-layer verdicts: speedups are against the baseline's fastest entry, and a slower sparse
backend is called slower."""

from __future__ import annotations

import pytest

from unsparse.report import timing_verdicts


def test_verdicts_use_the_fastest_baseline_entry_and_say_slower() -> None:
    timings = [
        {"layer": "a", "backend": "dense_alone", "time_ms": 2.0, "sparse": False},
        {"layer": "a", "backend": "dense_alone", "time_ms": 1.0, "sparse": False},
        {"layer": "a", "backend": "direct", "time_ms": 4.0, "sparse": True},
        {"layer": "a", "backend": "direct", "time_ms": 0.5, "sparse": True},
        {"layer": "b", "backend": "dense_alone", "time_ms": 1.0, "sparse": False},
        {"layer": "b", "backend": "direct", "time_ms": 2.0, "sparse": True},
        {"layer": "c", "backend": "direct", "time_ms": 2.0, "sparse": True},
    ]
    a, b, c = timing_verdicts(timings, "dense_alone")
    assert a["baseline_ms"] == 1.0 and a["sparse_speedup"] == pytest.approx(2.0) and a["fastest"] == "direct"
    assert a["verdict"] == "sparse faster (2.00x)"
    assert b["sparse_speedup"] == pytest.approx(0.5) and b["verdict"] == "sparse SLOWER (2.00x the baseline time)"
    assert b["fastest"] == "direct"  # the baseline is not a backend a plan can choose
    assert c["baseline_ms"] is None and c["verdict"] == "no sparse/baseline pair measured"
