"""Quantization table like paper 004 Table 5: top-1 and file bytes of each scheme on pruned small CNNs.

Small VGG and small ResNet on Fashion-MNIST (a training subset, CPU budget): dense training, one-shot
magnitude pruning to 0.9 weighted sparsity with masked fine-tuning, then every quantization scheme on the
same pruned model: fp32 (none), fp16, linear fixed point 8 and 16 bits, k-means 4-bit indices with 8- and
16-bit centroids. Each quantized model is written with ``save_sparse``, read back with ``load_sparse`` and
evaluated on the test split as reloaded (fake quantization on the CPU), so every figure is of the file.

Writes ``docs/quantization_results.md`` and ``docs/quantization_results.json``; every figure comes from this
run. Training and pruning resume from ``--workdir`` checkpoints and finished schemes are skipped.

    PYTHONPATH=. python scripts/quant_table.py            # full (about 15 minutes on 2 CPU cores)
    PYTHONPATH=. python scripts/quant_table.py --quick    # smoke run (a minute or two)
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sklearn
import torch
from safetensors.torch import save as safetensors_save
from tqdm.auto import tqdm

from unsparse.atomic import atomic_write_bytes, atomic_write_json, atomic_write_text
from unsparse.data import Splits, fashion_mnist
from unsparse.job import git_commit
from unsparse.models import create_model
from unsparse.prune.magnitude import MagnitudePruner
from unsparse.quant import ActivationSpec, FP16Quantizer, KMeansQuantizer, LinearQuantizer, NoQuantization
from unsparse.quant.base import Quantizer
from unsparse.report.document import smoke_run_notice
from unsparse.runtime import set_backend, sparsify
from unsparse.settings import output_file
from unsparse.sparse.codecs import PART_SEPARATOR
from unsparse.sparse.io import file_tensor_bytes, load_sparse, save_sparse
from unsparse.train import Trainer

BUDGETS = {
    "full": {"limit_train": 6000, "val": 2000, "test": None, "width": 16, "dense_epochs": 3, "fine_tune_epochs": 2,
             "calibration_batches": 4},
    "quick": {"limit_train": 1024, "val": 256, "test": 512, "width": 8, "dense_epochs": 1, "fine_tune_epochs": 1,
              "calibration_batches": 1},
}
BATCH_SIZE = 128
EVAL_BATCH_SIZE = 500
LR = 0.05
FINE_TUNE_LR = 0.01
TARGET = 0.9
EVAL_BACKEND = "dense_cpu"  # same weights and activation quantizers as "reference", faster on the CPU
MODELS = ("vgg_small", "resnet_small")
SATURATION_CHECK = "linear 8-bit, quantile 1.0"
"""Extra row: linear 8-bit with activations saturated at max |x|, to separate saturation from bit width."""
LITERAL_RULE = "linear 8-bit, 0.99 x max"
"""Extra row: linear 8-bit with activations saturated at 0.99 max |x|, paper 004 §4's sentence read literally."""


def schemes(calibration_batches: int) -> dict[str, tuple[str, Callable[[], Quantizer]]]:
    """Row name -> (weights/activations label, quantizer factory); settings are the configs/quant defaults."""
    def fixed(bits: int, quantile: float = 0.99, rule: str = "quantile") -> ActivationSpec:
        return ActivationSpec(format="fixed", bits=bits, quantile=quantile, calibration_batches=calibration_batches,
                              rule=rule)

    return {
        "fp32": ("32b / 32b", NoQuantization),
        "fp16": ("16b / 16b", FP16Quantizer),
        "linear 8-bit": ("8b / 8b", lambda: LinearQuantizer(bits=8, activations=fixed(8))),
        "linear 16-bit": ("16b / 16b", lambda: LinearQuantizer(bits=16, activations=fixed(16))),
        SATURATION_CHECK: ("8b / 8b, activations saturate at max", lambda: LinearQuantizer(
            bits=8, activations=fixed(8, quantile=1.0))),
        LITERAL_RULE: ("8b / 8b, activations saturate at 0.99 max", lambda: LinearQuantizer(
            bits=8, activations=fixed(8, rule="fraction_of_max"))),
        "k-means 4-bit, 8-bit centroids": ("4b (8b codebook) / 16b", lambda: KMeansQuantizer(centroid_bits=8)),
        "k-means 4-bit, 16-bit centroids": ("4b (16b codebook) / 16b", lambda: KMeansQuantizer(centroid_bits=16)),
    }


