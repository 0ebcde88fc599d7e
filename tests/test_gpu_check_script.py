"""``scripts/gpu_check.py`` hands its benchmark options to ``run_bench`` (no GPU needed: the benchmark is replaced)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from unsparse.runtime import bench


def test_benchmark_options_reach_run_bench(load_script: Callable[[str], ModuleType], monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    """The per-layer options and ``--end-to-end-sparsity`` arrive as ``run_bench`` arguments; without the latter,
    ``run_bench``'s own default applies."""
    calls: list[dict] = []
    monkeypatch.setattr(bench, "run_bench", lambda out, **kwargs: calls.append(kwargs) or {"targets": {}})
    gpu_check = load_script("gpu_check")
    common = ["--skip-tests", "--out", str(tmp_path), "--models", "vgg16", "--sparsities", "0.7"]
    assert gpu_check.main([*common, "--end-to-end", "vgg16", "--end-to-end-sparsity", "0.7"]) == 0
    assert gpu_check.main([*common, "--end-to-end"]) == 0
    first, second = calls
    assert first["end_to_end"] == ["vgg16"] and first["end_to_end_sparsity"] == 0.7
    assert first["models"] == ["vgg16"] and first["sparsities"] == [0.7]
    assert second["end_to_end"] == [] and "end_to_end_sparsity" not in second  # run_bench's default applies
