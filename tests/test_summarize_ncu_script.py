"""scripts/summarize_ncu.py: an ncu CSV summarised per segment of launch IDs and per compiled kernel."""

from __future__ import annotations

import lzma
from pathlib import Path

import pytest

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
          '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def ncu_csv(launches: list[tuple[int, int, int, float, float]]) -> str:
    """ncu's CSV of ``(id, registers, instructions, duration ns, stall %)`` launches of ``generated_conv``, with the
    profiler's notes before the header and thousands separators in the values, as ncu writes them."""
    lines = ["==PROF== Connected to process 1", HEADER]
    for launch_id, registers, instructions, duration, stall in launches:
        for metric, value in (("gpu__time_duration.sum", f"{duration:,.0f}"),
                              ("launch__registers_per_thread", str(registers)),
                              ("sm__inst_executed.sum", f"{instructions:,}"),
                              ("smsp__warp_issue_stalled_no_instruction_per_warp_active.pct", str(stall))):
            lines.append(f'"{launch_id}","1","python3","host","generated_conv","1","7","(256, 1, 1)","(392, 1, 1)",'
                         f'"0","9.0","Command line profiler metrics","{metric}","","{value}"')
    return "\n".join(lines) + "\n"


LAUNCHES = [(0, 48, 1000, 80000.0, 0.1), (1, 48, 1000, 82000.0, 0.3), (2, 48, 1000, 81000.0, 0.2),
            (3, 48, 1000, 84000.0, 0.3), (4, 64, 1010, 40000.0, 1.5), (5, 48, 1000, 82000.0, 0.4)]


def test_launches_are_grouped_per_segment_and_compiled_kernel(load_script, tmp_path: Path) -> None:
    script = load_script("summarize_ncu")
    path = tmp_path / "ncu.csv.xz"
    with lzma.open(path, "wt") as stream:
        stream.write(ncu_csv(LAUNCHES))
    launches = script.read_launches(path)
    assert [launch["ID"] for launch in launches] == list(range(6))
    rows = script.summary_rows(launches, [("probe", 0, 3), ("full", 3, 6)])
    assert [(row["segment"], row["launches"], row["median_us"], row["min_us"], row["max_us"]) for row in rows] == [
        ("probe", 3, 81.0, 80.0, 82.0), ("full", 2, 83.0, 82.0, 84.0), ("full", 1, 40.0, 40.0, 40.0)]
    assert "registers_per_thread=64 inst_executed=1010" in rows[2]["kernel"]
    assert rows[1]["smsp__warp_issue_stalled_no_instruction_per_warp_active.pct"] == pytest.approx(0.35)
    whole = script.summary_rows(launches, [])
    assert [(row["segment"], row["launches"]) for row in whole] == [("all", 5), ("all", 1)]
    table = script.markdown(rows)
    assert table.splitlines()[0].startswith("| segment | kernel | launches | median_us |")
    assert len(table.splitlines()) == 2 + len(rows)


@pytest.mark.parametrize(("text", "message"), [
    ("==PROF== nothing profiled\n", "no ncu CSV header"),
    (ncu_csv(LAUNCHES).replace("gpu__time_duration.sum", "dram__bytes.sum"), "gpu__time_duration.sum missing"),
    (ncu_csv(LAUNCHES).replace('"82,000"', '"n/a"', 1), "not a number"),
])
def test_a_file_that_is_no_ncu_csv_is_refused_in_one_line(load_script, run_script, tmp_path: Path, text: str,
                                                          message: str) -> None:
    path = tmp_path / "ncu.csv"
    path.write_text(text)
    status, output = run_script(load_script("summarize_ncu"), [str(path)])
    assert status == 2 and message in output and "Traceback" not in output


def test_a_segment_is_name_start_end(load_script, run_script, tmp_path: Path) -> None:
    script = load_script("summarize_ncu")
    assert script.parse_segment("estimates=0:180") == ("estimates", 0, 180)
    path = tmp_path / "ncu.csv"
    path.write_text(ncu_csv(LAUNCHES))
    for bad in ("estimates", "=0:3", "a=3:3", "a=x:4"):
        status, output = run_script(script, [str(path), "--segments", bad])
        assert status == 2 and "expected name=start:end" in output
