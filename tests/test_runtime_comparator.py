"""CPU tests of timing, plans, the ``auto`` backend and the comparator (with CPU backends and fakes)."""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest
import torch
from torch import nn

from unsparse.runtime import sparse_layers, sparsify
from unsparse.runtime.backends import base, get_backend
from unsparse.runtime.backends.base import ConvBackend
from unsparse.runtime.backends.dense import DenseBackend
from unsparse.runtime.backends.lowering import LoweringBackend
from unsparse.runtime.backends.reference import ReferenceBackend
from unsparse.runtime.comparator import (
    LayerComparison,
    Measurement,
    check_error,
    check_images,
    check_plan,
    compare_layer,
    plan_model,
    planning_summary,
    relative_error,
    tolerance,
)
from unsparse.runtime.layout import layout_of
from unsparse.runtime.modules import SparseConv
from unsparse.runtime.plan import Plan, PlanEntry, PlanError, layer_key, precision_tag, use_plan
from unsparse.runtime.precision import tf32_flags
from unsparse.runtime.timing import Timing, host_enqueue_ms, host_profile, rotation_count, time_backend, time_fn
from unsparse.sparse import ConvGeometry, UniformCSR, sparse_conv

if TYPE_CHECKING:
    from conftest import VirtualClock


def small_layer(seed: int = 0, batch: int = 3):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(6, 4, 3, 3, generator=gen)
    weight[torch.rand(weight.shape, generator=gen) < 0.7] = 0
    return torch.randn(batch, 4, 10, 9, generator=gen), UniformCSR.from_dense(weight), torch.randn(6, generator=gen)


class Broken(ConvBackend):
    name = "test_broken"
    device_types = frozenset({"cpu"})

    def conv(self, x, csr, bias, geometry, **params: Any) -> torch.Tensor:
        out = get_backend("dense_cpu").conv(x, csr, bias, geometry)
        out[-1, 0, 0, 0] += 1.0  # wrong in the last image only
        return out


class Slow(ConvBackend):
    """Correct settings whose calls cost their ``cost_ms`` where a test charges them to the ``virtual_clock``
    (:func:`costs`), most of them far more than the dense backend."""

    name = "test_slow"
    device_types = frozenset({"cpu"})

    def tuning_space(self, x, csr, geometry) -> list[dict[str, Any]]:
        return [{"cost_ms": ms} for ms in (80.0, 1.0, 100.0, 2.0, 60.0)]

    def conv(self, x, csr, bias, geometry, cost_ms: float = 0.0, **params: Any) -> torch.Tensor:
        """``F.conv2d``, not a registered backend, whose calls would be charged too."""
        return torch.nn.functional.conv2d(x, csr.to_conv2d_weight(), bias, geometry.stride, geometry.padding,
                                          geometry.dilation, geometry.groups)


def costs(**ms: float) -> Callable[[str, UniformCSR, dict[str, Any]], float]:
    """A ``virtual_clock`` cost: ``ms[backend name]`` per call, a setting of a backend not named (:class:`Slow` and
    its subclasses) its ``cost_ms``."""
    return lambda name, csr, params: ms[name] if name in ms else params["cost_ms"]


@pytest.fixture
def fakes(monkeypatch: pytest.MonkeyPatch) -> None:
    for cls in (Broken, Slow):
        monkeypatch.setitem(base._REGISTRY, cls.name, cls)


def test_a_backend_releases_what_it_held_for_its_timings_once_they_are_all_done(monkeypatch: pytest.MonkeyPatch,
                                                                                  fakes: None) -> None:
    """The comparator calls each backend's ``release`` with the layer's weight once, after every setting of that
    backend was checked and timed, not before."""
    events: list[tuple[str, Any]] = []

    class Releasing(Slow):
        name = "test_releasing"

        def conv(self, x, csr, bias, geometry, cost_ms: float = 0.0, **params: Any) -> torch.Tensor:
            events.append(("call", cost_ms))
            return super().conv(x, csr, bias, geometry, cost_ms, **params)

        def release(self, csr: UniformCSR) -> None:
            events.append(("release", csr))

    monkeypatch.setitem(base._REGISTRY, Releasing.name, Releasing)
    x, csr, bias = small_layer(3)
    result = compare_layer(x, csr, bias, ConvGeometry.of(1, 1), ["test_releasing"], runs=2, warmup=0)
    assert result.best is not None and result.best.timing is not None
    assert events[-1] == ("release", csr) and [kind for kind, _ in events].count("release") == 1
    assert {cost for kind, cost in events if kind == "call"} == {80.0, 1.0, 100.0, 2.0, 60.0}


def test_time_fn_counts_runs_and_reports_milliseconds(virtual_clock: VirtualClock) -> None:
    """Run ``i`` takes ``(i + 1) ** 2`` ms on the virtual clock (median 110.5, mean 143.5), each warm-up call 1000 ms
    (not timed)."""
    calls = []

    def fn(i: int) -> None:
        calls.append(i)
        virtual_clock.advance(1000.0 if len(calls) <= 2 else (i + 1.0) ** 2)

    timing = time_fn(fn, "cpu", runs=20, warmup=2, rotation=3)
    assert calls == [0, 1, *range(20)]
    assert timing.runs == 20 and timing.rotation == 3
    assert (timing.min_ms, timing.median_ms, timing.max_ms) == pytest.approx((1.0, 110.5, 400.0))
    with pytest.raises(ValueError, match="runs"):
        time_fn(lambda i: None, "cpu", runs=0)


def test_rotation_count_exceeds_twice_the_cache() -> None:
    assert rotation_count(10, 0) == 1
    count = rotation_count(30 * 2**20, 50 * 2**20)
    assert count * 30 * 2**20 > 100 * 2**20 and (count - 1) * 30 * 2**20 <= 100 * 2**20
    assert rotation_count(1, 2**30, limit=8) == 8
    with pytest.raises(ValueError):
        rotation_count(-1, 0)


