"""Two plans side by side (``unsparse.report.plan_comparison``, ``scripts/compare_plans.py``): the keys of one
precision and layout from either plan, slowest first, each plan's backend and median, and the summed medians of the
keys both time."""

from __future__ import annotations

import json

import pytest

from unsparse.report.plan_comparison import comparison_markdown, plan_rows
from unsparse.runtime.plan import Plan, PlanEntry

LAYER_A = "x=8x4x7x7|w=4x4x3x3|L=4|s=1x1|p=1x1|d=1x1|g=1|dims=2|epilogue=relu"
LAYER_B = "x=8x4x7x7|w=8x4x1x1|L=2|s=1x1|p=0x0|d=1x1|g=1|dims=2"


def plan(**medians: tuple[str, float]) -> Plan:
    """A plan on GPU ``GPU``: for each keyword, the key :data:`KEYS` names, with its ``(backend, median_ms)``."""
    return Plan({f"GPU|{KEYS[name]}": PlanEntry(backend, {}, median) for name, (backend, median) in medians.items()})


KEYS = {"a32": f"float32|{LAYER_A}", "b32": f"float32|{LAYER_B}", "a16": f"float16|{LAYER_A}",
        "a32_nhwc": f"float32|{LAYER_A}|fmt=nhwc", "a_tf32": f"float32+tf32|{LAYER_A}"}


def test_rows_take_one_precision_and_layout_slowest_first_with_each_plans_choice() -> None:
    before = plan(a32=("cudnn", 2.0), b32=("direct", 0.5), a16=("cudnn", 9.0), a32_nhwc=("cudnn", 9.0),
                  a_tf32=("cudnn", 9.0))
    after = plan(a32=("direct", 1.6), a16=("direct", 9.0))
    rows = plan_rows(before, after, "float32")
    assert [row.layer for row in rows] == [LAYER_A, LAYER_B]  # b32 only before: after its median-less peers
    assert (rows[0].before_backend, rows[0].before_ms, rows[0].after_backend, rows[0].after_ms) == (
        "cudnn", 2.0, "direct", 1.6)
    assert rows[0].speedup == pytest.approx(1.25) and rows[1].after_backend is None and rows[1].speedup is None
    assert [row.layer for row in plan_rows(before, after, "float32", "nhwc")] == [f"{LAYER_A}|fmt=nhwc"]
    assert [row.before_ms for row in plan_rows(before, after, "float32+tf32")] == [9.0]
    with pytest.raises(ValueError, match="layout: expected"):
        plan_rows(before, after, "float32", "NHWC")


def test_the_page_sums_the_keys_both_plans_time_and_escapes_the_keys_pipes() -> None:
    before = plan(a32=("cudnn", 2.0), b32=("direct", 0.5))
    after = plan(a32=("direct", 1.0), b32=("direct", float("nan")))  # a median not measured
    rows = plan_rows(before, after, "float32")
    assert rows[1].after_ms is None
    page = comparison_markdown(rows, "old.json", "new.json", "float32", "nchw")
    assert "Summed over the 1 keys both plans time: 2.000 ms before, 1.000 ms after (2.000x)." in page
    line = next(line for line in page.splitlines() if "w=4x4x3x3" in line)
    assert line.startswith("| `x=8x4x7x7\\|w=4x4x3x3\\|") and line.count(" | ") == 5  # six cells
    assert line.endswith("| cudnn | 2 | direct | 1 | 2 |")


def test_the_script_writes_the_page_and_refuses_a_malformed_plan(tmp_path, load_script, run_script) -> None:
    script = load_script("compare_plans")
    old, new, out = tmp_path / "old.json", tmp_path / "new.json", tmp_path / "page.md"
    plan(a32=("cudnn", 2.0)).save(old)
    plan(a32=("direct", 1.0)).save(new)
    code, _ = run_script(script, [str(old), str(new), "--out", str(out)])
    assert code == 0 and "(2.000x)" in out.read_text()
    code, text = run_script(script, [str(old), str(new), "--precision", "float16", "--out", str(out)])
    assert code == 2 and "no float16 nchw key in either plan" in text
    data = json.loads(new.read_text())
    data["entries"][f"GPU|{KEYS['a32']}"]["median_ms"] = "fast"
    new.write_text(json.dumps(data))
    code, text = run_script(script, [str(old), str(new), "--out", str(out)])
    assert code == 2 and "new.json" in text and "Traceback" not in text
    code, text = run_script(script, [str(old), str(tmp_path / "missing.json"), "--out", str(out)])
    assert code == 2 and "missing.json" in text
    code, text = run_script(script, [str(old), str(old), "--out", str(tmp_path)])
    assert code == 2 and "is a folder" in text
