"""Re-render the Markdown report (and, with ``--plots``, the PNG plots) of benchmark JSON files.

Every figure comes from the JSON that ``scripts/gpu_check.py`` (``unsparse.runtime.bench.run_bench``) wrote on
the GPU machine; this only formats it again, e.g. after the report layout changed.

    PYTHONPATH=. python scripts/render_bench.py benchmarks/results/h100_*.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from unsparse.atomic import atomic_write_text
from unsparse.report.benchmark import evaluate_targets, linked_plots, markdown_report, plot_results
from unsparse.report.results import beside, load_result, result_stem


def is_bench_result(result: dict[str, Any]) -> bool:
    """Whether a result file is ``run_bench``'s: an environment and per-layer records with a target sparsity (other
    scripts' results, e.g. ``time_cudnn_layouts.py``'s, also have ``layers`` and ``environment``)."""
    layers = result.get("layers")
    return ("environment" in result and isinstance(layers, list)
            and all(isinstance(record, dict) and "target_sparsity" in record for record in layers))


def main(argv: list[str] | None = None) -> int:
    """Write ``<name>.md`` beside each ``<name>.json`` or ``<name>.json.xz`` (targets recomputed from the
    records) and with ``--plots`` ``<name>_speedup.png`` etc. (those with data), which the page then links; without
    ``--plots`` it keeps linking the plots the page already links and that exist beside it
    (:func:`~unsparse.report.benchmark.linked_plots`), so each committed page re-renders byte for byte. Files of other
    scripts are skipped, and a file that cannot be rendered (a missing or null field) is named with its error while
    the others still render.

    Returns:
        0, or 1 if any file could not be rendered.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path, help="bench JSON files (.json or .json.xz)")
    parser.add_argument("--plots", action="store_true",
                        help="also write the PNG plots beside each file and link them from its page")
    args = parser.parse_args(argv)
    failed = 0
    for path in args.results:
        try:
            result = load_result(path)
            if not is_bench_result(result):
                print(f"skipped {path}: not a run_bench result")
                continue
            result.setdefault("end_to_end", [])
            result["targets"] = evaluate_targets(result)
            stem = result_stem(path)
            page = beside(stem, ".md")
            plots = (plot_results(result, path.parent, prefix=f"{stem.name}_") if args.plots
                     else linked_plots(page, stem.name))
            atomic_write_text(page, markdown_report(result, plots=plots))
        except (ValueError, KeyError, TypeError, AttributeError, OSError) as error:
            failed += 1
            print(f"FAILED {path}: {type(error).__name__}: {error}", file=sys.stderr)
            continue
        print(f"rendered {page}")
    return int(failed > 0)


if __name__ == "__main__":
    sys.exit(main())
