"""The ``generated`` backend's checks on the CPU: which layers it refuses and why, its tuning space, and that the
comparator leaves it out unless named. Its kernels run in ``tests/gpu/test_gpu_generated.py``."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from unsparse.runtime import launch_geometry as lg
from unsparse.runtime.backends import available_backends, get_backend
from unsparse.runtime.backends.generated import (
    MAX_PRODUCTS,
    MAX_SHARED_PRODUCTS,
    MAX_WIDE_PRODUCTS,
    SETTINGS,
    GeneratedBackend,
)
from unsparse.runtime.comparator import COMPARED_BY_DEFAULT_EXCLUDES
from unsparse.sparse.format import UniformCSR
from unsparse.sparse.geometry import ConvGeometry
from unsparse.sparse.phases import phase_split


def layer(out_channels: int = 8, channels: int = 4, kernel: int = 3, density: float = 0.3,
          dtype: torch.dtype = torch.float32) -> UniformCSR:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_channels, channels, kernel, kernel, generator=generator)
    weight *= torch.rand(weight.shape, generator=generator) < density
    return UniformCSR.from_dense(weight.to(dtype))


@pytest.fixture
def on_cpu(monkeypatch: pytest.MonkeyPatch) -> GeneratedBackend:
    """The backend with the CPU among its device types, so that its own checks after the device's can be read."""
    monkeypatch.setattr(GeneratedBackend, "device_types", frozenset({"cpu", "cuda"}))
    monkeypatch.setitem(sys.modules, "cupy", object())
    return GeneratedBackend()


def test_it_runs_on_cuda_only_and_is_not_compared_by_default() -> None:
    x = torch.randn(1, 4, 6, 6)
    assert "runs on ['cuda']" in get_backend("generated").unsupported_reason(x, layer(), ConvGeometry.of(1, 1))
    assert "generated" in available_backends("cuda") and "generated" in COMPARED_BY_DEFAULT_EXCLUDES


@pytest.mark.parametrize(("change", "expected"), [
    ({"dilation": 2}, "dilation 1"),
    ({"stride": 2, "conv1d": True}, "on Conv2d only"),
    ({"groups": 2}, "groups=2"),
    ({"x_dtype": torch.float64}, "generated kernels exist for torch.float32, torch.float16, not torch.float64"),
    ({"csr_dtype": torch.float16}, "differs from input dtype"),
    ({"dense": True}, "products per generated program"),
    ({"huge": True}, "32-bit pixel, offset and padded row indexing"),
    ({"many_rows": True}, "32-bit pixel, offset and padded row indexing"),
])
def test_unsupported_layers_are_refused_with_a_reason(on_cpu: GeneratedBackend, change: dict, expected: str) -> None:
    csr = layer(channels=1024, kernel=11, density=1.0) if change.get("dense") else layer(
        dtype=change.get("csr_dtype", torch.float32))
    x = torch.randn(2, csr.in_channels_per_group, 6, 6, dtype=change.get("x_dtype", torch.float32))
    if change.get("huge"):
        x = torch.empty(1).expand(2**16, 4, 2**8, 2**8)
    if change.get("many_rows"):  # 2**28 one-pixel outputs, but 2**28 * 4 * 3 padded rows
        x = torch.empty(1).expand(2**28, 4, 1, 1)
    geometry = ConvGeometry.of(change.get("stride", 1), 1, change.get("dilation", 1), change.get("groups", 1))
    if change.get("conv1d"):
        csr, x = layer(kernel=1), x[:, :, :1]
        geometry = ConvGeometry.of(2, 0, spatial_dims=1)
    reason = on_cpu.unsupported_reason(x, csr, geometry)
    assert reason is not None and expected in reason
    assert on_cpu.unsupported_reason(torch.randn(2, 4, 6, 6), layer(), ConvGeometry.of(1, 1)) is None


def test_conv_refuses_what_unsupported_reason_refuses(on_cpu: GeneratedBackend) -> None:
    with pytest.raises(ValueError, match=r"^generated: generated kernels run dilation 1"):
        on_cpu.conv(torch.randn(1, 4, 6, 6), layer(), None, ConvGeometry.of(1, 1, 2))