def trim(splits: Splits, val: int, test: int | None) -> Splits:
    """``splits`` with the validation (and optionally test) split cut to its first images."""
    return dataclasses.replace(splits, val=(splits.val[0][:val], splits.val[1][:val]),
                               test=splits.test if test is None else (splits.test[0][:test], splits.test[1][:test]))


def file_breakdown(path: Path) -> dict[str, int]:
    """Bytes of the file, its header (JSON metadata), the conv weight values (or codec parts), the conv indices."""
    stored = file_tensor_bytes(path)
    base = {key: key.split(PART_SEPARATOR)[0] for key in stored}
    return {"file_bytes": path.stat().st_size, "header_bytes": path.stat().st_size - sum(stored.values()),
            "conv_values_bytes": sum(size for key, size in stored.items() if base[key].endswith(".values")),
            "conv_col_idx_bytes": sum(size for key, size in stored.items() if base[key].endswith(".col_idx"))}


def prepare(name: str, budget: dict[str, Any], trainer: Trainer, workdir: Path) -> tuple[torch.nn.Module, dict]:
    """Dense training then magnitude pruning (both checkpointed); the dense FP32 file and top-1 figures."""
    torch.manual_seed(0)
    model = create_model(name, width=budget["width"])
    started = time.perf_counter()
    trainer.fit(model, budget["dense_epochs"], workdir / "dense.pt", desc=f"{name} dense")
    dense_path = atomic_write_bytes(workdir / "dense_fp32.safetensors", safetensors_save(
        {key: value.contiguous() for key, value in model.state_dict().items()}))
    dense = {"top1": trainer.evaluate(model, "test", f"{name} test dense")["top1"],
             "file_bytes": dense_path.stat().st_size,
             "header_bytes": dense_path.stat().st_size - sum(file_tensor_bytes(dense_path).values()),
             "conv_weight_bytes": 4 * sum(m.weight.numel() for m in model.modules()
                                          if isinstance(m, torch.nn.Conv2d))}
    result = MagnitudePruner(target=TARGET, scope="global", fine_tune_epochs=budget["fine_tune_epochs"],
                             lr=FINE_TUNE_LR).run(model, trainer, workdir / "prune")
    pruned = {"top1": trainer.evaluate(model, "test", f"{name} test pruned")["top1"],
              "weighted_sparsity": result.weighted_sparsity, "layer_sparsity": result.layer_sparsity,
              "train_and_prune_s": time.perf_counter() - started}
    return model, {"dense": dense, "pruned": pruned}


def quantize_row(sparse: torch.nn.Module, quantizer: Quantizer, trainer: Trainer, path: Path) -> dict[str, Any]:
    """Quantize a copy of ``sparse``, save, reload, evaluate the reloaded model on the test split."""
    started = time.perf_counter()
    model = quantizer.quantize(copy.deepcopy(sparse), trainer.loaders["val"])
    save_sparse(model, path)
    loaded = set_backend(load_sparse(path), EVAL_BACKEND)
    return {"top1": trainer.evaluate(loaded, "test", f"test {path.stem}")["top1"], **file_breakdown(path),
            "quantization": loaded.unsparse_metadata["quantization"], "seconds": time.perf_counter() - started}


def run_model(name: str, budget: dict[str, Any], trainer: Trainer, workdir: Path) -> dict[str, Any]:
    """One model's block; finished scheme rows are read back from ``workdir/rows.json`` instead of rerun."""
    workdir.mkdir(parents=True, exist_ok=True)
    model, block = prepare(name, budget, trainer, workdir)
    sparse = sparsify(model.cpu())
    rows_path = workdir / "rows.json"
    rows = json.loads(rows_path.read_text()) if rows_path.exists() else {}
    table = schemes(budget["calibration_batches"])
    for scheme, (label, build) in tqdm(table.items(), desc=f"{name} schemes", leave=False):
        path = workdir / f"{scheme.replace(' ', '_').replace(',', '')}.safetensors"
        if scheme not in rows or not path.exists():
            rows[scheme] = {"label": label, **quantize_row(sparse, build(), trainer, path)}
            atomic_write_json(rows_path, rows)
    return {"model": name, "model_kwargs": {"width": budget["width"]}, **block,
            "rows": {scheme: rows[scheme] for scheme in table}}


