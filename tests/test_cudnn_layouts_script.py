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


def test_main_writes_the_measured_records_as_json(load_script: Callable[[str], ModuleType],
                                                   monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``main``'s path from the command line to the file, on the CPU: the CUDA check and the two timings replaced
    (they run on the GPU only), every selected layer and model timed on the ``--device`` given, once per precision,
    and the JSON written, its folder created, with the environment, the layouts and the records in order."""
    script = load_script("time_cudnn_layouts")
    calls: list[tuple[str, str, torch.device]] = []

    def layer(layer, batch, precision, device, runs):
        calls.append((layer.name, precision, device))
        return {"model_layer": layer.name, "batch": batch, "precision": precision, "ms": {"nchw": 1.0}}

    def model(name, batch, precision, device, runs):
        calls.append((name, precision, device))
        return {"model": name, "batch": batch, "precision": precision, "nhwc_speedup": 1.5}

    monkeypatch.setattr(script, "require_cuda", lambda name: None)
    monkeypatch.setattr(script, "time_layer", layer)
    monkeypatch.setattr(script, "time_model", model)
    out = tmp_path / "new" / "layouts.json"
    script.main(["--models", "alexnet", "--precisions", "fp32", "fp16", "--batch", "4", "--runs", "3",
                 "--layer-filter", r"^features\.(0|3)$", "--whole-models", "--device", "cuda:1", "--out", str(out)])
    cuda = torch.device("cuda:1")
    assert calls == [("features.0", "fp32", cuda), ("features.0", "fp16", cuda), ("features.3", "fp32", cuda),
                     ("features.3", "fp16", cuda), ("alexnet", "fp32", cuda), ("alexnet", "fp16", cuda)]
    result = json.loads(out.read_text())
    assert result["runs"] == 3 and result["layouts"] == list(script.LAYOUTS)
    assert {"torch", "commit"} <= set(result["environment"])
    assert [(r["model"], r["model_layer"], r["precision"], r["batch"]) for r in result["layers"]] == [
        ("alexnet", "features.0", "fp32", 4), ("alexnet", "features.0", "fp16", 4),
        ("alexnet", "features.3", "fp32", 4), ("alexnet", "features.3", "fp16", 4)]
    assert result["models"] == [{"model": "alexnet", "batch": 4, "precision": precision, "nhwc_speedup": 1.5}
                                for precision in ("fp32", "fp16")]
    assert [p.name for p in out.parent.iterdir()] == ["layouts.json"]


def test_an_out_folder_is_refused_before_any_timing(load_script: Callable[[str], ModuleType],
                                                     monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
                                                     tmp_path: Path) -> None:
    """The JSON is written once, after every timing: a folder as ``--out`` failed there with a traceback. It is
    refused with the other options, before the CUDA check."""
    script = load_script("time_cudnn_layouts")
    monkeypatch.setattr(script, "require_cuda", lambda name: pytest.fail("got past the options"))
    with pytest.raises(SystemExit) as stopped:
        script.main(["--models", "alexnet", "--out", str(tmp_path)])
    assert stopped.value.code == 2 and list(tmp_path.iterdir()) == []
    assert f"--out: {tmp_path} is a folder; expected a file name" in capsys.readouterr().err
