"""The ceiling script of the weight-specialised kernels (``scripts/generated_ceiling.py``): the issue rate it reads
from the probe, the instructions it counts per program, and the page it writes, on small hand-checked layers."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch


@pytest.fixture
def ceiling(load_script: Callable[[str], ModuleType]) -> ModuleType:
    return load_script("generated_ceiling")


ICACHE = [{"body_instructions": 16, "ffma_warp_instructions_per_ns_per_sm": 1.0},
          {"body_instructions": 64, "ffma_warp_instructions_per_ns_per_sm": 0.5}]


def test_the_rate_is_the_smallest_probed_body_that_holds_the_program(ceiling: ModuleType) -> None:
    assert ceiling.issue_rate(ICACHE[::-1], 8) == 1.0
    assert ceiling.issue_rate(ICACHE, 16) == 1.0
    assert ceiling.issue_rate(ICACHE, 17) == 0.5
    assert ceiling.issue_rate(ICACHE, 10**6) == 0.5
    with pytest.raises(ValueError, match=r"^icache:"):
        ceiling.issue_rate([], 8)


def test_a_program_counts_one_load_per_used_tap_one_ffma_per_product_and_one_store_per_row(
        ceiling: ModuleType) -> None:
    weight = torch.tensor([[1.0, 0.0], [0.0, 0.0], [2.0, 3.0]]).reshape(3, 2, 1, 1)
    counts = ceiling.layer_ceiling(weight, (0, 0), (8, 8), 1, ICACHE, sms=2)
    assert (counts["programs"], counts["products"], counts["largest_body_instructions"]) == (1, 3, 2 + 3 + 3)
    assert counts["product_share"] == 3 / 8
    assert counts["ceiling_ms"] == pytest.approx(8 * 2 / (1.0 * 2) / 1e6)  # 64 pixels: 2 warps, rate 1 on 2 SMs


def test_the_half2_model_counts_pair_loads_by_parity_runs_of_products_and_two_stores_per_row(
        ceiling: ModuleType) -> None:
    """Taps at (c, s) of a 1 x 3 kernel on an unpadded plane of width 6: offsets c * 6 + s, odd for s = 1. Row 0 has
    20 products (two runs of 16), row 1 one."""
    weight = torch.zeros(2, 20, 1, 3)
    weight[0, :, 0, 0] = 1.0  # 20 taps at even offsets
    weight[1, 0, 0, 1] = 2.0  # one tap at an odd offset
    (program,) = ceiling.gs.programs(weight.numpy(), (0, 0), (1, 6), ceiling.ROWS)
    assert ceiling.half2_body(program) == (20 + 3) + 21 + ceiling.FLUSH * (2 + 1) + 2 * 2
    assert ceiling.fp32_body(program) == 21 + 21 + 2
    half2 = ceiling.layer_ceiling(weight, (0, 0), (1, 6), 32, ICACHE, sms=1, model="half2")
    assert half2["ceiling_ms"] == pytest.approx(ceiling.half2_body(program) * 2 / 0.5 / 1e6)  # 128 pixels: 2 warps


def bench(tmp_path: Path) -> Path:
    layer = {"layer": "features.0", "precision": "fp32_generated", "in_chw": [2, 6, 6], "weight_shape": [4, 2, 3, 3],
             "batch": 2, "geometry": {"padding": [1, 1]}, "baseline": {"median_ms": 0.01}}
    records = [layer, {**layer, "precision": "tf32_generated"}, {**layer, "layer": "old", "baseline": None}]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"environment": {"sm_count": 4}, "layers": records}))
    return path


def test_the_script_writes_one_record_per_fp32_layer_and_sparsity(ceiling: ModuleType, tmp_path: Path,
                                                                  run_script: Callable[..., tuple[int, str]]) -> None:
    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps({"icache": ICACHE}))
    out = tmp_path / "ceiling"
    code, _ = run_script(ceiling, ["--cudnn", str(bench(tmp_path)), "--probe", str(probe), "--sparsities", "0.5",
                                   "0.9", "--out", str(out)])
    assert code == 0
    records = json.loads(out.with_suffix(".json").read_text())["records"]
    assert [(r["layer"], r["sparsity"]) for r in records] == [("features.0", 0.5), ("features.0", 0.9)]
    assert [r["products"] for r in records] == [36, 8]  # of 72 weights, floor(s * 72) are dropped
    for record in records:
        assert record["ceiling_speedup"] == pytest.approx(0.01 / record["ceiling_ms"])
    page = out.with_suffix(".md").read_text()
    assert page.count("| features.0 |") == 2 and "nothing here was timed" in page


def test_the_half2_model_takes_the_median_cudnn_fp16_time_of_each_probed_shape(
        ceiling: ModuleType, tmp_path: Path, run_script: Callable[..., tuple[int, str]]) -> None:
    record = {"layer": "vgg16.features.12", "in_chw": [2, 6, 6], "weight_shape": [4, 2, 3, 3], "batch": 2}
    probe = {"environment": {"sms": 4}, "icache": ICACHE, "records": [
        {**record, "cudnn_fp16": {"median_ms": ms}} for ms in (0.01, 0.03, 0.02)] + [{**record, "cudnn_fp16": None}]}
    path = tmp_path / "probe.json"
    path.write_text(json.dumps(probe))
    out = tmp_path / "half2"
    code, _ = run_script(ceiling, ["--model", "half2", "--cudnn", str(path), "--probe", str(path), "--sparsities",
                                   "0.9", "--out", str(out)])
    assert code == 0
    (result,) = json.loads(out.with_suffix(".json").read_text())["records"]
    assert result["cudnn_ms"] == 0.02 and result["padding"] == [1, 1]
    assert "HYPOTHETICAL" in out.with_suffix(".md").read_text()