def findings(block: dict[str, Any]) -> list[str]:
    """Sentences read off one block's figures (nothing here is fixed in advance)."""
    rows = block["rows"]
    fp32 = rows["fp32"]

    def change(scheme: str) -> float:
        return rows[scheme]["top1"] - fp32["top1"]

    kmeans = rows["k-means 4-bit, 8-bit centroids"]
    lines = [f"- FP16 changes top-1 by {change('fp16'):+.2f} points; linear 8-bit by {change('linear 8-bit'):+.2f}, "
             f"16-bit by {change('linear 16-bit'):+.2f}; with activations saturated at max |x| instead of the "
             f"0.99 quantile, 8-bit changes it by {change(SATURATION_CHECK):+.2f}, at 0.99 max |x| (the paper's "
             f"sentence) by {change(LITERAL_RULE):+.2f}; k-means 4-bit by "
             f"{change('k-means 4-bit, 8-bit centroids'):+.2f} (8-bit centroids) and "
             f"{change('k-means 4-bit, 16-bit centroids'):+.2f} (16-bit centroids)."]
    if abs(change("linear 8-bit") - change("linear 16-bit")) < 0.5 < change(SATURATION_CHECK) - change("linear 8-bit"):
        lines.append("- 8 and 16 bits lose about the same and saturating at max |x| loses less: the linear rows' "
                     "loss comes from saturating the top 1 % of activation magnitudes, not from the bit width.")
    lines.append(f"- The k-means 4-bit file is {kmeans['file_bytes'] / fp32['file_bytes']:.1%} of the FP32 sparse "
                 f"file and {kmeans['file_bytes'] / block['dense']['file_bytes']:.1%} of the dense FP32 file; its "
                 f"int32 column indices are {kmeans['conv_col_idx_bytes'] / kmeans['file_bytes']:.0%} of it and the "
                 f"header {kmeans['header_bytes'] / kmeans['file_bytes']:.0%}.")
    return lines


