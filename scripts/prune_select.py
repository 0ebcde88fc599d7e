"""Choose evolutionary settings for the pruning table on the validation split, never the test split.

For each CNN of ``scripts/prune_table.py``: train the dense model of a budget, run the evolutionary pruner
(paper 004 Alg. 2, ``configs/prune/evolutionary.yaml``) to the table's 92 % target once per combination of the
``--grid`` settings (default: ``epsilon``, the relative validation drop that counts as a stall, Alg. 2 line 25, at
0.015 and 0.005), then fine-tune a copy of each pruned model with masks on once per ``--fine-tune-lr`` for the
budget's fine-tuning epochs. Every candidate is scored by top-1 on the validation split; the test split is never
loaded into a metric. The best candidate per model is what ``prune_table.py --evolutionary KEY=VALUE ...
--fine-tune-lr LR`` should then run with.

    PYTHONPATH=. python scripts/prune_select.py --budget gpu_w32 --models resnet_small \
        --grid "epsilon=[0.015, 0.005]" --grid "alpha=[0.1, 1.0]" --out select.json

Writes ``--out`` (JSON, atomically, after every candidate: a stopped run keeps what it finished) and prints the
page that ``--render JSON... --out PAGE.md`` writes (several JSONs of one budget, seed and commit are joined into
one table). Checkpoints under ``--workdir`` make a rerun resume (dense training and pruning runs; the fine-tunings
start over); ``--dense-only`` trains just the dense models, so that ``scripts/prune_select_gpu.sh`` can give one
dense model to candidates that run side by side on one GPU.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import itertools
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from unsparse.atomic import atomic_write_json, atomic_write_text
from unsparse.data import FASHION_MNIST_DIR, Splits, fashion_mnist
from unsparse.job import git_commit
from unsparse.models import create_model
from unsparse.prune.evolutionary import EvolutionaryPruner
from unsparse.report.document import smoke_run_notice
from unsparse.settings import output_file
from unsparse.train import Trainer, deterministic_algorithms


def _prune_table():
    """``scripts/prune_table.py`` as a module (budgets, settings, target and batch size are shared)."""
    spec = importlib.util.spec_from_file_location("prune_table", Path(__file__).resolve().parent / "prune_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TABLE = _prune_table()


def best(candidates: list[dict[str, Any]]) -> dict[str, Any]:
    """The candidate with the highest validation top-1 (the first of equals, i.e. the earlier in the grid). A NaN
    top-1 (a diverged model: :meth:`~unsparse.train.Trainer.evaluate`) ranks below every number; as the first
    candidate it had won, since no number compares greater than NaN."""
    return max(candidates, key=lambda candidate: -math.inf if math.isnan(candidate["val_top1"])
               else candidate["val_top1"])


def train_dense(name: str, budget: dict[str, Any], trainer: Trainer, workdir: Path, seed: int) -> torch.nn.Module:
    """Model ``name`` trained dense for the budget's epochs, from ``seed``; resumes from (or, once finished,
    only loads) ``workdir/dense.pt``, so jobs given copies of one finished checkpoint share one dense model."""
    torch.manual_seed(seed)
    dense = create_model(name, width=budget["width"])
    trainer.fit(dense, budget["dense_epochs"], workdir / "dense.pt", desc=f"{name} dense")
    return dense


def run_setup(budget_name: str, device: torch.device, data_root: Path) -> tuple[dict[str, Any], Splits,
                                                                        dict[str, Any]]:
    """What a validation run of one budget on ``device`` needs: the budget's settings, Fashion-MNIST from
    ``data_root`` cut as the budget says, and the fields every result JSON's ``meta`` starts with (budget name and
    settings, device and its name, torch version, short commit)."""
    budget = TABLE.BUDGETS[budget_name]
    splits = TABLE.trim(fashion_mnist(root=data_root, limit_train=budget["limit_train"]), budget["val"],
                        budget["test"])
    meta = {"budget_name": budget_name, "budget": budget, "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else TABLE.cpu_name(),
            "torch": torch.__version__, "commit": (git_commit() or "none")[:7]}
    return budget, splits, meta


def add_run_options(parser: argparse.ArgumentParser, workdir: str) -> None:
    """The options the validation scripts share (``prune_allocation.py`` too): budget, device, data, seed, checkpoint
    folder, progress bars and ``--deterministic``; ``workdir`` is the default checkpoint folder."""
    parser.add_argument("--budget", choices=list(TABLE.BUDGETS), default="gpu_w32",
                        help="data and training budget of scripts/prune_table.py (default %(default)s: all 55,000 "
                             "training images at width 32, meant for a CUDA GPU: several minutes per model on an "
                             "H100, many hours on a CPU; quick is a smoke run)")
    parser.add_argument("--device", type=TABLE.device_option, default="auto",
                        help="torch device: auto (cuda if available, else cpu), cpu, cuda or cuda:N (default "
                             "%(default)s)")
    parser.add_argument("--data-root", type=Path, default=FASHION_MNIST_DIR,
                        help="folder with the four Fashion-MNIST idx files (default %(default)s)")
    parser.add_argument("--seed", type=TABLE.seed_option, default=0,
                        help="seed of the initial weights, the training order and the pruner (default %(default)s)")
    parser.add_argument("--workdir", type=Path, default=Path(workdir),
                        help="checkpoints; a rerun resumes from them (default %(default)s)")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=False,
                        help="tqdm progress bars")
    TABLE.add_deterministic_option(parser)


def grid_option(parser: argparse.ArgumentParser, pairs: list[tuple[str, Any]] | None) -> dict[str, list[Any]]:
    """``--grid`` as setting -> values (a single value is a list of one; default ``epsilon=[0.015, 0.005]``);
    ``parser.error`` naming ``--grid`` for a setting given twice or with no values."""
    grid = {key: value if isinstance(value, list) else [value]
            for key, value in TABLE.settings_option(parser, "--grid", pairs or [("epsilon", [0.015, 0.005])]).items()}
    empty = [key for key, values in grid.items() if not values]
    if empty:
        parser.error(f"--grid: {', '.join(empty)} has no values")
    return grid


def select(name: str, budget: dict[str, Any], grid: dict[str, list[Any]], learning_rates: list[float],
           trainer_for: Callable[[], Trainer], workdir: Path, seed: int,
           record: Callable[[list[dict[str, Any]]], None]) -> list[dict[str, Any]]:
    """Dense training, then every combination of the ``grid`` pruner settings (``EvolutionaryPruner`` argument
    name -> values, overriding the config file) x ``learning_rates`` for model ``name``.

    ``trainer_for()`` returns a fresh :class:`Trainer` (loaders reseeded, so every candidate sees the same
    batch order); ``record(candidates)`` is called after every candidate. Returns one dict per candidate, in grid
    order: each grid setting, ``fine_tune_lr``, ``val_top1`` (%), ``weighted_sparsity`` (eq. 7-8), ``stalls``,
    ``iterations`` and ``wall_time_s`` (s, pruning and this fine-tuning).
    """
    dense = train_dense(name, budget, trainer_for(), workdir, seed)
    candidates: list[dict[str, Any]] = []
    for values in itertools.product(*grid.values()):
        settings = dict(zip(grid, values, strict=True))
        label = "-".join(f"{key}_{value}" for key, value in settings.items()) or "config"
        started = time.perf_counter()
        pruned = copy.deepcopy(dense)
        pruner = EvolutionaryPruner(**{**TABLE.evolutionary_settings(seed), **settings,
                                       "target": TABLE.TARGET, "iterations": budget["iterations"],
                                       "batches_per_iteration": budget["batches"], "fine_tune_epochs": 0})
        result = pruner.run(pruned, trainer_for(), workdir / label)
        iterations = [entry for entry in result.history if entry["phase"] == "prune" and entry["iteration"] > 0]
        pruning_s = time.perf_counter() - started
        for lr in learning_rates:
            started = time.perf_counter()
            tuned = copy.deepcopy(pruned)
            torch.manual_seed(seed)
            trainer = trainer_for()
            trainer.fit(tuned, budget["fine_tune_epochs"], None, lr=lr, desc=f"{name} fine-tune lr {lr}")
            candidates.append({
                "model": name, **settings, "fine_tune_lr": lr,
                "val_top1": trainer.evaluate(tuned, "val")["top1"],
                "weighted_sparsity": result.weighted_sparsity, "iterations": len(iterations),
                "stalls": sum("rewind" in entry["events"] for entry in iterations),
                "wall_time_s": pruning_s + time.perf_counter() - started})
            TABLE.say(f"{name} {label} lr {lr}: val top1 {candidates[-1]['val_top1']:.2f}")
            record(candidates)
    return candidates


SELECTION_META = ("budget_name", "budget", "seed", "commit", "device_name", "grid")
"""The ``meta`` fields of an ``--out`` JSON that :func:`markdown` reads."""


def read_written(parser: argparse.ArgumentParser, paths: list[Path], body: str,
                 meta_keys: tuple[str, ...]) -> list[dict[str, Any]]:
    """The ``--render`` files (``prune_table.read_results``), each checked to be what a run of the script wrote: a
    JSON object holding a ``meta`` object with ``meta_keys`` and a ``body`` object (``prune_allocation.py`` reads
    its own files with this too).

    ``parser.error`` naming ``--render``, the file and what it lacks otherwise: a JSON of another script, or a
    hand-cut one, ended in a KeyError or TypeError traceback.
    """
    results = TABLE.read_results(parser, "--render", paths)
    for path, result in zip(paths, results, strict=True):
        if not (isinstance(result, dict) and isinstance(result.get("meta"), dict)
                and isinstance(result.get(body), dict)):
            parser.error(f"--render: {path} is no JSON this script wrote: it needs an object with 'meta' and "
                         f"'{body}' objects")
        missing = [key for key in meta_keys if key not in result["meta"]]
        if missing:
            parser.error(f"--render: {path}: meta lacks {', '.join(missing)}")
    return results


def merge(selections: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Selections of one budget, seed, commit and device joined into one (e.g. the per-candidate jobs of
    ``scripts/prune_select_gpu.sh``): candidates concatenated per model in the order given, grids united per
    setting. Other selections stay separate; the order of first appearance is kept."""
    merged: dict[tuple[Any, ...], dict[str, Any]] = {}
    for selection in selections:
        meta = selection["meta"]
        key = (meta["budget_name"], meta["seed"], meta["commit"], meta["device_name"])
        if key not in merged:
            merged[key] = {"meta": {**meta, "grid": {}}, "candidates": {}}
        grid = merged[key]["meta"]["grid"]
        for setting, values in meta["grid"].items():
            known = grid.setdefault(setting, [])
            known += [value for value in values if value not in known]
        for name, candidates in selection["candidates"].items():
            merged[key]["candidates"][name] = merged[key]["candidates"].get(name, []) + candidates
    return list(merged.values())