def test_time_backend_on_cpu(virtual_clock: VirtualClock) -> None:
    virtual_clock.charge(costs(dense_cpu=1.5), DenseBackend)
    x, csr, bias = small_layer()
    timing = time_backend("dense_cpu", x, csr, bias, ConvGeometry.of(1, 1), runs=20)
    assert timing.runs == 20 and timing.rotation == 1 and timing.median_ms == pytest.approx(1.5)


def test_every_cpu_backend_refuses_a_bias_that_is_not_one_per_output_channel() -> None:
    """The kernels read ``bias[m]`` for every output channel: ``run`` refuses any other shape (the CUDA backends:
    ``tests/gpu``)."""
    x, csr, bias = small_layer()
    for name in ("reference", "dense_cpu", "im2col_cublas"):
        for bad in (bias[:1], bias[:, None], torch.cat([bias, bias])):
            with pytest.raises(ValueError, match=r"bias: shape"):
                get_backend(name).run(x, csr, bad, ConvGeometry.of(1, 1))


def test_compare_layer_rejects_wrong_backend_and_picks_fastest(fakes: None, virtual_clock: VirtualClock) -> None:
    """Five settings of ``test_slow`` are screened and its two fastest (1 and 2 ms) fully timed; the fastest correct
    setting is the 1 ms one, not im2col_cublas (1.5 ms); the wrong backend is never timed."""
    virtual_clock.charge(costs(im2col_cublas=1.5), Slow, LoweringBackend)
    x, csr, bias = small_layer(batch=5)
    result = compare_layer(x, csr, bias, ConvGeometry.of(1, 1), ["test_broken", "test_slow", "im2col_cublas"],
                           runs=20, screen_runs=2, keep=2)
    broken = [m for m in result.measurements if m.backend == "test_broken"]
    assert [m.status for m in broken] == ["wrong"] and broken[0].timing is None
    slow = [m for m in result.measurements if m.backend == "test_slow"]
    assert [m.screen.median_ms for m in slow] == pytest.approx([m.params["cost_ms"] for m in slow])
    assert sorted(m.timing.median_ms for m in slow if m.timing is not None) == pytest.approx([1.0, 2.0])
    assert (result.best.backend, result.best.params) == ("test_slow", {"cost_ms": 1.0})
    assert result.best.median_ms == pytest.approx(1.0)
    assert result.fastest("im2col_cublas").median_ms == pytest.approx(1.5)
    assert json.loads(json.dumps(result.to_dict()))["best"]["backend"] == "test_slow"


class Compiling(Slow):
    """:class:`Slow` with a ``precompile`` that takes 50 ms of wall time."""

    name = "test_compiling"

    def precompile(self, x, csr, geometry, space) -> None:
        time.sleep(0.05)


