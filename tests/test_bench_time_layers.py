"""``bench.add_layer_arguments`` and ``bench.time_layers``: the options and the layer loop that the layer-timing
scripts (``estimate_accuracy.py``, ``time_residual_fusion.py``) share, on the CPU with a stand-in for their timing."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from unsparse.runtime import bench


def parsed(arguments: list[str]) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser()
    bench.add_layer_arguments(parser, "layers", dtypes=["float32"])
    return parser, parser.parse_args(arguments)


def test_every_layer_and_dtype_is_recorded_in_order_and_written_after_each(tmp_path: Path) -> None:
    """Each layer of ``--layers`` (AlexNet's own convs, pruned) with each dtype reaches ``records`` once, TF32 off,
    and the file holds every record after each call (the last write is the whole result)."""
    parser, args = parsed(["--model", "alexnet", "--layers", "features.3", "features.0", "--dtypes", "float32",
                           "float16", "--out", str(tmp_path / "out")])
    assert (args.batch, args.sparsity, args.runs) == (128, 0.9, 20)
    seen: list[tuple] = []

    def records(layer: bench.ConvLayer, dtype: torch.dtype) -> list[dict]:
        seen.append((layer.name, dtype, torch.backends.cuda.matmul.allow_tf32, len(written())))
        return [{"layer": layer.name, "dtype": str(dtype), "zeros": float((layer.weight == 0).float().mean())}]

    def written() -> list[dict]:
        path = tmp_path / "out" / "result.json"
        return json.loads(path.read_text())["records"] if path.exists() else []

    result = {"model": args.model, "records": []}
    bench.time_layers(parser, args, result, "result.json", records)
    assert [(name, dtype) for name, dtype, _, _ in seen] == [
        ("features.3", torch.float32), ("features.3", torch.float16), ("features.0", torch.float32),
        ("features.0", torch.float16)]
    assert [count for *_, count in seen] == [0, 1, 2, 3] and not any(tf32 for _, _, tf32, _ in seen)
    assert written() == result["records"] and len(result["records"]) == 4
    assert all(abs(record["zeros"] - 0.9) < 0.01 for record in result["records"])


def test_an_unknown_layer_ends_the_script_naming_the_option(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    parser, args = parsed(["--model", "alexnet", "--layers", "features.99", "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit) as stopped:
        bench.time_layers(parser, args, {"records": []}, "result.json", lambda layer, dtype: [])
    assert stopped.value.code == 2 and "--layers: ['features.99'] are not convs of alexnet" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
