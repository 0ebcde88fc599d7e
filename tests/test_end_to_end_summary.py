"""The whole-model summary across benchmark runs (``unsparse.report.end_to_end_summary``), on hand-made records
and on the committed page (CPU, no timing)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from unsparse.report.end_to_end_summary import (
    best_rows,
    dense_mode,
    latest_rows,
    summary_markdown,
    summary_row,
    summary_rows,
)

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "end_to_end_summary.md"


def record(**fields):
    base = {"model": "vgg16", "batch": 128, "precision": "tf32", "sparsity": 0.98, "dense_ms": 20.0,
            "dense_nhwc_ms": 15.0, "planned_ms": 12.0, "planned_nhwc_ms": 14.0,
            "backend_counts": {"cudnn": 3, "generated": 10}, "off_cudnn": {f"l{i}": "generated" for i in range(10)},
            "backend_counts_nhwc": {"cudnn": 13}, "off_cudnn_nhwc": {}}
    return base | fields


def test_a_row_holds_the_plan_against_the_faster_dense_model_and_says_what_won() -> None:
    row = summary_row(record(dense_fused_convs=13, dense_fused_ms=13.0, dense_fused_nhwc_ms=12.2,
                             best_dense_fused_layout="nhwc"), "r")
    assert (row["dense_ms"], row["dense_layout"], row["planned_ms"], row["planned_layout"]) == (15.0, "NHWC", 12.0,
                                                                                                 "NCHW")
    assert row["best_dense_ms"] == 12.2 and row["speedup"] == pytest.approx(12.2 / 12.0)
    assert (row["off_cudnn"], row["convs"], row["verdict"]) == (10, 13, "within noise")
    assert summary_row(record(), "r")["verdict"] == "faster (no fused dense model timed)"
    nothing_to_fuse = summary_row(record(dense_fused_convs=0, dense_folded_batch_norm=0), "r")
    assert nothing_to_fuse["verdict"] == "faster" and nothing_to_fuse["dense_fused_ms"] is None
    slower = summary_row(record(dense_fused_ms=11.0, best_dense_fused_layout="nchw"), "r")
    assert slower["verdict"] == "SLOWER" and slower["speedup"] == pytest.approx(11.0 / 12.0)
    all_cudnn = summary_row(record(planned_ms=16.0, planned_nhwc_ms=11.9), "r")  # the NHWC plan is faster
    assert (all_cudnn["planned_layout"], all_cudnn["off_cudnn"], all_cudnn["verdict"]) == ("NHWC", 0,
                                                                                          "no sparse kernel")
    converted = summary_row(record(off_cudnn={"l0": "generated", "l1": "cudnn, converted to nhwc"}), "r")
    assert converted["off_cudnn"] == 1
    only_converted = summary_row(record(off_cudnn={"l1": "cudnn, converted to nhwc"}, planned_ms=11.0), "r")
    assert (only_converted["off_cudnn"], only_converted["verdict"]) == (0, "no sparse kernel")
    old = summary_row({k: v for k, v in record().items() if "nhwc" not in k and "backend" not in k
                       and "off" not in k}, "r")
    assert old["convs"] is None and old["planned_layout"] == "NCHW" and old["dense_layout"] == "NCHW"


def test_the_graph_ratio_takes_each_side_in_its_faster_layout_and_is_absent_without_graph_times() -> None:
    """A host-bound run (eager planned NHWC far slower than its graph replay) reads SLOWER eagerly and about 1.00
    in CUDA graphs; a record without graph times has no graph ratio, and the page shows "-" for it."""
    host_bound = record(dense_graph_ms=7.7, dense_nhwc_graph_ms=5.72, planned_graph_ms=7.5, planned_nhwc_graph_ms=5.73,
                        dense_nhwc_ms=6.0, planned_ms=7.9, planned_nhwc_ms=9.1)
    row = summary_row(host_bound, "r")
    assert row["verdict"] == "SLOWER" and row["best_graph_speedup"] == pytest.approx(5.72 / 5.73)
    assert summary_row(record(dense_graph_ms=20.0, planned_nhwc_graph_ms=10.0), "r")["best_graph_speedup"] == 2.0
    rejected = record(dense_graph_ms=8.0, planned_graph_ms=10.0, planned_nhwc_graph_ms=4.0, planned_nhwc_ms=None)
    assert summary_row(rejected, "r")["best_graph_speedup"] == 0.8  # the NHWC plan's output failed: not its time
    bare = summary_row(record(), "r")
    assert bare["best_graph_speedup"] is None
    assert "| 1.25 | - | 10 of 13 |" in summary_markdown([bare], "made")


def test_the_fused_column_says_how_many_fused_relus_take_the_residual_add() -> None:
    fused = summary_row(record(folded_batch_norm=53, fused_relu=49, fused_residual=16), "r")
    older = summary_row(record(folded_batch_norm=53, fused_relu=33), "r")  # from before residuals fused
    assert (fused["fused_residual"], older["fused_residual"]) == (16, 0)
    page = summary_markdown([fused, older], "made")
    assert "| 53 / 49 (16 residual)+0 |" in page and "| 53 / 33+0 |" in page


def test_the_precision_names_the_sparse_backends_a_plan_chose_among_where_more_than_its_own() -> None:
    """A whole model planned on direct and generated at fp32 reads so; a record of one sparse backend, or from
    before records named them, shows the precision alone."""
    combined = summary_row(record(precision="fp32", sparse_backends=["direct", "generated"]), "r")
    own = summary_row(record(precision="fp32", sparse_backends=["direct"]), "r")
    assert (combined["precision"], own["precision"], summary_row(record(), "r")["precision"]) == (
        "fp32 (direct+generated)", "fp32", "tf32")
    assert "| fp32 (direct+generated) |" in summary_markdown([combined], "made")


def test_the_latest_table_keeps_the_last_run_of_each_setting_and_the_full_table_keeps_every_run() -> None:
    """Of two runs of one setting the later one (the later in the given order) is the latest, whatever it fused; a
    run of another batch or precision label is a setting of its own; the page lists the latest first, then every
    run in the given order."""
    earlier = summary_row(record(precision="fp32"), "v49")
    later = summary_row(record(precision="fp32", fused_relu=13), "v50")
    batch_1 = summary_row(record(precision="fp32", batch=1), "v50b1")
    combined = summary_row(record(precision="fp32", sparse_backends=["direct", "generated"]), "v50c")
    rows = [earlier, batch_1, later, combined]
    assert [row["run"] for row in latest_rows(rows)] == ["v50b1", "v50", "v50c"]
    assert [row["run"] for row in latest_rows([later, earlier])] == ["v49"]
    batch_32 = summary_row(record(precision="fp32", batch=32), "v50b32")
    unknown = summary_row(record(precision="fp32", sparsity=None), "trained")
    assert [row["run"] for row in latest_rows([unknown, later, batch_32, batch_1])] == ["v50b1", "v50b32", "v50",
                                                                                        "trained"]  # by number
    page = summary_markdown(rows, "made")
    latest, every = page.split("## Latest run of each setting", 1)[1].split("## Every run")
    assert "`v49`" not in latest and latest.count("| `v50") == 3
    assert [line.split("`")[1] for line in every.splitlines() if line.startswith("| `")] == ["v49", "v50b1", "v50",
                                                                                            "v50c"]


def test_the_committed_page_is_what_its_command_makes_from_the_committed_results() -> None:
    """The page names the command that made it; run on the same files it gives the page byte for byte, so a figure
    in it is one of the results' and a result added later without remaking the page is caught."""
    text = PAGE.read_text(encoding="utf-8")
    command = text.split("Made by `", 1)[1].split("`", 1)[0]
    arguments = shlex.split(command)[2:]
    paths = arguments[:arguments.index("--out")]
    assert len(paths) >= 14 and all((ROOT / path).is_file() for path in paths)
    committed = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "benchmarks" / "results").glob(
        "h200_*_end_to_end_*.json"))
    assert paths == committed  # every H200 end-to-end result is in it
    assert summary_markdown(summary_rows(ROOT / path for path in paths), command) == text


