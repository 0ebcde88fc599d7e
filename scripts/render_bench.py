"""Re-render the Markdown report (and, with ``--plots``, the PNG plots) of benchmark JSON files.

Every figure comes from the JSON that ``scripts/gpu_check.py`` (``unsparse.runtime.bench.run_bench``) wrote on
the GPU machine; this only formats it again, e.g. after the report layout changed.

    PYTHONPATH=. python scripts/render_bench.py benchmarks/results/h100_*.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

from unsparse.atomic import atomic_write_text
from unsparse.report.benchmark import evaluate_targets, markdown_report, plot_results
from unsparse.report.results import beside, load_result, result_stem


def main(argv: list[str] | None = None) -> None:
    """Write ``<name>.md`` beside each ``<name>.json`` or ``<name>.json.xz`` (targets recomputed from the
    records)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path, help="bench JSON files (.json or .json.xz)")
    parser.add_argument("--plots", action="store_true", help="also write the PNG plots beside each file")
    args = parser.parse_args(argv)
    for path in args.results:
        result = load_result(path)
        if "layers" not in result or "environment" not in result:
            continue
        result.setdefault("end_to_end", [])
        result["targets"] = evaluate_targets(result)
        page = beside(result_stem(path), ".md")
        atomic_write_text(page, markdown_report(result))
        if args.plots:
            plot_results(result, path.parent)
        print(f"rendered {page}")


if __name__ == "__main__":
    main()