STRIDED = [  # (N, C, H, W, M, kernel, stride, padding, density)
    (2, 3, 29, 27, 9, 7, 2, 3, 0.1),  # a ResNet stem at a small plane
    (2, 3, 35, 33, 7, 11, 4, 2, 0.1),  # an AlexNet stem
    (3, 5, 13, 11, 6, 3, 2, 1, 0.5),  # odd planes: the split's plane has a row and column more
    (2, 4, 9, 9, 5, 1, 2, 0, 0.6),  # a downsampling 1x1: one phase
    (2, 2, 3, 2, 4, 5, 5, 2, 0.7),  # a stride beyond the input: one pixel per phase image
]


@pytest.mark.parametrize("case", STRIDED)
def test_a_strided_layer_runs_as_its_phase_split(on_cpu: GeneratedBackend, case: tuple) -> None:
    """The stride-1 layer the kernels run (:meth:`GeneratedBackend.stride_one_layer`), its padded input
    (``kernel_input``) and its programs of the strided layer's plane, run on the CPU as the kernels index them, give
    ``conv2d`` with the stride in float64, for every row: one all-zero and one fully dense among them."""
    from unsparse.runtime import generated_source as gs

    N, C, H, W, M, kernel, stride, padding, density = case
    generator = torch.Generator().manual_seed(sum(case[:8]))
    weight = torch.randn(M, C, kernel, kernel, generator=generator, dtype=torch.float64)
    weight *= torch.rand(weight.shape, generator=generator, dtype=torch.float64) < density
    weight[0], weight[1] = 0.0, torch.randn(C, kernel, kernel, generator=generator, dtype=torch.float64)
    csr = UniformCSR.from_dense(weight.float())
    x = torch.randn(N, C, H, W, generator=generator)
    geometry = ConvGeometry.of(stride, padding)
    assert on_cpu.unsupported_reason(x, csr, geometry) is None
    layer_one = on_cpu.stride_one_layer(x, csr, geometry)
    expected = F.conv2d(x.double(), weight.float().double(), stride=stride, padding=padding)
    assert layer_one.split is not None and layer_one.geometry.stride == (1, 1)
    assert layer_one.out_hw == tuple(expected.shape[2:])
    padded = layer_one.kernel_input(x).numpy()
    weight_one = layer_one.csr.to_conv2d_weight().numpy()
    programs = gs.programs(weight_one, layer_one.geometry.padding, layer_one.in_hw, 4, layer_one.out_hw)
    out = torch.from_numpy(np.concatenate([gs.run_program(p, padded) for p in programs], axis=1))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert on_cpu.stride_one_layer(x, csr, geometry).split is layer_one.split  # split once per weight


LOAD_BATCHES = ({"rows": 32, "programs": 1, "load_batch": 16}, {"rows": 32, "programs": 1, "load_batch": 32})
"""The settings of 32 rows whose bodies group their loads: timed wherever the first setting is."""

WIDE_LOAD_BATCH = {"rows": 64, "programs": 1, "load_batch": 16}
"""The setting of 64 rows whose body groups its loads: timed where 64 rows are."""


