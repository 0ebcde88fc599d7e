"""The ``generated`` backend's kernels against a float64 CPU reference, on the cases of ``test_gpu_backends`` it
supports (dilation 1; strided Conv2d layers through their phase split), every setting of its tuning space, with the
output poisoned before each call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.gpu.test_gpu_backends import CASES, CUDA, make_case, poison_allocator
from tests.test_phases import CASES as PHASE_CASES
from unsparse.runtime import get_backend, sparse_layers, sparsify
from unsparse.runtime.backends.generated import SETTINGS, GeneratedBackend, side_streams
from unsparse.runtime.comparator import compare_layer, relative_error, tolerance
from unsparse.runtime.precision import precision_mode
from unsparse.sparse import UniformCSR
from unsparse.sparse.geometry import ConvGeometry
from unsparse.sparse.phases import phase_split

SUPPORTED = sorted(name for name, case in CASES.items() if case[9] == 1)
"""Cases with dilation 1 (odd shapes, 1x1, 5x5, a Conv1d, all-zero, fully dense and empty rows; strided ones, the
AlexNet stem and a stride beyond the input among them, through their phase split)."""

PROGRAMS_CASE = (2, 6, 5, 7, 230, 3, 3, 1, 1, 1, 0.8, 1, 1)
"""A 3x3 layer of 230 output channels: 8 programs of 32 rows, the last partial."""


def check_settings(case: str, dtype: torch.dtype, seed: int, settings: list[dict] | None = None,
                   repeats: int = 1) -> None:
    """Run ``case`` at each of ``settings`` (default: the backend's tuning space, compiled first) ``repeats`` times,
    each output poisoned first, and compare with the float64 reference, read in the current stream's order without a
    synchronisation (as a caller reads it; kernels on side streams must have joined it)."""
    x, csr, bias, geometry, ref = make_case(case, dtype, seed=seed)
    backend = get_backend("generated")
    assert backend.unsupported_reason(x, csr, geometry) is None
    if settings is None:
        settings = backend.tuning_space(x, csr, geometry)
        backend.precompile(x, csr, geometry, settings)
    assert settings
    for params in settings:
        for _ in range(repeats):
            poison_allocator(ref.numel(), dtype)
            out = backend.run(x, csr, bias, geometry, **params)
            assert torch.isfinite(out).all(), f"{params}: unwritten or non-finite outputs"
            error = relative_error(out.cpu(), ref)
            assert error <= tolerance(dtype), f"{case} {params}: relative error {error:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", SUPPORTED)
def test_generated_every_setting_matches_float64_reference(case: str, dtype: torch.dtype) -> None:
    check_settings(case, dtype, seed=hash(case) % 1000)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("out_channels", [230, 200])
def test_shared_kernels_match_float64_reference(monkeypatch: pytest.MonkeyPatch, out_channels: int,
                                                dtype: torch.dtype) -> None:
    """3x3 layers of 8 and 7 programs of 32 rows (the last partial) at every setting of :data:`SETTINGS`, so that
    shared kernels of 8, 4 and 3 programs and a lone last program run, twice each (the counters start again from
    zero); 2 x 5 x 7 = 70 pixels leave threads past the last pixel; one empty and one dense row. The launch-bound
    settings (``min_blocks``) change no code path; they run on the strided cases, whose tuning space holds them."""
    monkeypatch.setitem(CASES, "programs", (*PROGRAMS_CASE[:4], out_channels, *PROGRAMS_CASE[5:]))
    settings = [*(params for params in SETTINGS if "min_blocks" not in params),
                {"rows": 32, "programs": 4, "load_batch": 16}]  # a shared kernel's bodies group their loads too
    check_settings("programs", dtype, seed=out_channels, settings=settings, repeats=2)


GRAPHED = next(params for params in SETTINGS if params.get("graph"))
"""The setting that replays its call as a CUDA graph of its own."""

CHUNKED = [*(params for params in SETTINGS if params.get("chunks", 1) > 1), {"rows": 32, "programs": 8, "chunks": 4}]
"""The settings that pad sub-batches on a side stream, and the shared kernels in sub-batches (each with its own tile
counters), a call's argument the comparator does not time."""


@pytest.mark.parametrize("params", [SETTINGS[5], GRAPHED, *CHUNKED])
def test_side_streams_start_after_and_finish_before_the_current_streams_neighbours(
        monkeypatch: pytest.MonkeyPatch, params: dict) -> None:
    """With several streams (kernels, or the padding of sub-batches) the work on side streams must wait for what
    the current stream queued before the call and be waited for by what it queues after: the input is overwritten
    on the current stream behind about 5 ms of GPU sleep just before the call, and the output is copied to the host
    right after it."""
    monkeypatch.setitem(CASES, "programs", PROGRAMS_CASE)
    x, csr, bias, geometry, ref = make_case("programs", torch.float32, seed=41)
    backend = get_backend("generated")
    assert params.get("streams", 1) > 1 or params["chunks"] >= x.shape[0]  # two sub-batches of one image
    backend.run(torch.zeros_like(x), csr, bias, geometry, **params)  # compiled and bound before the queue
    stale = torch.zeros_like(x)
    torch.cuda.synchronize()
    torch.cuda._sleep(10**7)
    stale.copy_(x)
    out = backend.run(stale, csr, bias, geometry, **params)
    assert relative_error(out.cpu(), ref) <= tolerance(torch.float32), params


@pytest.mark.parametrize("params", [SETTINGS[5], GRAPHED, {"rows": 32, "programs": 4}, *CHUNKED])
def test_generated_kernels_replay_in_a_cuda_graph(monkeypatch: pytest.MonkeyPatch, params: dict) -> None:
    """The end-to-end benchmark's graph timings replay the generated kernels, forked over side streams, sharing
    tile counters or after the padding of each sub-batch on a side stream: a replay must recompute the captured
    output (a ``graph`` setting, whose own capture cannot nest in another, queues its work there)."""
    from unsparse.runtime.timing import capture_graph

    monkeypatch.setitem(CASES, "programs", PROGRAMS_CASE)
    x, csr, bias, geometry, ref = make_case("programs", torch.float32, seed=42)
    backend = get_backend("generated")
    outputs: list[torch.Tensor] = []
    graph = capture_graph(lambda: outputs.append(backend.conv(x, csr, bias, geometry, **params)))
    captured = outputs[-1]
    captured.fill_(float("nan"))
    graph.replay()
    assert relative_error(captured.cpu(), ref) <= tolerance(torch.float32), params


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("params", [SETTINGS[0], {"rows": 32, "programs": 4}, *CHUNKED])
def test_the_relu_in_the_epilogue_matches_the_float64_reference(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
                                                                params: dict) -> None:
    """``relu=True`` (a layer fused with its ReLU) in one-program, shared and chunked kernels: the outputs equal the
    reference's ReLU (sums of both signs, one empty and one dense row), the negative ones stored as exactly 0, and
    the same call without the flag still gives the plain convolution (its launches are bound apart)."""
    monkeypatch.setitem(CASES, "programs", PROGRAMS_CASE)
    x, csr, bias, geometry, ref = make_case("programs", dtype, seed=44)
    backend = get_backend("generated")
    poison_allocator(ref.numel(), dtype)
    out = backend.run(x, csr, bias, geometry, relu=True, **params).cpu()
    assert (ref < 0).any() and (out < 0).sum() == 0
    assert relative_error(out, torch.relu(ref)) <= tolerance(dtype), params
    plain = backend.run(x, csr, bias, geometry, **params).cpu()
    assert relative_error(plain, ref) <= tolerance(dtype), params


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("params", [SETTINGS[0], {"rows": 32, "programs": 4}, SETTINGS[-1], SETTINGS[5], GRAPHED,
                                    *CHUNKED])
def test_the_residual_in_the_epilogue_matches_the_float64_reference(monkeypatch: pytest.MonkeyPatch,
                                                                    dtype: torch.dtype, params: dict) -> None:
    """A layer fused with its residual add and the ReLU after it, prepared once as ``SparseConv`` keeps it
    (``prepare(..., relu=True, residual=...)``), in one-program, shared (also bounded to 3 blocks per SM), 8-stream,
    graph-replayed and chunked kernels: two calls with two residuals each give ``relu(conv + residual)`` of the
    float64 reference (a graph copies each residual in; a stale one would fail the second), a channels-last residual
    the same; in float32 bit for bit the unfused ``relu(out + residual)`` of the same kernels (one rounding either
    way). A residual with a fused max pool, or of another shape, is refused naming it."""
    monkeypatch.setitem(CASES, "programs", PROGRAMS_CASE)
    x, csr, bias, geometry, ref = make_case("programs", dtype, seed=46)
    backend = get_backend("generated")
    residuals = [torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)
                 for seed in (7, 8)]
    call = backend.prepare(x, csr, bias, geometry, relu=True, residual=residuals[0].to(CUDA), **params)
    plain = backend.run(x, csr, bias, geometry, **params)
    for residual in residuals:
        expected = torch.relu(ref + residual.double())
        assert (ref < 0).any() and (expected == 0).any()
        for layout in (torch.contiguous_format, torch.channels_last):
            poison_allocator(ref.numel(), dtype)
            out = call(x, residual.to(CUDA).contiguous(memory_format=layout))
            assert relative_error(out.cpu(), expected) <= tolerance(dtype), (params, layout)
            if dtype == torch.float32:
                assert torch.equal(out, torch.relu(plain + residual.to(CUDA))), (params, layout)
    with pytest.raises(ValueError, match="residual"):
        backend.conv(x, csr, bias, geometry, max_pool=True, residual=residuals[0].to(CUDA), **params)
    with pytest.raises(ValueError, match="residual"):
        backend.conv(x, csr, bias, geometry, residual=residuals[0][:1].to(CUDA), **params)


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("params", [SETTINGS[0], {"rows": 32, "programs": 4}, {"rows": 6, "programs": 1},
                                    {"rows": 32, "programs": 1, "load_batch": 16}, *CHUNKED])