def test_the_switched_column_holds_the_switched_plan_against_the_fastest_dense_model() -> None:
    """Against the fastest of the eager dense model (15.0 here), the dense fused model's faster single layout and the
    dense fused model switched alike; absent where the run timed no switched plan."""
    base = record(dense_fused_ms=13.0, dense_fused_nhwc_ms=12.2, best_dense_fused_layout="nhwc",
                  planned_switched_ms=11.0, dense_fused_layout_switch="pool")
    assert summary_row(base | {"dense_fused_switched_ms": 12.5}, "r")["switched_speedup"] == pytest.approx(12.2 / 11)
    assert summary_row(base | {"dense_fused_switched_ms": 11.8}, "r")["switched_speedup"] == pytest.approx(11.8 / 11)
    before_the_fix = {k: v for k, v in base.items() if k != "dense_fused_layout_switch"}
    assert summary_row(before_the_fix | {"dense_fused_switched_ms": 11.8}, "r")["switched_speedup"] == pytest.approx(
        12.2 / 11)
    assert summary_row(record(planned_switched_ms=10.0), "r")["switched_speedup"] == pytest.approx(15.0 / 10)
    assert summary_row(record(), "r")["switched_speedup"] is None
    switched = summary_row(base | {"dense_fused_switched_ms": 12.5}, "a")
    page = summary_markdown([switched, summary_row(record(), "b")], "cmd")
    assert f"| {switched['verdict']} | 1.11 |" in page and page.rstrip().endswith("| - |")


