"""Ablation: does the evolutionary pruner's per-layer allocation explain its ResNet shortfall against gradual magnitude?

The pruning table (``scripts/prune_table.py``) has ``resnet_small`` lose more top-1 with the evolutionary pruner
(paper 004 Alg. 2) than with gradual magnitude pruning (Zhu & Gupta 2017) at the same weighted sparsity (eq. 7-8),
and the two allocate sparsity to layers differently. From one dense model of the table's budget and seed, three
arms run from copies of it:

- ``evolutionary``: as in the table (``configs/prune/evolutionary.yaml`` with ``--evolutionary`` overrides, the
  budget's iterations and fine-tuning epochs at ``--fine-tune-lr``);
- ``gradual_global``: gradual magnitude with one global threshold at the weighted sparsity ``evolutionary``
  reached, its schedule as long as the evolutionary iterations used (the table's baseline);
- ``gradual_allocation``: the same schedule, each layer to the sparsity ``evolutionary`` gave it
  (``layer_targets``), so it differs from ``gradual_global`` only in the allocation.

Two more arms swap masks (``--arms``; ``docs/pruning_h100_w32/plan_mask_swap.md``): ``evolutionary_masks`` and
``allocation_masks`` fix the final masks of ``evolutionary`` and of ``gradual_allocation`` on a fresh copy of the
dense model and train it for as many epochs as ``gradual_allocation`` trains, at the fine-tuning learning rate.

Every arm is scored by top-1 on the validation and the test split. Nothing is chosen from these figures; the
plans and reading rules are in ``docs/pruning_h100_w32/plan_allocation_ablation.md`` and ``plan_mask_swap.md``.

    PYTHONPATH=. python scripts/prune_allocation.py --model resnet_small --seed 0 --out allocation_seed0.json \
        --evolutionary epsilon=0.005 --fine-tune-lr 0.05
    PYTHONPATH=. python scripts/prune_allocation.py --model resnet_small --seed 0 --out mask_swap_seed0.json \
        --evolutionary epsilon=0.005 --fine-tune-lr 0.05 \
        --arms evolutionary gradual_allocation evolutionary_masks allocation_masks
    PYTHONPATH=. python scripts/prune_allocation.py --render seed0.json seed1.json --out allocation.md

Writes ``--out`` (JSON, atomically, after every arm: a stopped run keeps what it finished); ``--render`` joins
seeds into the Markdown page. ``scripts/prune_allocation_gpu.sh`` runs one seed per job on a lent GPU.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from unsparse.atomic import atomic_write_json, atomic_write_text
from unsparse.prune.base import PruneResult
from unsparse.prune.evolutionary import EvolutionaryPruner
from unsparse.prune.masks import attach_masks, layer_sparsity, masks_of, model_weighted_sparsity
from unsparse.report.document import smoke_run_notice
from unsparse.settings import output_file
from unsparse.train import Trainer, deterministic_algorithms

ARMS = ("evolutionary", "gradual_global", "gradual_allocation")
"""The allocation ablation's arms (the default of ``--arms``)."""
MASK_ARMS = {"evolutionary_masks": "evolutionary", "allocation_masks": "gradual_allocation"}
"""Mask-swap arms and the arm whose final masks each fixes on a fresh dense copy."""
RUN_META = ("model", "budget_name", "overrides", "fine_tune_lr", "seed", "commit", "device_name")
"""The ``meta`` fields of an ``--out`` JSON that :func:`markdown` reads."""