def test_the_max_pool_in_the_epilogue_matches_the_float64_reference(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
                                                                    params: dict, relu: bool) -> None:
    """``max_pool=True`` (a layer fused with the 2x2 max pool after it, with and without its ReLU) in one-program,
    shared and chunked kernels, each lane group of four reducing one window, and with programs of 6 rows (the
    butterfly pads them to 8, the last lane of each window storing none): the output is the reference's pool,
    ``(N, M, E // 2, F // 2)``; the 5x7 output plane's last row and column are pooled out, as ``nn.MaxPool2d(2)``
    drops them; 2 x 2 x 3 = 12 windows leave lanes past the last one. A channels-last input gets a channels-last
    output."""
    monkeypatch.setitem(CASES, "programs", PROGRAMS_CASE)
    x, csr, bias, geometry, ref = make_case("programs", dtype, seed=45)
    expected = F.max_pool2d(torch.relu(ref) if relu else ref, 2)
    backend = get_backend("generated")
    poison_allocator(expected.numel(), dtype)
    out = backend.run(x, csr, bias, geometry, relu=relu, max_pool=True, **params)
    assert out.shape == expected.shape == (2, 230, 2, 3)
    assert relative_error(out.cpu(), expected) <= tolerance(dtype), params
    poison_allocator(expected.numel(), dtype)
    last = backend.run(x.contiguous(memory_format=torch.channels_last), csr, bias, geometry, relu=relu,
                       max_pool=True, **params)
    assert last.is_contiguous(memory_format=torch.channels_last) and torch.equal(last, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("params", [SETTINGS[0], {"rows": 64, "programs": 1}, *CHUNKED])
def test_a_stem_through_its_phase_split_with_its_relu_and_pool(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
                                                               params: dict) -> None:
    """A ResNet-like stem (3 input channels, 7x7, stride 2, padding 3, 64 output channels at 0.9, one empty and one
    dense row) on an odd 37x41 input, so its phase split's plane has a row more than the 19x21 output: run plain, with
    its ReLU, and with its ReLU and a 2x2 max pool in the epilogue, from NCHW and channels-last inputs."""
    monkeypatch.setitem(CASES, "stem", (4, 3, 37, 41, 64, 7, 7, 2, 3, 1, 0.9, 1, 1))
    x, csr, bias, geometry, ref = make_case("stem", dtype, seed=46)
    backend = get_backend("generated")
    for relu, max_pool in ((False, False), (True, False), (True, True)):
        expected = torch.relu(ref) if relu else ref
        expected = F.max_pool2d(expected, 2) if max_pool else expected
        for source in (x, x.contiguous(memory_format=torch.channels_last)):
            poison_allocator(expected.numel(), dtype)
            out = backend.run(source, csr, bias, geometry, relu=relu, max_pool=max_pool, **params)
            assert out.shape == expected.shape and torch.isfinite(out).all()
            assert relative_error(out.cpu(), expected) <= tolerance(dtype), (relu, max_pool, params)


def test_the_pooled_kernels_loop_over_windows_keep_nan_and_refuse_a_plane_below_2x2(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One block of 64 threads for 3 x 6 x 5 = 90 windows (360 lanes: the grid-stride loop runs six times, its last
    pass partial); a NaN input pixel gives NaN in the pooled outputs whose windows hold a NaN sum, as torch's pool of
    the kernels' unpooled output does (the kernel's own maximum, not fmaxf, which would drop it), and the other
    outputs equal that pool bit for bit; a 1-row output plane has no 2x2 window."""
    from unsparse.runtime import generated_source

    monkeypatch.setitem(CASES, "programs", (3, 6, 13, 11, 70, 3, 3, 1, 1, 1, 0.8, 1, 1))
    monkeypatch.setattr(generated_source, "choose_threads", lambda total, sms: 64)
    monkeypatch.setattr(generated_source, "launch_grid", lambda total, threads, resident, sms: (1, 1, 1))
    x, csr, bias, geometry, ref = make_case("programs", torch.float32, seed=47)
    backend = GeneratedBackend()  # its own launch cache: launches bound with other grids are not reused
    out = backend.run(x, csr, bias, geometry, relu=True, max_pool=True)
    assert relative_error(out.cpu(), F.max_pool2d(torch.relu(ref), 2)) <= tolerance(torch.float32)
    x[1, 2, 6, 4] = float("nan")  # NaN where a nonzero weight reads it (the kernels skip the zeros, cuDNN does not)
    expected = F.max_pool2d(backend.run(x, csr, bias, geometry, relu=True).double().cpu(), 2)
    out = backend.run(x, csr, bias, geometry, relu=True, max_pool=True).cpu()
    assert expected.isnan().any() and torch.equal(out.isnan(), expected.isnan())
    assert torch.equal(out[~out.isnan()].double(), expected[~expected.isnan()])
    with pytest.raises(ValueError, match="max_pool needs an output plane of at least 2x2, not 1x11"):
        backend.run(x[:, :, :1].contiguous(), csr, bias, ConvGeometry.of(1, 1), max_pool=True)


def test_the_comparator_times_a_fused_layer_on_the_pooled_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer fused with its ReLU and pool, compared on cuDNN (pool and ReLU after it) and the generated kernels
    (in their epilogue): every generated setting passes the check against the pooled float64 reference, the key
    names the epilogue, and the baseline (the convolution alone) is timed too (no screening: the kernels of several
    programs are checked whatever the one-program ones time)."""
    monkeypatch.setitem(CASES, "programs", PROGRAMS_CASE)
    x, csr, bias, geometry, _ = make_case("programs", torch.float32, seed=48)
    with precision_mode(False):
        result = compare_layer(x, csr, bias, geometry, ["cudnn", "generated"], runs=3, warmup=1, baseline=True,
                               relu=True, max_pool=True, screen_ratio=None)
    assert result.key.endswith("|epilogue=relu+max_pool")
    generated = [m for m in result.measurements if m.backend == "generated"]
    assert generated and all(m.status == "ok" for m in generated), [m.reason for m in generated]
    assert result.default_measurement("cudnn") is not None and result.baseline.median_ms > 0


def test_the_comparator_builds_the_kernels_of_several_programs_only_near_cudnn(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With screening (the default), the layer's one-program settings are estimated first, and built and screened
    only where the estimate comes within ``SCREEN_RATIO`` of cuDNN's full median (else recorded as screened with
    it); its settings of several programs are either all checked and timed, where the best one-program setting
    (screened, or estimated where not built) comes within the ratio, or all recorded as screened otherwise: never
    built and left unrecorded."""
    from unsparse.runtime.comparator import SCREEN_RATIO

    monkeypatch.setitem(CASES, "programs", PROGRAMS_CASE)
    x, csr, bias, geometry, _ = make_case("programs", torch.float32, seed=49)
    with precision_mode(True):
        result = compare_layer(x, csr, bias, geometry, ["cudnn", "generated"], runs=3, warmup=1)
    limit = SCREEN_RATIO * result.fastest("cudnn").median_ms
    generated = [m for m in result.measurements if m.backend == "generated"]
    shared = [m for m in generated if m.params["programs"] > 1]
    single = [m for m in generated if m.params["programs"] == 1]
    assert shared and single and all(m.estimate_ms > 0 for m in single)
    for m in single:
        assert m.status == ("ok" if m.estimate_ms <= limit else "screened"), m.reason
        assert (m.screen is not None) == (m.status == "ok")
    near = min(m.screen.median_ms if m.screen else m.estimate_ms for m in single) <= limit
    assert {m.status for m in shared} == ({"ok"} if near else {"screened"}), [m.reason for m in shared]


@pytest.mark.parametrize(("case", "max_pool"), [("programs", False), ("programs", True), ("alexnet_11x11_s4", False),
                                                ("stride2_1x1_odd", True)])
def test_estimates_time_one_program_per_setting_and_leave_its_kernels_correct(
        monkeypatch: pytest.MonkeyPatch, case: str, max_pool: bool) -> None:
    """On a layer of several programs and on stems through their phase split, with and without the pooled
    epilogue, eager and as graph replays: each setting of one program per kernel gets a finite, positive estimate
    and those of several none; every setting then runs correctly (the probes are its own kernels, compiled once)."""
    monkeypatch.setitem(CASES, "programs", PROGRAMS_CASE)
    x, csr, bias, geometry, ref = make_case(case, torch.float32, seed=50)
    backend = get_backend("generated")
    space = backend.tuning_space(x, csr, geometry)
    for graphs in (False, True):
        estimates = backend.estimate_ms([x, x.flip(0)], csr, geometry, space, relu=True, max_pool=max_pool,
                                        graphs=graphs)
        for params, estimate in zip(space, estimates, strict=True):
            assert (estimate is None) == (params["programs"] > 1), (params, graphs)
            assert estimate is None or 0 < estimate < float("inf")
    pooled = F.max_pool2d(torch.relu(ref), 2) if max_pool else torch.relu(ref)
    for params in space:
        out = backend.run(x, csr, bias, geometry, relu=True, max_pool=max_pool, **params)
        assert relative_error(out.cpu(), pooled) <= tolerance(torch.float32), params


def test_side_streams_are_made_once_per_device_and_count() -> None:
    assert side_streams(CUDA, 2) is side_streams(CUDA, 2) and len(side_streams(CUDA, 3)) == 3


def test_a_vgg_block_fused_on_generated_computes_the_dense_block() -> None:
    """VGG's conv, ReLU, conv, ReLU, pool sequence sparsified with both fusions and run on the generated kernels:
    the first conv carries its ReLU, the second its ReLU and the pool, and the block's output equals the dense
    block's (float32, TF32 off)."""
    torch.manual_seed(46)
    block = nn.Sequential(nn.Conv2d(3, 40, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(40, 70, 3, padding=1),
                          nn.ReLU(inplace=True), nn.MaxPool2d(2, 2)).eval()
    with torch.no_grad():
        for conv in (block[0], block[2]):
            conv.weight.mul_(torch.rand_like(conv.weight) > 0.7)
    sparse = sparsify(block, backend="generated", fuse_relu=True, fuse_max_pool=True).to(CUDA)
    assert [(layer.relu, layer.max_pool) for layer in sparse_layers(sparse).values()] == [(True, False), (True, True)]
    x = torch.randn(3, 3, 18, 14)
    with torch.no_grad(), precision_mode(False):
        out = sparse(x.to(CUDA)).cpu()
        expected = block.double()(x.double())
    assert relative_error(out, expected) <= tolerance(torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_chunked_settings_give_the_whole_batchs_output_on_an_odd_batch(monkeypatch: pytest.MonkeyPatch,
                                                                       dtype: torch.dtype) -> None:
    """Batch 5 in chunks of 2, 2 and 1 images (each with its own bound launches and tile counters): every output
    equals, bit for bit, that of the same kernels on the whole batch (each pixel's sum runs in the same order), and
    matches the float64 reference; the input is channels-last, so each sub-batch is made contiguous on the side
    stream."""
    monkeypatch.setitem(CASES, "programs", (5, *PROGRAMS_CASE[1:]))
    x, csr, bias, geometry, ref = make_case("programs", dtype, seed=43)
    x = x.contiguous(memory_format=torch.channels_last)
    backend = get_backend("generated")
    for params in CHUNKED:
        whole = backend.run(x, csr, bias, geometry, rows=params["rows"], programs=params["programs"])
        poison_allocator(ref.numel(), dtype)
        chunked = backend.run(x, csr, bias, geometry, **params)
        assert torch.equal(chunked, whole), params
        assert relative_error(chunked.cpu(), ref) <= tolerance(dtype), params


def test_generated_on_a_channels_last_input_without_bias() -> None:
    x, csr, bias, geometry, ref = make_case("odd_3x3", torch.float32, seed=11)
    bias_free = ref - bias.cpu().double().reshape(1, -1, 1, 1)
    out = get_backend("generated").run(x.contiguous(memory_format=torch.channels_last), csr, None, geometry)
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert relative_error(out.cpu(), bias_free) <= tolerance(torch.float32)


def test_generated_sees_a_weight_changed_in_place() -> None:
    x, csr, bias, geometry, _ = make_case("odd_3x3", torch.float32, seed=12)
    backend = get_backend("generated")
    before = backend.run(x, csr, bias, geometry)
    csr.values.mul_(2.0)
    after = backend.run(x, csr, bias, geometry)
    expected = 2.0 * (before - bias.reshape(1, -1, 1, 1)) + bias.reshape(1, -1, 1, 1)
    assert relative_error(after.cpu(), expected.cpu().double()) <= tolerance(torch.float32)


def test_comparator_times_generated_when_named_and_refuses_a_dilated_layer() -> None:
    """Named, ``generated`` is timed, not screened out: on layers this small its probe's estimate against cuDNN's
    time is noise, so screening is off here (``screen_ratio=None``)."""
    for case, seed in (("groups_tiles_chunks", 13), ("stride2_3x3", 14)):
        x, csr, bias, geometry, _ = make_case(case, torch.float32, seed=seed)
        comparison = compare_layer(x, csr, bias, geometry, ["cudnn", "generated"], runs=3, warmup=1,
                                   screen_ratio=None)
        assert comparison.fastest("generated") is not None
    x, csr, bias, geometry, _ = make_case("dilation2", torch.float32, seed=15)
    assert "dilation 1" in get_backend("generated").unsupported_reason(x.to(CUDA), csr, geometry)


def test_generated_converts_a_bias_of_another_dtype() -> None:
    """The kernels read the bias as the input's dtype: a float32 bias on a float16 layer is converted, not read as
    halves."""
    x, csr, bias, geometry, ref = make_case("odd_3x3", torch.float16, seed=15)
    out = get_backend("generated").run(x, csr, bias.float(), geometry)
    assert relative_error(out.cpu(), ref) <= tolerance(torch.float16)


@pytest.mark.parametrize("threads", [256, 128, 64])
def test_one_compiled_kernel_runs_at_every_block_size(monkeypatch: pytest.MonkeyPatch, threads: int) -> None:
    """The kernels hold no threads per block (a batch size picks its own at launch): each block size of
    ``THREAD_CHOICES`` runs the same compiled kernels, one-program and shared, to the float64 reference; 70 pixels
    leave a partial block at each."""
    from unsparse.runtime import generated_source

    monkeypatch.setitem(CASES, "programs", PROGRAMS_CASE)
    asked: list[int] = []
    monkeypatch.setattr(generated_source, "choose_threads", lambda total, sms: asked.append(total) or threads)
    x, csr, bias, geometry, ref = make_case("programs", torch.float32, seed=43)
    backend = GeneratedBackend()  # its own launch cache: launches bound at other block sizes are not reused
    for params in (SETTINGS[0], {"rows": 32, "programs": 4}):
        out = backend.run(x, csr, bias, geometry, **params)
        assert relative_error(out.cpu(), ref) <= tolerance(torch.float32), (threads, params)
    assert asked, "the launches did not take their block size from choose_threads"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("shape", "padding"), [((3, 5, 13, 11), (1, 1)), ((2, 3, 7, 300), (2, 0)),
                                                ((1, 70_000, 2, 3), (0, 1)), ((2, 4, 5, 5), (0, 0))])
def test_padded_float32_on_the_gpu_is_the_zero_padded_float32_input(shape: tuple, padding: tuple,
                                                                     dtype: torch.dtype) -> None:
    """``pad_planes`` against ``F.pad`` of the float32 input: a row count that leaves a block's last warps past the
    end (15 planes of 15 rows), rows wider than a warp (several column steps), 70,000 planes of 2 rows (rows
    that span planes within a warp), a channels-last input, and the unpadded case."""
    from unsparse.runtime.backends.generated import padded_float32

    x = torch.randn(shape, device=CUDA).to(dtype)
    if shape[0] == 2:
        x = x.contiguous(memory_format=torch.channels_last)
    N, C, H, W = shape
    poison_allocator(N * C * (H + 2 * padding[0]) * (W + 2 * padding[1]), torch.float32)
    out = padded_float32(x, padding)
    expected = torch.nn.functional.pad(x.float(), (padding[1], padding[1], padding[0], padding[0]))
    assert out.dtype == torch.float32 and out.is_contiguous() and torch.equal(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", PHASE_CASES)
def test_padded_float32_gathers_the_padded_phase_images_in_one_pass(case: tuple, dtype: torch.dtype) -> None:
    """``pad_planes`` with a phase split (a strided layer's input to the generated kernels) against ``F.pad`` of the
    float32 phase images (:meth:`PhaseSplit.input`), on the phase tests' layers: stems, odd planes whose last phase
    rows and columns are zero, one phase of a 1x1 layer (also at an odd phase), inputs smaller than the stride, and
    wrapped phases or a stride beyond 32 bits (those take the two-copy path); one input channels-last."""
    from unsparse.runtime.backends.generated import padded_float32

    N, C, H, W, M, R, S, stride, padding = case
    split = phase_split(UniformCSR.from_dense(torch.randn(M, C, R, S)), ConvGeometry.of(stride, padding))
    x = torch.randn(N, C, H, W, device=CUDA).to(dtype)
    if (H, W) == (13, 11):
        x = x.contiguous(memory_format=torch.channels_last)
    pad_h, pad_w = split.geometry.padding
    expected = torch.nn.functional.pad(split.input(x).float(), (pad_w, pad_w, pad_h, pad_h))
    poison_allocator(expected.numel(), torch.float32)
    out = padded_float32(x, split.geometry.padding, split)
    assert out.dtype == torch.float32 and out.is_contiguous() and torch.equal(out, expected)


def reference(x: torch.Tensor, csr: UniformCSR, bias: torch.Tensor, geometry: ConvGeometry) -> torch.Tensor:
    """``F.conv2d`` of the layer in float64 on the CPU, of the values the kernels read."""
    return F.conv2d(x.double().cpu(), csr.to_conv2d_weight().double().cpu(), bias.double().cpu(), geometry.stride,
                    geometry.padding)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_graph_call_computes_each_new_input_bias_batch_and_weight(monkeypatch: pytest.MonkeyPatch,
                                                                    dtype: torch.dtype) -> None:
    """The ``graph`` setting copies each call's input and bias into its capture and hands out a copy of the output:
    an earlier output stays as computed, a new bias tensor counts, another batch size is captured anew, and a weight
    edited in place is compiled and captured anew; each against the float64 reference on fresh random inputs."""
    monkeypatch.setitem(CASES, "programs", PROGRAMS_CASE)
    x, csr, bias, geometry, ref = make_case("programs", dtype, seed=45)
    backend = get_backend("generated")
    generator = torch.Generator().manual_seed(46)
    first = backend.run(x, csr, bias, geometry, **GRAPHED)
    calls = [(x, bias, ref, first)]
    for batch in (x.shape[0], x.shape[0], 3):
        x2 = torch.randn(batch, *x.shape[1:], generator=generator).to(dtype).to(CUDA)
        bias2 = torch.randn(bias.shape, generator=generator).to(dtype).to(CUDA)
        calls.append((x2, bias2, reference(x2, csr, bias2, geometry), backend.run(x2, csr, bias2, geometry,
                                                                                   **GRAPHED)))
    csr.values.mul_(-2.0)
    calls.append((x, bias, reference(x, csr, bias, geometry), backend.run(x, csr, bias, geometry, **GRAPHED)))
    for index, (_, _, expected, out) in enumerate(calls):
        error = relative_error(out.cpu(), expected)
        assert error <= tolerance(dtype), f"call {index}: relative error {error:.3g}"


def test_graph_calls_from_two_streams_each_get_their_own_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """Calls on two streams, each queued behind the same 5 ms of GPU sleep, share one capture's static tensors: the
    second call's copy in waits for the first call's copy out (without that wait it would overwrite the input of
    the first call's replay, about 0.3 ms of kernels on 32768 images), so each output is its own input's, bit for
    bit the call without ``graph`` (the same kernels)."""
    monkeypatch.setitem(CASES, "programs", PROGRAMS_CASE)
    _, csr, bias, geometry, _ = make_case("programs", torch.float32, seed=47)
    generator = torch.Generator().manual_seed(48)
    inputs = [torch.randn(32768, *PROGRAMS_CASE[1:4], generator=generator).to(CUDA) for _ in range(2)]
    backend = get_backend("generated")
    expected = [backend.run(v, csr, bias, geometry, **SETTINGS[5]) for v in inputs]
    backend.run(inputs[0], csr, bias, geometry, **GRAPHED)  # captured before the race
    torch.cuda.synchronize()
    outputs = []
    for v in inputs:
        with torch.cuda.stream(torch.cuda.Stream()):
            torch.cuda._sleep(10**7)
            outputs.append(backend.run(v, csr, bias, geometry, **GRAPHED))
    torch.cuda.synchronize()
    assert all(torch.equal(out, want) for out, want in zip(outputs, expected, strict=True))


@pytest.mark.parametrize("timing", ["eager", "graph"])
def test_the_comparator_times_graph_settings_eagerly_only(monkeypatch: pytest.MonkeyPatch, timing: str) -> None:
    """Eagerly the ``graph`` setting is checked and timed like the rest; under graph timing, where its call would be
    its twin's inside the timed capture, it is left out."""
    monkeypatch.setitem(CASES, "programs", PROGRAMS_CASE)
    x, csr, bias, geometry, _ = make_case("programs", torch.float32, seed=49)
    result = compare_layer(x, csr, bias, geometry, ["generated"], runs=3, timing=timing, screen_ratio=None)
    graphed = [m for m in result.measurements if m.params.get("graph")]
    assert [m.status for m in graphed] == (["ok"] if timing == "eager" else [])
    assert result.best is not None and result.best.status == "ok"