def markdown(blocks: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The results page."""
    out = ["# Quantization results", "", *smoke_run_notice(["quick"] if meta["quick"] else []),
           f"Generated by `scripts/quant_table.py{' --quick' if meta['quick'] else ''}` on {meta['host']} "
           f"(torch {meta['torch']}, scikit-learn {meta['sklearn']}, {meta['threads']} CPU threads, commit "
           f"{meta['commit']}, {meta['wall_time_s'] / 60:.1f} min). Budget: {meta['budget']}.", "",
           "Paper 004 Table 5 reports the change in top-1 that quantizing a pruned model causes; this page does "
           f"the same for small CNNs on {meta['data']}: dense training, one-shot global magnitude pruning to "
           f"{TARGET:.0%} weighted sparsity with masked fine-tuning, then each scheme applied to that pruned "
           "model, written with `save_sparse`, read back with `load_sparse` and evaluated on the test split as "
           "reloaded. Bytes are whole `.safetensors` files; the dense FP32 file holds the unpruned trained "
           "weights (state dict). *vs dense* is file bytes / dense FP32 file bytes.", ""]
    for block in blocks:
        dense, pruned = block["dense"], block["pruned"]
        fp32 = block["rows"]["fp32"]["top1"]
        out += [f"## {block['model']} {block['model_kwargs']}", "",
                f"Dense FP32 top-1 {dense['top1']:.2f} %, file {dense['file_bytes']:,} bytes (conv weights "
                f"{dense['conv_weight_bytes']:,}). Pruned to weighted sparsity {pruned['weighted_sparsity']:.4f}: "
                f"top-1 {pruned['top1']:.2f} % (masked dense model).", "",
                "| scheme | weights / activations | test top-1 % | vs fp32 (points) | file bytes | vs dense FP32 | "
                "conv values bytes | conv col_idx bytes | header bytes |", "|---|---|---|---|---|---|---|---|---|",
                f"| dense FP32 (unpruned) | 32b / 32b | {dense['top1']:.2f} | | {dense['file_bytes']:,} | 1.000 | "
                f"{dense['conv_weight_bytes']:,} | 0 | {dense['header_bytes']:,} |"]
        for scheme, row in block["rows"].items():
            out.append(f"| {scheme} | {row['label']} | {row['top1']:.2f} | {row['top1'] - fp32:+.2f} | "
                       f"{row['file_bytes']:,} | {row['file_bytes'] / dense['file_bytes']:.3f} | "
                       f"{row['conv_values_bytes']:,} | {row['conv_col_idx_bytes']:,} | {row['header_bytes']:,} |")
        out += ["", *findings(block), ""]
    out += ["## Notes", "", *meta["notes"], ""]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny budgets (a smoke run of a minute or two; without "
                                                             "it about 15 minutes on 2 CPU cores)")
    parser.add_argument("--workdir", type=Path, default=Path("outputs/quant_table"),
                        help="checkpoints and quantized files, under full/ or quick/ (default %(default)s)")
    parser.add_argument("--out", type=output_file, default=None,
                        help="markdown file, the JSON written beside it; not a folder (default "
                             "docs/quantization_results.md; --quick: under --workdir)")
    args = parser.parse_args()
    budget = BUDGETS["quick" if args.quick else "full"]
    workdir = args.workdir / ("quick" if args.quick else "full")
    out = args.out or (workdir / "quantization_results.md" if args.quick else Path("docs/quantization_results.md"))
    started = time.perf_counter()
    splits = trim(fashion_mnist(limit_train=budget["limit_train"]), budget["val"], budget["test"])
    blocks = []
    for name in MODELS:
        trainer = Trainer(splits.loaders(BATCH_SIZE, EVAL_BATCH_SIZE), lr=LR)
        blocks.append(run_model(name, budget, trainer, workdir / name))
    commit = (git_commit() or "")[:7]
    meta = {
        "quick": args.quick, "host": platform.node() or "unknown", "torch": torch.__version__,
        "sklearn": sklearn.__version__, "threads": torch.get_num_threads(), "commit": commit or "none",
        "budget": {**budget, "batch_size": BATCH_SIZE, "lr": LR, "fine_tune_lr": FINE_TUNE_LR},
        "wall_time_s": time.perf_counter() - started,
        "data": f"Fashion-MNIST ({len(splits.train[1])} train, {len(splits.val[1])} val, {len(splits.test[1])} "
                "test images)",
        "notes": [
            "- Quantized: every sparse convolution's weights and its input activations. BatchNorm, biases and "
            "the Linear classifier stay FP32 in every scheme (they are included, as FP32, in the file bytes).",
            "- Linear fixed point (paper 004 eq. 19-21, reconstructed as `Q(x) = step * clip(round(x / step), "
            "-(2^(b-1)-1), 2^(b-1)-1)`): one step per layer; weights saturate at max |w|, activations at the "
            "0.99 quantile of the nonzero |x| from a histogram (2048 bins) of the first calibration batches of the "
            "validation split (`quant.activations.rule=quantile`, the default; the row marked quantile 1.0 "
            "saturates at max |x|). Paper 004 §4 sets the threshold to 0.99 after a histogram analysis, and its "
            "sentence \"values higher than 0.99 x_max are saturated to 0.99 x_max\" reads as a fraction of the "
            "maximum: the row marked 0.99 x max does that (`rule=fraction_of_max`).",
            "- FP16 and the k-means rows use float16 activations (the paper's 16b activations); k-means clusters "
            "each layer's nonzero weights into 16 centroids (scikit-learn KMeans, k-means++, n_init 4, seed 0), "
            "stores 4-bit indices two per byte plus the centroids as 8- or 16-bit fixed point; zeros stay zero.",
            "- Evaluation is fake quantization on the CPU: float32 arithmetic on values that lie exactly on each "
            f"format's grid (backend `{EVAL_BACKEND}`, the same weights and activation quantizers as `reference`).",
            "- Every sparse file stores a 4-byte column index per stored entry (UniformCSR `col_idx`, int32), so "
            "the index bytes bound the saving of quantizing values: see the col_idx column. The header (JSON "
            "metadata: one entry per tensor or codec part, codec parameters, per-layer facts) is a visible share "
            "at this model size; the linear rows also store one activation saturation level per layer.",
            "- Top-1 on the Fashion-MNIST test split; one seed, so differences of a few tenths of a point are "
            "within run-to-run noise.",
        ]}
    atomic_write_json(out.with_suffix(".json"), {"meta": meta, "blocks": blocks})
    atomic_write_text(out, markdown(blocks, meta))
    print(markdown(blocks, meta))


if __name__ == "__main__":
    main()