def test_tuning_space_bounds_the_generated_body() -> None:
    backend = get_backend("generated")
    x = torch.randn(1, 4, 6, 6)
    assert SETTINGS[0] == {"rows": 32, "programs": 1}
    assert backend.tuning_space(x, layer(out_channels=256), ConvGeometry.of(1, 1)) == [  # batch 1: no chunks
        params for params in SETTINGS if "chunks" not in params and "min_blocks" not in params]  # stride 1
    assert backend.tuning_space(x, layer(out_channels=10), ConvGeometry.of(1, 1)) == [SETTINGS[0]]
    assert backend.tuning_space(x, layer(out_channels=100), ConvGeometry.of(1, 1)) == [  # 4 programs of 32 rows
        {"rows": 32, "programs": 1}, {"rows": 64, "programs": 1}, {"rows": 128, "programs": 1},
        {"rows": 32, "programs": 4}, {"rows": 32, "programs": 1, "streams": 8},
        {"rows": 32, "programs": 1, "streams": 8, "graph": True}, *LOAD_BATCHES, WIDE_LOAD_BATCH]
    assert {"rows": 128, "programs": 1} not in backend.tuning_space(x, layer(out_channels=64), ConvGeometry.of(1, 1))
    assert backend.tuning_space(x, layer(out_channels=20), ConvGeometry.of(1, 1)) == [  # one kernel
        SETTINGS[0], *LOAD_BATCHES]
    dense = layer(out_channels=256, channels=256, kernel=3, density=1.0)  # 2304 per row: 32 rows fit, 64 do not
    assert dense.row_length * 64 > MAX_PRODUCTS >= dense.row_length * 32
    assert backend.tuning_space(x, dense, ConvGeometry.of(1, 1)) == [
        {"rows": 32, "programs": 1}, {"rows": 32, "programs": 1, "streams": 8},
        {"rows": 32, "programs": 1, "streams": 8, "graph": True}, *LOAD_BATCHES]
    stem = backend.tuning_space(x, layer(out_channels=64), ConvGeometry.of(2, 1))  # strided: also the bounded 64
    assert [params for params in stem if "min_blocks" in params] == [
        {"rows": 64, "programs": 1, "min_blocks": 1}, {"rows": 64, "programs": 1, "min_blocks": 2}]
    bounded_shared = {"rows": 32, "programs": 4, "min_blocks": 3}
    pointwise = backend.tuning_space(x, layer(out_channels=100, kernel=1), ConvGeometry.of(1, 0))
    assert [params for params in pointwise if "min_blocks" in params] == [bounded_shared]  # 1x1: the bounded 4
    assert pointwise.index(bounded_shared) == len(pointwise) - 1 and {"rows": 32, "programs": 4} in pointwise
    strided_pointwise = backend.tuning_space(x, layer(out_channels=100, kernel=1), ConvGeometry.of(2, 0))
    assert [params for params in strided_pointwise if "min_blocks" in params] == [
        {"rows": 64, "programs": 1, "min_blocks": 1}, {"rows": 64, "programs": 1, "min_blocks": 2}, bounded_shared]
    assert bounded_shared not in backend.tuning_space(x, layer(out_channels=96, kernel=1), ConvGeometry.of(1, 0))


@pytest.mark.parametrize(("dtype", "stride"), [(torch.float32, 1), (torch.float16, 1), (torch.float32, 2)])
def test_graph_settings_are_timed_only_within_the_bytes_their_capture_holds(
        monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, stride: int) -> None:
    """A ``graph`` setting keeps a copy of the input, the float32 padded input and the output between calls: it is
    timed only while those bytes stay within GRAPH_BYTES; its twin on 8 streams stays."""
    from unsparse.runtime.backends import generated

    backend = get_backend("generated")
    csr, geometry = layer(out_channels=100, dtype=dtype), ConvGeometry.of(stride, 1)
    x = torch.randn(3, 4, 9, 7).to(dtype)
    E, F_ = (9 + 2 - 3) // stride + 1, (7 + 2 - 3) // stride + 1
    element = x.element_size()
    padded = (4 * 11 * 9 if stride == 1  # padded by 1; a split: 4 phase images of 5x4, of 2x2 filters, padded by 1
              else 4 * 4 * (5 + 2) * (4 + 2))
    expected = 3 * (4 * 9 * 7 * element + padded * 4 + 100 * E * F_ * element)
    assert backend.graph_bytes(x, csr, geometry) == expected
    twin = {"rows": 32, "programs": 1, "streams": 8}
    for bound, admitted in ((expected, True), (expected - 1, False)):
        monkeypatch.setattr(generated, "GRAPH_BYTES", bound)
        space = backend.tuning_space(x, csr, geometry)
        assert ({**twin, "graph": True} in space) == admitted and twin in space


def test_release_drops_the_graph_captures_and_keeps_the_rest(on_cpu: GeneratedBackend) -> None:
    """After the comparator's timings only the chosen setting runs: ``release`` drops the weight's ``graph``
    captures (rebuilt by the next call that needs one) and keeps its programs, launches and other weights'."""
    csr, other = layer(), layer(out_channels=16)
    builds: list[Any] = []

    def entry(weight: UniformCSR, key: tuple) -> object:
        return on_cpu._cache.get(weight, key, lambda: builds.append(key) or object())

    keys = [("graph", 1), ("programs", 32), ("graph", 2), ("launches", 32)]
    before = [entry(csr, key) for key in keys] + [entry(other, ("graph", 1))]
    on_cpu.release(csr)
    on_cpu.release(layer(out_channels=12))  # nothing cached for it: nothing happens
    after = [entry(csr, key) for key in keys] + [entry(other, ("graph", 1))]
    assert [a is b for a, b in zip(before, after, strict=True)] == [False, True, False, True, True]
    assert builds == [*keys, ("graph", 1), ("graph", 1), ("graph", 2)]