@pytest.fixture
def compiling(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(base._REGISTRY, Compiling.name, Compiling)
    monkeypatch.setitem(base._INSTANCES, Compiling.name, Compiling())


def test_compare_layer_records_the_seconds_each_backend_compiled(compiling: None) -> None:
    """A backend with ``precompile`` gets its wall seconds in ``compile_s`` (and in the JSON form); one without has no
    entry."""
    x, csr, bias = small_layer()
    result = compare_layer(x, csr, bias, ConvGeometry.of(1, 1), [Compiling.name, "dense_cpu"], runs=1,
                           screen_runs=1)
    assert set(result.compile_s) == {Compiling.name} and 0.05 <= result.compile_s[Compiling.name] < 5
    assert json.loads(json.dumps(result.to_dict()))["compile_s"] == result.compile_s


def test_compare_layer_graph_timing_needs_cuda_and_a_known_mode() -> None:
    x, csr, bias = small_layer()
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA input"):
        compare_layer(x, csr, bias, ConvGeometry.of(1, 1), ["dense_cpu"], runs=3, timing="graph")
    with pytest.raises(ValueError, match="timing: unknown"):
        compare_layer(x, csr, bias, ConvGeometry.of(1, 1), ["dense_cpu"], runs=3, timing="wall")


def test_compare_layer_records_unsupported_backends() -> None:
    x, csr, bias = small_layer()
    result = compare_layer(x, csr, bias, ConvGeometry.of(1, 1), ["direct", "dense_cpu"], runs=3)
    direct = [m for m in result.measurements if m.backend == "direct"]
    assert direct[0].status == "unsupported" and "cuda" in direct[0].reason
    assert result.best.backend == "dense_cpu"


def test_relative_error_and_tolerance() -> None:
    ref = torch.ones(4, dtype=torch.float64)
    assert relative_error(ref.float(), ref) == 0
    assert relative_error(torch.tensor([1.0, 1.0, 1.0, float("nan")]), ref) == float("inf")
    assert relative_error(torch.ones(3), ref) == float("inf")
    assert tolerance(torch.float16) > tolerance(torch.float32) and tolerance(torch.float32, tf32=True) > 1e-4


def test_the_checked_images_are_the_first_the_middle_and_the_last() -> None:
    """Sub-batch starts and tails and both images of a float16 pair (a mutation audit found no test of them)."""
    assert [check_images(batch) for batch in (1, 2, 5, 128)] == [[0], [0, 1], [0, 2, 4], [0, 64, 127]]


def test_check_error_floors_at_the_dtype_resolution() -> None:
    bound = tolerance(torch.float16)
    tiny = torch.full((100,), 3e-7, dtype=torch.float64)  # float16 subnormals: spacing 2**-24 ~ 6e-8
    stored = tiny.half()
    assert relative_error(stored, tiny) > bound  # rounding alone reads as a large relative error
    assert check_error(stored, tiny, bound) <= bound
    off_by_two_steps = stored + 2 * 2.0**-24
    assert check_error(off_by_two_steps.half(), tiny, bound) > bound
    normal = torch.randn(100, dtype=torch.float64)
    assert check_error(normal.half(), normal, bound) == pytest.approx(relative_error(normal.half(), normal))
    assert check_error(normal.float() * 1.01, normal, tolerance(torch.float32)) > tolerance(torch.float32)


def test_plan_json_round_trip_and_validation(tmp_path) -> None:
    plan = Plan({"k1": PlanEntry("direct", {"variant": "rows", "sub_batch": 4}, 1.5, "cudnn")})
    plan.save(tmp_path / "p.json")
    loaded = Plan.load(tmp_path / "p.json")
    assert loaded.to_dict() == plan.to_dict()
    with pytest.raises(PlanError, match="version"):
        Plan.from_dict({"version": 99, "entries": {}})
    with pytest.raises(PlanError, match="backend"):
        Plan.from_dict({"version": 1, "entries": {"k": {"backend": "nope", "params": {}, "median_ms": 1,
                                                           "runner_up": None}}})
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(PlanError, match="JSON"):
        Plan.load(tmp_path / "bad.json")


def entry(**fields) -> dict:
    return {"version": 1, "entries": {"k": {"backend": "reference", "params": {}, "median_ms": 1.0,
                                           "runner_up": None, **fields}}}


@pytest.mark.parametrize(("data", "field"), [
    ({"version": True, "entries": {}}, "version: expected the integer 1"),
    ({"version": 1, "entries": {}, "format": "x"}, "plan: expected the fields"),
    (entry(backend="auto"), r"entries\['k'\].backend: 'auto' is not a backend a plan may name"),
    (entry(params={"images_per_step": {"n": 1}}), r"entries\['k'\].params"),
    (entry(params={"images_per_step": 1.5}), r"entries\['k'\].params"),
    (entry(params=[1]), r"entries\['k'\].params"),
    (entry(median_ms=-1.0), r"entries\['k'\].median_ms"),
    (entry(median_ms="3"), r"entries\['k'\].median_ms"),
    (entry(median_ms=[1]), r"entries\['k'\].median_ms"),
    (entry(median_ms=10**400), r"entries\['k'\].median_ms"),
    (entry(runner_up="nope"), r"entries\['k'\].runner_up"),
])
def test_plan_fields_are_checked_naming_the_field(data, field) -> None:
    """A plan file is untrusted input: each malformed field is refused by name, never loaded (found by a review
    helper fuzzing plans: these loaded, or raised TypeError/OverflowError)."""
    with pytest.raises(PlanError, match=field):
        Plan.from_dict(data)


@pytest.mark.parametrize(("text", "message"), [
    (b'{"version": 1, "entries": {"k": {"backend": "reference", "params": {}, "median_ms": NaN, "runner_up": null}}}',
     "NaN is not JSON"),
    (b'{"version": 1, "version": 1, "entries": {}}', "duplicate keys"),
    (b'\xff\xfe{}', "not a plan file"),
    (b"[" * 100_000 + b"]" * 100_000, "not a plan file"),
])
def test_a_plan_file_that_is_not_strict_json_is_refused_naming_the_file(tmp_path, text, message) -> None:
    path = tmp_path / "plan.json"
    path.write_bytes(text)
    with pytest.raises(PlanError, match=f"plan.json: .*{message}"):
        Plan.load(path)


def test_an_unmeasured_median_is_saved_as_null(tmp_path) -> None:
    Plan({"k": PlanEntry("dense_cpu", {}, math.nan, None)}).save(tmp_path / "p.json")
    data = json.loads((tmp_path / "p.json").read_text(), parse_constant=lambda name: pytest.fail(name))
    assert data["entries"]["k"]["median_ms"] is None
    assert math.isnan(Plan.load(tmp_path / "p.json").get("k").median_ms)


def test_auto_checks_a_planned_entry_against_the_layer_before_running_it(caplog) -> None:
    """An entry's params must be a setting its backend offers for the layer (a negative ``images_per_step`` left the
    reference's output unwritten); a planned backend that cannot run the layer falls back to dense, logged."""
    x, csr, bias = small_layer(seed=6)
    g = ConvGeometry.of(1, 1)
    dense = get_backend("dense_cpu").conv(x, csr, bias, g)
    use_plan(Plan({layer_key(x, csr, g): PlanEntry("reference", {"images_per_step": -1}, 1.0)}))
    with pytest.raises(PlanError, match=r"params: \{'images_per_step': -1\} is not a setting reference offers"):
        sparse_conv(x, csr, bias, g, backend="auto")
    use_plan(Plan({layer_key(x, csr, g): PlanEntry("im2col_cublas", {"bogus": 1}, 1.0)}))
    with pytest.raises(PlanError, match="bogus"):
        sparse_conv(x, csr, bias, g, backend="auto")
    use_plan(Plan({layer_key(x, csr, g): PlanEntry("direct", {}, 1.0)}))  # a CUDA backend, planned for a CPU key
    with caplog.at_level("WARNING"):
        out = sparse_conv(x, csr, bias, g, backend="auto")
    assert torch.equal(out, dense)
    assert any("the plan's direct does not run" in record.getMessage() for record in caplog.records)
    with pytest.raises(ValueError, match="images_per_step"):
        get_backend("reference").conv(x, csr, bias, g, images_per_step=0)


def test_a_grouped_layer_runs_its_planned_dense_setting(monkeypatch) -> None:
    """``auto`` used to send every grouped layer to the dense default with no parameters, whatever its plan said
    (a report naming NHWC for a layer that ran NCHW)."""
    gen = torch.Generator().manual_seed(8)
    weight = torch.randn(6, 2, 3, 3, generator=gen)
    csr, x, g = UniformCSR.from_dense(weight), torch.randn(2, 4, 7, 7, generator=gen), ConvGeometry.of(1, 1, groups=2)
    use_plan(Plan({layer_key(x, csr, g): PlanEntry("dense_cpu", {"memory_format": "channels_last"}, 1.0)}))
    dense = get_backend("dense_cpu")
    computed_in = []
    conv_call = dense.conv_call

    def recording(*args, **params):
        call = conv_call(*args, **params)

        def recorded(x):
            out = call(x)
            computed_in.append(layout_of(out))
            return out

        return recorded

    monkeypatch.setattr(dense, "conv_call", recording)
    out = sparse_conv(x, csr, None, g, backend="auto")
    assert computed_in == ["nhwc"] and layout_of(out) == "nchw"  # the planned setting, converted back by run
    assert torch.allclose(out, torch.nn.functional.conv2d(x, weight, padding=1, groups=2), atol=1e-5)


def test_plan_keys_separate_weight_dtypes_and_cublas_precision() -> None:
    """A float16 weight on a float32 input is another problem for the kernels (the direct ones need equal dtypes),
    and the lowering backends' products follow cuBLAS's TF32 flag, not cuDNN's."""
    x, csr, _ = small_layer()
    g = ConvGeometry.of(1, 1)
    assert layer_key(x, csr.to(dtype=torch.float16), g) == layer_key(x, csr, g) + "|wdtype=float16"
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    try:
        tags = set()
        for cudnn, matmul in ((False, False), (True, True), (False, True), (True, False)):
            torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = cudnn, matmul
            tags.add(precision_tag(torch.float32, "cuda"))
        assert tags == {"float32", "float32+tf32", "float32+matmul_tf32", "float32+tf32+matmul_fp32"}
        assert precision_tag(torch.float32, "cpu") == "float32"
        for cudnn, matmul in ((False, True), (True, False), (True, True), (False, False)):  # the C getters' reads
            torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = cudnn, matmul
            assert tf32_flags() == (cudnn, matmul)
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def test_layer_key_separates_batch_dtype_shape_and_geometry() -> None:
    x, csr, _ = small_layer()
    g = ConvGeometry.of(1, 1)
    keys = {layer_key(x, csr, g), layer_key(x[:2], csr, g), layer_key(x.double(), csr.to(dtype=torch.float64), g),
            layer_key(x, csr, ConvGeometry.of(2, 1)), layer_key(x, csr, g, device="NVIDIA H100")}
    assert len(keys) == 5 and "cpu" in layer_key(x, csr, g)


def test_auto_backend_follows_plan_and_falls_back(fakes: None) -> None:
    x, csr, bias = small_layer(seed=4)
    g = ConvGeometry.of(1, 1)
    missing = sparse_conv(x, csr, bias, g, backend="auto")
    dense = get_backend("dense_cpu").conv(x, csr, bias, g)
    assert torch.equal(missing, dense)
    use_plan(Plan({layer_key(x, csr, g): PlanEntry("test_broken", {}, 1.0)}))
    planned = sparse_conv(x, csr, bias, g, backend="auto")
    assert not torch.equal(planned, dense)  # the (deliberately wrong) planned backend really ran


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, stride=2),
                                  nn.Conv2d(8, 4, 1))
        self.conv1d = nn.Conv1d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.body(x)
        return self.conv1d(y.flatten(2))


