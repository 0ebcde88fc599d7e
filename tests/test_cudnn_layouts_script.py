"""``scripts/time_cudnn_layouts.py`` on the CPU: every layout computes the NCHW result, and the JSON says so; the
command line refuses a device that is not CUDA."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch


def test_layouts_agree_and_are_recorded(load_script: Callable[[str], ModuleType]) -> None:
    """Per layer every layout of the module's list is timed and its output equals NCHW's to float32 rounding; the
    whole-model record compares the channels-last model with the NCHW one; the result names the layouts (timed on the
    CPU through ``measure``: the command line takes CUDA devices only)."""
    script = load_script("time_cudnn_layouts")
    args = script.build_parser().parse_args(["--models", "alexnet", "--precisions", "fp32", "--batch", "2", "--runs",
                                             "1", "--layer-filter", r"^features\.(0|10)$", "--whole-models",
                                             "--out", "unused.json"])
    result = json.loads(json.dumps(script.measure(args, torch.device("cpu"))))
    assert result["layouts"] == list(script.LAYOUTS)
    assert [r["model_layer"] for r in result["layers"]] == ["features.0", "features.10"]
    for record in result["layers"]:
        assert set(record["ms"]) == set(script.LAYOUTS) and all(ms > 0 for ms in record["ms"].values())
        assert record["rel_error"]["nchw"] == 0 and max(record["rel_error"].values()) < 1e-5
        assert record["fastest"] in script.LAYOUTS
    (model,) = result["models"]
    assert model["model"] == "alexnet" and model["rel_error"] < 1e-5
    assert model["nhwc_speedup"] == model["nchw_ms"] / model["nhwc_ms"]


@pytest.mark.parametrize(("device", "says"), [("cpu", "'cpu' is not a CUDA device"),
                                              ("gpu0", "'gpu0' is not a device")])
def test_a_device_other_than_cuda_is_refused(load_script: Callable[[str], ModuleType], capsys: pytest.CaptureFixture,
                                             tmp_path: Path, device: str, says: str) -> None:
    """``--device cpu`` timed the CPU's convolutions under cuDNN's labels (a scripts audit's find): it is refused
    while parsing, naming the value, and nothing is written."""
    out = tmp_path / "layouts.json"
    with pytest.raises(SystemExit) as stopped:
        load_script("time_cudnn_layouts").main(["--models", "alexnet", "--layer-filter", "^none$", "--device", device,
                                                "--out", str(out)])
    assert stopped.value.code == 2 and not out.exists()
    assert f"argument --device: {says}" in capsys.readouterr().err
