"""Command line (Hydra): ``unsparse`` runs the main job; ``unsparse bench`` the GPU per-layer benchmark.

Hydra lives here and in ``configs/`` only; the library imports without it. Config groups mirror the code's
choices (``data=``, ``model=``, ``prune=``, ``quant=``, ``runtime=``, ``experiment=``) and objects are built
with ``hydra.utils.instantiate`` from their ``_target_``.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from unsparse.pipeline import TimingSettings, TrainSettings, resolve_device, run_pipeline

CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "configs")
log = logging.getLogger("unsparse")


@hydra.main(version_base=None, config_path=CONFIG_DIR, config_name="config")
def run(cfg: DictConfig) -> None:
    """The main job on the composed config; outputs go to Hydra's output directory."""
    outdir = Path(HydraConfig.get().runtime.output_dir)
    log.info("config:\n%s", OmegaConf.to_yaml(cfg))
    report = run_pipeline(
        splits=instantiate(cfg.data), model=instantiate(cfg.model), pruner=instantiate(cfg.prune),
        quantizer=instantiate(cfg.quant).quantize, outdir=outdir,
        train=TrainSettings(**cfg.train), timing=TimingSettings(**cfg.runtime.timing),
        backend=cfg.runtime.backend, device=resolve_device(cfg.device), progress=cfg.progress, seed=cfg.seed)
    accuracy = report["accuracy"]
    log.info("weighted sparsity %.2f%% | top-1 dense %.2f, pruned %.2f, sparse run %.2f | report: %s",
             100 * report["pruning"]["weighted_sparsity"], accuracy["dense"], accuracy["pruned"],
             accuracy["sparse_run"], outdir / "report.md")


@hydra.main(version_base=None, config_path=CONFIG_DIR, config_name="bench")
def bench(cfg: DictConfig) -> None:
    """``unsparse bench``: the GPU per-layer comparison (needs CUDA); outputs in Hydra's output directory."""
    from unsparse.pipeline import git_commit
    from unsparse.runtime.bench import QUICK, run_bench

    settings = OmegaConf.to_container(cfg, resolve=True)
    settings.pop("hydra", None)
    if settings.pop("quick"):
        settings.update(QUICK)
    run_bench(HydraConfig.get().runtime.output_dir, commit=git_commit(), **settings)


def main() -> None:
    """Console-script entry: ``unsparse [overrides]`` (main job) or ``unsparse bench [overrides]``."""
    if len(sys.argv) > 1 and sys.argv[1] == "bench":
        sys.argv.pop(1)
        bench()
    else:
        run()
