"""Whole-model timing for ``unsparse bench``: a dense model on cuDNN against its sparse copy running the plan.

:func:`bench_end_to_end` takes a torchvision model with synthetic pruned weights and times it in NCHW and in
channels-last from end to end; :func:`bench_end_to_end_sparse` takes a model loaded from a sparse file. Both check
each plan against its dense default (:func:`~unsparse.runtime.comparator.check_plan`) before timing, time both sides
eagerly (CUDA events after warm-up, medians: :func:`~unsparse.runtime.timing.time_fn`) and as CUDA-graph replays
(:func:`graph_timings`), since eager times of a host-bound model measure the host, not the kernels.
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any, NamedTuple

import torch
from torch import nn

from unsparse.runtime.backends import get_backend
from unsparse.runtime.batch_norm_folding import (
    FOLD_POLICIES,
    FOLDED_ATTRIBUTE,
    fold_batch_norm_,
    fold_batch_norm_into_epilogues_,
)
from unsparse.runtime.comparator import (
    LayerComparison,
    PlanCheck,
    best_times,
    check_plan,
    epilogue_passes,
    plan_model,
    planned_backends,
    planning_summary,
    relative_error,
    tolerance,
)
from unsparse.runtime.dense_fusion import choose_epilogues_, fuse_dense_conv_relu
from unsparse.runtime.hooks import forward_with_pre_hooks
from unsparse.runtime.layout import channels_last_after, layout_of, layout_switch
from unsparse.runtime.modules import set_backend, sparse_layers, sparsify, temporary_backend
from unsparse.runtime.plan import Plan, without_epilogue
from unsparse.runtime.precision import PRECISIONS, precision_mode
from unsparse.runtime.timing import Timing, time_fn, time_graph


def graph_timings(dense: Callable[[], Any], planned: Callable[[], Any], device: torch.device,
                  runs: int, layout: str = "nchw") -> dict[str, Any]:
    """CUDA-graph medians (ms) of the dense and the planned forward, as ``dense_graph_ms`` and
    ``planned_graph_ms``, plus ``graph_speedup`` (dense over planned) and ``graph_error`` (why there are none:
    not CUDA, or a capture that failed); for ``layout="nhwc"`` the keys read ``dense_nhwc_graph_ms``,
    ``planned_nhwc_graph_ms``, ``graph_nhwc_speedup`` and ``graph_nhwc_error``. Eager times include the host's
    per-layer work; where a model is host-bound these tell how much of a gap is kernels."""
    tag = "" if layout == "nchw" else f"_{layout}"
    dense_key, planned_key, speedup_key, error_key = (f"dense{tag}_graph_ms", f"planned{tag}_graph_ms",
                                                      f"graph{tag}_speedup", f"graph{tag}_error")
    record: dict[str, Any] = dict.fromkeys((dense_key, planned_key, speedup_key, error_key))
    if device.type != "cuda":
        record[error_key] = f"no CUDA graphs on {device.type}"
        return record
    try:
        record[dense_key] = time_graph(dense, device, runs).median_ms
        record[planned_key] = time_graph(planned, device, runs).median_ms
    except RuntimeError as error:
        record[error_key] = f"capture failed: {error}"
        return record
    record[speedup_key] = record[dense_key] / record[planned_key]
    return record


def bench_end_to_end(model: nn.Module, input_shape: Sequence[int], batch: int, precision: str,
                     device: torch.device, runs: int, plan: Plan, backends: list[str] | None,
                     fuse_relu: bool = False, fuse_max_pool: bool = False,
                     fold_batch_norm: str = "off", checkpoint: Callable[[Plan], Any] | None = None,
                     channels_last: bool = True) -> dict[str, Any]:
    """Time the dense model (cuDNN) against its sparsified copy running the plan ("auto"), same precision, each
    in NCHW and in channels-last from end to end.

    The sparse copy is planned with :func:`~unsparse.runtime.comparator.plan_model` (entries already in ``plan`` are
    reused; ``checkpoint`` called with the plan after each new entry) once on an NCHW input and once on the same input
    in channels-last (a second copy; its layers receive and return NHWC, and each direct layer's conversions are part of
    its measured time). Outputs are compared with the dense NCHW model's within 10x the dtype's tolerance (TF32-aware).

    Record fields, times in ms (eager medians): ``dense_ms`` / ``planned_ms`` and ``speedup`` (NCHW, as before layouts
    were planned); ``dense_nhwc_ms`` (:func:`channels_last_copy`) and ``planned_nhwc_ms``, each None if its output
    disagrees (errors recorded either way; a one-channel input cannot carry the layout, so the sparse model is then not
    planned in it: ``planned_nhwc_ms`` and its error None); ``speedup_vs_best_dense``: the NCHW planned model against
    the fastest dense layout; ``best_planned_layout`` and ``best_speedup``: the fastest planned layout against the
    fastest dense layout, what a user who runs the planner's best model gets. ``layers_planned_now``,
    ``layers_screened`` and ``planning_compile_s`` (s) count what planning both copies took
    (:func:`~unsparse.runtime.comparator.planning_summary`; ``plan_entries_reused``: the entries it found).
    ``backend_counts`` / ``off_cudnn`` name the planned backends per layer (NCHW), ``backend_counts_nhwc`` /
    ``off_cudnn_nhwc`` the channels-last plan's; ``epilogue_passes`` / ``epilogue_passes_nhwc`` name the ``cudnn``
    layers planned with their fused ReLU as passes after cuDNN's convolution, where that timed faster than cuDNN's fused
    call (:func:`~unsparse.runtime.comparator.epilogue_passes`). A
    stronger dense baseline is timed in the same run: the dense model with each convolution, its bias and its ReLU as
    one cuDNN call, or as the convolution and passes where those are faster on the layer (:func:`dense_fused_timings`:
    ``dense_fused_convs``, ``dense_fused_passes``, ``dense_fused_ms``, ``dense_fused_nhwc_ms`` and their errors),
    ``best_dense_fused_layout`` its fastest layout and ``best_speedup_vs_dense_fused`` the fastest
    planned layout against it (None where nothing fuses). CUDA-graph
    times (:func:`graph_timings`) of both layouts tell host-bound gaps apart. Each plan is checked end to end against
    its dense default right after planning (:func:`~unsparse.runtime.comparator.check_plan`; ``plan_check``,
    ``plan_check_nhwc``: both medians and the keys set back to the default), so the planned times are of the plans that
    survived that check.

    A third layout, ``"switched"``, is timed for the planned model, the eager dense model and the dense model fused by
    cuDNN: NCHW up to the model's first max pool and channels-last after it
    (:func:`~unsparse.runtime.layout.layout_switch`; ``layout_switch`` names the pool, or with ``fuse_max_pool`` the
    first conv that fused one (since the fifty-third session; before, such a model had no switch), None where the model
    calls neither or its input has one channel). The planned model is the NCHW copy fed NCHW, its layers after the
    switch running the channels-last plan's entries (the plan holds both, keyed by layout); each dense one is its
    channels-last copy with its modules before the switch taken from its NCHW model (NCHW weights and epilogue choices:
    :func:`switched_dense_timing`). ``planned_switched_ms``, ``dense_switched_ms`` and ``dense_fused_switched_ms``
    (eager medians; None where not timed or the output's relative error, ``planned_switched_rel_error`` /
    ``dense_switched_rel_error`` / ``dense_fused_switched_rel_error``, exceeds the tolerance; ``dense_layout_switch``
    and ``dense_fused_layout_switch`` name the dense models' pool, which differs from the planned model's where the
    planned copy fused its first pool into a conv: the dense models switch after that pool, the planned one after the
    conv that fused it, the same place in the forward); ``planned_switched_graph_ms``, ``dense_switched_graph_ms`` and
    ``dense_fused_switched_graph_ms`` the same models replayed as CUDA graphs (their ``*_graph_error`` says why there is
    none). Since the fifty-third session the switched times enter the ``best_*`` layouts and ratios as a third layout
    (``best_dense_layout``, ``best_planned_layout`` and ``best_dense_fused_layout`` may be ``"switched"``); before, they
    were recorded beside them, and the eager dense model was not switched. ``backend_counts_switched`` and
    ``off_cudnn_switched`` give the switched planned model's backends as ``backend_counts`` and ``off_cudnn`` give the
    NCHW plan's (:func:`switched_backends`; None without a switch). With ``fold_batch_norm`` ``"epilogue"`` the switched
    planned model folds as the NCHW plan chose, also in the layers after the switch that run channels-last entries: the
    same function, possibly a pass more or less than the channels-last copy folds.

    With ``fuse_relu`` the sparse copies fuse each conv with the ReLU that alone reads its output, through the copy's
    FX graph (:func:`~unsparse.runtime.modules.fuse_relu`: VGG's ``nn.ReLU`` modules, and with ``fold_batch_norm``
    ``"all"`` ResNet's and GoogLeNet's conv, BatchNorm, ReLU calls; ``fused_relu`` counts the layers), which a backend
    that fuses it applies in its epilogue; and each conv whose output a residual add reads, the add's sum then read by
    a ReLU alone, with that add and ReLU (the end of ResNet's blocks; ``fused_residual`` counts them, among
    ``fused_relu``), which ``cudnn`` runs in one call and ``direct`` in its kernels' epilogue
    (``ConvBackend.fuses_residual_relu``); the dense model runs as PyTorch runs it, ReLU apart. With
    ``fuse_max_pool`` they fuse the 2x2 max pool after a conv in an ``nn.Sequential`` too
    (:func:`~unsparse.runtime.modules.fuse_max_pool_`, past the ReLU, before the ReLUs fuse; ``fused_max_pool``
    counts the layers). The per-layer comparisons time each fused layer with what it is fused with
    (:func:`~unsparse.runtime.comparator.plan_model`; ``fusion_planned``: True), a separate pass after backends that
    do not fuse it. What fusing buys is measured in the same run: ``planned_unfused_ms`` times a third sparse copy
    without fusion on the same choices (NCHW, eager; each unfused key takes the entry of the fused key it comes from,
    :func:`~unsparse.runtime.plan.without_epilogue`, less its epilogue setting
    (:meth:`~unsparse.runtime.plan.PlanEntry.unfused`: a cuDNN layer planned with its ReLU as passes runs the same
    convolution), the first layer's where two fused keys lose their epilogues to one, and the plan's own entry where
    the key is also an unfused layer's of the timed copy, which the active plan the ``"auto"`` backend reads must
    keep; nothing is added to ``plan``, though the active plan holds the new keys from then on)
    and ``fusion_speedup`` is it over
    ``planned_ms``; both None without either flag. ``cudnn_fuses_relu`` records that the ``cudnn`` backend applies a
    fused layer's ReLU in its call (runs before it paid a ReLU pass after cuDNN), ``direct_fuses_relu`` that the
    ``direct`` kernels apply it as they store (runs before the forty-fourth session paid a pass after them),
    ``direct_fuses_residual`` that they add a residual block's identity as they store too (before the forty-sixth
    session, an add pass and a ReLU pass after them).

    ``fold_batch_norm`` (:data:`~unsparse.runtime.batch_norm_folding.FOLD_POLICIES`, recorded as such) folds eval-mode
    BatchNorms after a conv into it in the sparse copies: ``"all"`` every one, before planning and the fusions
    (:func:`~unsparse.runtime.batch_norm_folding.fold_batch_norm_`); ``"epilogue"`` after planning, only into the
    layers whose planned backend adds the bias in its epilogue
    (:func:`~unsparse.runtime.batch_norm_folding.fold_batch_norm_into_epilogues_`) as the plan stands after its
    check, making no fusion that folding exposes (:func:`_plan_check_fold`); each layout's copy folds by its own
    plan. The
    unfused copy folds the NCHW copy's layers. Unless ``"off"``, the fused dense baseline folds every BatchNorm; the
    eager dense model never does. ``folded_batch_norm`` and ``folded_batch_norm_nhwc`` count the layers that took one
    (0 when off).

    ``channels_last`` False plans and times the sparse copy in NCHW only: no channels-last plan, so no planned NHWC or
    switched times (None, as for a one-channel input), while the dense models are still timed in every layout. It saves
    the channels-last planning's device time where that plan is known to lose (ResNet-50 FP32 at 0.9, b128: about 10
    of the plan's 50 device-minutes for a model twice as slow as the NCHW plan, sixty-first session).
    ``channels_last_plan`` says which: ``"planned"``, ``"one channel"`` or ``"not asked"``.

    ``model`` is not modified: the dense model timed is a copy on ``device`` in the precision's dtype, so a caller
    timing one model at several precisions times each from the same weights (before the fiftieth session the model was
    converted in place, and an FP32 run after an FP16 one timed FP16-rounded weights, whose generated kernels compiled
    ahead from the unrounded ones matched none).

    Raises:
        ValueError: ``fold_batch_norm`` not among the policies.
    """
    if fold_batch_norm not in FOLD_POLICIES:
        raise ValueError(f"fold_batch_norm: {fold_batch_norm!r} not among {', '.join(FOLD_POLICIES)}")
    dtype, tf32 = PRECISIONS[precision].dtype, PRECISIONS[precision].tf32
    bound = 10 * tolerance(dtype, tf32)
    with precision_mode(tf32):
        dense = copy.deepcopy(model).to(device, dtype).eval()
        fusions = {"fuse_relu": fuse_relu, "fuse_max_pool": fuse_max_pool}
        sparse, sparse_nhwc = (sparsify(dense, **fusions, fold_batch_norm=fold_batch_norm == "all") for _ in range(2))
        x = torch.randn(batch, *input_shape, device=device, dtype=dtype)
        x_nhwc = x.contiguous(memory_format=torch.channels_last)
        one_channel = layout_of(x_nhwc) != "nhwc"  # the same bytes, so the layers would run NCHW
        nhwc_planned = channels_last and not one_channel
        reused_before = len(plan.entries)
        by_plan = fold_batch_norm == "epilogue"
        plan, comparisons, check = _plan_check_fold(sparse, x, plan, backends, runs, by_plan, checkpoint)
        plan, comparisons_nhwc, check_nhwc = (_plan_check_fold(sparse_nhwc, x_nhwc, plan, backends, runs, by_plan,
                                                               checkpoint)
                                              if nhwc_planned else (plan, [], None))
        folded = getattr(sparse, FOLDED_ATTRIBUTE, [])
        unfused = sparsify(dense) if fuse_relu or fuse_max_pool else None
        if unfused is not None:
            if folded:
                fold_batch_norm_(unfused, only=folded)
            same_choices = Plan()
            for key in filter(None, (getattr(layer, "plan_key", None) for layer in sparse_layers(sparse).values())):
                unfused_key = without_epilogue(key)
                same_choices.entries.setdefault(unfused_key, plan.entries.get(unfused_key, plan.entries[key].unfused()))
            plan_model(unfused, x, same_choices, backends)
        with torch.no_grad():
            dense_out, sparse_out = dense(x), sparse(x)
            dense_t = time_fn(lambda i: dense(x), device, runs=runs)
            sparse_t = time_fn(lambda i: sparse(x), device, runs=runs)
            unfused_t = None if unfused is None else time_fn(lambda i: unfused(x), device, runs=runs)
            graphs = graph_timings(lambda: dense(x), lambda: sparse(x), device, runs)
            dense_nhwc, nhwc_t, nhwc_error = dense_channels_last(dense, x, dense_out, runs)
            dense_switched = switched_dense_timing(dense, dense_nhwc, x, dense_out, runs, bound, "dense")
            dense_fused = dense_fused_timings(dense, x, dense_out, runs, bound, fold_batch_norm != "off")
            planned_nhwc_error, planned_nhwc_t = math.inf, None
            if nhwc_planned:
                planned_nhwc_error = relative_error(sparse_nhwc(x_nhwc).double(), dense_out.double())
                planned_nhwc_t = time_fn(lambda i: sparse_nhwc(x_nhwc), device, runs=runs)
                graphs |= graph_timings(lambda: dense_nhwc(x_nhwc), lambda: sparse_nhwc(x_nhwc), device, runs,
                                        "nhwc")
            switch = layout_switch(sparse, x)[0] if nhwc_planned else None
            switched = None if switch is None else _switched_timing(sparse, switch, x, dense_out, runs)
            switched_layouts = None if switch is None else switched_input_layouts(sparse, switch, x)
        error = relative_error(sparse_out.double(), dense_out.double())
    planned_switched_ms = (switched.eager.median_ms if switched is not None and switched.rel_error <= bound
                           else None)
    dense_times = {"nchw": dense_t.median_ms, "nhwc": nhwc_t.median_ms if nhwc_error <= bound else math.inf,
                   "switched": dense_switched["dense_switched_ms"] or math.inf}
    planned_times = {"nchw": sparse_t.median_ms,
                     "nhwc": planned_nhwc_t.median_ms if planned_nhwc_error <= bound else math.inf,
                     "switched": planned_switched_ms or math.inf}
    best_dense, best_planned = min(dense_times, key=dense_times.get), min(planned_times, key=planned_times.get)
    fused_times = {layout: dense_fused[f"dense_fused{tag}_ms"]
                   for layout, tag in (("nchw", ""), ("nhwc", "_nhwc"), ("switched", "_switched"))
                   if dense_fused[f"dense_fused{tag}_ms"] is not None}
    best_fused = min(fused_times, key=fused_times.get) if fused_times else None
    by_layer = planned_backends(sparse, plan)
    by_layer_nhwc = planned_backends(sparse_nhwc, plan) if nhwc_planned else {}
    by_layer_switched = (None if switched_layouts is None
                         else switched_backends(by_layer, by_layer_nhwc, switched_layouts))
    return {"batch": batch, "precision": precision, "dense_ms": dense_t.median_ms, "planned_ms": sparse_t.median_ms,
            "speedup": dense_t.median_ms / sparse_t.median_ms, "rel_error": error,
            "dense_nhwc_ms": _finite(dense_times["nhwc"]), "dense_nhwc_rel_error": nhwc_error, **dense_switched,
            "best_dense_layout": best_dense, "speedup_vs_best_dense": dense_times[best_dense] / sparse_t.median_ms,
            "planned_nhwc_ms": _finite(planned_times["nhwc"]),
            "planned_nhwc_rel_error": planned_nhwc_error if nhwc_planned else None,
            "best_planned_layout": best_planned,
            "best_speedup": dense_times[best_dense] / planned_times[best_planned], **dense_fused,
            "best_dense_fused_layout": best_fused,
            "best_speedup_vs_dense_fused": (fused_times[best_fused] / planned_times[best_planned]
                                            if best_fused is not None else None),
            "plan_check": asdict(check), "plan_check_nhwc": None if check_nhwc is None else asdict(check_nhwc),
            "channels_last_plan": "planned" if nhwc_planned else "one channel" if one_channel else "not asked",
            "tolerance": bound, **planning_summary(comparisons + comparisons_nhwc),
            "plan_entries_reused": reused_before, **graphs, "dense_timing": dense_t.to_dict(),
            "fused_relu": sum(layer.relu for layer in sparse_layers(sparse).values()),
            "fused_residual": sum(layer.residual for layer in sparse_layers(sparse).values()),
            "fused_max_pool": sum(layer.max_pool for layer in sparse_layers(sparse).values()),
            "fold_batch_norm": fold_batch_norm, "folded_batch_norm": len(folded),
            "folded_batch_norm_nhwc": len(getattr(sparse_nhwc, FOLDED_ATTRIBUTE, [])),
            "fusion_planned": True, "cudnn_fuses_relu": get_backend("cudnn").fuses_relu,
            "direct_fuses_relu": get_backend("direct").fuses_relu,
            "direct_fuses_residual": get_backend("direct").fuses_residual_relu,
            "planned_unfused_ms": None if unfused_t is None else unfused_t.median_ms,
            "fusion_speedup": None if unfused_t is None else unfused_t.median_ms / sparse_t.median_ms,
            "planned_timing": sparse_t.to_dict(),
            "planned_nhwc_timing": None if planned_nhwc_t is None else planned_nhwc_t.to_dict(),
            "backend_counts": dict(Counter(by_layer.values())),
            "off_cudnn": {name: backend for name, backend in by_layer.items() if backend != "cudnn"},
            "backend_counts_nhwc": dict(Counter(by_layer_nhwc.values())),
            "off_cudnn_nhwc": {name: backend for name, backend in by_layer_nhwc.items() if backend != "cudnn"},
            "epilogue_passes": epilogue_passes(sparse, plan),
            "epilogue_passes_nhwc": epilogue_passes(sparse_nhwc, plan) if nhwc_planned else [],
            "layout_switch": switch,
            "planned_switched_ms": planned_switched_ms,
            "planned_switched_rel_error": None if switched is None else switched.rel_error,
            "planned_switched_graph_ms": None if switched is None else switched.graph_ms,
            "planned_switched_graph_error": None if switched is None else switched.graph_error,
            "backend_counts_switched": None if by_layer_switched is None else dict(Counter(by_layer_switched.values())),
            "off_cudnn_switched": None if by_layer_switched is None else {
                name: backend for name, backend in by_layer_switched.items() if backend != "cudnn"}}


def switched_input_layouts(model: nn.Module, switch: str, x: torch.Tensor) -> dict[str, str]:
    """SparseConv name -> the layout (``"nchw"``, ``"nhwc"``: :func:`~unsparse.runtime.layout.layout_of`) of the
    input it receives when ``model`` is fed ``x`` switched to channels-last after its module ``switch``
    (:func:`~unsparse.runtime.layout.channels_last_after`), in module order; a layer not called is left out. One
    forward pass under ``torch.no_grad()``; ``model`` is not modified."""
    layouts: dict[str, str] = {}

    def record(name: str, x: torch.Tensor) -> None:  # a pre-hook returning a value would replace the input
        layouts.setdefault(name, layout_of(x))

    layers = sparse_layers(model)
    hooks = [(layer, lambda layer, inputs, name=name: record(name, inputs[0])) for name, layer in layers.items()]
    with channels_last_after(model, switch):
        forward_with_pre_hooks(model, x, hooks)
    return {name: layouts[name] for name in layers if name in layouts}


def switched_backends(by_layer: dict[str, str], by_layer_nhwc: dict[str, str],
                      input_layouts: dict[str, str]) -> dict[str, str]:
    """Layer name -> backend label of a planned model switched to channels-last after its first max pool: a layer
    looks its plan entry up by the layout of the input it receives (``input_layouts``, :func:`switched_input_layouts`),
    so it reads the NCHW plan's label (``by_layer``, :func:`~unsparse.runtime.comparator.planned_backends`) where that
    input is NCHW and the channels-last plan's (``by_layer_nhwc``) where it is channels-last. In ``by_layer``'s order;
    a layer not called, or without a label in the plan it reads, is left out."""
    plans = {"nchw": by_layer, "nhwc": by_layer_nhwc}
    return {name: plans[input_layouts[name]][name] for name in by_layer
            if name in input_layouts and name in plans[input_layouts[name]]}


def _plan_check_fold(model: nn.Module, x: torch.Tensor, plan: Plan, backends: list[str] | None, runs: int,
                     fold_into_epilogues: bool, checkpoint: Callable[[Plan], Any] | None = None,
                     ) -> tuple[Plan, list[LayerComparison], PlanCheck]:
    """:func:`~unsparse.runtime.comparator.plan_model` on ``model`` (mutated: planned) and
    :func:`~unsparse.runtime.comparator.check_plan`; then with ``fold_into_epilogues``
    :func:`~unsparse.runtime.batch_norm_folding.fold_batch_norm_into_epilogues_` by the checked plan. The layers keep
    their keys, so each folded layer runs the very entry its fold was decided on (a layer the check set back to cuDNN
    keeps its BatchNorm); for the same reason no fusion that folding exposes is made (a ReLU after a folded BatchNorm
    stays a pass: fusing it would re-key the layer onto an entry of its own, possibly one that adds the bias in a
    pass). The check compares the unfolded plan with the unfolded dense default; the folds then only take passes
    out of the planned side. ``checkpoint``: :func:`~unsparse.runtime.comparator.plan_model`'s, called with the plan
    after each new entry. Returns the plan, the comparisons made and the check."""
    plan, comparisons = plan_model(model, x, plan, backends, checkpoint)
    check = check_plan(model, x, plan, comparisons, runs)
    if fold_into_epilogues:
        fold_batch_norm_into_epilogues_(model, plan)
    return plan, comparisons, check


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def channels_last_copy(dense: nn.Module) -> nn.Module:
    """A copy of ``dense`` with its 4-D parameters in channels-last (``Module.to(memory_format=...)``); fed an NHWC
    input, every activation stays NHWC from end to end. ``dense`` is not modified."""
    return copy.deepcopy(dense).to(memory_format=torch.channels_last)


def dense_channels_last(dense: nn.Module, x: torch.Tensor, dense_out: torch.Tensor,
                        runs: int) -> tuple[nn.Module, Timing, float]:
    """:func:`channels_last_copy` of ``dense``, its eager timing (ms) on ``x`` in channels-last, and the relative
    error of its output against ``dense_out`` (NCHW run)."""
    model = channels_last_copy(dense)
    x = x.contiguous(memory_format=torch.channels_last)
    error = relative_error(model(x).double(), dense_out.double())
    return model, time_fn(lambda i: model(x), x.device, runs=runs), error


def dense_fused_timings(dense: nn.Module, x: torch.Tensor, dense_out: torch.Tensor, runs: int,
                        bound: float, fold_batch_norm: bool = False) -> dict[str, Any]:
    """The dense model with each convolution, its bias and its ReLU as one cuDNN call
    (:func:`~unsparse.runtime.dense_fusion.fuse_dense_conv_relu`, through the model's FX graph: VGG's, and ResNet's
    and GoogLeNet's where their BatchNorms are folded), timed eagerly in NCHW and in channels-last
    (:func:`channels_last_copy`): a dense baseline that fuses what the eager one runs as separate passes; with
    ``fold_batch_norm``, a copy of ``dense`` with its BatchNorms folded into the convolutions first
    (:func:`~unsparse.runtime.batch_norm_folding.fold_batch_norm_`; ``dense`` is not modified). Call it under
    ``torch.no_grad()``.

    Returns:
        ``dense_fused_convs`` (how many convolutions take their ReLU), ``dense_folded_batch_norm`` (how many take
        their BatchNorm), ``dense_fused_ms`` and ``dense_fused_nhwc_ms``
        (medians, ms; None where nothing is fused or folded, the output's relative error against ``dense_out`` exceeds
        ``bound``, or cuDNN refused the fused call), ``dense_fused_rel_error`` and ``dense_fused_nhwc_rel_error``
        (None where nothing is fused or it was refused), ``dense_fused_error``: the refusal (a ``RuntimeError``'s
        first line; no fused engine for a layer, say), else None; ``dense_fused_graph_ms`` and
        ``dense_fused_nhwc_graph_ms``: the same models replayed as CUDA graphs (:func:`time_graph`; GPU time without
        the host's per-layer work, which :func:`graph_timings` gives the planned model too), None where the eager
        median is None, off CUDA, or where the capture failed (``dense_fused_graph_error`` says why);
        ``dense_fused_passes`` and ``dense_fused_nhwc_passes``: how many fused convolutions of each layout run their
        epilogue as passes after cuDNN's convolution, timed faster than cuDNN's fused call on this input
        (:func:`~unsparse.runtime.dense_fusion.choose_epilogues_`, 0 off CUDA), as the planned model's ``cudnn``
        layers may (None where nothing is fused); ``dense_fused_switched_ms`` and ``dense_fused_switched_rel_error``:
        the fused model fed NCHW, NCHW up to its first max pool and channels-last after it
        (:func:`switched_dense_timing`; ``dense_fused_layout_switch`` the pool's name), None where the model calls
        no max pool or ``x`` has one channel (the median also where the error exceeds ``bound``);
        ``dense_fused_switched_error``: a ``RuntimeError`` of that model's run, which leaves the single-layout times
        recorded.
    """
    source = copy.deepcopy(dense) if fold_batch_norm else dense
    folded = len(fold_batch_norm_(source)) if fold_batch_norm else 0
    fused, count = fuse_dense_conv_relu(source)
    record: dict[str, Any] = {"dense_fused_convs": count, "dense_folded_batch_norm": folded, **dict.fromkeys(
        ("dense_fused_passes", "dense_fused_nhwc_passes", "dense_fused_ms", "dense_fused_nhwc_ms",
         "dense_fused_rel_error", "dense_fused_nhwc_rel_error",
         "dense_fused_error", "dense_fused_graph_ms", "dense_fused_nhwc_graph_ms", "dense_fused_graph_error")),
        **_switched_fields("dense_fused")}
    if not count and not folded:
        return record

    def timed(tag: str, model: nn.Module, inputs: torch.Tensor) -> tuple[Callable[[], Any], Timing, float]:
        record[f"dense_fused{tag}_passes"] = choose_epilogues_(model, inputs, runs)
        return (lambda: model(inputs), time_fn(lambda i: model(inputs), x.device, runs=runs),
                relative_error(model(inputs).double(), dense_out.double()))

    fused_nhwc = channels_last_copy(fused)
    try:
        timings = {"": timed("", fused, x),
                   "_nhwc": timed("_nhwc", fused_nhwc, x.contiguous(memory_format=torch.channels_last))}
    except RuntimeError as error:
        record["dense_fused_error"] = _first_line(error)
        return record
    record |= switched_dense_timing(fused, fused_nhwc, x, dense_out, runs, bound, "dense_fused")
    for tag, (forward, timing, error) in timings.items():
        record[f"dense_fused{tag}_rel_error"] = error
        if error > bound:
            continue
        record[f"dense_fused{tag}_ms"] = timing.median_ms
        if x.device.type != "cuda":
            record["dense_fused_graph_error"] = f"no CUDA graphs on {x.device.type}"
            continue
        try:
            record[f"dense_fused{tag}_graph_ms"] = time_graph(forward, x.device, runs).median_ms
        except RuntimeError as error:
            record["dense_fused_graph_error"] = f"capture failed: {error}"
    return record


def _first_line(error: Exception) -> str:
    """``"RuntimeError: <first line>"``: an error as a record keeps it."""
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def switched_dense_timing(model_nchw: nn.Module, model_nhwc: nn.Module, x: torch.Tensor, reference: torch.Tensor,
                          runs: int, bound: float, prefix: str) -> dict[str, Any]:
    """A dense model timed switched to channels-last after its first max pool (:func:`_switched_dense` of its NCHW
    and channels-last copies ``model_nchw``, ``model_nhwc``; fed NCHW ``x``), its output compared with ``reference``.

    Returns:
        ``{prefix}_switched_ms`` (eager median, ms; None where the model calls no max pool, ``x`` has one channel (it
        cannot carry channels-last), the run raised, or the relative error exceeds ``bound``),
        ``{prefix}_switched_rel_error``, ``{prefix}_layout_switch`` (the pool's name), ``{prefix}_switched_error``
        (a ``RuntimeError``'s first line, say cuDNN's refusal of a fused call: the single-layout times stay
        recorded), ``{prefix}_switched_graph_ms`` and ``{prefix}_switched_graph_error`` (:class:`SwitchedTiming`;
        since the fifty-third session), each None where not applicable.
    """
    record = _switched_fields(prefix)
    if layout_of(x.contiguous(memory_format=torch.channels_last)) != "nhwc":
        return record
    try:
        switched = _switched_dense(model_nchw, model_nhwc, x)
        if switched is not None:
            timing = _switched_timing(*switched, x, reference, runs)
            record |= {f"{prefix}_layout_switch": switched[1], f"{prefix}_switched_rel_error": timing.rel_error,
                       f"{prefix}_switched_ms": timing.eager.median_ms if timing.rel_error <= bound else None,
                       f"{prefix}_switched_graph_ms": timing.graph_ms,
                       f"{prefix}_switched_graph_error": timing.graph_error}
    except RuntimeError as error:
        record[f"{prefix}_switched_error"] = _first_line(error)
    return record


def _switched_fields(prefix: str) -> dict[str, Any]:
    """The fields :func:`switched_dense_timing` returns for a dense model named ``prefix``, each None: a record's
    defaults, also where nothing was timed switched."""
    return dict.fromkeys(f"{prefix}_{field}" for field in ("switched_ms", "switched_rel_error", "layout_switch",
                                                           "switched_error", "switched_graph_ms",
                                                           "switched_graph_error"))


def _switched_dense(model_nchw: nn.Module, model_nhwc: nn.Module,
                    x: torch.Tensor) -> tuple[nn.Module, str] | None:
    """A dense model fed NCHW that switches to channels-last after its first max pool: a copy of ``model_nhwc`` (the
    channels-last copy of ``model_nchw``, weights channels-last and epilogue choices made on channels-last inputs)
    whose modules called before the switch (:func:`~unsparse.runtime.layout.layout_switch` on NCHW ``x``) are
    replaced by copies of ``model_nchw``'s, NCHW weights and choices made on NCHW inputs; so each side computes in
    its own layout with weights of that layout (no weight converted per call). With the switch's name; None where the
    model calls no max pool. Neither model is modified."""
    switch, head = layout_switch(model_nchw, x)
    if switch is None:
        return None
    model = copy.deepcopy(model_nhwc)
    for name in head:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, copy.deepcopy(model_nchw.get_submodule(name)))
    return model, switch


class SwitchedTiming(NamedTuple):
    """A model fed NCHW and switched to channels-last after one of its modules, timed (:func:`_switched_timing`).

    Attributes:
        eager: its eager timing (ms).
        rel_error: its output's relative error against the reference.
        graph_ms: its CUDA-graph median (ms, :func:`~unsparse.runtime.timing.time_graph`), None where there is none.
        graph_error: why there is none: not CUDA, or the capture failed.
    """

    eager: Timing
    rel_error: float
    graph_ms: float | None
    graph_error: str | None


def _switched_timing(model: nn.Module, switch: str, x: torch.Tensor, reference: torch.Tensor,
                     runs: int) -> SwitchedTiming:
    """``model`` fed NCHW ``x``, switched to channels-last after its module ``switch``
    (:func:`~unsparse.runtime.layout.channels_last_after`): its eager timing, its output's relative error against
    ``reference``, and its CUDA-graph time (the hook's conversion is captured with the layers)."""
    graph_ms, graph_error = None, f"no CUDA graphs on {x.device.type}"
    with channels_last_after(model, switch):
        error = relative_error(model(x).double(), reference.double())
        eager = time_fn(lambda i: model(x), x.device, runs=runs)
        if x.device.type == "cuda":
            try:
                graph_ms, graph_error = time_graph(lambda: model(x), x.device, runs).median_ms, None
            except RuntimeError as capture_error:
                graph_error = f"capture failed: {capture_error}"
    return SwitchedTiming(eager, error, graph_ms, graph_error)


def bench_end_to_end_sparse(model: nn.Module, input_shape: Sequence[int], batch: int, device: torch.device,
                            runs: int, plan: Plan) -> dict[str, Any]:
    """A model that is already sparse (loaded from a file): its dense fallback (cuDNN, NCHW) vs its plan. Each layer
    planned now also records cuDNN's convolution alone in its faster layout (``baseline``); the whole model runs in NCHW
    only: the trained models take one-channel images, which cannot carry the channels-last layout
    (:func:`~unsparse.runtime.layout.layout_of`). The plan is checked end to end against the dense default right after
    planning (:func:`~unsparse.runtime.comparator.check_plan`, ``plan_check``), as in :func:`bench_end_to_end`. Then
    both are timed one after the other, eagerly (``dense_ms``, ``planned_ms``) and as CUDA graphs
    (:func:`graph_timings`): a small trained model is host-bound eagerly (the H200 run of the twenty-fourth session:
    0.13 ms of GPU time per forward against 0.5-1.2 ms of host time), so only the graph times tell its kernels apart.

    ``layers``: one record per layer key planned now: ``key``, ``best`` (the backend of the fastest correct time),
    ``planned`` (the backend the plan kept for the key after the check: the dense default where the fastest did not
    beat it by :data:`~unsparse.runtime.comparator.PLAN_MARGIN`, or where the check set the plan back), ``best_ms``
    (each backend's fastest median, ms) and ``baseline``.
    """
    layers = sparse_layers(model)
    dtype = next(iter(layers.values())).values.dtype if layers else torch.float32
    precision = "fp16" if dtype == torch.float16 else "fp32"
    with precision_mode(False):
        x = torch.randn(batch, *input_shape, device=device, dtype=dtype)
        set_backend(model, "cudnn")
        with torch.no_grad():
            dense_out = model(x)
        reused_before = len(plan.entries)
        plan, comparisons = plan_model(model, x, plan, baseline=True)
        check = check_plan(model, x, plan, comparisons, runs)

        def dense_forward() -> torch.Tensor:
            with temporary_backend(model, "cudnn"):
                return model(x)

        with torch.no_grad():
            sparse_out = model(x)
            with temporary_backend(model, "cudnn"):  # set once: per call it would add host time to the dense side
                dense_t = time_fn(lambda i: model(x), device, runs=runs)
            sparse_t = time_fn(lambda i: model(x), device, runs=runs)
            graphs = graph_timings(dense_forward, lambda: model(x), device, runs)
    layer_records = []
    for comparison in comparisons:
        best = comparison.best
        layer_records.append({"key": comparison.key, "best": None if best is None else best.backend,
                              "planned": plan.entries[comparison.key].backend,
                              "best_ms": best_times(comparison, sorted({m.backend for m in comparison.measurements})),
                              "baseline": comparison.baseline.to_dict()})
    return {"batch": batch, "precision": precision, "dense_ms": dense_t.median_ms, "planned_ms": sparse_t.median_ms,
            "speedup": dense_t.median_ms / sparse_t.median_ms, "layers": layer_records,
            "rel_error": relative_error(sparse_out.double(), dense_out.double()),
            "tolerance": 10 * tolerance(dtype), **planning_summary(comparisons),
            "plan_entries_reused": reused_before, "plan_check": asdict(check), "dense_timing": dense_t.to_dict(),
            "planned_timing": sparse_t.to_dict(), **graphs}