def test_plan_model_on_cpu_matches_dense_and_reuses_plan() -> None:
    torch.manual_seed(2)
    model = Net().eval()
    x = torch.randn(2, 3, 12, 12)
    sparse = sparsify(model)
    plan, comparisons = plan_model(sparse, x, backends=["dense_cpu", "im2col_cublas", "reference"], runs=3)
    assert len(comparisons) == 4 and len(plan.entries) == 4
    with torch.no_grad():
        assert relative_error(sparse(x).double(), model(x).double()) < 1e-5
    _, comparisons = plan_model(sparsify(model), x, plan, runs=3)
    assert comparisons == []


def test_plan_model_checkpoints_the_plan_after_each_layer_it_adds() -> None:
    """``checkpoint`` sees the plan once per new entry, holding the entries so far (what a killed run resumes from),
    and not for entries reused."""
    torch.manual_seed(3)
    model, x = Net().eval(), torch.randn(2, 3, 12, 12)
    saved: list[list[str]] = []
    plan, _ = plan_model(sparsify(model), x, backends=["dense_cpu"], runs=3,
                         checkpoint=lambda plan: saved.append(list(plan.entries)))
    assert [len(entries) for entries in saved] == [1, 2, 3, 4] and saved[-1] == list(plan.entries)
    partial = Plan({key: plan.entries[key] for key in saved[1]})
    saved.clear()
    plan_model(sparsify(model), x, partial, backends=["dense_cpu"], runs=3,
               checkpoint=lambda plan: saved.append(list(plan.entries)))
    assert [len(entries) for entries in saved] == [3, 4]


def test_plan_model_logs_each_layer_it_plans_by_name(caplog: pytest.LogCaptureFixture) -> None:
    """One INFO line per entry added, naming the layer, its backend and the seconds it took; none for a reused one."""
    torch.manual_seed(4)
    net, x = Net().eval(), torch.randn(2, 3, 12, 12)
    model = sparsify(net)
    layer_names = [name for name, module in model.named_modules() if isinstance(module, SparseConv)]
    with caplog.at_level(logging.INFO, logger="unsparse.runtime.comparator"):
        plan, _ = plan_model(model, x, backends=["dense_cpu"], runs=3)
    lines = [record.getMessage() for record in caplog.records if record.getMessage().startswith("planned ")]
    assert [line.split()[1] for line in lines] == layer_names
    assert all(" s of it compiling: dense_cpu " in line for line in lines)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="unsparse.runtime.comparator"):
        plan_model(sparsify(net), x, plan, backends=["dense_cpu"], runs=3)
    assert not [record for record in caplog.records if record.getMessage().startswith("planned ")]


def test_plan_model_log_line_splits_the_compile_seconds_by_backend(caplog: pytest.LogCaptureFixture,
                                                                   compiling: None) -> None:
    """Where a backend compiled while its layer was compared, the layer's line names it with its seconds; a backend
    that compiles nothing is not named."""
    torch.manual_seed(4)
    x = torch.randn(2, 3, 12, 12)
    with caplog.at_level(logging.INFO, logger="unsparse.runtime.comparator"):
        plan_model(sparsify(Net().eval()), x, backends=[Compiling.name, "dense_cpu"], runs=1)
    lines = [record.getMessage() for record in caplog.records if record.getMessage().startswith("planned ")]
    assert lines and all(re.search(r" s of it compiling \(test_compiling 0\.\d\): ", line) for line in lines)


def test_auto_backend_follows_a_changed_plan() -> None:
    from unsparse.runtime.backends import get_backend
    from unsparse.runtime.plan import layer_key, use_plan

    x, csr, _ = small_layer()
    geometry = ConvGeometry.of(1, 1)
    key = layer_key(x, csr, geometry)
    auto = get_backend("auto")
    use_plan(Plan({key: PlanEntry("dense_cpu", {}, 1.0)}))
    assert auto.resolve(x, csr, geometry) == ("dense_cpu", {})
    use_plan(Plan({key: PlanEntry("reference", {}, 0.5)}))
    assert auto.resolve(x, csr, geometry) == ("reference", {})


