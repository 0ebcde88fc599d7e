"""``compile_ahead``: the benchmark compiles every layer's generated kernels in one pass before it times any."""

from __future__ import annotations

import sys

import pytest
import torch

from unsparse.runtime import bench
from unsparse.runtime import generated_source as gs
from unsparse.runtime.backends import generated, get_backend
from unsparse.runtime.backends.generated import GeneratedBackend
from unsparse.sparse.format import UniformCSR
from unsparse.sparse.geometry import ConvGeometry


def conv_layer(name: str, out_channels: int, channels: int, stride: int = 1, dilation: int = 1) -> bench.ConvLayer:
    generator = torch.Generator().manual_seed(out_channels)
    weight = torch.randn(out_channels, channels, 3, 3, generator=generator)
    weight *= torch.rand(weight.shape, generator=generator) < 0.3
    return bench.ConvLayer(name, weight, None, ConvGeometry.of(stride, 1, dilation), (channels, 10, 10), 1, False)


@pytest.fixture
def compiles(monkeypatch: pytest.MonkeyPatch) -> list[list[tuple[str, str]]]:
    """The generated backend on the CPU, with the kernel lists handed to ``compile_all`` recorded, not compiled."""
    monkeypatch.setattr(GeneratedBackend, "device_types", frozenset({"cpu", "cuda"}))
    monkeypatch.setitem(sys.modules, "cupy", object())
    calls: list[list[tuple[str, str]]] = []

    def record(kernels: list[tuple[str, str]], deadline: float | None = None) -> list[str]:
        calls.append(kernels)
        return ["kernel"] * len(kernels)

    monkeypatch.setattr(generated, "compile_all", record)
    return calls


def test_every_supported_layer_is_compiled_in_one_pass(compiles) -> None:
    layers = [conv_layer("a", 40, 8), conv_layer("b", 160, 16), conv_layer("strided", 40, 8, stride=2),
              conv_layer("dilated", 40, 8, dilation=2)]
    ahead = bench.compile_ahead(layers, ["fp32_generated", "tf32_generated", "fp32"], torch.device("cpu"))
    backend = generated.GeneratedBackend()
    expected, every = [], []
    for layer in layers[:3]:
        csr = UniformCSR.from_dense(layer.weight)
        x = torch.empty(1, *layer.in_chw)
        space = backend.tuning_space(x, csr, layer.geometry)
        expected += backend.kernel_sources(x, csr, layer.geometry, [p for p in space if p["programs"] == 1],
                                           probes=True)
        every += backend.kernel_sources(x, csr, layer.geometry, space)
    assert len(compiles) == 1
    # the two float32 precisions list each layer's probes once, one kernel per setting of one program per kernel
    # (the stride-2 layer's, of its phase split, too); the rest of each setting's kernels and those of several
    # programs wait for its comparison (its estimates), and the dilated layer, which the backend refuses, and the
    # direct backend of "fp32" add none
    assert sorted(compiles[0]) == sorted(expected) and set(expected) < set(every)
    assert {entry for _, entry in every} == {gs.ENTRY, gs.SHARED_ENTRY}
    assert {entry for _, entry in compiles[0]} == {gs.ENTRY}
    assert ahead["layers"] == 3 and ahead["kernels"] == len(set(expected)) and ahead["seconds"] >= 0
    assert ahead["skipped"] == 0


def test_each_dtype_lists_a_layers_kernels_once(compiles) -> None:
    """FP32 and TF32 compute in float32 and time the same kernels; FP16's kernels are its own, listed beside them."""
    layer = conv_layer("a", 40, 8)
    bench.compile_ahead([layer], ["fp32_generated", "fp16_generated", "tf32", "fp16"], torch.device("cpu"),
                        also=["generated"])
    backend = generated.GeneratedBackend()
    per_dtype = []
    for dtype in (torch.float32, torch.float16):
        csr, x = UniformCSR.from_dense(layer.weight.to(dtype)), torch.empty(1, *layer.in_chw, dtype=dtype)
        per_dtype.append(backend.kernel_sources(x, csr, layer.geometry, backend.screen_space(x, csr, layer.geometry),
                                                probes=True))
    assert not set(per_dtype[0]) & set(per_dtype[1])
    assert len(compiles) == 1 and sorted(compiles[0]) == sorted(per_dtype[0] + per_dtype[1])


