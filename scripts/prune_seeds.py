"""Summary of pruning tables run with several seeds (``scripts/prune_table.py --seed``): per model and method,
the mean and sample standard deviation over seeds of the test metric and of its change from the same seed's
dense model, the goal verdict on the mean, and how often evolutionary beats gradual magnitude.

    PYTHONPATH=. python scripts/prune_seeds.py docs/pruning_results_h100_long.json \
        docs/pruning_results_h100_long_seed*.json --out docs/pruning_results_h100_long_seeds.md

Files of one seed are joined (``prune_table.py --models`` runs split one seed by model); two files holding a
result for the same model and seed are refused, both named (a repeated run is pooled with ``--pool`` instead, on
purpose). A model missing from some seeds (not run, or failed) is still summarised over the seeds that have it,
with a warning on stderr and a line on the page naming the seeds it covers and those it lacks, so that no mean
over fewer seeds passes for one over all of them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from unsparse.atomic import atomic_write_text
from unsparse.report.results import load_result
from unsparse.strict_json import nan_if_none

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


def merge_by_seed(runs: list[dict[str, Any]], sources: list[Path]) -> list[dict[str, Any]]:
    """One run per seed: runs of the same seed (``prune_table.py --models`` subsets, read from ``sources``) pooled,
    in order of first appearance; a model's failed block gives way to a finished one from another file.

    Raises:
        ValueError: if two runs of one seed have different budgets or gradual schedules (they are not one
            experiment), or two files of one seed both hold a finished block of one model (naming both files: a
            duplicate seed).
    """
    merged: dict[int, dict[str, Any]] = {}
    found: dict[tuple[int, str], tuple[dict[str, Any], Path]] = {}
    for run, path in zip(map(with_settings, runs), sources, strict=True):
        seed = run["meta"].get("seed", 0)
        if seed not in merged:
            merged[seed] = {"meta": run["meta"], "blocks": []}
        elif run["meta"].get("budget") != merged[seed]["meta"].get("budget"):
            raise ValueError(f"runs of seed {seed} have different budgets: {merged[seed]['meta'].get('budget')} "
                             f"and {run['meta'].get('budget')}")
        elif gradual_schedule(run, path) != gradual_schedule(merged[seed], path):
            raise ValueError(f"runs of seed {seed} have different gradual schedules ({path} against an earlier "
                             "file): they are not one experiment")
        for block in run["blocks"]:
            earlier = found.get((seed, block["model"]))
            if earlier and "error" not in earlier[0] and "error" not in block:
                raise ValueError(f"seed {seed}: {block['model']} is in both {earlier[1]} and {path} (a duplicate "
                                 "seed; --pool counts repeated runs)")
            if earlier is None or "error" in earlier[0]:
                found[seed, block["model"]] = (block, path)
    for (seed, _), (block, _) in found.items():
        merged[seed]["blocks"].append(block)
    return list(merged.values())


def coverage(model: str, runs: list[dict[str, Any]]) -> str | None:
    """A line for the page if ``model`` has no finished block in some of the ``runs``' seeds (None if it is in
    all), also written to stderr as a warning: the seeds its figures cover and those they lack."""
    seeds = list(dict.fromkeys(run["meta"].get("seed", 0) for run in runs))
    covered = {run["meta"].get("seed", 0) for run in runs
               if any(block["model"] == model and "error" not in block for block in run["blocks"])}
    missing = [seed for seed in seeds if seed not in covered]
    if not missing:
        return None
    print(f"warning: {model} is missing from seed(s) {missing} (not run or failed); its figures cover seed(s) "
          f"{sorted(covered)} only", file=sys.stderr)
    return (f"**Partial**: these figures cover seed(s) {sorted(covered)} only; {model} is missing from seed(s) "
            f"{missing} (not run or failed).")


GRADUAL_PACES = {"step": " (the baseline pruning as often as the evolutionary run: after every iteration's batches)",
                 "epoch": " (the baseline pruning only at epoch ends, one step an epoch against one per "
                          "evolutionary iteration: a coarse baseline)"}
"""How often the tables' gradual magnitude baseline pruned, by their ``gradual_schedule`` (``epoch`` before the
twenty-first session, when the field did not exist)."""


def gradual_schedule(run: dict[str, Any], source: Path) -> str:
    """How often ``run``'s gradual baseline pruned (its meta's ``gradual_schedule``, ``"epoch"`` where absent).

    Raises:
        ValueError: naming ``source``, for a value other than those of :data:`GRADUAL_PACES`.
    """
    schedule = run["meta"].get("gradual_schedule", "epoch")
    if schedule not in GRADUAL_PACES:
        raise ValueError(f"{source}: gradual_schedule {schedule!r}, expected one of {sorted(GRADUAL_PACES)}")
    return schedule


def gradual_pace(runs: list[dict[str, Any]], model: str) -> str:
    """The clause for ``model``'s "evolutionary beats gradual" line: how often the baseline pruned in the runs that
    hold a finished block of it (their ``gradual_schedule``, checked by :func:`gradual_schedule`)."""
    schedules = {run["meta"].get("gradual_schedule", "epoch") for run in runs
                 if any(block["model"] == model and "error" not in block for block in run["blocks"])}
    return GRADUAL_PACES[schedules.pop()] if len(schedules) == 1 else (
        " (baselines of both schedules pooled: see the tables)")


def summary(runs: list[dict[str, Any]], sources: list[Path], notes: list[str] | None = None,
            pool: bool = False) -> str:
    """The Markdown page for runs of one budget with different seeds (several files of one seed are merged);
    ``notes`` are paragraphs placed under the heading (e.g. how the settings were chosen). With ``pool``, files
    are not merged: every block of a model counts as one run, so repeated runs of one protocol with the same seeds
    pool into one mean (n = all of them). A model missing from some seeds is summarised over the seeds that have
    it, marked on the page and warned of on stderr (:func:`coverage`). How often the gradual baseline pruned is
    said per model, from the files that hold it.

    Raises:
        ValueError: files of one seed from different budgets or gradual schedules, a duplicate seed
            (:func:`merge_by_seed`), or an unknown ``gradual_schedule`` (naming the file).
    """
    for run, source in zip(runs, sources, strict=True):
        gradual_schedule(run, source)
    budgets = {run["meta"].get("budget_name") for run in runs}
    files = ", ".join(f"`{path.name}` (seed {run['meta'].get('seed', 0)}, commit {run['meta']['commit']})"
                      for path, run in zip(sources, runs, strict=True))
    runs = [with_settings(run) for run in runs] if pool else merge_by_seed(runs, sources)
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
        models = list(dict.fromkeys(block["model"] for run in runs for block in run["blocks"] if "error" not in block))
    for model in models:
        # merged runs hold at most one block per model: one list serves both modes
        blocks = [b for run in runs for b in run["blocks"] if b["model"] == model and "error" not in b]
        key = "top1" if "top1" in blocks[0]["rows"][0]["test"] else "mse"
        change = "change (points)" if key == "top1" else "ratio to dense"
        lines += [f"## {model}", ""]
        partial = coverage(model, runs)
        if partial:
            lines += [partial, ""]
        settings = {json.dumps(block["settings"], sort_keys=True) for block in blocks if block["settings"]}
        if settings:
            lines += [f"Run with {' / '.join(sorted(settings))} (the tables' `--fine-tune-lr` and `--evolutionary` "
                      "options; unset: 0.01 and the config file).", ""]
        lines += [f"| method | test {key} | {change} | weighted sparsity |", "|---|---|---|---|"]
        per_method: dict[str, list[float]] = {}
        for method in [row["method"] for row in blocks[0]["rows"]]:
            values, changes, sparsity = [], [], []
            for block in blocks:
                dense = nan_if_none(block["rows"][0]["test"][key])
                row = next(r for r in block["rows"] if r["method"] == method)
                value = nan_if_none(row["test"][key])
                values.append(value)
                changes.append(value - dense if key == "top1" else value / dense)
                sparsity.append(row["weighted_sparsity"])
            per_method[method] = changes
            digits = 2 if key == "top1" else 5
            lines.append(f"| {method} | {spread(values, digits)} | {spread(changes, 2)} | {min(sparsity):.4f} |")
        evolutionary, gradual = per_method["evolutionary"], per_method["gradual"]
        better = [e > g if key == "top1" else e < g for e, g in zip(evolutionary, gradual, strict=True)]
        lines += ["", f"Evolutionary beats gradual magnitude in {sum(better)} of {len(better)} {unit}"
                  f"{gradual_pace(runs, model)}."]
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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=Path, help="pruning_results JSON files (.json or .json.xz)")
    parser.add_argument("--out", type=Path, required=True, help="the Markdown page to write")
    parser.add_argument("--note", action="append", default=[], help="a paragraph under the heading (repeatable)")
    parser.add_argument("--pool", action="store_true",
                        help="count every file's block as one run (repeated runs of one protocol), not one per seed")
    args = parser.parse_args(argv)
    try:
        runs = [load_result(path, strict=False) for path in args.results]  # histories may hold -Infinity
        page = summary(runs, args.results, args.note, args.pool)
    except (OSError, ValueError) as error:
        parser.error(f"results: {error}")
    atomic_write_text(args.out, page)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