def test_plan_leaves_the_dense_default_only_for_a_gain_beyond_the_margin() -> None:
    from unsparse.runtime.comparator import LayerComparison, Measurement
    from unsparse.runtime.timing import Timing

    def measured(backend: str, params: dict, ms: float) -> Measurement:
        return Measurement(backend, params, "ok", 0.0, timing=Timing(ms, ms, ms, 20, 1))

    nchw = measured("cudnn", {"memory_format": "contiguous"}, 1.00)
    close = LayerComparison("k", [nchw, measured("cudnn", {"memory_format": "channels_last"}, 0.98),
                                  measured("direct", {"variant": "tile"}, 0.99)])
    assert close.best.params == {"memory_format": "channels_last"}  # the report still names the fastest
    assert close.plan_entry().backend == "cudnn" and close.plan_entry().params == {"memory_format": "contiguous"}
    clear = LayerComparison("k", [nchw, measured("direct", {"variant": "tile"}, 0.90)])
    assert clear.plan_entry().backend == "direct" and clear.plan_entry(margin=0.2).backend == "cudnn"
    no_default = LayerComparison("k", [measured("direct", {"variant": "rows"}, 2.0)])
    assert no_default.plan_entry().backend == "direct"


def test_host_enqueue_time_is_the_mean_wall_clock_per_call(virtual_clock: VirtualClock) -> None:
    """Calls of 1, 2, 3, 4 and 5 ms on the virtual clock: 3 ms each on average."""
    calls = []

    def forward() -> None:
        calls.append(1)
        virtual_clock.advance(float(len(calls)))

    ms = host_enqueue_ms(forward, "cpu", runs=5)
    assert len(calls) == 5 and ms == pytest.approx(3.0)


def test_host_profile_lists_the_function_that_takes_the_time() -> None:
    calls = []

    def slow_step() -> None:
        calls.append(1)
        time.sleep(0.002)

    text = host_profile(slow_step, "cpu", runs=4, top=5)
    assert len(calls) == 4 and "slow_step" in text and "time.sleep" in text



def fake_comparison(key: str, default_ms: float, fast_ms: float) -> LayerComparison:
    """The dense default measured at ``default_ms`` and a 60 ms-per-call setting of ``test_slow`` at ``fast_ms``."""
    return LayerComparison(key, [
        Measurement("dense_cpu", {}, "ok", 0.0, timing=Timing(default_ms, default_ms, default_ms, 20, 1)),
        Measurement("test_slow", {"cost_ms": 60.0}, "ok", 0.0, timing=Timing(fast_ms, fast_ms, fast_ms, 20, 1))])


def one_layer_model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(5)
    conv = nn.Conv2d(4, 6, 3, padding=1)
    with torch.no_grad():
        conv.weight[torch.rand(conv.weight.shape) < 0.7] = 0
    return sparsify(nn.Sequential(conv)), torch.randn(2, 4, 9, 8)


def test_check_plan_sets_a_slower_plan_back_to_the_dense_default(fakes, virtual_clock: VirtualClock) -> None:
    """A layer whose comparison said the slow backend was fast (a per-layer time that the model does not see):
    the planned model (60 ms on the virtual clock) is slower than its dense default (1 ms), so the entry goes back
    to the default."""
    virtual_clock.charge(costs(dense_cpu=1.0), Slow, DenseBackend)
    sparse, x = one_layer_model()
    plan, _ = plan_model(sparse, x, backends=["dense_cpu"], runs=3)
    (layer,) = sparse_layers(sparse).values()
    comparison = fake_comparison(layer.plan_key, 1.0, 0.001)
    plan.entries[layer.plan_key] = comparison.plan_entry()
    use_plan(plan)
    assert get_backend("auto").resolve(x, layer.csr, layer.geometry)[0] == "test_slow"
    check = check_plan(sparse, x, plan, [comparison], runs=3, warmup=1)
    assert (check.planned_ms, check.default_ms) == pytest.approx((60.0, 1.0)) and check.reverted == (layer.plan_key,)
    assert check.timing == "eager"  # no CUDA graphs on the CPU
    entry = plan.get(layer.plan_key)
    assert (entry.backend, entry.params, entry.median_ms, entry.runner_up) == ("dense_cpu", {}, 1.0, "test_slow")
    assert get_backend("auto").resolve(x, layer.csr, layer.geometry)[0] == "dense_cpu"
    ref = torch.nn.functional.conv2d(x.double(), layer.csr.to_conv2d_weight().double(), layer.bias.double(),
                                     padding=1)
    with torch.no_grad():
        assert relative_error(sparse(x).double(), ref) < 1e-5


def test_check_plan_sets_back_to_the_dense_default_also_when_it_was_not_compared(
        fakes, virtual_clock: VirtualClock) -> None:
    """A plan made from other backends only (``test_slow``'s fastest setting, 1 ms on the virtual clock): the
    slower model still goes back to the dense default (0.5 ms), which the comparison did not time (median NaN)."""
    virtual_clock.charge(costs(dense_cpu=0.5), Slow, DenseBackend)
    sparse, x = one_layer_model()
    plan, comparisons = plan_model(sparse, x, backends=["test_slow"], runs=3, screen_runs=1, keep=1)
    (layer,) = sparse_layers(sparse).values()
    assert (plan.get(layer.plan_key).backend, plan.get(layer.plan_key).params) == ("test_slow", {"cost_ms": 1.0})
    check = check_plan(sparse, x, plan, comparisons, runs=3, warmup=1)
    entry = plan.get(layer.plan_key)
    assert (check.planned_ms, check.default_ms) == pytest.approx((1.0, 0.5))
    assert check.reverted == (layer.plan_key,) and (entry.backend, entry.params) == ("dense_cpu", {})
    assert math.isnan(entry.median_ms) and entry.runner_up == "test_slow"


