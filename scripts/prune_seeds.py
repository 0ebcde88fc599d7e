"""Summary of pruning tables run with several seeds (``scripts/prune_table.py --seed``): per model and method,
the mean and sample standard deviation over seeds of the test metric and of its change from the same seed's
dense model, the goal verdict on the mean, and how often evolutionary beats gradual magnitude.

    PYTHONPATH=. python scripts/prune_seeds.py docs/pruning_results_h100_long.json \
        docs/pruning_results_h100_long_seed*.json --out docs/pruning_results_h100_long_seeds.md
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from unsparse.atomic import atomic_write_text
from unsparse.report.results import load_result

GOAL_SPARSITY, GOAL_DROP = 0.92, 0.5
"""Issue 3's goal: >= 92 % weighted sparsity with <= 0.5 point top-1 drop from dense."""


def spread(values: list[float], digits: int) -> str:
    """``mean ± sample std (n)``; the std is left out for one value."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return f"{mean:.{digits}f} (n=1)"
    return f"{mean:.{digits}f} ± {statistics.stdev(values):.{digits}f} (n={len(values)})"


def with_settings(run: dict[str, Any]) -> dict[str, Any]:
    """``run`` with the table options it ran with (``fine_tune_lr``, ``evolutionary_overrides``) on every block."""
    settings = {key: run["meta"][key] for key in ("fine_tune_lr", "evolutionary_overrides") if key in run["meta"]}
    return {**run, "blocks": [{**block, "settings": settings} for block in run["blocks"]]}


def merge_by_seed(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One run per seed: runs of the same seed (``prune_table.py --models`` subsets) pooled, in order of first
    appearance; each model's block comes from the first file that has it.

    Raises:
        ValueError: if two runs of one seed have different budgets (they are not one experiment).
    """
    merged: dict[int, dict[str, Any]] = {}
    for run in map(with_settings, runs):
        seed = run["meta"].get("seed", 0)
        if seed not in merged:
            merged[seed] = {"meta": run["meta"], "blocks": list(run["blocks"])}
            continue
        if run["meta"].get("budget") != merged[seed]["meta"].get("budget"):
            raise ValueError(f"runs of seed {seed} have different budgets: {merged[seed]['meta'].get('budget')} "
                             f"and {run['meta'].get('budget')}")
        have = {block["model"] for block in merged[seed]["blocks"]}
        merged[seed]["blocks"] += [block for block in run["blocks"] if block["model"] not in have]
    return list(merged.values())


def summary(runs: list[dict[str, Any]], sources: list[Path], notes: list[str] | None = None,
            pool: bool = False) -> str:
    """The Markdown page for runs of one budget with different seeds (several files of one seed are merged);
    ``notes`` are paragraphs placed under the heading (e.g. how the settings were chosen). With ``pool``, files
    are not merged: every block of a model counts as one run, so repeated runs of one protocol with the same seeds
    pool into one mean (n = all of them)."""
    budgets = {run["meta"].get("budget_name") for run in runs}
    files = ", ".join(f"`{path.name}` (seed {run['meta'].get('seed', 0)}, commit {run['meta']['commit']})"
                      for path, run in zip(sources, runs, strict=True))
    runs = [with_settings(run) for run in runs] if pool else merge_by_seed(runs)
    unit = "runs" if pool else "seeds"
    seeds = [run["meta"].get("seed", 0) for run in runs]
    lines = [f"# Pruning results {'pooled over runs' if pool else 'over seeds'}", "",
             f"Budget {', '.join(sorted(map(str, budgets)))}; seeds {seeds}; files: {files}.",
             "Each seed trains its own dense model; changes are against that seed's dense model. ± is the sample "
             f"standard deviation over {unit}.", "", *(line for note in notes or [] for line in (note, ""))]
    complete = [{block["model"] for block in run["blocks"] if "error" not in block} for run in runs]
    if pool:
        models = list(dict.fromkeys(model for found in complete for model in sorted(found)))
    else:
        models = [block["model"] for block in runs[0]["blocks"]
                  if "error" not in block and all(block["model"] in found for found in complete)]
    for model in models:
        # merged runs hold one block per model, each complete for the models kept: one list serves both modes
        blocks = [b for run in runs for b in run["blocks"] if b["model"] == model and "error" not in b]
        key = "top1" if "top1" in blocks[0]["rows"][0]["test"] else "mse"
        change = "change (points)" if key == "top1" else "ratio to dense"
        lines += [f"## {model}", ""]
        settings = {json.dumps(block["settings"], sort_keys=True) for block in blocks if block["settings"]}
        if settings:
            lines += [f"Run with {' / '.join(sorted(settings))} (the tables' `--fine-tune-lr` and `--evolutionary` "
                      "options; unset: 0.01 and the config file).", ""]
        lines += [f"| method | test {key} | {change} | weighted sparsity |", "|---|---|---|---|"]
        per_method: dict[str, list[float]] = {}
        for method in [row["method"] for row in blocks[0]["rows"]]:
            values, changes, sparsity = [], [], []
            for block in blocks:
                dense = block["rows"][0]["test"][key]
                row = next(r for r in block["rows"] if r["method"] == method)
                values.append(row["test"][key])
                changes.append(row["test"][key] - dense if key == "top1" else row["test"][key] / dense)
                sparsity.append(row["weighted_sparsity"])
            per_method[method] = changes
            digits = 2 if key == "top1" else 5
            lines.append(f"| {method} | {spread(values, digits)} | {spread(changes, 2)} | {min(sparsity):.4f} |")
        evolutionary, gradual = per_method["evolutionary"], per_method["gradual"]
        better = [e > g if key == "top1" else e < g for e, g in zip(evolutionary, gradual, strict=True)]
        lines += ["", f"Evolutionary beats gradual magnitude in {sum(better)} of {len(better)} {unit}."]
        if key == "top1":
            drop = -statistics.fmean(evolutionary)
            met = drop <= GOAL_DROP and min(r["weighted_sparsity"] for b in blocks for r in b["rows"]
                                            if r["method"] == "evolutionary") >= GOAL_SPARSITY - 1e-9
            lines.append(f"Goal (>= {GOAL_SPARSITY:.0%} weighted sparsity, <= {GOAL_DROP} point drop): "
                         f"{'met' if met else 'NOT met'} on the mean (drop {drop:.2f} points; per {unit[:-1]} "
                         f"{', '.join(f'{-c:.2f}' for c in evolutionary)}).")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Write the summary of the given ``pruning_results*.json`` files."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path, help="pruning_results JSON files (.json or .json.xz)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--note", action="append", default=[], help="a paragraph under the heading (repeatable)")
    parser.add_argument("--pool", action="store_true",
                        help="count every file's block as one run (repeated runs of one protocol), not one per seed")
    args = parser.parse_args(argv)
    runs = [load_result(path, strict=False) for path in args.results]  # histories may hold -Infinity
    atomic_write_text(args.out, summary(runs, args.results, args.note, args.pool))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