def test_the_switched_column_gives_the_switched_models_verdict_where_the_run_recorded_its_backends() -> None:
    """Faster beyond the margin with a sparse conv, no sparse kernel where it runs none (a cuDNN layer converted to
    the other layout is not sparse), SLOWER beyond the margin whatever its kernels."""
    base = record(dense_fused_ms=13.0, dense_fused_nhwc_ms=12.2, best_dense_fused_layout="nhwc",
                  dense_fused_layout_switch="pool", dense_fused_switched_ms=13.5,
                  backend_counts_switched={"direct": 1, "cudnn": 3},
                  off_cudnn_switched={"conv1": "direct", "fc": "cudnn, converted to nhwc"})

    def cell(**changes: object) -> str:
        row = summary_row(base | changes, "r")
        return summary_markdown([row], "cmd").rstrip().rsplit("|", 2)[1].strip()

    assert cell(planned_switched_ms=11.0) == "1.11, faster (1 of 4 convs sparse)"
    assert cell(planned_switched_ms=12.0) == "1.02, within noise (1 of 4 convs sparse)"
    assert cell(planned_switched_ms=13.0) == "0.94, SLOWER (1 of 4 convs sparse)"
    assert cell(planned_switched_ms=11.0, off_cudnn_switched={"fc": "cudnn, converted to nhwc"}) == (
        "1.11, no sparse kernel (0 of 4 convs sparse)")
    assert cell(planned_switched_ms=11.0, backend_counts_switched=None) == "1.11"