def test_check_plan_keeps_a_plan_that_is_not_slower_by_more_than_the_margin(virtual_clock: VirtualClock) -> None:
    """A layer planned off the dense default (``reference``, 2 ms on the virtual clock against 1 ms) stays planned
    when the model's slowdown is within the margin (150 %); the check reports the margin it used."""
    virtual_clock.charge(costs(dense_cpu=1.0, reference=2.0), DenseBackend, ReferenceBackend)
    sparse, x = one_layer_model()
    plan, comparisons = plan_model(sparse, x, backends=["dense_cpu", "reference"], runs=3)
    (layer,) = sparse_layers(sparse).values()
    plan.entries[layer.plan_key] = PlanEntry("reference", {}, 1.0, "dense_cpu")
    use_plan(plan)
    before = dict(plan.entries)
    check = check_plan(sparse, x, plan, comparisons, runs=3, warmup=1, margin=1.5)
    assert check.reverted == () and plan.entries == before and check.margin == 1.5
    assert (check.planned_ms, check.default_ms) == pytest.approx((2.0, 1.0))
    assert get_backend("auto").resolve(x, layer.csr, layer.geometry)[0] == "reference"


def test_temporary_backend_puts_each_layer_back_also_after_an_error() -> None:
    from unsparse.runtime.modules import set_backend, temporary_backend

    sparse, _ = one_layer_model()
    set_backend(sparse, "reference", images_per_step=2)
    (layer,) = sparse_layers(sparse).values()
    with pytest.raises(RuntimeError, match="inside"), temporary_backend(sparse, "dense_cpu"):
        assert (layer.backend, layer.backend_params) == ("dense_cpu", {})
        raise RuntimeError("inside")
    assert (layer.backend, layer.backend_params) == ("reference", {"images_per_step": 2})


def test_a_layer_no_compared_backend_computes_is_planned_on_the_dense_default(caplog) -> None:
    """``backends`` naming only a sparse backend that refuses grouped layers: the grouped layer is planned on the
    dense default with a logged reason (it raised), the other layer on that backend, and the model stays correct."""
    torch.manual_seed(4)
    model = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1, groups=8)).eval()
    sparse, x = sparsify(model), torch.randn(2, 4, 10, 10)
    with caplog.at_level("WARNING"):
        plan, _ = plan_model(sparse, x, backends=["im2col_cusparse"], runs=2, warmup=0)
    layers = sparse_layers(sparse)
    assert plan.get(layers["0"].plan_key).backend == "im2col_cusparse"
    assert plan.get(layers["2"].plan_key).backend == "dense_cpu"
    assert "no backend compared computed this layer correctly (im2col_cusparse unsupported)" in caplog.text
    with torch.no_grad():
        assert torch.allclose(sparse(x), model(x), atol=1e-5)



def test_a_full_timing_far_slower_than_its_screening_is_repeated_once(monkeypatch) -> None:
    """A busy moment during one setting's full timing made the comparator keep a slower setting (H100, AlexNet's
    stem: 0.543 ms against a screening of 0.241); that timing is now repeated once and kept on the record."""
    from unsparse.runtime import comparator

    # per Slow setting (its cost_ms), the medians its successive timings report: screening, full, repeat
    scripted = {1.0: [0.0010, 0.0050, 0.0011], 2.0: [0.0020, 0.0021]}
    ran: list[float] = []

    class Recording(Slow):
        name = "test_recording"

        def conv(self, x, csr, bias, geometry, cost_ms: float = 0.0, **params: Any) -> torch.Tensor:
            ran.append(cost_ms)
            return get_backend("dense_cpu").conv(x, csr, bias, geometry)

    def fake_time_fn(fn, device, runs, warmup, rotation):
        fn(0)  # one call: the setting it times is the last one run
        timed.append(ran[-1])
        medians = scripted.get(ran[-1], [1.0])
        value = medians[min(timed.count(ran[-1]), len(medians)) - 1]
        return Timing(value, value, value, runs, rotation)

    timed: list[float] = []
    monkeypatch.setitem(base._REGISTRY, Recording.name, Recording)
    monkeypatch.setitem(base._INSTANCES, Recording.name, Recording())
    monkeypatch.setattr(comparator, "time_fn", fake_time_fn)
    x, csr, bias = small_layer(batch=3)
    result = compare_layer(x, csr, bias, ConvGeometry.of(1, 1), [Recording.name], runs=20, keep=2)
    fastest = result.best
    assert fastest.params == {"cost_ms": 1.0} and fastest.median_ms == pytest.approx(0.0011)
    assert fastest.disturbed.median_ms == pytest.approx(0.0050)
    other = next(m for m in result.measurements if m.params == {"cost_ms": 2.0})
    assert other.disturbed is None and timed.count(1.0) == 3 and timed.count(2.0) == 2


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
def test_the_dense_default_is_timed_in_full_even_when_its_screening_ranks_it_last(
        monkeypatch: pytest.MonkeyPatch, layout: torch.memory_format) -> None:
    """cuDNN offers four settings for a layer fused with its ReLU (two layouts, fused call or passes), more than the
    three the comparator times in full. With the default (fused call in the input's layout) screened slowest and
    another setting 1 % faster in full, the default still has its full timing, and the plan keeps it: 1 % is inside
    the margin (cuDNN let onto the CPU, where its fused call falls back; timings stood in for)."""
    from unsparse.runtime import comparator
    from unsparse.runtime.backends.dense import CudnnBackend

    monkeypatch.setattr(CudnnBackend, "device_types", frozenset({"cpu"}))
    x, csr, bias = small_layer(seed=21)
    x = x.contiguous(memory_format=layout)
    default_format = "contiguous" if layout == torch.contiguous_format else "channels_last"
    other_format = "channels_last" if layout == torch.contiguous_format else "contiguous"
    screening = {(default_format, None): 1.03, (default_format, "passes"): 1.00, (other_format, None): 1.01,
                 (other_format, "passes"): 1.02}
    full = {**screening, (default_format, None): 1.00, (default_format, "passes"): 0.99}
    running: dict[str, tuple] = {}
    run = CudnnBackend.run

    def recording_run(self, *args, **params):
        running["setting"] = (params.get("memory_format"), params.get("epilogue"))
        return run(self, *args, **params)

    def stand_in_time_fn(fn, device, runs=20, warmup=3, rotation=1):
        fn(0)
        median = (screening if runs == 3 else full)[running["setting"]]
        return Timing(median, median, median, runs, rotation)

    monkeypatch.setattr(CudnnBackend, "run", recording_run)
    monkeypatch.setattr(comparator, "time_fn", stand_in_time_fn)
    result = compare_layer(x, csr, bias, ConvGeometry.of(1, 1), ["cudnn"], runs=20, screen_runs=3, relu=True)
    assert len(result.measurements) == 4 and all(m.screen is not None for m in result.measurements)
    default = result.default_measurement()
    assert default is not None and default.params == {"memory_format": default_format}
    assert default.timing.median_ms == 1.00 and sum(m.timing is not None for m in result.measurements) == 4
    assert result.best.params == {"memory_format": default_format, "epilogue": "passes"}
    assert result.chosen() is default


