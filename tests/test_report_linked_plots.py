"""A re-render without ``--plots`` keeps the plot links of a result whose name the page's links percent-encode."""

from __future__ import annotations

import shutil
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


def test_plots_of_a_result_named_with_a_space_stay_linked(tmp_path, load_script) -> None:
    """The page links ``run%201_speedup.png`` (``quote``), while linked_plots looked for ``](run 1_speedup.png)``:
    render_bench.py without --plots dropped every link of such a page."""
    shutil.copy(RESULTS / "h100_2026-11-25_twentysecond_alexnet_fp16.json", tmp_path / "run 1.json")
    render = load_script("render_bench").main
    assert render([str(tmp_path / "run 1.json"), "--plots"]) == 0
    linked = (tmp_path / "run 1.md").read_text(encoding="utf-8")
    assert "](run%201_speedup.png)" in linked
    assert render([str(tmp_path / "run 1.json")]) == 0
    assert (tmp_path / "run 1.md").read_text(encoding="utf-8") == linked