def test_a_run_that_timed_every_model_switched_reads_switched_as_a_third_layout() -> None:
    """With the eager dense model timed switched too (``dense_switched_ms``), the row's times, layouts, plan counts
    and verdict come from the fastest of three layouts; without it the switched planned time is left to its column."""
    three = record(planned_switched_ms=11.0, dense_switched_ms=14.0, dense_fused_convs=13, dense_fused_ms=13.0,
                   dense_fused_nhwc_ms=12.2,
                   dense_fused_switched_ms=11.5, best_dense_fused_layout="switched",
                   backend_counts_switched={"direct": 1, "cudnn": 12}, off_cudnn_switched={"conv1": "direct"})
    row = summary_row(three, "r")
    assert (row["planned_ms"], row["planned_layout"], row["dense_ms"], row["dense_layout"]) == (11.0, "switched",
                                                                                                 14.0, "switched")
    assert (row["dense_fused_ms"], row["dense_fused_layout"], row["best_dense_ms"]) == (11.5, "switched", 11.5)
    assert (row["off_cudnn"], row["convs"], row["verdict"]) == (1, 13, "faster")
    assert row["speedup"] == pytest.approx(11.5 / 11.0)
    graphs = {"dense_graph_ms": 19.0, "dense_nhwc_graph_ms": 14.5, "dense_switched_graph_ms": 13.8,
              "planned_graph_ms": 11.9, "planned_nhwc_graph_ms": 13.9, "planned_switched_graph_ms": 10.9}
    assert summary_row(three | graphs, "r")["best_graph_speedup"] == pytest.approx(13.8 / 10.9)
    assert summary_row(three | graphs | {"planned_switched_ms": None}, "r")["best_graph_speedup"] == pytest.approx(
        13.8 / 11.9)  # a switched output that failed: not its graph time
    earlier = {k: v for k, v in three.items() if k != "dense_switched_ms"} | {"best_dense_fused_layout": "nhwc"}
    two = summary_row(earlier, "r")
    assert (two["planned_ms"], two["planned_layout"], two["off_cudnn"]) == (12.0, "NCHW", 10)
    assert two["best_dense_ms"] == 12.2


def test_the_best_table_keeps_the_highest_ratio_per_model_and_cudnn_precision_among_runs_with_a_fused_dense_model():
    """Runs against cuDNN's fused dense model only (an older run, eager dense alone, would overstate the ratio); the
    precision labels of one cuDNN mode are one group whatever sparse backends the plan chose among; another batch or
    cuDNN mode is a group of its own; of equal ratios the first."""
    fused = {"dense_fused_ms": 14.0, "dense_fused_convs": 13, "best_dense_fused_layout": "nchw"}
    unfused = summary_row(record(precision="fp32", planned_ms=2.0), "old")  # 7.5x against eager dense only
    generated = summary_row(record(precision="fp32_generated", planned_ms=3.0, **fused), "g")
    combined = summary_row(record(precision="fp32", sparse_backends=["direct", "generated"], planned_ms=2.8,
                                  **fused), "c")
    tf32 = summary_row(record(precision="tf32_generated", **fused), "t")
    again = summary_row(record(precision="tf32", **fused), "t2")
    batch_1 = summary_row(record(precision="fp32", batch=1, **fused), "b1")
    assert [row["run"] for row in best_rows([unfused, generated, combined, tf32, again, batch_1])] == ["b1", "c", "t"]
    assert [dense_mode(label) for label in ("fp32_generated", "tf32 (direct+generated)", "fp16_half2", "fp16")] == [
        "fp32", "tf32", "fp16", "fp16"]
    page = summary_markdown([unfused, generated, combined], "made")
    best = page.split("## Best run of each model and precision", 1)[1].split("## Latest run")[0]
    assert [line.split("`")[1] for line in best.splitlines() if line.startswith("| `")] == ["c"]


def test_the_script_refuses_a_missing_or_malformed_file_in_one_line(tmp_path, load_script, run_script) -> None:
    """A result file that cannot be read or is no JSON is refused with exit status 2 and its name, no traceback, and
    nothing is written."""
    script = load_script("summarize_end_to_end")
    broken, out = tmp_path / "broken.json", tmp_path / "page.md"
    broken.write_text("{not json")
    for path in (tmp_path / "missing.json", broken):
        code, text = run_script(script, [str(path), "--out", str(out)])
        assert code == 2 and path.name in text and "Traceback" not in text
    assert not out.exists()