def test_nothing_is_compiled_without_a_backend_that_lists_its_kernels(compiles) -> None:
    ahead = bench.compile_ahead([conv_layer("a", 40, 8)], ["fp32", "fp16"], torch.device("cpu"))
    assert compiles == [] and ahead["kernels"] == 0 and ahead["layers"] == 0 and ahead["skipped"] == 0


def test_the_deadline_reaches_compile_all_and_the_kernels_left_are_counted_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each distinct kernel that ``compile_all`` did not start by the deadline counts once in ``skipped``, though
    both float32 precisions list it (a 70-channel layer has a probe of 32, 64 and 128 rows)."""
    monkeypatch.setattr(GeneratedBackend, "device_types", frozenset({"cpu", "cuda"}))
    monkeypatch.setitem(sys.modules, "cupy", object())
    deadlines: list[float | None] = []

    def compile_the_first_two(kernels: list[tuple[str, str]], deadline: float | None = None) -> list[str | None]:
        deadlines.append(deadline)
        first = list(dict.fromkeys(kernels))[:2]
        return ["kernel" if kernel in first else None for kernel in kernels]

    monkeypatch.setattr(generated, "compile_all", compile_the_first_two)
    ahead = bench.compile_ahead([conv_layer("a", 70, 8)], ["fp32_generated", "tf32_generated"], torch.device("cpu"),
                                deadline=12.5)
    assert deadlines == [12.5] and ahead["kernels"] > 2 and ahead["skipped"] == ahead["kernels"] - 2


def test_the_settings_a_plan_chose_compile_ahead_with_the_probes(compiles) -> None:
    """A resumed run's planned layers: each layer whose input plane and weight a plan's ``generated`` entry names
    (whatever that entry's batch, epilogue or TF32 flags) has that setting's kernels compiled ahead from its own
    weights, beside every layer's probes; an entry of another backend, of no layer key, or of a setting the layer's
    tuning space does not offer (a tampered plan) adds none."""
    from unsparse.runtime.plan import Plan, PlanEntry, layer_key

    layers = [conv_layer("a", 160, 16), conv_layer("b", 40, 8), conv_layer("a_again", 160, 16)]
    layers[2] = bench.ConvLayer("a_again", -layers[0].weight, None, layers[0].geometry, layers[0].in_chw, 1, False)
    backend = generated.GeneratedBackend()
    csrs = [UniformCSR.from_dense(layer.weight) for layer in layers]
    xs = [torch.empty(1, *layer.in_chw) for layer in layers]
    space = backend.tuning_space(xs[0], csrs[0], layers[0].geometry)
    shared = max(space, key=lambda params: params["programs"])
    assert shared["programs"] > 1
    key = layer_key(torch.empty(128, *layers[0].in_chw), csrs[0], layers[0].geometry, device="a GPU", relu=True)
    other = layer_key(torch.empty(128, *layers[1].in_chw), csrs[1], layers[1].geometry, device="a GPU")
    tampered = layer_key(torch.empty(2, *layers[1].in_chw), csrs[1], layers[1].geometry, device="a GPU")
    plan = Plan({key: PlanEntry("generated", shared, 0.1), other: PlanEntry("direct", {"variant": "tile"}, 0.1),
                 "not a layer key": PlanEntry("generated", shared, 0.1),
                 tampered: PlanEntry("generated", {"rows": 10**9, "programs": 1}, 0.1)})
    ahead = bench.compile_ahead(layers, ["fp32_generated"], torch.device("cpu"), plans=[plan, plan])
    probes = [kernel for layer, csr, x in zip(layers, csrs, xs, strict=True)
              for kernel in backend.kernel_sources(x, csr, layer.geometry,
                                                   backend.screen_space(x, csr, layer.geometry), probes=True)]
    first, again = (backend.kernel_sources(xs[i], csrs[i], layers[i].geometry, [shared]) for i in (0, 2))
    planned = first + again
    assert set(planned).isdisjoint(probes) and set(first).isdisjoint(again)  # each from its layer's own weights
    assert len(compiles) == 1 and sorted(compiles[0]) == sorted(probes + planned)
    assert ahead["planned_layers"] == 2 and ahead["kernels"] == len(set(probes + planned))


def test_shared_compiles_each_unplanned_layers_kernels_of_several_programs_and_a_planned_layers_choice(
        compiles) -> None:
    """With ``shared`` a layer no plan entry names gets its kernels of several programs ahead beside its probes (its
    other one-program kernels still wait for the screen); a layer a plan entry names gets its probes and the chosen
    setting's kernels only, as without the flag; a refused layer gets none."""
    from unsparse.runtime.plan import Plan, PlanEntry, layer_key

    layers = [conv_layer("planned", 40, 8), conv_layer("new", 160, 16), conv_layer("dilated", 40, 8, dilation=2)]
    backend = generated.GeneratedBackend()
    csrs = [UniformCSR.from_dense(layer.weight) for layer in layers[:2]]
    xs = [torch.empty(1, *layer.in_chw) for layer in layers[:2]]
    spaces = [backend.tuning_space(x, csr, layer.geometry) for x, csr, layer in zip(xs, csrs, layers, strict=False)]
    chosen = spaces[0][0]
    plan = Plan({layer_key(torch.empty(128, *layers[0].in_chw), csrs[0], layers[0].geometry, device="a GPU"):
                 PlanEntry("generated", chosen, 0.1)})
    ahead = bench.compile_ahead(layers, ["fp32_generated"], torch.device("cpu"), plans=[plan], shared=True)
    probes = [kernel for x, csr, layer in zip(xs, csrs, layers, strict=False)
              for kernel in backend.kernel_sources(x, csr, layer.geometry,
                                                   backend.screen_space(x, csr, layer.geometry), probes=True)]
    planned = backend.kernel_sources(xs[0], csrs[0], layers[0].geometry, [chosen])
    several = backend.kernel_sources(xs[1], csrs[1], layers[1].geometry, [p for p in spaces[1] if p["programs"] > 1])
    assert gs.SHARED_ENTRY in {entry for _, entry in several}  # (and the one-program rest of 5 programs of 32 rows)
    assert len(compiles) == 1 and sorted(compiles[0]) == sorted(probes + planned + several)
    assert ahead["shared"] is True and ahead["planned_layers"] == 1 and ahead["layers"] == 2
    assert ahead["kernels"] == len(set(probes + planned + several))
    for x, csr, layer, space in zip(xs, csrs, layers, spaces, strict=False):  # the rest waits for the screen
        assert not set(backend.kernel_sources(x, csr, layer.geometry, space)) <= set(compiles[0])
    compiles.clear()
    assert bench.compile_ahead(layers, ["fp32_generated"], torch.device("cpu"))["shared"] is False
    assert set(compiles[0]).isdisjoint(several)


def test_a_kernel_signature_keeps_what_the_source_holds() -> None:
    """Batch, GPU, TF32 flags, epilogue and layout go; the plane, weight, row length and geometry stay."""
    key = "H200|float32+tf32|x=128x64x56x56|w=64x64x3x3|L=71|s=1x1|p=1x1|d=1x1|g=1|dims=2|epilogue=relu|fmt=nhwc"
    signature = bench.kernel_signature(key)
    assert signature == ("float32", "64x56x56", "w=64x64x3x3", "L=71", "s=1x1", "p=1x1", "d=1x1", "g=1", "dims=2")
    assert bench.kernel_signature("cpu|float32|x=1x64x56x56|w=64x64x3x3|L=71|s=1x1|p=1x1|d=1x1|g=1|dims=2") == signature
    assert bench.kernel_signature(key.replace("L=71", "L=72")) != signature
    assert bench.kernel_signature(key.replace("float32+tf32", "float16")) != signature
    assert bench.kernel_signature("x") == ("", "") and bench.kernel_signature("a|b|c") == ("b", "")


def test_a_whole_model_keeps_every_conv_with_its_own_weights() -> None:
    """Merged, the two equal 3x3 convs of a small model are one layer of count 2 (a per-layer benchmark times the
    shape once); unmerged, as a whole model's compile ahead needs them, each is its own layer with its own weights, in
    call order, the first marked stem."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Conv2d(8, 8, 3, padding=1),
                                torch.nn.Conv2d(8, 8, 3, padding=1))
    merged = bench.conv_layers(model, (3, 10, 10))
    assert [(layer.name, layer.count) for layer in merged] == [("0", 1), ("1", 2)]
    whole = bench.conv_layers(model, (3, 10, 10), merge=False)
    assert [(layer.name, layer.count, layer.stem) for layer in whole] == [("0", 1, True), ("1", 1, False),
                                                                         ("2", 1, False)]
    for layer, module in zip(whole, model, strict=True):
        assert torch.equal(layer.weight, module.weight)


def test_a_plan_chooses_among_cudnn_its_precisions_backend_and_those_added_each_once() -> None:
    assert bench.plan_backends("fp32") == ["cudnn", "direct"]
    assert bench.plan_backends("fp32", ["generated"]) == ["cudnn", "direct", "generated"]
    assert bench.plan_backends("fp32_generated", ["direct", "generated"]) == ["cudnn", "generated", "direct"]
    assert bench.plan_backends("fp16_half2", ["cudnn"]) == ["cudnn", "direct_half2"]


def test_a_backend_that_cannot_run_the_precisions_dtype_is_not_offered_nor_named(monkeypatch) -> None:
    """``direct_half2`` runs float16 only: at ``fp32`` and ``tf32`` it would refuse every layer, so a run's plan and
    its label (``sparse_backends``) leave it out there, and keep it at ``fp16``; its layers say why on their own."""
    assert bench.plan_backends("fp32", ["direct_half2", "generated"]) == ["cudnn", "direct", "generated"]
    assert bench.plan_key("tf32", ["direct_half2"]) == bench.plan_key("tf32") == "direct"
    assert bench.plan_backends("fp16", ["direct_half2"]) == ["cudnn", "direct", "direct_half2"]
    half2 = get_backend("direct_half2")
    monkeypatch.setattr(type(half2), "device_types", frozenset({"cpu"}))  # past the device check, to the dtype's
    x, csr = torch.zeros(1, 4, 6, 6), UniformCSR.from_dense(torch.randn(4, 4, 3, 3))
    assert half2.unsupported_reason(x, csr, ConvGeometry.of(1, 1)) == (
        "direct_half2 runs torch.float16 inputs only, not torch.float32")
    csr16 = UniformCSR.from_dense(torch.randn(4, 4, 3, 3, dtype=torch.float16))
    assert "inputs only" not in (half2.unsupported_reason(x.half(), csr16, ConvGeometry.of(1, 1)) or "")  # CuPy's


def test_plans_among_the_same_backends_share_a_key_and_the_plan_files_is_direct_alone() -> None:
    assert bench.plan_key("fp32") == bench.plan_key("tf32") == bench.plan_key("fp16", ["direct"]) == "direct"
    assert bench.plan_key("fp32", ["generated"]) == bench.plan_key("fp32_generated", ["direct"]) == "direct+generated"
    assert bench.plan_key("fp16_half2") == "direct_half2"


def test_a_backend_added_to_a_precision_compiles_its_kernels_ahead_too(compiles) -> None:
    """At ``fp32`` alone nothing compiles ahead (``direct`` lists no kernels); with ``generated`` added, as whole
    models planned on both do, its kernels of each layer it supports are compiled in the one pass."""
    layers = [conv_layer("a", 40, 8), conv_layer("dilated", 40, 8, dilation=2)]
    assert bench.compile_ahead(layers, ["fp32"], torch.device("cpu"))["kernels"] == 0
    ahead = bench.compile_ahead(layers, ["fp32"], torch.device("cpu"), also=["generated"])
    backend = generated.GeneratedBackend()
    csr, x = UniformCSR.from_dense(layers[0].weight), torch.empty(1, *layers[0].in_chw)
    expected = backend.kernel_sources(x, csr, layers[0].geometry, backend.screen_space(x, csr, layers[0].geometry),
                                      probes=True)
    assert compiles == [expected] and ahead["layers"] == 1 and ahead["kernels"] == len(set(expected))


@pytest.mark.parametrize(("setting", "message"), [
    (["cudnn"], r"end_to_end_backends: \['cudnn'\] not among direct, direct_half2, generated$"),
    (["auto"], r"end_to_end_backends: \['auto'\] not among"),  # it would time the plan's own choice as a candidate
    (["im2col_cublas"], r"end_to_end_backends: \['im2col_cublas'\] not among"),
    (["generatd"], r"end_to_end_backends: \['generatd'\] not among .*generated"),
    ("generated", r"end_to_end_backends: expected a list"),
])
def test_the_benchmark_refuses_an_added_backend_that_is_no_sparse_backend(setting: object, message: str) -> None:
    with pytest.raises(bench.BenchRefusedError, match=message):
        bench.check_run_settings(end_to_end_backends=setting)


def conv_batch_norm_relu() -> torch.nn.Sequential:
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                torch.nn.Conv2d(8, 8, 3, padding=1))
    with torch.no_grad():
        model[0].weight *= torch.rand(model[0].weight.shape) < 0.4
        model[1].running_mean.uniform_(-1, 1), model[1].running_var.uniform_(0.5, 2), model[1].weight.uniform_(0.5, 2)
    return model.eval()


def test_a_whole_model_compiled_ahead_with_its_batch_norms_folded_lists_the_kernels_planning_asks_for(
        compiles) -> None:
    """With ``fold_batch_norm="all"`` the whole-model benchmark plans a copy whose BatchNorms are folded into the
    convs' stored values: a generated source written from the unfolded weights would be another kernel. The layers
    compiled ahead carry the folded weights, bit for bit those of the planned sparse copy, in the plan's dtype; the
    model is left as it was, and without folding (or folding after planning) the weights are the model's."""
    from unsparse.runtime.modules import sparse_layers, sparsify

    model = conv_batch_norm_relu()
    weights = [module.weight.detach().clone() for module in (model[0], model[3])]
    layers = bench.end_to_end_layers(model, (3, 6, 6), torch.float32, torch.device("cpu"), "all")
    planned = sparse_layers(sparsify(model, fold_batch_norm=True))
    assert [layer.name for layer in layers] == ["0", "3"]
    for layer, (name, conv) in zip(layers, planned.items(), strict=True):
        assert layer.name == name and torch.equal(layer.weight, conv.csr.to_dense())
        assert torch.equal(layer.bias, conv.bias.detach())
    assert not torch.equal(layers[0].weight, weights[0])  # the BatchNorm scaled it
    assert torch.equal(model[0].weight, weights[0]) and torch.equal(model[3].weight, weights[1])
    backend = generated.GeneratedBackend()
    x = torch.empty(1, *layers[0].in_chw)
    csr = planned["0"].csr
    asked = backend.kernel_sources(x, csr, layers[0].geometry, backend.tuning_space(x, csr, layers[0].geometry))
    bench.compile_ahead(layers[:1], ["fp32_generated"], torch.device("cpu"))
    assert compiles == [asked]
    for policy in ("off", "epilogue"):
        unfolded = bench.end_to_end_layers(model, (3, 6, 6), torch.float32, torch.device("cpu"), policy)
        assert all(torch.equal(layer.weight, weight) for layer, weight in zip(unfolded, weights, strict=True))
    half = bench.end_to_end_layers(model, (3, 6, 6), torch.float16, torch.device("cpu"), "all")
    assert half[0].weight.dtype == torch.float16
    assert torch.equal(half[0].weight, sparse_layers(sparsify(model.half(), fold_batch_norm=True))["0"].csr.to_dense())


def test_whole_models_planned_on_added_backends_compile_per_dtype_and_plan_apart_from_the_plan_file(
        monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """``run_bench`` with ``end_to_end_backends`` (GPU work replaced): the model's kernels compile ahead once per dtype
    when BatchNorms fold before planning (the folded weights differ per dtype), with the added backends; each
    precision plans among cuDNN, its own backend and the added ones, in one plan kept from the plan file and saved
    beside it; each record names its sparse backends."""
    from unsparse.runtime.plan import Plan, PlanEntry

    ahead, folded, planned = [], [], []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "environment", lambda commit=None: {})
    monkeypatch.setattr(bench, "device_name", lambda device: "a GPU")
    monkeypatch.setattr(bench, "build_model", lambda name: conv_batch_norm_relu())

    def layers_of(model, input_shape, dtype, device, fold_batch_norm):
        folded.append((dtype, fold_batch_norm))
        return bench.conv_layers(model, input_shape, False)

    def compile_ahead(layers, precisions, device, deadline=None, also=(), plans=(), shared=False):
        ahead.append((list(precisions), list(also), {id(plan) for plan in plans}, shared))
        return {"layers": 0, "kernels": 0, "skipped": 0, "seconds": 0.0}

    def bench_end_to_end(model, shape, batch, precision, device, runs, plan, backends, *options, checkpoint,
                         channels_last):
        plan.entries[f"layer at {precision}"] = PlanEntry("generated", median_ms=1.0)
        planned.append((precision, backends, id(plan)))
        return {"batch": batch, "precision": precision, "dense_ms": 2.0, "planned_ms": 1.0}

    for name, replacement in (("end_to_end_layers", layers_of), ("compile_ahead", compile_ahead),
                              ("bench_end_to_end", bench_end_to_end), ("evaluate_targets", lambda result: {}),
                              ("plot_results", lambda result, out_dir: []),
                              ("markdown_report", lambda result, plots=(): "page")):
        monkeypatch.setattr(bench, name, replacement)
    result = bench.run_bench(tmp_path, models=[], end_to_end=["vgg16"], precisions=["fp32", "tf32", "fp16"],
                             end_to_end_fold_batch_norm="all", end_to_end_backends=["generated"],
                             compile_shared_kernels=True)
    assert folded == [(torch.float32, "all"), (torch.float16, "all")]
    assert [(precisions, also, every) for precisions, also, _, every in ahead] == [
        (["fp32", "tf32"], ["generated"], True), (["fp16"], ["generated"], True)]
    assert [(precision, backends) for precision, backends, _ in planned] == [
        (precision, ["cudnn", "direct", "generated"]) for precision in ("fp32", "tf32", "fp16")]
    assert len({plan for _, _, plan in planned}) == 1
    assert all(plans == {planned[0][2]} for _, _, plans, _ in ahead)  # the plan the layers will be planned in
    assert [r["sparse_backends"] for r in result["end_to_end"]] == [["direct", "generated"]] * 3
    assert Plan.load(tmp_path / "plan.json").entries == {}
    assert set(Plan.load(tmp_path / "plan_direct+generated.json").entries) == {
        "layer at fp32", "layer at tf32", "layer at fp16"}


def test_a_run_killed_while_planning_a_whole_model_resumes_from_the_layers_planned(
        monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """Every plan is saved after each layer its planning adds (``checkpoint``), so a run killed mid-plan (here a
    KeyboardInterrupt after the first layer) leaves those layers in its plan file, and a second run in the same
    folder starts from them; the direct plan file and the added backends' one stay apart."""
    from unsparse.runtime.plan import Plan, PlanEntry

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "environment", lambda commit=None: {})
    monkeypatch.setattr(bench, "device_name", lambda device: "a GPU")
    monkeypatch.setattr(bench, "build_model", lambda name: conv_batch_norm_relu())
    seen: list[set[str]] = []

    def bench_end_to_end(model, shape, batch, precision, device, runs, plan, backends, *options, checkpoint,
                         channels_last):
        seen.append(set(plan.entries))
        for layer in ("first", "second"):
            if layer not in plan.entries:
                plan.entries[layer] = PlanEntry("generated", median_ms=1.0)
                checkpoint(plan)
                if len(seen) == 1:
                    raise KeyboardInterrupt
        return {"batch": batch, "precision": precision, "dense_ms": 2.0, "planned_ms": 1.0}

    for name, replacement in (("compile_ahead", lambda *args, **kwargs: {"kernels": 0, "skipped": 0}),
                              ("bench_end_to_end", bench_end_to_end), ("evaluate_targets", lambda result: {}),
                              ("plot_results", lambda result, out_dir: []),
                              ("markdown_report", lambda result, plots=(): "page")):
        monkeypatch.setattr(bench, name, replacement)
    Plan({"a direct layer": PlanEntry("direct", median_ms=1.0)}).save(tmp_path / "plan.json")

    def run() -> dict:
        return bench.run_bench(tmp_path, models=[], end_to_end=["vgg16"], precisions=["fp32"],
                               end_to_end_backends=["generated"])

    with pytest.raises(KeyboardInterrupt):
        run()
    assert set(Plan.load(tmp_path / "plan_direct+generated.json").entries) == {"first"}
    assert run()["end_to_end"][0]["planned_ms"] == 1.0
    assert seen == [set(), {"first"}]
    assert set(Plan.load(tmp_path / "plan_direct+generated.json").entries) == {"first", "second"}
    assert set(Plan.load(tmp_path / "plan.json").entries) == {"a direct layer"}


def test_pruned_layers_are_the_named_convs_with_their_own_pruned_weights_in_the_order_asked() -> None:
    """The scripts that time or compile chosen layers (estimate_accuracy, load_distance, time_side_streams) take them
    from one place: the same seed gives the same weights, and a name that is no conv is refused naming it."""
    layers = bench.pruned_layers("alexnet", 0.9, ["features.3", "features.0"])
    assert list(layers) == ["features.3", "features.0"]
    assert layers["features.3"].weight.shape == (192, 64, 5, 5) and layers["features.0"].in_chw == (3, 224, 224)
    density = (layers["features.3"].weight != 0).float().mean().item()
    assert density == pytest.approx(0.1, abs=0.01)
    again = bench.pruned_layers("alexnet", 0.9, ["features.3"])["features.3"]
    assert torch.equal(again.weight, layers["features.3"].weight)
    with pytest.raises(ValueError, match=r"\['classifier.1', 'features.1'\] are not convs of alexnet"):
        bench.pruned_layers("alexnet", 0.9, ["features.1", "features.3", "classifier.1"])