def _script(name: str):
    """``scripts/NAME.py`` as a module (budgets, settings and dense training are shared with it)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SELECT = _script("prune_select")
TABLE = SELECT.TABLE


def ablate(name: str, budget: dict[str, Any], overrides: dict[str, Any], fine_tune_lr: float,
           trainer_for: Any, workdir: Path, seed: int, record: Any,
           chosen: tuple[str, ...] = ARMS, gradual_schedule: str = "step") -> dict[str, dict[str, Any]]:
    """The ``chosen`` arms (module docstring) on model ``name`` from one dense model of ``budget`` and ``seed``;
    ``evolutionary`` always runs (the others take its sparsity), and an arm whose masks a chosen mask-swap arm
    fixes runs too.

    ``trainer_for()`` returns a fresh :class:`Trainer` (loaders reseeded, so every arm sees the same batch order);
    ``record(arms)`` is called after every arm. Returns per arm: ``val_top1`` and ``test_top1`` (%),
    ``weighted_sparsity`` (eq. 7-8), ``layer_sparsity`` (per layer name), ``wall_time_s`` (s); the evolutionary
    arm also ``iterations`` (used), the gradual arms ``pruning_steps`` and ``pruning_unit`` (their schedule's
    steps, in epochs or training batches: ``gradual_schedule``, as ``prune_table.matched_gradual``) and the
    mask-swap arms ``epochs`` (trained).
    """
    dense = SELECT.train_dense(name, budget, trainer_for(), workdir, seed)
    arms: dict[str, dict[str, Any]] = {}
    models: dict[str, torch.nn.Module] = {}

    def finish(arm: str, model: torch.nn.Module, result: Any, **extra: Any) -> None:
        trainer = trainer_for()
        arms[arm] = {"val_top1": trainer.evaluate(model, "val")["top1"],
                     "test_top1": trainer.evaluate(model, "test")["top1"],
                     "weighted_sparsity": result.weighted_sparsity, "layer_sparsity": result.layer_sparsity,
                     "wall_time_s": result.wall_time_s, **extra}
        models[arm] = model
        TABLE.say(f"{name} seed {seed} {arm}: val {arms[arm]['val_top1']:.2f} test {arms[arm]['test_top1']:.2f} "
                  f"weighted sparsity {result.weighted_sparsity:.4f}")
        record(arms)

    model = copy.deepcopy(dense)
    trainer = trainer_for()
    evolutionary = EvolutionaryPruner(**{**TABLE.evolutionary_settings(seed), **overrides, "target": TABLE.TARGET,
                                         "iterations": budget["iterations"],
                                         "batches_per_iteration": budget["batches"],
                                         "fine_tune_epochs": budget["fine_tune_epochs"],
                                         "fine_tune_lr": fine_tune_lr})
    result = evolutionary.run(model, trainer, workdir / "evolutionary")
    used = sum(entry["phase"] == "prune" and entry["iteration"] > 0 for entry in result.history)
    finish("evolutionary", model, result, iterations=used)
    allocations = {"gradual_global": {"scope": "global"},
                   "gradual_allocation": {"scope": "layer", "layer_targets": result.layer_sparsity}}
    needed = set(chosen) | {MASK_ARMS[arm] for arm in chosen if arm in MASK_ARMS}
    epochs = 0
    for arm, allocation in allocations.items():
        pruner = TABLE.matched_gradual(result.weighted_sparsity, used, budget["batches"], len(trainer.loaders["train"]),
                                       gradual_schedule, budget["fine_tune_epochs"], fine_tune_lr, **allocation)
        epochs = pruner.epochs(len(trainer.loaders["train"]))
        if arm in needed:
            model = copy.deepcopy(dense)
            finish(arm, model, pruner.run(model, trainer_for(), workdir / arm), pruning_steps=pruner.pruning_steps,
                   pruning_unit=pruner.unit)
    for arm, source in MASK_ARMS.items():
        if arm in chosen:
            started = time.perf_counter()
            model = copy.deepcopy(dense)
            masks = attach_masks(model, list(masks_of(models[source])))
            for layer, mask in masks_of(models[source]).items():
                masks[layer].set(mask.mask)
            history = trainer_for().fit(model, epochs, workdir / arm / "fit.pt", lr=fine_tune_lr, desc=arm)
            sparsity = model_weighted_sparsity(model)
            finish(arm, model, PruneResult(arm, sparsity, layer_sparsity(model), masked_weighted_sparsity=sparsity,
                                           history=history, wall_time_s=time.perf_counter() - started),
                   epochs=epochs)
    return arms


def _mean_sd(values: list[float]) -> str:
    spread = f" ± {statistics.stdev(values):.2f}" if len(values) > 1 else ""
    return f"{statistics.mean(values):+.2f}{spread}"


def markdown(runs: list[dict[str, Any]]) -> str:
    """The page for ``--out`` JSONs of one model (one per seed): per seed and arm the top-1 on both splits, then
    mean ± sample standard deviation over seeds of differences between arms: with ``gradual_global``, each arm's
    difference to it (the allocation ablation); with the mask-swap arms, the split of the shortfall S = A - B into
    P = A - C, M = C - D and R = D - B (``plan_mask_swap.md``)."""
    meta = runs[0]["meta"]
    lines = [f"# Ablation: {meta['model']}", "", *smoke_run_notice(run["meta"]["budget_name"] for run in runs),
             "Written by `scripts/prune_allocation.py --render`; plans and reading rules in "
             "`plan_allocation_ablation.md` and `plan_mask_swap.md`. Per seed one dense model; every arm starts "
             f"from a copy of it (budget `{meta['budget_name']}`, evolutionary overrides {meta['overrides']}, "
             f"fine-tuning learning rate {meta['fine_tune_lr']}). Top-1 in %. The gradual arms' cubic schedule spans "
             "the training batches of the evolutionary iterations used, "
             f"{TABLE.GRADUAL_PACE[meta.get('gradual_schedule', 'epoch')]}.", "",
             "| seed | commit | device | arm | val top1 | test top1 | weighted sparsity | wall s |",
             "|---|---|---|---|---|---|---|---|"]
    for run in runs:
        for arm, row in run["arms"].items():
            lines.append(f"| {run['meta']['seed']} | {run['meta']['commit']} | {run['meta']['device_name']} | {arm} "
                         f"| {row['val_top1']:.2f} | {row['test_top1']:.2f} | {row['weighted_sparsity']:.4f} | "
                         f"{row['wall_time_s']:.0f} |")
    present = set.intersection(*(set(run["arms"]) for run in runs))
    complete = [run["arms"] for run in runs]

    def difference(plus: str, minus: str) -> str:
        return " | ".join(_mean_sd([arms[plus][split] - arms[minus][split] for arms in complete])
                          for split in ("val_top1", "test_top1"))

    if set(ARMS) <= present:
        lines += ["", f"Differences to `gradual_global` in points, over {len(complete)} seed(s) (mean ± sample "
                      "standard deviation):", "", "| arm | val | test |", "|---|---|---|"]
        lines += [f"| {arm} | {difference(arm, 'gradual_global')} |" for arm in (ARMS[0], ARMS[2])]
    if {"evolutionary", "gradual_allocation", *MASK_ARMS} <= present:
        terms = [("S = A - B: shortfall against gradual_allocation", "evolutionary", "gradual_allocation"),
                 ("P = A - C: evolutionary training, given its masks", "evolutionary", "evolutionary_masks"),
                 ("M = C - D: the masks", "evolutionary_masks", "allocation_masks"),
                 ("R = D - B: fixed masks against the gradual schedule", "allocation_masks", "gradual_allocation")]
        lines += ["", f"Mask swap, points over {len(complete)} seed(s) (mean ± sample standard deviation; "
                      "S = P + M + R):", "", "| term | val | test |", "|---|---|---|"]
        lines += [f"| {label} | {difference(plus, minus)} |" for label, plus, minus in terms]
    names = list(complete[0]["evolutionary"]["layer_sparsity"]) if complete else []
    shown = [arm for arm in ("evolutionary", "gradual_global") if arm in present]
    lines += ["", "Per-layer sparsity (seed order as above; `gradual_allocation` and the mask-swap arms match "
                  "`evolutionary` by construction):", "", "| layer | " + " | ".join(shown) + " |",
              "|---|" + "---|" * len(shown)]
    for layer in names:
        lines.append(f"| {layer} | " + " | ".join(
            ", ".join(f"{arms[arm]['layer_sparsity'][layer]:.2f}" for arms in complete) for arm in shown) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("vgg_small", "resnet_small"), default="resnet_small",
                        help="model to ablate (default %(default)s)")
    parser.add_argument("--evolutionary", nargs="*", action="extend", type=TABLE.setting, default=[],
                        metavar="KEY=VALUE", help="EvolutionaryPruner settings overriding the config file (repeatable)")
    parser.add_argument("--fine-tune-lr", type=TABLE.learning_rate, default=0.05,
                        help="fine-tuning learning rate of every arm (default %(default)s)")
    parser.add_argument("--out", type=output_file, required=True, help="JSON file (with --render: the Markdown page)")
    parser.add_argument("--render", nargs="+", type=Path, metavar="JSON",
                        help="write the page for these --out files (.json or .json.xz) and run nothing")
    parser.add_argument("--arms", nargs="+", choices=[*ARMS, *MASK_ARMS], default=list(ARMS),
                        help="arms to run (evolutionary always runs; a mask-swap arm also runs its source arm; "
                             f"default: {' '.join(ARMS)})")
    TABLE.add_gradual_schedule_option(parser)
    SELECT.add_run_options(parser, "outputs/prune_allocation")
    args = parser.parse_args()
    if args.render:
        runs = SELECT.read_written(parser, args.render, "arms", RUN_META)
        models = sorted({run["meta"]["model"] for run in runs})
        if len(models) > 1:  # the per-layer table follows the first file's layers
            parser.error(f"--render: the files are of several models ({', '.join(models)}); give one model's seeds")
        atomic_write_text(args.out, markdown(runs))
        return
    overrides = TABLE.settings_option(parser, "--evolutionary", args.evolutionary)
    TABLE.check_evolutionary(parser, "--evolutionary", [overrides], args.seed)
    TABLE.check_data_root(parser, "--data-root", args.data_root)
    budget, splits, meta = SELECT.run_setup(args.budget, args.device, args.data_root)
    meta |= {"model": args.model, "seed": args.seed, "overrides": overrides,
             "fine_tune_lr": args.fine_tune_lr, "deterministic": args.deterministic,
             "gradual_schedule": args.gradual_schedule}
    started = time.perf_counter()

    def trainer_for() -> Trainer:
        return Trainer(splits.loaders(TABLE.BATCH_SIZE, seed=args.seed), device=args.device, lr=0.05,
                       progress=args.progress)

    def record(arms: dict[str, dict[str, Any]]) -> None:
        atomic_write_json(args.out, {"meta": {**meta, "wall_time_s": time.perf_counter() - started}, "arms": arms})

    with deterministic_algorithms(args.deterministic):
        ablate(args.model, budget, overrides, args.fine_tune_lr, trainer_for,
               args.workdir / f"seed{args.seed}" / args.model, args.seed, record, tuple(args.arms),
               args.gradual_schedule)


if __name__ == "__main__":
    main()
