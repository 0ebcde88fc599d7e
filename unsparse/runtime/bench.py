"""``unsparse bench`` as a plain function (Hydra-free): per-layer and end-to-end comparisons on a GPU.

Models: torchvision VGG16, ResNet-50, AlexNet and GoogLeNet at 224x224 with synthetic weights (torchvision's
random initialisation, magnitude-pruned per layer to each sparsity; the report says so), and optionally a
trained model from a sparse file. Per layer and (batch, precision, sparsity) every backend is compared by
:func:`~unsparse.runtime.comparator.compare_layer`; end to end, the dense model (cuDNN) is timed against
the sparse model running its plan (:mod:`unsparse.runtime.end_to_end`). Output: ``bench.json``, and ``bench.md``
with PNG plots (:mod:`unsparse.report.benchmark`) in ``out_dir``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import glob
import inspect
import json
import math
import os
import platform
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from unsparse.atomic import atomic_write_text, write_record
from unsparse.job import git_commit, git_tree_modified
from unsparse.report.benchmark import ESCOIN_MODELS, compiled_ahead, evaluate_targets, markdown_report, plot_results
from unsparse.runtime.backends import get_backend
from unsparse.runtime.batch_norm_folding import FOLD_POLICIES, fold_batch_norm_
from unsparse.runtime.comparator import TIMINGS, best_times, compare_layer
from unsparse.runtime.end_to_end import bench_end_to_end, bench_end_to_end_sparse
from unsparse.runtime.generated_source import LOAD_BATCH
from unsparse.runtime.modules import set_backend
from unsparse.runtime.plan import Plan, PlanError, device_name, layer_key, without_epilogue
from unsparse.runtime.precision import PRECISIONS, SPARSE_BACKENDS, precision_mode
from unsparse.runtime.timing import MIN_RUNS
from unsparse.settings import check_integer, check_number, check_seed
from unsparse.sparse.format import UniformCSR
from unsparse.sparse.geometry import ConvGeometry

MODELS = ("vgg16", "resnet50", "alexnet", "googlenet")
QUICK = {"models": ["vgg16", "alexnet", "resnet50", "googlenet"], "sparsities": [0.9], "batches": [128],
         "precisions": ["fp32"], "end_to_end": ["vgg16"]}
"""Quick mode (one device call of a few minutes): every model at FP32, batch 128, sparsity 0.9."""
LOWERING_LIMIT_BYTES = 4 * 2**30
"""Lowering backends are skipped (and the skip recorded) when the im2col matrix would exceed this."""


@dataclasses.dataclass(frozen=True)
class ConvLayer:
    """One distinct conv layer of a model: dense weight, geometry, input ``(C, H, W)``, occurrences."""

    name: str
    weight: torch.Tensor
    bias: torch.Tensor | None
    geometry: ConvGeometry
    in_chw: tuple[int, int, int]
    count: int
    stem: bool


def environment(commit: str | None = None) -> dict[str, Any]:
    """GPU name, driver, torch/CUDA/cuDNN/CuPy versions, host, commit: recorded in every result file. With them
    ``tree_modified`` (:func:`~unsparse.job.git_tree_modified`), where ``commit`` is the checkout's HEAD
    (:func:`~unsparse.job.git_commit`): True where tracked files differ from it, so that ``commit`` does not name the
    code that ran (a copied tree on a lent GPU machine whose git is older: pass ``$UNSPARSE_COMMIT``); None where
    ``$UNSPARSE_COMMIT`` names the commit, there is no git, or ``commit`` is another commit (git cannot compare the
    tree with it)."""
    info: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "commit": commit,
                            "tree_modified": git_tree_modified() if commit is not None and commit == git_commit()
                            else None,
                            "python": platform.python_version(), "host": platform.node(),
                            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, sm_count=props.multi_processor_count,
                    l2_bytes=getattr(props, "L2_cache_size", None), cudnn=torch.backends.cudnn.version())
        try:
            import cupy

            info.update(cupy=cupy.__version__, driver=cupy.cuda.runtime.driverGetVersion())
        except ImportError:
            info.update(cupy=None)
    return info


def require_cuda(script: str) -> None:
    """For a GPU-only script, after parsing its arguments and before any work: without a CUDA device, one line on
    stderr naming ``script`` and exit status 2 (instead of torch's driver error, a traceback, further on).

    Raises:
        SystemExit: with status 2, where ``torch.cuda.is_available()`` is False.
    """
    if not torch.cuda.is_available():
        print(f"{script}: needs a CUDA GPU, and torch sees none here", file=sys.stderr)
        raise SystemExit(2)


class BenchRefusedError(ValueError):
    """What :func:`run_bench` refuses before any work: a setting (:func:`check_settings`; the message names it), a
    machine without CUDA, or a plan file that is unreadable or no valid plan."""


def check_settings(models: Sequence[str], sparsities: Sequence[float], batches: Sequence[int],
                   precisions: Sequence[str], lowering_models: Sequence[str], end_to_end: Sequence[str],
                   end_to_end_sparsity: float, end_to_end_batch: int, runs: int, sparse_file: str | Path | None,
                   sparse_input_shape: Sequence[int] | None, layer_filter: str | None, time_budget_s: float | None,
                   timing: str, seed: int, end_to_end_fuse_relu: bool = False,
                   end_to_end_fuse_max_pool: bool = False, end_to_end_fold_batch_norm: str = "off",
                   end_to_end_backends: Sequence[str] = (), end_to_end_channels_last: bool = True,
                   compile_shared_kernels: bool = False) -> None:
    """Check :func:`run_bench`'s settings (same meanings) before any GPU work, so that a typo does not surface
    after minutes of timings or as a traceback deep inside them: model names from :data:`MODELS`, precisions from
    :data:`~unsparse.runtime.precision.PRECISIONS`, sparsities in ``[0, 1)`` (the range of :func:`magnitude_prune_`),
    batch sizes and ``runs`` integers >= 1, every sequence a list or tuple (not a string or a lone number),
    ``sparse_file`` an existing file with a non-empty ``sparse_input_shape`` (positive integers), ``layer_filter`` a
    regular expression, ``time_budget_s`` > 0, ``timing`` one of :data:`~unsparse.runtime.comparator.TIMINGS`, ``seed``
    an integer in ``[0, 2^32)``, the seeds torch's CPU generator tells apart (:func:`~unsparse.settings.check_seed`;
    ``seed=1.5`` reached ``torch.manual_seed``, which took it as 1), ``end_to_end_fuse_relu``,
    ``end_to_end_fuse_max_pool``, ``end_to_end_channels_last`` and ``compile_shared_kernels`` bools,
    ``end_to_end_fold_batch_norm`` one of :data:`~unsparse.runtime.batch_norm_folding.FOLD_POLICIES`,
    ``end_to_end_backends`` a list of sparse backends (:data:`~unsparse.runtime.precision.SPARSE_BACKENDS`; ``auto``
    among them would resolve to itself).

    Raises:
        BenchRefusedError: (a ``ValueError``) naming the setting and the value.
    """
    try:
        for field, value in (("models", models), ("sparsities", sparsities), ("batches", batches),
                             ("precisions", precisions), ("lowering_models", lowering_models),
                             ("end_to_end", end_to_end), ("end_to_end_backends", end_to_end_backends)):
            _check_list(value, field)
        for field, names, known in (("models", models, MODELS), ("lowering_models", lowering_models, MODELS),
                                    ("end_to_end", end_to_end, MODELS), ("precisions", precisions, PRECISIONS),
                                    ("timing", [timing], TIMINGS),
                                    ("end_to_end_backends", end_to_end_backends, SPARSE_BACKENDS)):
            unknown = [name for name in names if not isinstance(name, str) or name not in known]
            if unknown:
                raise ValueError(f"{field}: {unknown} not among {', '.join(known)}")
        for field, values in (("sparsities", sparsities), ("end_to_end_sparsity", [end_to_end_sparsity])):
            for value in values:
                check_number(value, field, lambda number: 0 <= number < 1, "in [0, 1) (a sparsity)")
        for field, values in (("batches", batches), ("end_to_end_batch", [end_to_end_batch]), ("runs", [runs])):
            for value in values:
                check_integer(value, field)
        if sparse_file is not None:
            if not Path(sparse_file).is_file():
                raise ValueError(f"sparse_file: {sparse_file} is no file")
            if sparse_input_shape is None:
                raise ValueError("sparse_input_shape: needed with sparse_file (the per-sample input shape, e.g. "
                                 "[1, 28, 28])")
            _check_list(sparse_input_shape, "sparse_input_shape")
            if not sparse_input_shape:
                raise ValueError("sparse_input_shape: empty; expected the per-sample input shape, e.g. [1, 28, 28]")
            for value in sparse_input_shape:
                check_integer(value, "sparse_input_shape")
        check_seed(seed)
        for field, value in (("end_to_end_fuse_relu", end_to_end_fuse_relu),
                             ("end_to_end_fuse_max_pool", end_to_end_fuse_max_pool),
                             ("end_to_end_channels_last", end_to_end_channels_last),
                             ("compile_shared_kernels", compile_shared_kernels)):
            if not isinstance(value, bool):
                raise ValueError(f"{field}: expected true or false, got {value!r}")
        if not isinstance(end_to_end_fold_batch_norm, str) or end_to_end_fold_batch_norm not in FOLD_POLICIES:
            raise ValueError(f"end_to_end_fold_batch_norm: {end_to_end_fold_batch_norm!r} not among "
                             f"{', '.join(FOLD_POLICIES)}")
        if time_budget_s is not None:
            check_number(time_budget_s, "time_budget_s", lambda number: number > 0, "> 0 (or null)")
        if layer_filter is not None:
            if not isinstance(layer_filter, str):
                raise ValueError(f"layer_filter: expected a regular expression (a string), got {layer_filter!r}")
            re.compile(layer_filter)
    except re.error as error:
        raise BenchRefusedError(f"layer_filter: {layer_filter!r} is no regular expression ({error})") from None
    except ValueError as error:
        raise BenchRefusedError(str(error)) from None


def check_run_settings(**settings: Any) -> None:
    """:func:`check_settings` on keyword settings of :func:`run_bench` (those not given at its defaults), for a
    caller that checks its command line before other work (``scripts/gpu_check.py``).

    Raises:
        BenchRefusedError: as :func:`check_settings`.
        TypeError: a name that is no setting of :func:`run_bench`.
    """
    arguments = RUN_BENCH_SIGNATURE.bind("", **settings)
    arguments.apply_defaults()
    check_settings(*(arguments.arguments[name] for name in inspect.signature(check_settings).parameters))


def _check_list(value: Any, field: str) -> None:
    """``value`` must be a list or tuple (a string or a lone number, as a command line gives ``batches=128``, is
    not).

    Raises:
        ValueError: naming ``field``.
    """
    if not isinstance(value, list | tuple):
        raise ValueError(f"{field}: expected a list, e.g. [{value!r}], got {value!r}")


def build_model(name: str) -> nn.Module:
    """A torchvision model by name with synthetic weights (no download), eval mode.

    Conv weights are drawn He-normal (fan-in, ReLU gain) instead of torchvision's initialisers, whose small
    scales (GoogLeNet's truncated normal of std 0.01) make activations underflow float16 a few layers deep;
    the timing of a layer does not depend on the values, the numerical checks of the end-to-end runs do.

    Raises:
        KeyError: for names outside :data:`MODELS`.
    """
    import torchvision

    if name not in MODELS:
        raise KeyError(f"model {name!r}; known: {MODELS}")
    kwargs = {"aux_logits": False, "init_weights": True} if name == "googlenet" else {}
    model = getattr(torchvision.models, name)(weights=None, **kwargs).eval()
    for module in model.modules():
        if isinstance(module, nn.Conv1d | nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
    return model


def magnitude_prune_(model: nn.Module, sparsity: float) -> nn.Module:
    """Zero the ``floor(sparsity * numel)`` smallest-magnitude entries of every conv weight, per layer (in place;
    ties at the threshold go too, so at least that many), then scale the kept weights so that each layer's weight
    norm is unchanged (activations keep their scale through a deep synthetic model). Records state the measured
    sparsity, which the floor keeps at or just below the requested one.

    Raises:
        ValueError: if ``sparsity`` is outside [0, 1).
    """
    if not 0 <= sparsity < 1:
        raise ValueError(f"sparsity: {sparsity} outside [0, 1)")
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Conv1d | nn.Conv2d):
                weight = module.weight
                drop = int(sparsity * weight.numel())
                if drop:
                    norm = torch.linalg.vector_norm(weight)
                    threshold = weight.abs().flatten().kthvalue(drop).values
                    weight[weight.abs() <= threshold] = 0
                    kept = torch.linalg.vector_norm(weight)
                    if kept > 0:
                        weight *= norm / kept
    return model


def conv_layers(model: nn.Module, input_shape: Sequence[int], merge: bool = True) -> list[ConvLayer]:
    """The conv layers of ``model`` for one input of ``input_shape`` (batch 1 is run on the CPU), in call order.

    With ``merge``, layers with equal weight shape, geometry and input size are merged (``count`` says how many;
    the first instance's weights are kept): a per-layer benchmark times each shape once. Without, every conv call
    is its own layer with its own weights (what a whole model runs, e.g. to compile its kernels ahead). The first
    conv of the model is marked ``stem``.
    """
    seen: dict[tuple, ConvLayer] = {}
    order: list[tuple] = []

    def hook(module: nn.Module, args: tuple[torch.Tensor, ...], name: str) -> None:
        x = args[0]
        chw = (x.shape[1], 1, x.shape[2]) if x.dim() == 3 else tuple(x.shape[1:])
        geometry = ConvGeometry.from_module(module)
        key = (tuple(module.weight.shape), geometry, chw) if merge else (name, len(order))
        if key in seen:
            layer = seen[key]
            seen[key] = ConvLayer(layer.name, layer.weight, layer.bias, geometry, chw, layer.count + 1, layer.stem)
        else:
            bias = None if module.bias is None else module.bias.detach().clone()
            seen[key] = ConvLayer(name, module.weight.detach().clone(), bias, geometry, chw, 1, not order)
            order.append(key)

    handles = [module.register_forward_pre_hook(lambda m, a, n=name: hook(m, a, n))
               for name, module in model.named_modules() if isinstance(module, nn.Conv1d | nn.Conv2d)]
    try:
        with torch.no_grad():
            model.cpu()(torch.randn(1, *input_shape))
    finally:
        for handle in handles:
            handle.remove()
    return [seen[key] for key in order]


def pruned_layers(model: str, sparsity: float, names: Sequence[str]) -> dict[str, ConvLayer]:
    """The convs ``names`` of the torchvision ``model`` (:func:`build_model`) with synthetic weights magnitude-pruned
    to ``sparsity`` (:func:`magnitude_prune_`) after ``torch.manual_seed(0)``, each with its own weights at 224x224
    (:func:`conv_layers` unmerged), by name, in the order of ``names``.

    Raises:
        ValueError: naming those of ``names`` that are no conv of the model.
    """
    torch.manual_seed(0)
    layers = {layer.name: layer for layer in conv_layers(magnitude_prune_(build_model(model), sparsity), (3, 224, 224),
                                                          merge=False)}
    unknown = sorted(set(names) - set(layers))
    if unknown:
        raise ValueError(f"{unknown} are not convs of {model}")
    return {name: layers[name] for name in names}


LAYER_DTYPES = {"float32": torch.float32, "float16": torch.float16}
"""The dtypes a script timing chosen layers (:func:`add_layer_arguments`) takes by name."""


def add_layer_arguments(parser: argparse.ArgumentParser, out_name: str,
                        dtypes: Sequence[str] = tuple(LAYER_DTYPES)) -> None:
    """Add the options of a script that times chosen convs of a torchvision model with synthetic pruned weights
    (:func:`pruned_layers`, :func:`time_layers`): ``--out`` (default ``$OUT/<out_name>``), ``--model``, ``--layers``,
    ``--sparsity``, ``--batch``, ``--dtypes`` (names of :data:`LAYER_DTYPES`, default ``dtypes``), ``--runs``."""
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_out")) / out_name)
    parser.add_argument("--model", choices=MODELS, default="resnet50")
    parser.add_argument("--layers", nargs="+", required=True, help="conv module names, as in the model")
    parser.add_argument("--sparsity", type=float, default=0.9)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--dtypes", nargs="+", choices=list(LAYER_DTYPES), default=list(dtypes))
    parser.add_argument("--runs", type=int, default=MIN_RUNS)


def time_layers(parser: argparse.ArgumentParser, args: argparse.Namespace, result: dict[str, Any], file_name: str,
                records: Callable[[ConvLayer, torch.dtype], list[dict[str, Any]]]) -> None:
    """For each layer of ``args.layers`` (:func:`pruned_layers`; an unknown name ends the script through
    ``parser.error`` naming ``--layers``) and dtype of ``args.dtypes``, TF32 off, append ``records(layer, dtype)`` to
    ``result["records"]`` and write ``result`` to ``args.out / file_name`` (atomically, after every one), showing
    progress."""
    try:
        layers = pruned_layers(args.model, args.sparsity, args.layers)
    except ValueError as error:
        parser.error(f"--layers: {error}")
    args.out.mkdir(parents=True, exist_ok=True)
    with precision_mode(False):
        for name in tqdm(args.layers, desc="layers"):
            for dtype in args.dtypes:
                result["records"] += records(layers[name], LAYER_DTYPES[dtype])
                atomic_write_text(args.out / file_name, json.dumps(result, indent=1))


def layer_backends(layer: ConvLayer, batch: int, dtype: torch.dtype, lowering: bool,
                   sparse: str = "direct") -> tuple[list[str], str | None]:
    """Backends to compare on a layer (cuDNN, the ``sparse`` direct backend, the lowering baselines), and why
    lowering was left out (im2col matrix too large), if so."""
    names = ["cudnn", sparse]
    if not lowering:
        return names, "lowering baselines not requested"
    C, H, W = layer.in_chw
    R, S = (1, layer.weight.shape[2]) if layer.weight.dim() == 3 else tuple(layer.weight.shape[2:])
    E, F_ = layer.geometry.output_size(H, W, (R, S))
    lowered = C // layer.geometry.groups * R * S * batch * E * F_ * torch.finfo(dtype).bits // 8
    if lowered > LOWERING_LIMIT_BYTES:
        return names, f"im2col matrix {lowered / 2**30:.1f} GiB > {LOWERING_LIMIT_BYTES / 2**30:.0f} GiB limit"
    return [*names, "im2col_cublas", "im2col_cusparse"], None


def bench_layer(layer: ConvLayer, batch: int, precision: str, device: torch.device, lowering: bool,
                runs: int, plan: Plan, timing: str = "eager") -> dict[str, Any]:
    """Compare backends on one layer (``timing`` as in :func:`~unsparse.runtime.comparator.compare_layer`);
    returns a JSON-ready record and adds the winner to ``plan``.

    ``speedup_vs_cudnn`` is the baseline's median over the sparse backend's: cuDNN's convolution alone in its
    fastest layout, without bias (:mod:`unsparse.runtime.baseline`; ``baseline`` in the record).
    ``speedup_vs_cudnn_call`` is against the ``cudnn`` backend as an NCHW model calls it (bias added, layout
    conversions inside the call), the figure every result before the twelfth session reported as
    ``speedup_vs_cudnn``. ``direct_compile_s``: the seconds the sparse backend compiled its kernels before timing
    (:attr:`~unsparse.runtime.comparator.LayerComparison.compile_s`; None for a backend that compiles nothing ahead).
    """
    mode = PRECISIONS[precision]
    dtype = mode.dtype
    with precision_mode(mode.tf32):
        weight = layer.weight.to(device, dtype)
        csr = UniformCSR.from_dense(weight)
        bias = None if layer.bias is None else layer.bias.to(device, dtype)
        C, H, W = layer.in_chw
        x = torch.randn(batch, C, H, W, device=device, dtype=dtype)
        names, skipped = layer_backends(layer, batch, dtype, lowering, mode.sparse)
        comparison = compare_layer(x, csr, bias, layer.geometry, names, runs=runs, timing=timing, baseline=True)
        if comparison.best is not None:
            plan.entries[comparison.key] = comparison.plan_entry()
    E, F_ = layer.geometry.output_size(H, W, csr.kernel_size)
    useful = 2 * batch * csr.nnz * E * F_
    record = {"layer": layer.name, "count": layer.count, "stem": layer.stem, "in_chw": list(layer.in_chw),
              "weight_shape": list(csr.weight_shape), "geometry": layer.geometry.to_dict(), "batch": batch,
              "precision": precision, "sparsity": csr.sparsity, "row_length": csr.row_length,
              "dense_flop": 2 * batch * csr.out_channels * csr.columns * E * F_, "useful_flop": useful,
              "lowering_skipped": skipped, "comparison": comparison.to_dict(),
              "best_ms": best_times(comparison, names), "sparse_backend": mode.sparse}
    record["baseline"] = record["comparison"].pop("baseline")
    direct = comparison.fastest(mode.sparse)
    record["direct_params"] = None if direct is None else direct.params
    record["direct_compile_s"] = comparison.compile_s.get(mode.sparse)
    record["direct_useful_tflops"] = None if direct is None else useful / direct.timing.median_ms / 1e9
    bases = {"cudnn": comparison.baseline.median_ms, "cudnn_call": record["best_ms"].get("cudnn"),
             "im2col_cublas": record["best_ms"].get("im2col_cublas"),
             "im2col_cusparse": record["best_ms"].get("im2col_cusparse")}
    for name, base in bases.items():
        record[f"speedup_vs_{name}"] = (base / direct.timing.median_ms
                                        if base is not None and direct is not None else None)
    return record


def plan_backends(precision: str, also: Sequence[str] = ()) -> list[str]:
    """The backends a plan at ``precision`` (a key of :data:`PRECISIONS`) chooses among per layer: ``cudnn``, the
    precision's sparse backend, then each of ``also`` not named before it that runs the precision's dtype
    (``ConvBackend.dtypes``: ``direct_half2`` is not offered at ``fp32``, where it would refuse every layer while the
    run's label named it), in that order.

    Raises:
        KeyError: ``precision`` not in :data:`PRECISIONS`, or an unknown backend in ``also``.
    """
    dtype = PRECISIONS[precision].dtype
    runs_dtype = [name for name in also if dtype in (get_backend(name).dtypes or {dtype})]
    return list(dict.fromkeys(("cudnn", PRECISIONS[precision].sparse, *runs_dtype)))


def plan_file(plan_path: Path, key: str) -> Path:
    """Where :func:`run_bench` keeps the plan of :func:`plan_key` ``key``: ``plan_path`` for ``direct``, else the file
    ``<stem>_<key>.json`` beside it (e.g. ``plan_direct+generated.json``)."""
    return plan_path if key == "direct" else plan_path.with_name(f"{plan_path.stem}_{key}.json")


def plan_key(precision: str, also: Sequence[str] = ()) -> str:
    """The name under which :func:`run_bench` keeps the plan of ``precision`` with the sparse backends ``also``: its
    sparse backends (:func:`plan_backends`) sorted and joined by ``+`` (``direct``: the plan file's;
    ``direct+generated`` for ``fp32`` with ``generated`` as for ``fp32_generated`` with ``direct``, the same choice
    among the same layer keys). Raises as :func:`plan_backends`."""
    return "+".join(sorted(plan_backends(precision, also)[1:]))


def end_to_end_layers(model: nn.Module, input_shape: Sequence[int], dtype: torch.dtype, device: torch.device,
                      fold_batch_norm: str = "off") -> list[ConvLayer]:
    """Every conv call of ``model`` with its own weights (:func:`conv_layers` without merging), with the weights a
    whole-model plan of ``dtype`` on ``device`` gives its layers: with ``fold_batch_norm`` ``"all"``, each
    BatchNorm folded into the conv before it on a copy of ``model`` in ``dtype`` on ``device``
    (:func:`~unsparse.runtime.batch_norm_folding.fold_batch_norm_`, as
    :func:`~unsparse.runtime.end_to_end.bench_end_to_end` folds its sparse copy before planning), so that the
    kernels compiled ahead are those planning asks for: a ``generated`` kernel's source holds its weights' bits, and
    a fold changes every one of them. ``"off"`` and ``"epilogue"`` (which folds after planning) keep the weights as
    they are. ``model`` is not modified.
    """
    layers = conv_layers(model, input_shape, False)
    if fold_batch_norm != "all":
        return layers
    folded = copy.deepcopy(model).to(device, dtype).eval()
    fold_batch_norm_(folded)
    modules = dict(folded.named_modules())
    return [dataclasses.replace(layer, weight=modules[layer.name].weight.detach(),
                                bias=None if modules[layer.name].bias is None else modules[layer.name].bias.detach())
            for layer in layers]


def kernel_signature(key: str) -> tuple[str, ...]:
    """The parts of a plan key (:func:`~unsparse.runtime.plan.layer_key`) that decide a ``generated`` kernel's
    source besides the weights' values: the input's dtype and plane ``C x H x W``, the weight's shape, row length,
    stride, padding, dilation, groups, dimensions and dtype; not the GPU, the TF32 flags, the batch size, the
    epilogue or the layout, which the source does not hold. A plan file is untrusted: a key of another form gives a
    signature no layer has, not an error."""
    parts = without_epilogue(key).split("|")[1:]
    precision, shape = [*parts, "", ""][:2]
    return (precision.partition("+")[0], shape.removeprefix("x=").partition("x")[2],
            *(part for part in parts[2:] if not part.startswith("fmt=")))


def _kernel_parameters(params: Mapping[str, Any]) -> tuple[Any, ...]:
    """What of a ``generated`` setting decides its kernels (:meth:`GeneratedBackend.kernel_sources`)."""
    return params.get("rows"), params.get("programs"), params.get("min_blocks", 0), params.get("load_batch", LOAD_BATCH)


def compile_ahead(layers: Sequence[ConvLayer], precisions: Sequence[str], device: torch.device,
                  deadline: float | None = None, also: Sequence[str] = (),
                  plans: Sequence[Plan] = (), shared: bool = False) -> dict[str, Any]:
    """Compile, in one :func:`~unsparse.runtime.backends.generated.compile_all`, every kernel the comparisons of
    ``layers`` at ``precisions`` will time first for a sparse backend that lists its kernels (``kernel_sources``: the
    ``generated`` backend), each precision's own or one of ``also`` (:func:`plan_backends`): the probes of its
    ``screen_space`` (``kernel_sources``' ``probes``, one kernel per setting that ``estimate_ms`` times), as a
    comparison builds the rest only where the estimates say they may win
    (:data:`~unsparse.runtime.comparator.SCREEN_RATIO`). So NVRTC's compiles of all layers share the CPU's cores,
    the longest first, instead of each layer waiting for its own largest kernel; each comparison's ``precompile``
    then finds its kernels compiled. A kernel's source holds no batch size, so one pass serves every batch, and
    precisions of one dtype (``fp32`` and ``tf32``) list a layer's kernels once. Layers the backend refuses are left
    to their comparison, which records why.

    With ``plans``, also the kernels of every setting of the backend that an entry of one of them already chose for a
    layer of the same :func:`kernel_signature` (any batch, epilogue or layout), built from that layer's own weights
    and only where the backend's tuning space offers a setting of those kernels (a plan file is untrusted):
    a run resumed from a saved plan skips those comparisons but runs those settings in its first forward, where the
    layers would compile one after another, each waiting for its longest kernel (a ResNet-50 layer4 kernel of 8
    programs takes minutes), while the rest of the CPU's cores idle.

    With ``shared``, also the kernels of each unplanned layer's settings of several programs (those of its
    ``tuning_space`` with ``programs`` > 1, ``generated_conv_shared``; a layer no plan entry names), which a comparison
    builds only where its probes' estimates pass the screen, and which NVRTC compiles on one core each, for up to
    minutes. Compiled one layer after another, each layer waits for its longest while the other cores idle: on the
    H200 (sixty-third session, ResNet-50 at 0.9, FP32, batch 128, NCHW) the 38 layers planned in two calls spent 727 of
    their 762 s compiling, the 3x3 layers of layer3 49-62 s each. Where most layers pass the screen, as a whole model's
    do, the pass over all cores saves that wait; its price is the kernels of layers whose screen would have failed.
    (Every setting's one-program kernels are no option: ResNet-50's at 0.9 are 3,191 kernels, 632 MB of source in
    FP32, against 274 kernels and 188 MB for its settings of several programs and 245 probes, 50 MB.)

    Args:
        layers: from :func:`conv_layers`. precisions: keys of :data:`PRECISIONS`. device: where the kernels run.
        deadline: ``time.monotonic()`` seconds after which no further kernel's compile starts (None: none).
        also: sparse backends timed beside each precision's own (``end_to_end_backends`` of :func:`run_bench`).
        plans: plans whose entries' settings compile ahead (above). shared: see above.

    Returns:
        ``{"layers": layers with kernels, "kernels": distinct kernels, "skipped": distinct kernels left uncompiled
        at the deadline, "seconds": wall seconds of the compile, "planned_layers": layers with kernels of a
        planned setting, "shared": the flag}`` (the counts 0 where no backend compiles ahead).
    """
    from unsparse.runtime.backends.generated import compile_all

    sources: list[tuple[str, str]] = []
    compiled_layers: set[str] = set()
    planned_layers: set[str] = set()
    chosen: dict[tuple[str, tuple[str, ...]], set[tuple[Any, ...]]] = {}
    for plan in plans:
        for key, entry in plan.entries.items():
            chosen.setdefault((entry.backend, kernel_signature(key)), set()).add(_kernel_parameters(entry.params))
    # (dtype, backend) pairs in order, each once: precisions of one dtype time the same kernels
    pairs = dict.fromkeys((PRECISIONS[precision].dtype, name) for precision in precisions
                          for name in plan_backends(precision, also)[1:])
    for layer in layers:
        for dtype, name in pairs:
            backend = get_backend(name)
            list_kernels = getattr(backend, "kernel_sources", None)
            if list_kernels is None:
                continue
            csr = UniformCSR.from_dense(layer.weight.to(device, dtype))
            x = torch.empty(1, *layer.in_chw, device=device, dtype=dtype)
            if backend.unsupported_reason(x, csr, layer.geometry) is None:
                sources += list_kernels(x, csr, layer.geometry, backend.screen_space(x, csr, layer.geometry),
                                        probes=True)
                compiled_layers.add(layer.name)
                wanted = chosen.get((name, kernel_signature(layer_key(x, csr, layer.geometry, device="any"))))
                if wanted:  # one offered setting per planned set of kernels (streams, chunks, graph share them)
                    planned = {_kernel_parameters(params): params
                               for params in backend.tuning_space(x, csr, layer.geometry)
                               if _kernel_parameters(params) in wanted}
                    if planned:
                        sources += list_kernels(x, csr, layer.geometry, list(planned.values()))
                        planned_layers.add(layer.name)
                elif shared:
                    sources += list_kernels(x, csr, layer.geometry, [
                        params for params in backend.tuning_space(x, csr, layer.geometry) if params["programs"] > 1])
    started = time.perf_counter()
    functions = compile_all(sources, deadline=deadline) if sources else []
    skipped = {source for source, function in zip(sources, functions, strict=True) if function is None}
    return {"layers": len(compiled_layers), "kernels": len(set(sources)), "skipped": len(skipped),
            "seconds": time.perf_counter() - started, "planned_layers": len(planned_layers),
            "shared": shared}


def run_bench(out_dir: str | Path, models: Sequence[str] = MODELS, sparsities: Sequence[float] = (0.8, 0.9, 0.95),
              batches: Sequence[int] = (1, 32, 128), precisions: Sequence[str] = ("fp32", "tf32", "fp16"),
              lowering_models: Sequence[str] = ESCOIN_MODELS, end_to_end: Sequence[str] = MODELS,
              end_to_end_sparsity: float = 0.9, end_to_end_batch: int = 128, runs: int = MIN_RUNS,
              sparse_file: str | Path | None = None, sparse_input_shape: Sequence[int] | None = None,
              plan_path: str | Path | None = None, commit: str | None = None, seed: int = 0,
              layer_filter: str | None = None, time_budget_s: float | None = None,
              timing: str = "eager", record: Mapping[str, str] | None = None,
              end_to_end_fuse_relu: bool = False, end_to_end_fuse_max_pool: bool = False,
              end_to_end_fold_batch_norm: str = "off", end_to_end_backends: Sequence[str] = (),
              end_to_end_channels_last: bool = True, compile_shared_kernels: bool = False) -> dict[str, Any]:
    """Run the benchmark on ``cuda:0`` and write ``bench.json``, ``bench.md`` and plots to ``out_dir``.

    Before the layers of a model and sparsity are compared, and before a model is timed whole, the kernels a sparse
    backend compiles for them are compiled together (:func:`compile_ahead`; its figures under ``compile_ahead``, those
    of a whole model, every conv with its own weights, with ``end_to_end`` true).

    Args:
        out_dir: output folder (created).
        models: torchvision models (:data:`MODELS`) for the per-layer comparison at 224x224, synthetic weights.
        sparsities: per-layer magnitude-pruning ratios. batches: batch sizes. precisions: keys of
            :data:`PRECISIONS`.
        lowering_models: models whose layers are also compared with im2col + cuBLAS / cuSPARSE.
        end_to_end, end_to_end_sparsity, end_to_end_batch: models timed whole (dense vs planned), at every
            precision in ``precisions``.
        end_to_end_fuse_relu: fuse each conv of those models with the ReLU after it in the sparse copy
            (:func:`~unsparse.runtime.end_to_end.bench_end_to_end`'s ``fuse_relu``).
        end_to_end_fuse_max_pool: likewise with the 2x2 max pool after it (``fuse_max_pool``).
        end_to_end_fold_batch_norm: where the sparse copies fold each BatchNorm after a conv into it, one of
            :data:`~unsparse.runtime.batch_norm_folding.FOLD_POLICIES` (``fold_batch_norm``); the fused dense
            baseline folds every one unless ``"off"``.
        end_to_end_backends: sparse backends those models' plans also choose from, beside each precision's own
            (:func:`plan_backends`; e.g. ``["generated"]`` at ``fp32``: ``cudnn``, ``direct`` or ``generated`` per
            layer), their kernels compiled ahead with the model's. Such a plan is kept apart from the plan file,
            whose choices were made among fewer backends (beside it, :func:`plan_file`); each record names its
            backends (``sparse_backends``).
        end_to_end_channels_last: False plans those models in NCHW only (no channels-last or switched planned
            times; :func:`~unsparse.runtime.end_to_end.bench_end_to_end`'s ``channels_last``).
        compile_shared_kernels: each compile ahead also compiles the layers' kernels of several programs, which a
            comparison builds after its screen (:func:`compile_ahead`'s ``shared``): for whole models, whose layers
            mostly pass the screen.
        runs: timed runs per setting (>= 20 per the protocol).
        sparse_file, sparse_input_shape: a trained sparse model (``unsparse.sparse.io.load_sparse``) and its
            per-sample input shape, e.g. ``(1, 28, 28)``; planned and timed end to end at each batch size.
        plan_path: plan JSON to extend and rewrite (reuse across runs); ``out_dir/plan.json`` if None, read before
            anything is written (a file :meth:`~unsparse.runtime.plan.Plan.load` refuses is a refusal). It holds
            the plans of the ``direct`` precisions; a precision with another sparse backend (``fp16_half2``), or
            whole models with ``end_to_end_backends``, plan apart, since their layer keys equal those of the same
            dtype (``fp16``): beside the file as ``<stem>_<key>.json`` (:func:`plan_file`, e.g.
            ``plan_direct+generated.json``), read at the start like it. A plan is saved (atomically) after each
            per-layer record and after each layer a whole model's planning adds to it, so that a run killed in its
            planning resumes, with the same ``out_dir`` or ``plan_path``, from the layers planned so far.
        commit: git commit recorded in the results. seed: torch seed.
        layer_filter: only per-layer records whose layer name matches this regular expression
            (``re.search``: a plain name such as ``features.1`` matches as a substring).
        time_budget_s: wall-clock seconds after which no further per-layer or end-to-end setting, and no
            :func:`compile_ahead` of a model and sparsity or kernel compile within it, is started (None: no
            limit); what was skipped is recorded under ``stopped_early``, each layer setting by name.
            ``bench.json`` is written atomically before the first compile and after every record (``complete``
            false until the end), so a killed run keeps its data.
        timing: how the per-layer comparison times settings (:data:`~unsparse.runtime.comparator.TIMINGS`):
            ``"graph"`` replays CUDA graphs, the GPU time without the host's per-call work (batch 1).
        record: text files written into ``out_dir`` (relative path -> content, atomically) and logged once the
            settings and the plan file are accepted and a GPU is present (:func:`~unsparse.atomic.write_record`),
            e.g. the command line's composed config: a refused run writes none.

    Returns:
        The dict written to ``bench.json``.

    Raises:
        BenchRefusedError: (a ``ValueError``) before anything runs: from :func:`check_settings`, without CUDA, or
            for a plan file that cannot be read or is no valid plan (the message names the file and the field).
    """
    check_settings(models, sparsities, batches, precisions, lowering_models, end_to_end, end_to_end_sparsity,
                   end_to_end_batch, runs, sparse_file, sparse_input_shape, layer_filter, time_budget_s, timing, seed,
                   end_to_end_fuse_relu, end_to_end_fuse_max_pool, end_to_end_fold_batch_norm, end_to_end_backends,
                   end_to_end_channels_last, compile_shared_kernels)
    if not torch.cuda.is_available():
        raise BenchRefusedError("run_bench needs a CUDA GPU, and torch sees none here")
    out_dir = Path(out_dir)
    plan_path = Path(plan_path) if plan_path is not None else out_dir / "plan.json"
    try:
        plan = Plan.load(plan_path) if plan_path.exists() else Plan()
        plans = {"direct": plan} | {  # per sparse backends ("+"-joined): fp16_half2's keys equal fp16's (same dtype)
            path.stem[len(plan_path.stem) + 1:]: Plan.load(path)
            for path in sorted(plan_path.parent.glob(f"{glob.escape(plan_path.stem)}_*.json"))}
    except (PlanError, OSError) as error:
        raise BenchRefusedError(f"plan_path: {error}") from error
    torch.manual_seed(seed)
    device = torch.device("cuda", 0)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_record(out_dir, record)

    def plan_for(precision: str, also: Sequence[str] = ()) -> Plan:
        return plans.setdefault(plan_key(precision, also), Plan())

    def save_plan(key: str) -> None:
        plans[key].save(plan_file(plan_path, key))
    result: dict[str, Any] = {"environment": environment(commit), "device": device_name(device),
                              "weights": "synthetic (He-normal random conv weights, per-layer magnitude pruning, "
                                         "kept weights rescaled to the layer norm)",
                              "input": [3, 224, 224], "runs": runs, "timing": timing, "complete": False,
                              "stopped_early": [], "compile_ahead": [],
                              "failed": [], "layers": [], "end_to_end": []}
    deadline = None if time_budget_s is None else time.monotonic() + time_budget_s

    def out_of_time(what: str) -> bool:
        if deadline is not None and time.monotonic() > deadline:
            result["stopped_early"].append(what)
            return True
        return False

    def compile_layers_ahead(label: str, layers: list[ConvLayer], chosen: Sequence[str] = precisions,
                             also: Sequence[str] = (), **where: Any) -> None:
        if out_of_time(f"{label}: compile ahead"):
            return
        ahead = compile_ahead(layers, chosen, device, deadline, also, [plan_for(p, also) for p in chosen],
                              compile_shared_kernels)
        if ahead["skipped"]:
            result["stopped_early"].append(f"{label}: compile ahead, {ahead['skipped']} of {ahead['kernels']} "
                                           "kernels not started")
        if ahead["kernels"]:
            record = {**where, **ahead}
            result["compile_ahead"].append(record)
            print(f"{label}: compiled {compiled_ahead(record)} ahead in {ahead['seconds']:.1f} s", flush=True)

    _write_json(result, out_dir)  # a run killed in its first compile ahead still leaves its environment
    for name in models:
        for sparsity in sparsities:
            layers = [layer for layer in conv_layers(magnitude_prune_(build_model(name), sparsity), (3, 224, 224))
                      if layer_filter is None or re.search(layer_filter, layer.name) is not None]
            compile_layers_ahead(f"{name} s{sparsity}", layers, model=name, sparsity=sparsity)
            for layer in layers:
                for batch in batches:
                    for precision in precisions:
                        if out_of_time(f"{name} {layer.name} s{sparsity} b{batch} {precision}"):
                            continue
                        record = bench_layer(layer, batch, precision, device, name in lowering_models, runs,
                                             plan_for(precision), timing)
                        record.update(model=name, target_sparsity=sparsity)
                        result["layers"].append(record)
                        _progress(record)
                        _write_json(result, out_dir)
                        save_plan(plan_key(precision))
                        torch.cuda.empty_cache()
    for name in end_to_end:
        model = magnitude_prune_(build_model(name), end_to_end_sparsity)
        dtypes = dict.fromkeys(PRECISIONS[precision].dtype for precision in precisions)
        groups = ([[p for p in precisions if PRECISIONS[p].dtype == dtype] for dtype in dtypes]
                  if end_to_end_fold_batch_norm == "all" else [precisions])  # folded weights differ per dtype
        for chosen in filter(None, groups):
            layers = end_to_end_layers(model, (3, 224, 224), PRECISIONS[chosen[0]].dtype, device,
                                       end_to_end_fold_batch_norm)
            compile_layers_ahead(f"end to end {name} s{end_to_end_sparsity}", layers, chosen, end_to_end_backends,
                                 model=name, sparsity=end_to_end_sparsity, end_to_end=True)
        for precision in precisions:
            if out_of_time(f"end to end {name} {precision}"):
                continue
            backends = plan_backends(precision, end_to_end_backends)
            key = plan_key(precision, end_to_end_backends)
            try:
                record = bench_end_to_end(model, (3, 224, 224), end_to_end_batch, precision, device, runs,
                                          plan_for(precision, end_to_end_backends), backends,
                                          end_to_end_fuse_relu, end_to_end_fuse_max_pool,
                                          end_to_end_fold_batch_norm, checkpoint=lambda _, key=key: save_plan(key),
                                          channels_last=end_to_end_channels_last)
            except RuntimeError as exc:  # e.g. no backend matched the reference on some layer: say so, go on
                result["failed"].append({"what": f"end to end {name} {precision}", "error": str(exc)})
                print(f"e2e {name} {precision}: FAILED: {exc}")
                continue
            record.update(model=name, sparsity=end_to_end_sparsity, weights="synthetic",
                          sparse_backends=backends[1:])
            result["end_to_end"].append(record)
            _write_json(result, out_dir)
            print(f"e2e {name} {precision}: dense {record['dense_ms']:.3f} ms, planned {record['planned_ms']:.3f} ms")
    if sparse_file is not None:
        from unsparse.sparse.io import load_sparse

        for batch in batches:
            if out_of_time(f"trained model {sparse_file} b{batch}"):
                continue
            trained = load_sparse(sparse_file).to(device)
            set_backend(trained, "cudnn")
            record = bench_end_to_end_sparse(trained, sparse_input_shape, batch, device, runs, plan)
            record.update(model=str(sparse_file), weights="trained")
            result["end_to_end"].append(record)
    for key, kept in plans.items():
        if kept is plan or kept.entries:
            save_plan(key)
    result["targets"] = evaluate_targets(result)
    result["complete"] = not result["stopped_early"] and not result["failed"]
    _write_json(result, out_dir)
    plots = plot_results(result, out_dir)  # first: the page links the plots written (none without data)
    # from the figures bench.json keeps (for_json's 6 significant digits), so that re-rendering the JSON gives the
    # same page: rounding the full value to the page's 4 digits could differ (1.3705 -> 1.371, its JSON 1.37050 ->
    # 1.370 again after a decimal round trip)
    atomic_write_text(out_dir / "bench.md", markdown_report(for_json(result), plots=plots))
    return result


RUN_BENCH_SIGNATURE = inspect.signature(run_bench)
""":func:`run_bench`'s parameters and defaults, for :func:`check_run_settings`."""


def _write_json(result: dict[str, Any], out_dir: Path) -> None:
    """Rewrite ``bench.json`` with the records so far, atomically (``complete`` is false until the end).

    Compact (no whitespace, :func:`for_json`'s rounding): the file is for machines, the Markdown report beside it
    for people, and indented 17-digit floats made committed results about 1.9x larger (1.56x from the indent,
    1.19x from the digits), too large to travel to the lent GPU machine with the pruning data.
    """
    atomic_write_text(out_dir / "bench.json", json.dumps(for_json(result), separators=(",", ":")))


SIGNIFICANT_DIGITS = 6
"""Digits kept of every float in ``bench.json``: a timing in ms keeps 10 ns below 10 ms and 100 ns below 100 ms,
finer than the ~0.5 us resolution of CUDA events."""


def for_json(value: Any) -> Any:
    """``value`` (nested dicts, lists, tuples, numbers, strings) made plain JSON: floats rounded to
    :data:`SIGNIFICANT_DIGITS` significant digits, NaN and infinities as ``None`` (JSON has neither), tuples as lists.
    """
    if isinstance(value, float):
        return float(f"{value:.{SIGNIFICANT_DIGITS}g}") if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: for_json(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [for_json(item) for item in value]
    return value


def _progress(record: dict[str, Any]) -> None:
    best = {"cudnn alone": record["baseline"]["median_ms"], **{f"{k} call" if k == "cudnn" else k: v
                                                               for k, v in record["best_ms"].items()}}
    text = ", ".join(f"{k} {v:.3f}" for k, v in best.items() if v is not None)
    compiled = record.get("direct_compile_s")
    print(f"{record['model']} {record['layer']} {record['in_chw']} b{record['batch']} {record['precision']} "
          f"s{record['target_sparsity']}: {text} ms" + ("" if compiled is None else f"; compiled {compiled:.1f} s"),
          flush=True)