class Screening(Slow):
    """A cheap setting (2 ms) and a dear one (0.5 ms, built only when asked: ``precompile`` records each space it
    is handed), as ``generated``'s one-program and several-program kernels; its calls cost their ``cost_ms``."""

    name = "test_screening"

    def __init__(self) -> None:
        self.built: list[list[dict[str, Any]]] = []

    def tuning_space(self, x, csr, geometry) -> list[dict[str, Any]]:
        return [{"cost_ms": 2.0}, {"cost_ms": 0.5, "dear": True}]

    def screen_space(self, x, csr, geometry) -> list[dict[str, Any]]:
        return [params for params in self.tuning_space(x, csr, geometry) if "dear" not in params]

    def precompile(self, x, csr, geometry, space) -> None:
        self.built.append(space)

    def conv(self, x, csr, bias, geometry, cost_ms: float = 0.0, dear: bool = False, **params: Any) -> torch.Tensor:
        assert not dear or {"cost_ms": cost_ms, "dear": True} in self.built[-1], "a dear setting ran unbuilt"
        return super().conv(x, csr, bias, geometry, cost_ms)


@pytest.fixture
def screening(monkeypatch: pytest.MonkeyPatch, virtual_clock: VirtualClock) -> Screening:
    backend = Screening()
    monkeypatch.setitem(base._REGISTRY, Screening.name, Screening)
    monkeypatch.setitem(base._INSTANCES, Screening.name, backend)
    return backend


@pytest.mark.parametrize(("rival_ms", "built"), [(1.0, False), (1.6, True)])
def test_dear_settings_are_built_only_where_the_cheap_ones_come_near_the_backends_timed_before(
        screening: Screening, virtual_clock: VirtualClock, rival_ms: float, built: bool) -> None:
    """Against a rival of 1.0 ms the cheap setting's 2.0 ms is beyond 1.3x: the dear setting is never built nor run,
    and is recorded as screened with both medians; against 1.6 ms it is within, so the dear one is built after the
    cheap one and wins."""
    virtual_clock.charge(costs(im2col_cublas=rival_ms), Screening, LoweringBackend)
    x, csr, bias = small_layer(batch=4)
    result = compare_layer(x, csr, bias, ConvGeometry.of(1, 1), ["im2col_cublas", Screening.name], runs=5,
                           screen_runs=2, screen_ratio=1.3)
    dear = next(m for m in result.measurements if m.params.get("dear"))
    cheap = next(m for m in result.measurements if m.params == {"cost_ms": 2.0})
    assert cheap.status == "ok" and cheap.screen.median_ms == pytest.approx(2.0)
    if built:
        assert screening.built == [[{"cost_ms": 2.0}], [{"cost_ms": 0.5, "dear": True}]]
        assert dear.status == "ok" and result.best is dear and dear.timing.median_ms == pytest.approx(0.5)
    else:
        assert screening.built == [[{"cost_ms": 2.0}]]
        assert dear.status == "screened" and dear.timing is None and dear.screen is None
        assert "2 ms" in dear.reason and "1.3 x" in dear.reason and f"{rival_ms:g} ms" in dear.reason
        assert result.best.backend == "im2col_cublas"
        assert json.loads(json.dumps(result.to_dict()))["measurements"][-1]["status"] == "screened"


