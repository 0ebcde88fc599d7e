"""``scripts/time_cudnn_layouts.py`` on the CPU: every layout computes the NCHW result, and the JSON says so."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType


def test_layouts_agree_and_are_recorded(load_script: Callable[[str], ModuleType], tmp_path: Path) -> None:
    """Per layer every layout of the module's list is timed and its output equals NCHW's to float32 rounding; the
    whole-model record compares the channels-last model with the NCHW one; the file names the layouts."""
    script = load_script("time_cudnn_layouts")
    out = tmp_path / "layouts.json"
    script.main(["--models", "alexnet", "--precisions", "fp32", "--batch", "2", "--runs", "1", "--device", "cpu",
                 "--layer-filter", r"^features\.(0|10)$", "--whole-models", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["layouts"] == list(script.LAYOUTS)
    assert [r["model_layer"] for r in result["layers"]] == ["features.0", "features.10"]
    for record in result["layers"]:
        assert set(record["ms"]) == set(script.LAYOUTS) and all(ms > 0 for ms in record["ms"].values())
        assert record["rel_error"]["nchw"] == 0 and max(record["rel_error"].values()) < 1e-5
        assert record["fastest"] in script.LAYOUTS
    (model,) = result["models"]
    assert model["model"] == "alexnet" and model["rel_error"] < 1e-5
    assert model["nhwc_speedup"] == model["nchw_ms"] / model["nhwc_ms"]