def markdown(selections: list[dict[str, Any]]) -> str:
    """The selection page: one row per candidate of every ``--out`` JSON given (:func:`merge`d), the best per
    model and merged selection marked."""
    merged = merge(selections)
    lines = ["# Evolutionary settings chosen on the validation split", "",
             *smoke_run_notice(selection["meta"]["budget_name"] for selection in merged),
             "Written by `scripts/prune_select.py --render`. Each candidate: the evolutionary pruner to 92 % "
             "weighted sparsity with the given settings (the others as in `configs/prune/evolutionary.yaml`), then "
             "the budget's masked fine-tuning at the given learning rate; scored by validation top-1 only (the test "
             "split was not evaluated).", ""]
    for selection in merged:
        meta = selection["meta"]
        keys = [key for key in meta["grid"] if key != "fine_tune_lr"]
        lines += [f"Budget `{meta['budget_name']}` {meta['budget']}, seed {meta['seed']}, on {meta['device_name']}, "
                  f"commit {meta['commit']}.", "",
                  "| model | " + " | ".join(keys) + " | fine-tune lr | val top1 | stalls / iterations | chosen |",
                  "|---" * (len(keys) + 5) + "|"]
        for name, candidates in selection["candidates"].items():
            chosen = best(candidates)
            lines += [f"| {name} | " + "".join(f"{c.get(key, '(config)')} | " for key in keys)
                      + f"{c['fine_tune_lr']} | {c['val_top1']:.2f} | {c['stalls']} / {c['iterations']} | "
                      f"{'yes' if c == chosen else ''} |"
                      for c in candidates]
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=("vgg_small", "resnet_small"),
                        default=["vgg_small", "resnet_small"], help="models to select for (default: both)")
    parser.add_argument("--grid", action="append", type=TABLE.setting, metavar="KEY=[V1, V2]",
                        help="an EvolutionaryPruner setting and its values (YAML); repeat for more settings "
                             "(default: epsilon=[0.015, 0.005])")
    parser.add_argument("--fine-tune-lr", nargs="+", type=TABLE.learning_rate, default=[0.01, 0.05],
                        help="fine-tuning learning rates, each tried on every pruned candidate (default 0.01 0.05)")
    parser.add_argument("--out", type=output_file, help="JSON file (with --render: the Markdown page); required unless "
                                                 "--dense-only")
    parser.add_argument("--dense-only", action="store_true",
                        help="only train (or finish) the dense models under --workdir, for jobs to share")
    parser.add_argument("--render", nargs="+", type=Path, metavar="JSON",
                        help="write the page for these --out files (.json or .json.xz) to --out and run nothing")
    add_run_options(parser, "outputs/prune_select")
    args = parser.parse_args()
    if args.out is None and args.render:
        parser.error("--out is required with --render")
    if args.out is None and not args.dense_only:
        parser.error("--out is required unless --dense-only")
    if args.render:
        atomic_write_text(args.out, markdown(read_written(parser, args.render, "candidates", SELECTION_META)))
        return
    grid = grid_option(parser, args.grid)
    TABLE.check_evolutionary(parser, "--grid", [dict(zip(grid, values, strict=True))
                                                for values in itertools.product(*grid.values())], args.seed)
    TABLE.check_data_root(parser, "--data-root", args.data_root)
    budget, splits, meta = run_setup(args.budget, args.device, args.data_root)
    meta |= {"seed": args.seed, "selection": "validation top-1", "grid": {**grid, "fine_tune_lr": args.fine_tune_lr},
             "deterministic": args.deterministic}
    done: dict[str, list[dict[str, Any]]] = {}

    def write(model: str, candidates: list[dict[str, Any]]) -> None:
        done[model] = list(candidates)
        chosen = {name: best(found) for name, found in done.items() if found}
        atomic_write_json(args.out, {"meta": meta, "candidates": done, "chosen": chosen})

    def trainer_for() -> Trainer:
        return Trainer(splits.loaders(TABLE.BATCH_SIZE, seed=args.seed), device=args.device, lr=0.05,
                       progress=args.progress)

    with deterministic_algorithms(args.deterministic):
        if args.dense_only:
            for name in args.models:
                train_dense(name, budget, trainer_for(), args.workdir / f"seed{args.seed}" / name, args.seed)
            return
        for name in args.models:
            select(name, budget, grid, args.fine_tune_lr, trainer_for, args.workdir / f"seed{args.seed}" / name,
                   args.seed, lambda candidates, name=name: write(name, candidates))
    print(markdown([{"meta": meta, "candidates": done}]))


if __name__ == "__main__":
    main()