def test_dear_settings_are_screened_out_where_no_cheap_setting_runs_correctly(
        screening: Screening, virtual_clock: VirtualClock, monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend whose settings timed first all fail the check shows no promise: its dear settings are not built,
    and their reason says why rather than quoting a time."""
    conv = Screening.conv

    def wrong_when_cheap(self, x, csr, bias, geometry, cost_ms=0.0, dear=False, **params):
        out = conv(self, x, csr, bias, geometry, cost_ms, dear, **params)
        return out if dear else out + 1.0

    monkeypatch.setattr(Screening, "conv", wrong_when_cheap)
    virtual_clock.charge(costs(im2col_cublas=1.0), Screening, LoweringBackend)
    x, csr, bias = small_layer(batch=4)
    result = compare_layer(x, csr, bias, ConvGeometry.of(1, 1), ["im2col_cublas", Screening.name], runs=3,
                           screen_runs=2, screen_ratio=1.3)
    statuses = {m.params.get("dear", False): m for m in result.measurements if m.backend == Screening.name}
    assert statuses[False].status == "wrong" and statuses[True].status == "screened"
    assert statuses[True].reason == "screened out: no setting timed first ran correctly"
    assert screening.built == [[{"cost_ms": 2.0}]]


@pytest.mark.parametrize("first", [True, False])
def test_every_setting_is_built_at_once_without_a_rival_or_without_screening(
        screening: Screening, virtual_clock: VirtualClock, first: bool) -> None:
    """The backend timed first has nothing to come near, and ``screen_ratio=None`` asks for every setting: both
    build the whole space in one ``precompile`` and time it, the dear setting winning."""
    virtual_clock.charge(costs(im2col_cublas=1.0), Screening, LoweringBackend)
    x, csr, bias = small_layer(batch=4)
    names = [Screening.name, "im2col_cublas"] if first else ["im2col_cublas", Screening.name]
    result = compare_layer(x, csr, bias, ConvGeometry.of(1, 1), names, runs=5, screen_runs=2,
                           screen_ratio=1.3 if first else None)
    assert screening.built == [[{"cost_ms": 2.0}, {"cost_ms": 0.5, "dear": True}]]
    assert result.best.params == {"cost_ms": 0.5, "dear": True}
    assert all(m.status == "ok" for m in result.measurements)


class Estimating(Screening):
    """:class:`Screening` with a second cheap setting (1.2 ms) and estimates of its cheap ones before their build:
    their ``cost_ms`` times :attr:`error` (each call to ``estimate_ms`` is recorded in :attr:`estimated`)."""

    name = "test_estimating"
    error = 1.0

    def __init__(self) -> None:
        super().__init__()
        self.estimated: list[list[dict[str, Any]]] = []

    def tuning_space(self, x, csr, geometry) -> list[dict[str, Any]]:
        return [{"cost_ms": 2.0}, {"cost_ms": 1.2}, {"cost_ms": 0.5, "dear": True}]

    def estimate_ms(self, inputs, csr, geometry, settings, relu=False, max_pool=False,
                    graphs=False) -> list[float | None]:
        self.estimated.append(settings)
        return [params["cost_ms"] * self.error for params in settings]


@pytest.fixture
def estimating(monkeypatch: pytest.MonkeyPatch, virtual_clock: VirtualClock) -> Estimating:
    backend = Estimating()
    monkeypatch.setitem(base._REGISTRY, Estimating.name, Estimating)
    monkeypatch.setitem(base._INSTANCES, Estimating.name, backend)
    virtual_clock.charge(costs(im2col_cublas=1.0), Estimating, LoweringBackend)
    return backend


def test_a_setting_estimated_beyond_the_ratio_is_not_built_and_the_estimate_is_recorded(
        estimating: Estimating) -> None:
    """Against a 1.0 ms rival at 1.3x the 2.0 ms estimate screens its setting out before any build (its reason
    quotes the estimate), the 1.2 ms one is built, timed and keeps its estimate beside its timing; it comes within
    the ratio, so the dear setting is built too, and wins."""
    x, csr, bias = small_layer(batch=4)
    result = compare_layer(x, csr, bias, ConvGeometry.of(1, 1), ["im2col_cublas", Estimating.name], runs=5,
                           screen_runs=2, screen_ratio=1.3)
    by_cost = {m.params["cost_ms"]: m for m in result.measurements if m.backend == Estimating.name}
    assert estimating.estimated == [[{"cost_ms": 2.0}, {"cost_ms": 1.2}]]
    assert estimating.built == [[{"cost_ms": 1.2}], [{"cost_ms": 0.5, "dear": True}]]
    assert by_cost[2.0].status == "screened" and by_cost[2.0].estimate_ms == 2.0 and by_cost[2.0].timing is None
    assert by_cost[2.0].reason == ("screened out: estimated before its build at 2 ms, more than 1.3 x the fastest "
                                   "other backend's 1 ms")
    assert by_cost[1.2].status == "ok" and by_cost[1.2].estimate_ms == 1.2
    assert by_cost[1.2].timing.median_ms == pytest.approx(1.2)
    assert by_cost[0.5].estimate_ms is None and result.best is by_cost[0.5]
    assert json.loads(json.dumps(result.to_dict()))["measurements"][-2]["estimate_ms"] == 2.0


def test_where_every_estimate_is_beyond_the_ratio_nothing_is_built(estimating: Estimating) -> None:
    """Estimates of 3.0 and 1.8 ms against a 1.0 ms rival: no setting is built nor run, and the dear one's reason
    quotes the best estimate."""
    estimating.error = 1.5
    x, csr, bias = small_layer(batch=4)
    result = compare_layer(x, csr, bias, ConvGeometry.of(1, 1), ["im2col_cublas", Estimating.name], runs=5,
                           screen_runs=2, screen_ratio=1.3)
    mine = [m for m in result.measurements if m.backend == Estimating.name]
    assert estimating.built == [] and [m.status for m in mine] == ["screened"] * 3
    assert [m.estimate_ms for m in mine] == [pytest.approx(3.0), pytest.approx(1.8), None]
    assert mine[-1].reason == ("screened out: the best setting tried first was estimated at 1.8 ms, more than 1.3 x "
                               "the fastest other backend's 1 ms")
    assert result.best.backend == "im2col_cublas" and Estimating.name in result.compile_s


@pytest.mark.parametrize("first", [True, False])
def test_nothing_is_estimated_without_a_rival_or_without_screening(estimating: Estimating, first: bool) -> None:
    x, csr, bias = small_layer(batch=4)
    names = [Estimating.name, "im2col_cublas"] if first else ["im2col_cublas", Estimating.name]
    result = compare_layer(x, csr, bias, ConvGeometry.of(1, 1), names, runs=5, screen_runs=2,
                           screen_ratio=1.3 if first else None)
    assert estimating.estimated == [] and len(estimating.built) == 1
    assert all(m.status == "ok" and m.estimate_ms is None for m in result.measurements)


def test_the_planning_summary_counts_layers_screened_and_the_seconds_compiled(
        screening: Screening, virtual_clock: VirtualClock) -> None:
    """Two layers compared against a 1 ms rival: the one whose cheap setting is too slow counts as screened, and
    the seconds each ``precompile`` took add up over layers and backends."""
    virtual_clock.charge(costs(im2col_cublas=1.0), Screening, LoweringBackend)
    x, csr, bias = small_layer(batch=4)
    comparisons = [compare_layer(x, csr, bias, ConvGeometry.of(1, 1), ["im2col_cublas", Screening.name], runs=3,
                                 screen_runs=2, screen_ratio=ratio) for ratio in (1.3, 3.0)]
    comparisons[0].compile_s, comparisons[1].compile_s = {Screening.name: 1.5}, {Screening.name: 2.0, "x": 0.25}
    assert planning_summary(comparisons) == {"layers_planned_now": 2, "layers_screened": 1,
                                             "planning_compile_s": 3.75}
    assert planning_summary([]) == {"layers_planned_now": 0, "layers_screened": 0, "planning_compile_s": 0}