def dense_rows(out_channels: int, row_length: int) -> UniformCSR:
    """A 3x3 layer whose every row holds ``row_length`` nonzeros."""
    weight = torch.zeros(out_channels, -(-row_length // 9), 3, 3)
    weight.view(out_channels, -1)[:, :row_length] = 1.0
    csr = UniformCSR.from_dense(weight)
    assert csr.row_length == row_length
    return csr


@pytest.mark.parametrize("rows", [64, 128])
@pytest.mark.parametrize("beyond", [0, 1])
def test_wide_programs_are_timed_only_within_their_bound(rows: int, beyond: int) -> None:
    """Beyond MAX_WIDE_PRODUCTS a 64-row program was slower than 32 rows wherever measured: a program of 64 or 128
    rows is not timed there, while the 32-row settings stay."""
    csr = dense_rows(256, MAX_WIDE_PRODUCTS // rows + beyond)
    x = torch.randn(1, csr.in_channels_per_group, 6, 6)
    space = get_backend("generated").tuning_space(x, csr, ConvGeometry.of(1, 1))
    assert ({"rows": rows, "programs": 1} in space) == (not beyond)
    assert {"rows": 32, "programs": 1} in space and {"rows": 32, "programs": 4} in space


@pytest.mark.parametrize(("row_length", "shared"), [
    (MAX_SHARED_PRODUCTS // 256, [4, 8]),  # eight programs of 32 rows just fit
    (MAX_SHARED_PRODUCTS // 256 + 1, [4]),
    (MAX_SHARED_PRODUCTS // 128 + 1, []),
])
def test_kernels_of_several_programs_are_timed_only_within_their_compile_bound(row_length, shared) -> None:
    """A kernel of G programs compiles its bodies in series: the comparator times it only while rows x G x the row
    length stays within MAX_SHARED_PRODUCTS; kernels of one program are bounded per program only."""
    csr = dense_rows(256, row_length)
    x = torch.randn(1, csr.in_channels_per_group, 6, 6)
    space = get_backend("generated").tuning_space(x, csr, ConvGeometry.of(1, 1))
    assert [params["programs"] for params in space if params["programs"] > 1] == shared
    assert {"rows": 32, "programs": 1} in space


def test_chunked_settings_need_two_images_per_chunk() -> None:
    """A chunked setting is timed only where each of its sub-batches holds at least two images; it is refused as
    a call argument below one chunk."""
    backend = get_backend("generated")
    csr, geometry = layer(out_channels=256), ConvGeometry.of(1, 1)
    chunked = [params for params in SETTINGS if params.get("chunks", 1) > 1]
    assert chunked and all(params["chunks"] == 4 for params in chunked)
    for batch, admitted in ((7, False), (8, True), (128, True)):
        space = backend.tuning_space(torch.empty(1, 4, 6, 6).expand(batch, 4, 6, 6), csr, geometry)
        assert all((params in space) == admitted for params in chunked), batch


@pytest.mark.parametrize(("chunks", "load_batch", "min_blocks"), [(0, 1, 0), (1, 0, 0), (1, 1, -1)])
def test_conv_refuses_fewer_than_one_chunk_or_load_or_negative_blocks(on_cpu: GeneratedBackend, chunks: int,
                                                                      load_batch: int, min_blocks: int) -> None:
    with pytest.raises(ValueError, match=f"min_blocks at least 0, got {chunks}, {load_batch} and {min_blocks}"):
        on_cpu.conv(torch.randn(2, 4, 6, 6), layer(), None, ConvGeometry.of(1, 1), chunks=chunks,
                    min_blocks=min_blocks, load_batch=load_batch)


def test_compile_all_compiles_each_distinct_kernel_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings that differ only in ``streams`` list the same kernels: each is compiled once, and every position of
    the list gets its kernel back."""
    from unsparse.runtime.backends import generated

    calls: list[tuple[str, str]] = []
    monkeypatch.setattr(generated, "compiled",
                        lambda source, entry, options: calls.append((source, entry)) or source + entry)
    kernels = [("a", "k"), ("b", "k"), ("a", "k"), ("a", "s"), ("b", "k")]
    assert generated.compile_all(kernels) == ["ak", "bk", "ak", "as", "bk"]
    assert sorted(calls) == [("a", "k"), ("a", "s"), ("b", "k")]


def test_compile_all_starts_the_longest_sources_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compile time grows with a kernel's body, so the longest go to the workers first; the result keeps the order
    asked for."""
    from unsparse.runtime.backends import generated

    calls: list[str] = []
    monkeypatch.setattr(generated, "compiled", lambda source, entry, options: calls.append(source) or source)
    kernels = [("bb", "k"), ("a", "k"), ("dddd", "k"), ("ccc", "k")]
    assert generated.compile_all(kernels, workers=1) == ["bb", "a", "dddd", "ccc"]
    assert calls == ["dddd", "ccc", "bb", "a"]


def test_compile_all_starts_no_compile_after_its_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """A benchmark's time budget reaches into its compile ahead: with one worker and a clock that passes the
    deadline during the second compile, the two longest kernels are compiled and the rest come back as None (every
    position of a kernel listed twice alike); a deadline already past compiles nothing."""
    from unsparse.runtime.backends import generated

    clock = [0.0]
    calls: list[str] = []

    def compile_for_ten_seconds(source: str, entry: str, options: tuple[str, ...]) -> str:
        calls.append(source)
        clock[0] += 10.0
        return source

    monkeypatch.setattr(generated, "compiled", compile_for_ten_seconds)
    monkeypatch.setattr(generated.time, "monotonic", lambda: clock[0])
    kernels = [("bb", "k"), ("a", "k"), ("dddd", "k"), ("ccc", "k"), ("a", "k")]
    assert generated.compile_all(kernels, workers=1, deadline=15.0) == [None, None, "dddd", "ccc", None]
    assert calls == ["dddd", "ccc"]
    calls.clear()
    assert generated.compile_all(kernels, workers=1, deadline=clock[0] - 1) == [None] * 5 and calls == []


def test_kernel_sources_do_not_depend_on_the_batch_and_are_what_precompile_compiles(
        on_cpu: GeneratedBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    """One compile serves every batch size: the sources of batch 1 and of batch 128 are the same, and precompile
    compiles exactly the listed kernels of every setting."""
    from unsparse.runtime.backends import generated

    csr, geometry = layer(out_channels=200, channels=8), ConvGeometry.of(1, 1)
    small, large = torch.empty(1, 8, 9, 9), torch.empty(1, 8, 9, 9).expand(128, 8, 9, 9)
    space = on_cpu.tuning_space(small, csr, geometry)
    chunked = on_cpu.tuning_space(large, csr, geometry)
    assert [params for params in chunked if "chunks" not in params] == space  # batch 128 adds the chunked twins
    assert {(params["rows"], params["programs"]) for params in chunked} == {
        (params["rows"], params["programs"]) for params in space}
    sources = on_cpu.kernel_sources(small, csr, geometry, space)
    assert sources == on_cpu.kernel_sources(large, csr, geometry, space)
    assert set(on_cpu.kernel_sources(large, csr, geometry, chunked)) == set(sources)
    # 200 rows: 7 programs of 32 (listed again for the streams setting and its graph), 4 of 64, 2 of 128, 2 kernels
    # of 4 programs of 32, and 7 programs of 32 at each of two groupings of their loads and 4 of 64 at one, sources
    # of their own
    assert [(p["rows"], p["programs"], p.get("streams", 1), p.get("graph", False), p.get("load_batch", 1))
            for p in space] == [
        (32, 1, 1, False, 1), (64, 1, 1, False, 1), (128, 1, 1, False, 1), (32, 4, 1, False, 1), (32, 1, 8, False, 1),
        (32, 1, 8, True, 1), (32, 1, 1, False, 16), (32, 1, 1, False, 32), (64, 1, 1, False, 16)]
    assert len(sources) == 7 + 4 + 2 + 2 + 7 + 7 + 7 + 7 + 4 and len(set(sources)) == 7 + 4 + 2 + 2 + 7 + 7 + 4
    strided = on_cpu.kernel_sources(small, csr, ConvGeometry.of(2, 1), on_cpu.tuning_space(
        small, csr, ConvGeometry.of(2, 1)))  # the two min_blocks settings: 4 programs of 64 each, other bounds
    assert len(strided) == len(sources) + 2 * 4 and len(set(strided)) == len(set(sources)) + 2 * 4
    compiled: list[list[tuple[str, str]]] = []
    monkeypatch.setattr(generated, "compile_all", lambda kernels: compiled.append(kernels))
    on_cpu.precompile(large, csr, geometry, space)
    assert compiled == [sources]


class ProbeRun:
    """Stands in for the GPU under :meth:`GeneratedBackend.estimate_ms`: a launch "takes" 0.001 ms per product of
    its program and a call the sum of its launches; records the kernels compiled, the programs bound, the launches
    of each timing's first call and the padded input each call of a timing read (one call per rotated input and one
    past them, which wraps to the first)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from unsparse.runtime.backends import generated
        from unsparse.runtime.timing import Timing

        self.compiled: list[list[tuple[str, str]]] = []
        self.bound: list[tuple[int, int, int, bool, bool, int]] = []
        self.calls: list[list[tuple[int, int]]] = []
        self.padded: list[list[torch.Tensor]] = []

        def bind(backend, x, csr, layer, setting, kernels):
            [[program]] = kernels

            def launch(stream, padded, bias, residual, y):
                self.calls[-1].append((setting.rows, program.first))
                self.padded[-1].append(padded)

            self.bound.append((program.first, setting.rows, setting.min_blocks, setting.relu, setting.max_pool,
                               setting.load_batch))
            return [(launch, False)]

        def time_fn(fn, device, runs=20, warmup=3, rotation=1):
            read = []
            for i in range(rotation + 1):
                self.calls.append([])
                self.padded.append([])
                fn(i)
                read.append(self.padded.pop()[0])
                if i:
                    self.calls.pop()
            self.padded.append(read)
            median = 0.001 * self.products[self.calls[-1][0]] * len(self.calls[-1])
            return Timing(median, median, median, runs, rotation)

        monkeypatch.setattr(generated, "compile_all", self.compiled.append)
        monkeypatch.setattr(GeneratedBackend, "_bind", bind)
        monkeypatch.setattr(generated, "time_fn", time_fn)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type("S", (), {"cuda_stream": 0}))
        self.products: dict[tuple[int, int], int] = {}


@pytest.mark.parametrize("stride", [1, 2])
def test_a_setting_is_estimated_by_a_call_of_its_medians_kernel_once_per_kernel(
        on_cpu: GeneratedBackend, monkeypatch: pytest.MonkeyPatch, stride: int) -> None:
    """Per setting of one program per kernel, one timed call that launches the kernel of the program of median
    products (compiled first, one of the setting's own kernels, bound with the epilogue flags) once per kernel of
    the setting, call i on input i of the rotation; kernels of several programs are not estimated. Settings on
    several streams or in chunks need the GPU's streams and run in ``tests/gpu``."""
    from unsparse.runtime import generated_source as gs

    probe_run = ProbeRun(monkeypatch)
    csr, geometry, x = layer(out_channels=200, channels=8), ConvGeometry.of(stride, 1), torch.randn(2, 8, 9, 9)
    space = [params for params in on_cpu.tuning_space(x, csr, geometry) if params.get("streams", 1) == 1]
    stride_one = on_cpu.stride_one_layer(x, csr, geometry)
    weight = stride_one.csr.to_conv2d_weight().float().numpy()
    expected, probes = [], []
    for params in space:
        every = gs.programs(weight, stride_one.geometry.padding, stride_one.in_hw, params["rows"], stride_one.out_hw)
        median = sorted(every, key=lambda program: program.products)[len(every) // 2]
        probe_run.products[params["rows"], median.first] = median.products
        if params["programs"] == 1:
            load_batch = params.get("load_batch", gs.LOAD_BATCH)
            probes.append((median.first, params["rows"], params.get("min_blocks", 0), True, False, load_batch))
            source = gs.kernel_source(median, x.dtype, params.get("min_blocks", 0), load_batch), gs.ENTRY
            assert source in on_cpu.kernel_sources(x, csr, geometry, [params])
        expected.append(len(every) * 0.001 * median.products if params["programs"] == 1 else None)
    inputs = [x, x + 1.0]
    estimates = on_cpu.estimate_ms(inputs, csr, geometry, space, relu=True)
    assert estimates == pytest.approx(expected)
    padded = [stride_one.kernel_input(v) for v in inputs]
    assert all(len(read) == 3 and all(torch.equal(read[i], padded[i % 2]) for i in range(3))
               for read in probe_run.padded), "the calls rotate through the inputs as the comparator's timings do"
    assert sum(estimate is None for estimate in estimates) == sum(params["programs"] > 1 for params in space) > 0
    assert probe_run.bound == probes
    assert [set(call) for call in probe_run.calls] == [{(rows, first)} for first, rows, *_ in probes]
    assert probe_run.compiled == [on_cpu.kernel_sources(x, csr, geometry, [p for p in space if p["programs"] == 1],
                                                        probes=True)]


def test_under_graph_timing_a_setting_is_estimated_by_replays_of_each_inputs_captured_call(
        on_cpu: GeneratedBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``graphs`` (the comparator's ``timing="graph"``), each rotated input's probe call is captured once and
    the timed calls are replays, input i % len on call i, with the same estimates as eager calls of the stub."""
    from unsparse.runtime.backends import generated

    probe_run = ProbeRun(monkeypatch)
    captured: list[Any] = []

    class Captured:
        def __init__(self, forward: Any) -> None:
            self.replay = forward
            captured.append(self)

    monkeypatch.setattr(generated, "capture_graph", Captured)
    csr, geometry, x = layer(out_channels=200, channels=8), ConvGeometry.of(1, 1), torch.randn(2, 8, 9, 9)
    space = [params for params in on_cpu.tuning_space(x, csr, geometry)
             if params.get("streams", 1) == 1 and params["programs"] == 1]
    inputs = [x, x + 1.0]
    for params in space:
        every = on_cpu._programs(csr, on_cpu.stride_one_layer(x, csr, geometry), params["rows"])
        median = sorted(every, key=lambda program: program.products)[len(every) // 2]
        probe_run.products[params["rows"], median.first] = median.products
    eager = on_cpu.estimate_ms(inputs, csr, geometry, space)
    assert captured == []
    assert on_cpu.estimate_ms(inputs, csr, geometry, space, graphs=True) == eager
    assert len(captured) == len(inputs) * len(space)
    padded = [on_cpu.stride_one_layer(x, csr, geometry).kernel_input(v) for v in inputs]
    assert all(torch.equal(read[i], padded[i % 2]) for read in probe_run.padded[len(space):] for i in range(3))


def test_nothing_is_estimated_where_the_call_would_fail(on_cpu: GeneratedBackend,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer the backend refuses, and a pooled plane below 2x2: every estimate None, nothing compiled or bound,
    so the check records why."""
    probe_run = ProbeRun(monkeypatch)
    csr = layer(out_channels=40)
    space = [dict(SETTINGS[0])]
    assert on_cpu.estimate_ms([torch.randn(1, 4, 9, 9)], csr, ConvGeometry.of(1, 1, 2), space) == [None]
    assert on_cpu.estimate_ms([torch.randn(1, 4, 1, 1)], csr, ConvGeometry.of(1, 1), space, max_pool=True) == [None]
    assert probe_run.compiled == [] and probe_run.bound == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("padding", [(0, 0), (1, 1), (2, 0), (0, 3)])
@pytest.mark.parametrize("channels_last", [False, True])
def test_padded_float32_is_the_zero_padded_float32_input(dtype: torch.dtype, padding: tuple[int, int],
                                                          channels_last: bool) -> None:
    """The kernels' input on the CPU (``F.pad`` there; the GPU's ``pad_planes`` has its GPU test): contiguous
    float32, for any float dtype and layout; an unpadded float32 input is not copied."""
    from unsparse.runtime.backends import generated

    x = torch.randn(2, 3, 5, 4).to(dtype)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    padded = generated.padded_float32(x, padding)
    expected = F.pad(x.float(), (padding[1], padding[1], padding[0], padding[0]))
    assert padded.dtype == torch.float32 and padded.is_contiguous()
    assert torch.equal(padded, expected)
    if dtype == torch.float32 and padding == (0, 0) and not channels_last:
        assert padded.data_ptr() == x.data_ptr()


def emulate_pad_planes(x: torch.Tensor, padding: tuple[int, int], gather: tuple,
                       monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    """``pad_planes`` in Python, line by line and vectorised over every warp's rows and lanes, run with the launch
    and arguments :func:`~unsparse.runtime.backends.generated.bound_padding` binds for ``x`` (``(N, C, H, W)``) and
    ``gather`` (:func:`~unsparse.runtime.backends.generated.padding_phases`), as
    :func:`~unsparse.runtime.backends.generated.padded_float32` asks on CUDA: per padded row its plane, phase and
    input row (or -1), per lane its column, the loads inside the input and the stores inside the output."""
    from unsparse.runtime import cupy_launcher as cl
    from unsparse.runtime.backends import generated

    N, C, H, W = x.shape
    phases, phase_hw = gather
    bound: list[tuple] = []
    monkeypatch.setattr(cl, "bind", lambda spec, args, device: bound.append((spec, args)))
    generated.bound_padding.__wrapped__(N * C, (H, W), padding, phases, phase_hw, x.dtype, torch.device("cpu"))
    (spec, args), = bound
    assert spec.name == f"pad_planes<{lg.cuda_type(x.dtype)},{lg.PADDING_ROWS}>"
    planes, H, W, pad_h, pad_w, SH, SW, FH, FW, PH, PW, HQ, WQ = args[2:]
    HP, WP = HQ + 2 * pad_h, WQ + 2 * pad_w
    rows = planes * PH * PW * HP
    row = torch.arange(spec.grid[0] * spec.block[0] // 32 * lg.PADDING_ROWS).unsqueeze(1)  # every warp's rows
    out_plane = row // HP
    plane, phase = out_plane // (PH * PW), out_plane % (PH * PW)
    q = row - out_plane * HP - pad_h
    y = SH * q + FH + phase // PW
    first_column = FW + phase % PW
    source = torch.where((row < rows) & (q >= 0) & (q < HQ) & (y < H), (plane * H + y) * W + first_column, -1)
    xx = torch.arange(-(-WP // 32) * 32).unsqueeze(0)  # every lane of every 32-column step
    u = xx - pad_w
    load = (xx < WP) & (u >= 0) & (u < WQ) & (source >= 0) & (SW * u + first_column < W)
    flat = x.contiguous().reshape(-1).float()
    value = torch.where(load, flat[torch.where(load, source + SW * u, 0)], 0.0)
    store = (xx < WP) & (row < rows)
    out = torch.full((rows * WP,), float("nan"))
    out[(row * WP + xx)[store]] = value[store]
    return out.view(N, -1, HP, WP)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_padding_kernel_emulation_gathers_the_padded_phase_images(dtype: torch.dtype,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """``pad_planes`` (emulated, with the arguments the Python side binds) writes ``F.pad`` of the float32 phase
    images (:meth:`PhaseSplit.input`) on every layer of the phase tests that ``padding_phases`` gathers in one pass
    (phases in one run per axis, a stride within 32 bits; the other three keep the two copies), and the plain padded
    copy without a split."""
    from tests.test_phases import CASES as PHASE_CASES
    from unsparse.runtime.backends.generated import padding_phases

    gathered = 0
    for N, C, H, W, M, R, S, stride, padding in PHASE_CASES:
        split = phase_split(UniformCSR.from_dense(torch.randn(M, C, R, S)), ConvGeometry.of(stride, padding))
        x = torch.randn(N, C, H, W).to(dtype)
        gather = padding_phases(x.shape, split)
        if gather is None:
            continue
        pad_h, pad_w = split.geometry.padding
        expected = F.pad(split.input(x).float(), (pad_w, pad_w, pad_h, pad_h))
        assert torch.equal(emulate_pad_planes(x, split.geometry.padding, gather, monkeypatch), expected), stride
        gathered += 1
    assert gathered == 10
    x = torch.randn(3, 5, 13, 70).to(dtype)  # rows wider than two warps
    gather = padding_phases(x.shape, None)
    assert torch.equal(emulate_pad_planes(x, (2, 1), gather, monkeypatch), F.pad(x.float(), (1, 1, 2, 2)))


def test_one_weight_at_two_paddings_gets_two_phase_splits(on_cpu: GeneratedBackend) -> None:
    """The programs and launches of a weight are cached by its original geometry: stride 2 with padding 3 and with
    padding 4 split the taps into the same phase-channel count and padding but other columns, so each gets its own
    kernels, and asking again gives the first ones."""
    csr, x = layer(out_channels=6, channels=3, kernel=7, density=0.3), torch.randn(2, 3, 20, 20)
    space = [dict(SETTINGS[0])]
    three, four = ConvGeometry.of(2, 3), ConvGeometry.of(2, 4)
    assert on_cpu.stride_one_layer(x, csr, three).geometry.padding == (2, 2)
    assert on_cpu.stride_one_layer(x, csr, four).geometry.padding == (2, 2)
    first = on_cpu.kernel_sources(x, csr, three, space)
    assert on_cpu.kernel_sources(x, csr, four, space) != first
    assert on_cpu.kernel_sources(x, csr, three, space) == first
