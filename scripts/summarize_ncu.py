"""Summarise an Nsight Compute CSV (``ncu --csv --print-units base --metrics ...``) per segment of launches and per
compiled kernel, as a Markdown table.

ncu lists one row per (kernel launch, metric); launches are numbered by ``ID`` in launch order. A segment is a range
of IDs that one phase of the profiled script launched (e.g. ``scripts/estimate_accuracy.py`` makes every estimate
before any full timing); within it, launches are grouped by what tells compiled kernels of one name apart
(``launch__registers_per_thread`` and ``sm__inst_executed.sum``, where collected, and the grid size), and each group
gets its launch count and the median, least and most of ``gpu__time_duration.sum`` (us), and the median of every
other collected metric. Lines before the CSV header (ncu's ``==PROF==`` notes) are skipped; a ``.xz`` file is read
compressed. A file without the header or the duration metric is refused in one line naming it (exit status 2).

Example (kernels/NOTES.md, sixty-second session)::

    python scripts/summarize_ncu.py benchmarks/results/h200_2026-12-02_v62_ncu_estimate_accuracy.csv.xz \\
        --segments estimates=0:180 full=180:348
"""

from __future__ import annotations

import argparse
import csv
import lzma
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

DURATION = "gpu__time_duration.sum"
"""The metric every summary needs: the kernel's time on the GPU (ns with ``--print-units base``)."""

KERNEL_KEYS = ("launch__registers_per_thread", "sm__inst_executed.sum")
"""Metrics that tell two compiled kernels of one name apart (with the grid size), where collected."""


def read_launches(path: Path) -> list[dict[str, str | float]]:
    """One dict per launch, in ID order: ``ID`` (int), ``Kernel Name``, ``Grid Size`` and each metric's value
    (float; ncu's thousands separators dropped).

    Raises:
        ValueError: without the CSV header (a column ``ID``) or without :data:`DURATION`, or for a metric value
            that is not a number. KeyError: for a header without ncu's columns (``Metric Name`` and the others).
    """
    opener = lzma.open if path.suffix == ".xz" else open
    with opener(path, "rt") as stream:
        lines = stream.read().splitlines()
    start = next((index for index, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise ValueError("no ncu CSV header (a line starting with \"ID\")")
    launches: dict[int, dict[str, str | float]] = {}
    for row in csv.DictReader(lines[start:]):
        launch = launches.setdefault(int(row["ID"]), {"ID": int(row["ID"]), "Kernel Name": row["Kernel Name"],
                                                      "Grid Size": row["Grid Size"]})
        try:
            launch[row["Metric Name"]] = float(row["Metric Value"].replace(",", ""))
        except ValueError:
            raise ValueError(f"launch {row['ID']}: {row['Metric Name']} is {row['Metric Value']!r}, not a "
                             "number") from None
    if not launches or any(DURATION not in launch for launch in launches.values()):
        raise ValueError(f"{DURATION} missing; profile with --metrics {DURATION},...")
    return [launches[key] for key in sorted(launches)]


def parse_segment(text: str) -> tuple[str, int, int]:
    """``name=start:end`` (IDs start <= ID < end) as ``(name, start, end)``.

    Raises:
        argparse.ArgumentTypeError: for another form or ``end <= start``.
    """
    name, _, span = text.partition("=")
    first, _, last = span.partition(":")
    if not name or not first.isdigit() or not last.isdigit() or int(last) <= int(first):
        raise argparse.ArgumentTypeError(f"segment {text!r}: expected name=start:end with start < end")
    return name, int(first), int(last)


def summary_rows(launches: Sequence[dict[str, str | float]],
                 segments: Sequence[tuple[str, int, int]]) -> list[dict[str, str | float | int]]:
    """One row per segment and compiled kernel (first seen first): ``segment``, ``kernel`` (name, grid and the
    :data:`KERNEL_KEYS` values), ``launches``, ``median_us``, ``min_us``, ``max_us`` and the median of each other
    metric. Without ``segments``, one segment ``all`` of every launch."""
    segments = segments or [("all", 0, max(int(launch["ID"]) for launch in launches) + 1)]
    metrics = sorted({key for launch in launches for key, value in launch.items()
                      if isinstance(value, float) and key != DURATION and key not in KERNEL_KEYS})
    rows: list[dict[str, str | float | int]] = []
    for name, start, end in segments:
        groups: dict[str, list[dict[str, str | float]]] = {}
        for launch in launches:
            if start <= int(launch["ID"]) < end:
                identity = [str(launch["Kernel Name"]), str(launch["Grid Size"]),
                            *(f"{key.split('__')[1].split('.')[0]}={launch[key]:.0f}" for key in KERNEL_KEYS
                              if key in launch)]
                groups.setdefault(" ".join(identity), []).append(launch)
        for kernel, members in groups.items():
            times = [float(launch[DURATION]) / 1000 for launch in members]
            row: dict[str, str | float | int] = {"segment": name, "kernel": kernel, "launches": len(members),
                                                 "median_us": statistics.median(times), "min_us": min(times),
                                                 "max_us": max(times)}
            for metric in metrics:
                values = [float(launch[metric]) for launch in members if metric in launch]
                if values:
                    row[metric] = statistics.median(values)
            rows.append(row)
    return rows


def markdown(rows: Sequence[dict[str, str | float | int]]) -> str:
    """``rows`` as a Markdown table; numbers to four significant digits, a metric absent from a row blank."""
    columns = list(dict.fromkeys(key for row in rows for key in row))

    def cell(value: str | float | int | None) -> str:
        return "" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(column)) for column in columns) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", type=Path, help="ncu --csv output (.csv or .csv.xz)")
    parser.add_argument("--segments", nargs="+", type=parse_segment, default=[],
                        help="name=start:end ranges of launch IDs (default: one segment of all)")
    args = parser.parse_args(argv)
    try:
        launches = read_launches(args.csv)
    except (OSError, ValueError, KeyError, lzma.LZMAError) as error:
        parser.error(f"{args.csv}: {type(error).__name__}: {error}")
    print(markdown(summary_rows(launches, args.segments)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
