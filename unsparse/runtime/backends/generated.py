"""The ``generated`` backend: weight-specialised direct sparse convolution (``kernels/generated_conv.cu``, v27).

Each nonzero of the layer's weight is compiled into the kernel as one fused multiply-add with an immediate operand
(:mod:`unsparse.runtime.generated_source`), one kernel per ``rows`` output channels, each looping over output pixels
(paper 004 §5 deploys one kernel per layer; Escoin paper 000 §3 is the direct method it specialises). The weight is
read once, on the host, when the kernels are generated; the kernels read no index at run time, so nothing from an
untrusted sparse file reaches a GPU address. Dilation 1, groups 1, float32 or float16 storage (float32 arithmetic);
a strided Conv2d runs as its stride-1 phase split (:mod:`unsparse.sparse.phases`: the input gathered into its padded
phase images inside the call, the kernels computing the strided layer's output plane), which is where a network's stem
(3 input channels, 7x7 or 11x11, stride 2 or 4) gets one loaded input value to feed every nonzero of the KT rows at
that tap. Other layers are refused with a reason and the comparator keeps cuDNN there.

Compiling costs seconds to minutes per layer (NVRTC, one module per kernel, compiled concurrently; CuPy also keeps
them in its disk cache), so the comparator leaves this backend out unless it is named
(:data:`~unsparse.runtime.comparator.COMPARED_BY_DEFAULT_EXCLUDES`).
"""

from __future__ import annotations

import functools
import hashlib
import math
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from unsparse.runtime import cupy_launcher as cl
from unsparse.runtime import generated_source as gs
from unsparse.runtime import launch_geometry as lg
from unsparse.runtime.backends.base import ConvBackend, WeightCache, kernel_input_reason, register_backend
from unsparse.runtime.backends.direct import kernel_residual
from unsparse.runtime.launch_geometry import Launch
from unsparse.runtime.timing import capture_graph, time_fn
from unsparse.sparse.format import UniformCSR
from unsparse.sparse.geometry import ConvGeometry
from unsparse.sparse.phases import PhaseSplit, phase_split

SETTINGS = ({"rows": 32, "programs": 1}, {"rows": 64, "programs": 1}, {"rows": 128, "programs": 1},
            {"rows": 32, "programs": 4}, {"rows": 32, "programs": 8}, {"rows": 32, "programs": 1, "streams": 8},
            {"rows": 64, "programs": 1, "chunks": 4}, {"rows": 64, "programs": 1, "min_blocks": 1},
            {"rows": 64, "programs": 1, "min_blocks": 2}, {"rows": 32, "programs": 1, "streams": 8, "graph": True},
            {"rows": 32, "programs": 1, "load_batch": 16}, {"rows": 32, "programs": 1, "load_batch": 32},
            {"rows": 64, "programs": 1, "load_batch": 16}, {"rows": 32, "programs": 4, "min_blocks": 3})
"""The settings the comparator times, the first the default: output channels per program (KT, the register
accumulators per thread), programs per kernel (G; G > 1 runs ``generated_conv_shared``, v31, each program on its
share of the SMs), ``streams``, how many of the layer's kernels may run at once (default 1, one after another; a
layer whose kernels each leave the SMs short of warps, 14x14 planes and batch 1, can overlap them, v32), and
``chunks``, sub-batches whose padding runs on a side stream while the kernels run on the one before (default 1: the
whole batch padded, then computed). At 0.98 the padding took about a quarter of VGG16 features.12's call and two
fifths of features.2's on the H200 (``pad_planes``, thirty-sixth session), while the kernels left DRAM bandwidth
unused; the chunked setting repeats (64, 1) with 4 sub-batches (features.2 2.63 -> 2.50 ms at 0.98, thirty-seventh
session; the twin of (32, 8) ran slower than (32, 8) on features.10 and .12, its four times as many launches each a
quarter as wide, and is not timed). The twenty-ninth session's probe on VGG16 features.12 at 0.9 ran 8.1 / 10.7 /
19.3 TFLOP/s at KT = 8 / 16 / 32 with G = 1 (``kernels/NOTES.md``). 128 rows double the products per input load at
high sparsity (a tap, an input channel and kernel position, has a nonzero among 64 rows with probability 1 - 0.95^64
= 0.96 at 0.95) at half the warps per SM (about 197 registers per thread). On the H200 (thirty-fifth session, VGG16,
FP32) they lost at batch 128 in all four layers where admitted (features.5 at 0.95 1.19x slower than 64 rows;
features.5, .7, .10 at 0.98 1.18-1.31x slower than the best) and won at batch 1 at 0.98 (features.5 0.021 against
0.026 ms, features.7 0.0285 against 0.031 ms: one kernel instead of two or four). ``min_blocks`` (default 0, none) is
the launch bound's blocks per SM, to which ptxas fits the registers per thread; timed with one program per kernel on
strided layers only (the stems, where the generated kernels pay; :meth:`GeneratedBackend.tuning_space`), and with four
on 1x1 layers only: on the H200 (sixty-fourth session, ResNet-50 at 0.9, FP32 b128, synthetic weights) the kernel of
four programs of 32 rows at 3 blocks per SM (80 registers instead of 64) ran the 1x1 layer2.2.conv1 and layer2.3.conv1
in 0.110 ms against 0.127, the 3x3 layer2.1.conv2 in 0.206 against 0.194. On the stems at 0.9 (local ptxas, 64 rows)
AlexNet's program takes 80 registers without it, 255 at 1 and 128 at 2, and ran fastest at 1 or 2 in the H200 runs (FP32
at batch 128 in the benchmark runs of 4eb2d81, d4c83bb and d630b0d: 0.189 ms unbounded, 0.172 at 1, 0.142 at 2);
ResNet-50's takes 128 without it or at 2 and 224 at 1, which lost. At 3 both took 80 and spilled, and lost (under
``ncu`` the ResNet-50 program's warps waited on loads 71 % of their cycles at 128 registers; 80 gave it a third more
warps but no faster run; ``kernels/NOTES.md``, fifty-fifth session). ``graph`` (default False) replays the call as a
CUDA graph captured once per input shape (:meth:`GeneratedBackend.conv`), timed on the 8-stream setting only, whose
many short kernels are host-bound when launched one by one (ResNet-50's layer4.0.conv3 at 0.9, batch 128, FP32: 64
launches, 0.245 ms as a graph, 0.54-1.11 ms eagerly; ``kernels/NOTES.md``, fifty-eighth session), and only within
:data:`GRAPH_BYTES`. ``load_batch`` (default :data:`~unsparse.runtime.generated_source.LOAD_BATCH`, 1) is the taps whose
loads each body issues together before their products (:func:`~unsparse.runtime.generated_source.products_source`),
which raises the loads in flight per thread and the registers: on the H200 (sixty-second session, synthetic uniform
weights at 0.9, FP32 b128, 32 rows) it ran ResNet-50's layer2.1.conv2 1.61x faster at 16 (ptxas had given three of its
four programs 48 registers and loads 11 instructions ahead of their use) and layer1.0.conv2 1.34x at 32, but VGG16's
features.12 6 % slower at 16 and 1.5x slower at 32, and layer3.1.conv2 8 % slower at 16 and 4 % faster at 32: a choice
per layer, timed beside the others. At 64 rows VGG16's features.12 ran 1.25x faster at 16 (still slower than 32 rows
ungrouped); local ptxas puts ResNet-50's layer1.0.conv2 program of 64 rows, that layer's winner in the fp32 plan of the
sixty-first session, at 80 registers and loads 19 instructions ahead ungrouped, 120 and 85 at 16. A kernel of several
programs is not grouped: its bodies share the registers of the most demanding one (layer2.1.conv2's four: 64 registers,
loads 69 instructions ahead, ungrouped). In the comparator (same session, a939c0e, ResNet-50 at 0.9, FP32 b128) 64 rows
at 16 became layer1.0.conv2's best, 0.213 ms against 0.245 ungrouped, and layer1.0.conv1's, 0.105 against 0.111;
layer2.1.conv2's 4-program kernel stayed best (0.192 ms; one program at 16: 0.228)."""

GRAPH_BYTES = 2**28
"""Most bytes a ``graph`` setting's captured call may hold for the comparator to time it: the input's copy, the padded
input and the output (:meth:`GeneratedBackend.graph_bytes`), which the capture keeps between calls, one per layer and
setting timed. At batch 128 in FP32, 256 MiB admits ResNet-50's 14x14 and 7x7 layers and its 28x28 3x3 layers, where the
calls are short and the host's launches count, and leaves out its 56x56 layers and 28x28 1x1 layers (294-980 MiB), where
no setting was measured host-bound; the captures of the admitted layers hold 4.1 GiB in all once each is timed. On the
H200 (``kernels/NOTES.md``, fifty-ninth session; ResNet-50 at 0.9, batch 128, FP32, eager) the setting ran
layer4.0.conv3 in 0.263 ms (its eager twin estimated at 1.09 ms, cuDNN 0.426) and layer3.0.conv3 in 0.192 ms (twin 0.616
estimated, cuDNN 0.345), the fastest setting of both."""

MAX_PRODUCTS = 2**17
"""Most multiply-adds one program's body may hold (``rows`` x the row length): bounds the generated source (about 50
bytes per product) and the compile time; denser layers are refused."""

MAX_WIDE_PRODUCTS = 2**13
"""Most multiply-adds a program of more than :data:`SETTINGS`' first ``rows`` (32; 64 or 128) may hold for the
comparator to time it. Measured on the H200 (VGG16, batch 128, FP32;
``h200_2026-11-29_generated_vgg16_s0{7,9}_fp32*.json``, ``..._s08_fp32_28.json``,
``..._v31_vgg16_s09_fp32_b1.json``): 64 rows beat 32 only where 64 x the row length was 5.1 k or less (features.0,
.2 and .5 at 0.9, batch 128 and 1), and were 1.02-1.82x slower in all ten cases from 9.2 k on (features.7, .10, .12,
.17 and .19 at 0.9; .5, .7, .10 and .12 at 0.7; .17 at 0.8: the larger body issues slower, ``kernels/NOTES.md``,
thirty-first session). Beyond this bound they cost compile time (half of a layer's) and are not timed."""

MAX_SHARED_PRODUCTS = 3 * 2**14
"""Most multiply-adds a kernel of several programs may hold (``rows`` x ``programs`` x the padded row length) for the
comparator to time it: NVRTC compiles the G bodies of such a kernel as one unit on one core (about 250-450 products
per second), while a layer's one-program kernels compile side by side. On the H200 machine (VGG16 at 0.9, batch 128,
FP32; ``kernels/NOTES.md``, thirty-first and thirty-third sessions) kernels of about 35 k products (features.12 and
.17, G = 4) compiled within the 2 minutes in which both layers compiled and ran, and ran 2-8 % faster than the
layer's one-program kernels on eight streams, while those of 65-70 k (features.19 G = 4: 2-3 minutes of NVRTC each)
came within 1.3 % of the next best setting (features.12 G = 8 against G = 4; features.19 G = 4, 1 % slower than
streams). The bound, 49,152, keeps the first and leaves out the second."""

PROBE_RUNS = 5
"""Timed calls of each setting's probe call (:meth:`GeneratedBackend.estimate_ms`), after two warm-up calls: the
estimate is their median (CUDA events)."""

INDEX_LIMIT = 2**31
"""The kernels index output pixels (``N * E * F``), the padded input plane of one image and (``pad_planes``) the
padded input's rows (``N * C * HP``) in 32 bits."""


def padded_float32(x: torch.Tensor, padding: tuple[int, int], split: PhaseSplit | None = None) -> torch.Tensor:
    """The contiguous float32 copy of ``x`` (``(N, C, H, W)``, any float dtype and layout), or with ``split`` of its
    phase images (:meth:`~unsparse.sparse.phases.PhaseSplit.input`, ``(N, C * P_h * P_w, HQ, WQ)``), zero-padded by
    ``padding`` on each side, as the generated kernels read it: ``(N, C', HQ + 2 * padding[0], WQ + 2 * padding[1])``.

    On CUDA one pass of ``pad_planes`` (``kernels/direct_conv.cu``), converting a float16 input on the way: each
    element read once and each padded element written once (8 bytes per float32 element, 6 per float16). ``F.pad``
    fills its whole output and then copies the input into it (12 bytes per float32 element): on the H200 it took
    1.595 ms of features.2's 3.0 ms at 0.98, batch 128 (its 1.64 GB input;
    ``benchmarks/results/h200_2026-11-29_v35_probe_border_vgg16_s098.json``), and torch's copy into the interior
    after zeroing the border strips ran 4 % faster than ``F.pad`` there but 3-10 % slower on the 112x112 and 56x56
    layers (``kernels/NOTES.md``, thirty-fifth session). The same pass gathers a split's phase images where their
    phases form one run per axis (:attr:`~unsparse.sparse.phases.PhaseSplit.one_run_per_axis`) and the stride fits
    32 bits, which saves the split's own copy of the input (``kernels/NOTES.md``, fifty-fifth session). Elsewhere
    ``F.pad`` of the float32 input (of the phase images). An unpadded float32 input without a split is returned
    itself (made contiguous).
    """
    pad_h, pad_w = padding
    if split is None and x.dtype == torch.float32 and not (pad_h or pad_w):
        return x.contiguous()
    gather = padding_phases(x.shape, split)
    if x.device.type != "cuda" or gather is None:
        x = x if split is None else split.input(x)
        return F.pad(x.contiguous().float(), (pad_w, pad_w, pad_h, pad_h))
    x = x.contiguous()
    N, C, H, W = x.shape
    phases, phase_hw = gather
    out = torch.empty(N, C * phases[2][0] * phases[2][1], phase_hw[0] + 2 * pad_h, phase_hw[1] + 2 * pad_w,
                      dtype=torch.float32, device=x.device)
    bound_padding(N * C, (H, W), padding, phases, phase_hw, x.dtype, x.device)(cl.current_stream(x.device), x, out)
    return out


def padding_phases(shape: Sequence[int], split: PhaseSplit | None) -> tuple[
        tuple[tuple[int, int], tuple[int, int], tuple[int, int]], tuple[int, int]] | None:
    """What ``pad_planes`` gathers from an input of ``shape`` ``(N, C, H, W)``: ``(phases, phase_hw)``, with
    ``phases`` the stride (clipped to the input, which changes nothing there: an axis no longer than its stride has
    one phase row or column), the first row and column phases and the number of each, for :func:`bound_padding`;
    ``((1, 1), (0, 0), (1, 1))`` and ``(H, W)`` without a split. None where the split's phases are not one run per
    axis or its stride does not fit the kernel's 32-bit arguments (:func:`padded_float32` then copies twice)."""
    H, W = shape[2], shape[3]
    if split is None:
        return ((1, 1), (0, 0), (1, 1)), (H, W)
    if not split.one_run_per_axis or max(split.stride) >= INDEX_LIMIT:
        return None
    phases = ((min(split.stride[0], H), min(split.stride[1], W)), (split.phases_h[0], split.phases_w[0]),
              (len(split.phases_h), len(split.phases_w)))
    return phases, split.input_size(H, W)


@functools.lru_cache(maxsize=256)
def bound_padding(planes: int, in_hw: tuple[int, int], padding: tuple[int, int],
                  phases: tuple[tuple[int, int], tuple[int, int], tuple[int, int]], phase_hw: tuple[int, int],
                  dtype: torch.dtype, device: torch.device) -> cl.BoundLaunch:
    """``pad_planes`` bound for ``planes`` input planes of ``in_hw`` on ``device``, gathering the phase images of
    ``phase_hw`` given by ``phases`` (the stride, the first row and column phases, the number of each; ``(1, 1), (0,
    0), (1, 1)`` and ``phase_hw = in_hw`` without a split) and padding them by ``padding`` (per call: the contiguous
    input, then the float32 output), once per size (:func:`padded_float32`)."""
    (stride_h, stride_w), (first_h, first_w), (count_h, count_w) = phases
    padded_hw = (phase_hw[0] + 2 * padding[0], phase_hw[1] + 2 * padding[1])
    spec = lg.padding_launch(dtype, planes * count_h * count_w, padded_hw)
    return cl.bind(spec, (cl.PER_CALL, cl.PER_CALL, planes, *in_hw, *padding, stride_h, stride_w, first_h, first_w,
                          count_h, count_w, *phase_hw), device)


@functools.cache
def compiled(source: str, entry: str, options: tuple[str, ...] = cl.COMPILE_OPTIONS) -> Any:
    """The ``cupy.RawKernel`` ``entry`` of ``source``, compiled once per process with the NVRTC ``options`` (through
    CuPy): :data:`~unsparse.runtime.generated_source.ENTRY` of a one-program source,
    :data:`~unsparse.runtime.generated_source.SHARED_ENTRY` of a source of several programs.

    Raises:
        ImportError: without CuPy.
    """
    import cupy

    return cupy.RawModule(code=source, options=options).get_function(entry)


def compile_all(kernels: list[tuple[str, str]], workers: int = 16,
                options: tuple[str, ...] = cl.COMPILE_OPTIONS, deadline: float | None = None) -> list[Any | None]:
    """:func:`compiled` of each ``(source, entry)`` pair with the NVRTC ``options``, concurrently (NVRTC runs
    outside the GIL), each distinct pair once: settings that share kernels (the same ``rows`` and ``programs`` with
    other ``streams``) list them twice, and two threads that miss :func:`compiled`'s cache together would both
    compile. The longest sources start first (a kernel's compile time is about proportional to its body, and the
    batch waits for its last), and as a layer's kernels can take minutes (:data:`MAX_SHARED_PRODUCTS`), on a terminal
    a tqdm bar counts the kernels done.

    ``deadline`` (``time.monotonic()`` seconds, None: none): a kernel whose compile has not started by then is not
    compiled and comes back as None; compiles already running finish (NVRTC cannot be stopped), so a benchmark's
    time budget bounds its compile ahead to the budget plus the longest compile in flight."""
    distinct = sorted(dict.fromkeys(kernels), key=lambda kernel: len(kernel[0]), reverse=True)

    def compile_in_time(kernel: tuple[str, str]) -> Any | None:
        if deadline is not None and time.monotonic() > deadline:
            return None
        return compiled(*kernel, options)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        done = tqdm(pool.map(compile_in_time, distinct), total=len(distinct),
                    desc="compile kernels", unit="kernel", leave=False, disable=None)
        functions = dict(zip(distinct, done, strict=True))
    return [functions[kernel] for kernel in kernels]


class Setting(NamedTuple):
    """One call's setting of :meth:`GeneratedBackend.conv`: its tuning parameters (:data:`SETTINGS`) and the
    epilogue's flags (the ReLU and the 2x2 max pool that follow the layer). ``graph``: the call replayed as a CUDA
    graph (:meth:`GeneratedBackend.conv`). ``probe``: each of the setting's kernels replaced by its probe
    (:meth:`GeneratedBackend.estimate_ms`), so the call's output is wrong but its time the estimate."""

    rows: int
    programs: int
    streams: int
    relu: bool
    max_pool: bool
    min_blocks: int
    graph: bool = False
    probe: bool = False
    load_batch: int = gs.LOAD_BATCH


class StrideOneLayer(NamedTuple):
    """The stride-1 layer the generated kernels run for a layer and input plane.

    Attributes:
        csr, geometry: the layer itself (stride 1), or its phase split's (phase channels, ``R' x S'`` filter,
            top/left padding, stride 1).
        split: the :class:`~unsparse.sparse.phases.PhaseSplit` of a strided layer, None at stride 1.
        in_hw: ``(H, W)`` of the input the kernels' padding reads (the phase images' size for a split).
        out_hw: ``(E, F)`` of the original layer, the outputs the kernels compute.
        original: the original layer's geometry; with ``in_hw`` it determines the rest for a weight, so the two
            key the weight's cached programs and launches.
    """

    csr: UniformCSR
    geometry: ConvGeometry
    split: PhaseSplit | None
    in_hw: tuple[int, int]
    out_hw: tuple[int, int]
    original: ConvGeometry

    def kernel_input(self, x: torch.Tensor) -> torch.Tensor:
        """The padded float32 input the kernels read (:func:`padded_float32`) of ``x``, ``(n, C, H, W)`` of the
        original layer: of its phase images (:meth:`~unsparse.sparse.phases.PhaseSplit.input`) for a split, in the
        same pass on CUDA."""
        return padded_float32(x, self.geometry.padding, self.split)


@functools.cache
def side_streams(device: torch.device, count: int) -> tuple[torch.cuda.Stream, ...]:
    """``count`` CUDA streams on ``device``, created once per process, that :meth:`GeneratedBackend.conv` spreads a
    layer's kernels over (``count`` > 1, ``streams``) or pads its sub-batches on (the one stream of ``count`` 1,
    ``chunks``)."""
    return tuple(torch.cuda.Stream(device) for _ in range(count))


@register_backend
class GeneratedBackend(ConvBackend):
    """Weight-specialised kernels; tuning parameters ``rows``, ``programs`` and ``streams`` (:data:`SETTINGS`)."""

    name = "generated"
    device_types = frozenset({"cuda"})
    fuses_relu = True
    fuses_max_pool = True
    fuses_residual_relu = True

    def __init__(self) -> None:
        self._cache = WeightCache()

    def adds_bias_in_epilogue(self, params: Mapping[str, Any]) -> bool:
        """True: every generated program adds ``bias[m]`` to its sums before it stores them."""
        return True

    def unsupported_reason(self, x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry) -> str | None:
        reason = super().unsupported_reason(x, csr, geometry)
        if reason is None:
            reason = kernel_input_reason(self.name, x, csr, gs.STORAGE_TYPES)
        if reason is not None:
            return reason
        if geometry.dilation != (1, 1) or (geometry.stride != (1, 1) and geometry.spatial_dims != 2):
            return (f"generated kernels run dilation 1 and strides other than 1 on Conv2d only (its phase split), "
                    f"not stride {geometry.stride} and dilation {geometry.dilation} on a Conv{geometry.spatial_dims}d")
        if csr.row_length * SETTINGS[0]["rows"] > MAX_PRODUCTS:
            return (f"{csr.row_length} nonzeros per row x {SETTINGS[0]['rows']} rows exceed {MAX_PRODUCTS} products "
                    "per generated program")
        layer = self.stride_one_layer(x, csr, geometry)
        N, C = x.shape[0], layer.csr.in_channels_per_group
        padded_h = layer.in_hw[0] + 2 * layer.geometry.padding[0]
        padded_w = layer.in_hw[1] + 2 * layer.geometry.padding[1]
        if (N * math.prod(layer.out_hw) >= INDEX_LIMIT or C * padded_h * padded_w >= INDEX_LIMIT
                or N * C * padded_h >= INDEX_LIMIT):
            return "tensor too large for the generated kernels' 32-bit pixel, offset and padded row indexing"
        return None

    def stride_one_layer(self, x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry) -> StrideOneLayer:
        """The :class:`StrideOneLayer` of a dilation-1 layer on input ``x`` (``(N, C, H, W)``): the layer itself at
        stride 1, else its phase split (cached per weight and geometry; paper 004 §5 deploys one kernel per layer,
        and the split keeps every nonzero and the uniform row length).

        Raises:
            ValueError: from :func:`~unsparse.sparse.phases.phase_split`, for a strided Conv1d or a dilated layer.
        """
        out_hw = geometry.output_size(x.shape[2], x.shape[3], csr.kernel_size)
        if geometry.stride == (1, 1):
            return StrideOneLayer(csr, geometry, None, (x.shape[2], x.shape[3]), out_hw, geometry)
        split = self._cache.get(csr, ("phases", geometry), lambda: phase_split(csr, geometry))
        return StrideOneLayer(split.csr, split.geometry, split, split.input_size(x.shape[2], x.shape[3]), out_hw,
                              geometry)

    def tuning_space(self, x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry) -> list[dict[str, Any]]:
        """The settings of :data:`SETTINGS` within :data:`MAX_PRODUCTS` per program; beyond the first, only those
        with ``rows`` below twice the layer's output channels (from twice on, at least half the accumulators stay
        empty), programs wider than the first within :data:`MAX_WIDE_PRODUCTS`, ``programs`` at most the layer's
        programs, ``ceil(M / rows)``, a kernel of several programs within :data:`MAX_SHARED_PRODUCTS` (its
        compile time), several ``streams`` only for a layer of several kernels, and ``chunks`` only for a batch of at
        least two images per chunk (a chunked setting runs its twin's kernels, so the space's kernels do not depend
        on the batch); ``min_blocks`` settings of one program per kernel only for a strided layer (a stem), those of
        several only for a 1x1 layer (where each was measured faster), by their unbounded twin's rules; ``graph``
        settings only within :data:`GRAPH_BYTES` (:meth:`graph_bytes`)."""
        return [dict(params) for params in SETTINGS if params["rows"] * csr.row_length <= MAX_PRODUCTS
                and (params == SETTINGS[0] or (
                    params["rows"] < 2 * csr.out_channels
                    and (params["rows"] <= SETTINGS[0]["rows"]
                         or params["rows"] * csr.row_length <= MAX_WIDE_PRODUCTS)
                    and params["programs"] <= -(-csr.out_channels // params["rows"])
                    and (params["programs"] == 1
                         or params["rows"] * params["programs"] * csr.row_length <= MAX_SHARED_PRODUCTS)
                    and (params.get("streams", 1) == 1
                         or -(-csr.out_channels // params["rows"]) > params["programs"])
                    and (params.get("chunks", 1) == 1 or x.shape[0] >= 2 * params["chunks"])
                    and ("min_blocks" not in params or (geometry.stride != (1, 1) if params["programs"] == 1
                                                        else csr.kernel_size == (1, 1)))
                    and (not params.get("graph") or self.graph_bytes(x, csr, geometry) <= GRAPH_BYTES)))]

    def graph_bytes(self, x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry) -> int:
        """Bytes a ``graph`` call's capture holds for input ``x`` (``(N, C, H, W)``): the copy of the input (``x``'s
        dtype), the float32 padded input the kernels read (:meth:`StrideOneLayer.kernel_input`, counted also where
        that is the input's copy itself) and the unpooled ``(N, M, E, F)`` output (``x``'s dtype): an upper bound."""
        layer = self.stride_one_layer(x, csr, geometry)
        padded = (layer.in_hw[0] + 2 * layer.geometry.padding[0]) * (layer.in_hw[1] + 2 * layer.geometry.padding[1])
        return x.shape[0] * (math.prod(x.shape[1:]) * x.element_size() + layer.csr.in_channels_per_group * padded * 4
                             + csr.out_channels * math.prod(layer.out_hw) * x.element_size())

    def screen_space(self, x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry) -> list[dict[str, Any]]:
        """The settings of :meth:`tuning_space` whose kernels hold one program each: they compile side by side, at
        most :data:`MAX_WIDE_PRODUCTS` products each beyond the first ``rows``, while a kernel of several programs
        (up to :data:`MAX_SHARED_PRODUCTS`) compiles as one unit on one core for up to minutes. The comparator
        compiles and times those only where the best of these comes near the layer's fastest other backend."""
        return [params for params in self.tuning_space(x, csr, geometry) if params["programs"] == 1]

    def kernel_sources(self, x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry,
                       space: list[dict[str, Any]], probes: bool = False) -> list[tuple[str, str]]:
        """The ``(source, entry)`` of every kernel of every setting in ``space`` for input ``x`` (its dtype and
        plane; the batch size and the threads per block are not in the source, so one list serves every batch),
        for :func:`compile_all`: :meth:`precompile` compiles one layer's, a benchmark can compile several layers'
        together (:func:`~unsparse.runtime.bench.compile_ahead`). With ``probes``, only the kernel
        :meth:`estimate_ms` times for each setting of one program per kernel (one of that setting's kernels)."""
        layer = self.stride_one_layer(x, csr, geometry)
        if probes:
            return [self._sources(x, layer, [[self._probe(csr, layer, params["rows"])]], params.get("min_blocks", 0),
                                  params.get("load_batch", gs.LOAD_BATCH))[0]
                    for params in space if params["programs"] == 1]
        return [kernel for params in space for kernel in
                self._sources(x, layer, self._kernels(csr, layer, params["rows"], params["programs"]),
                              params.get("min_blocks", 0), params.get("load_batch", gs.LOAD_BATCH))]

    def estimate_ms(self, inputs: Sequence[torch.Tensor], csr: UniformCSR, geometry: ConvGeometry,
                    settings: list[dict[str, Any]], relu: bool = False, max_pool: bool = False,
                    graphs: bool = False) -> list[float | None]:
        """Per setting of one program per kernel, the call's time (ms) with the epilogue flags ``relu`` and
        ``max_pool``, estimated by the call itself with one kernel standing in for all of the setting's: every
        program of a layer holds about the same number of products, ``rows`` x the uniform row length less the
        padding's zeros (paper 004 §5), so the kernel of the program of median products (:meth:`kernel_sources`
        with ``probes`` lists these; they compile first, concurrently, and a setting built later finds its own
        compiled) is launched as many times as the setting has kernels, with the setting's padding, ``streams``
        and ``chunks`` (its output is then wrong and dropped). Median of :data:`PROBE_RUNS` calls after two
        warm-ups, CUDA events, call ``i`` on ``inputs[i % len(inputs)]`` (``(N, C, H, W)`` each, the layer's input
        first), as the comparator times a call on its rotated inputs; with ``graphs``, each input's call captured
        as a CUDA graph (:func:`~unsparse.runtime.timing.capture_graph`) and replayed, as the comparator times
        under ``timing="graph"``: a setting of many kernels is host-bound when run eagerly (ResNet-50's
        layer4.0.conv3 at 0.9 on 8 streams, 64 launches: 0.245 ms as a graph in every process, 0.54-1.11 ms eagerly,
        the host's time to issue them; kernels/NOTES.md, fifty-eighth session), so an eager estimate would screen
        it out of a graph-timed comparison. A residual add after the convolution (in the kernels' epilogue,
        :meth:`conv`'s ``residual``: one more load per output) is not in the estimate.

        None for a setting of several programs per kernel (its kernel compiles as one unit: its probe would cost
        what the estimate saves), and for every setting where the call would fail (:meth:`unsupported_reason`, a
        pooled plane below 2x2): the check then records why."""
        x = inputs[0]
        layer = self.stride_one_layer(x, csr, geometry) if self.unsupported_reason(x, csr, geometry) is None else None
        if layer is None or (max_pool and min(layer.out_hw) < 2):
            return [None] * len(settings)
        single = [params for params in settings if params["programs"] == 1]
        compile_all(self.kernel_sources(x, csr, geometry, single, probes=True))

        def estimate(params: dict[str, Any]) -> float:
            setting = Setting(params["rows"], 1, params.get("streams", 1), relu, max_pool,
                              params.get("min_blocks", 0), params.get("graph", False), probe=True,
                              load_batch=params.get("load_batch", gs.LOAD_BATCH))
            calls = [functools.partial(self._call, v, csr, None, layer, setting, params.get("chunks", 1))
                     for v in inputs]
            if graphs:
                calls = [capture_graph(call).replay for call in calls]
            return time_fn(lambda i: calls[i % len(calls)](), x.device, runs=PROBE_RUNS, warmup=2,
                           rotation=len(calls)).median_ms

        return [estimate(params) if params["programs"] == 1 else None for params in settings]

    def release(self, csr: UniformCSR) -> None:
        """Drop the CUDA-graph captures of ``csr``'s ``graph`` settings (:meth:`conv`; up to :meth:`graph_bytes`
        each): after the comparator's timings only a plan's chosen setting runs, and captures again on its first
        call."""
        self._cache.drop(csr, lambda key: key[0] == "graph")

    def precompile(self, x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry,
                   space: list[dict[str, Any]]) -> None:
        """Compile every kernel of every setting in ``space`` (:meth:`kernel_sources`), concurrently, before anything
        is timed."""
        compile_all(self.kernel_sources(x, csr, geometry, space))

    def conv(self, x: torch.Tensor, csr: UniformCSR, bias: torch.Tensor | None, geometry: ConvGeometry,
             rows: int = SETTINGS[0]["rows"], programs: int = SETTINGS[0]["programs"],
             streams: int = 1, chunks: int = 1, relu: bool = False, max_pool: bool = False,
             min_blocks: int = 0, graph: bool = False, load_batch: int = gs.LOAD_BATCH,
             residual: torch.Tensor | None = None) -> torch.Tensor:
        """Pad the input in float32 (:func:`padded_float32`, timed with the call: the kernels read float32, since a
        conversion per load made NVRTC 3-4x slower; a strided layer's phase images, :meth:`stride_one_layer`, gathered
        in the same pass), then run the layer's programs of ``rows`` output channels,
        ``programs`` per kernel: a kernel of one program is v27's ``generated_conv``, one of several is
        ``generated_conv_shared``, whose tile counters (int32, zeroed here) are allocated with each call that has one.

        With ``streams`` > 1 the kernels (which write disjoint output channels) are spread round-robin over that
        many side streams of :func:`side_streams`, forked from and joined back into the current stream, so the
        output is ready in the current stream's order, as with one stream, and a CUDA graph captures the fork.

        With ``chunks`` > 1 the batch is split into that many sub-batches of ``ceil(N / chunks)`` images (UnSparse-Opt
        §5's sub-batch), each padded on a side stream (forked from the current one) and computed on the current
        stream once its padding is done, so that chunk k + 1's padding overlaps chunk k's kernels.

        The kernels read the bias as ``x``'s dtype, so a bias of another dtype (or not contiguous) is converted first,
        as the ``direct`` backend does. With ``relu`` they apply the ReLU that follows the layer as they store
        (:attr:`fuses_relu`), which saves the ReLU's pass over the output (read and write). With ``max_pool`` they
        also apply the 2x2, stride-2 max pool that follows it (:attr:`fuses_max_pool`; four lanes per pool window,
        ``kernels/generated_conv.cu``), which saves the pool's pass and three quarters of the output's writes.

        With ``graph`` the call (padding, kernels, streams) runs as a CUDA graph, captured at the first call of each
        input shape and dtype on a static copy of the input and replayed afterwards: each call then costs the host
        four launches (the input's and the bias's copies in, the replay, the output's copy out) instead of one per
        kernel, and the GPU the copies (reads and writes of the input and output). The capture, one per weight and
        setting, holds up to :meth:`graph_bytes` of device memory until the input's shape changes or the weight is
        edited; inside another capture (a model timed or run as a CUDA graph) the call is queued as without
        ``graph``.

        ``load_batch``: the taps whose loads each kernel's body issues together before their products
        (:func:`~unsparse.runtime.generated_source.products_source`; more loads in flight, more registers).

        ``residual`` (``(N, M, E, F)`` of ``x``'s dtype and device, any layout; None: none) is added by the kernels'
        epilogue after the bias and before the ReLU, in float32, rounded once with the rest (a residual block's
        ``relu(conv3(x) + identity)``, :attr:`fuses_residual_relu`; v64): one load per output instead of the add's
        pass over the output (a read of each of the two and a write). It is read in NCHW (a channels-last one is
        copied first, :func:`~unsparse.runtime.backends.direct.kernel_residual`); under ``graph`` it is copied into the
        capture's own residual with each call, as the input is, and with ``chunks`` each sub-batch's kernels read its
        part.

        Returns:
            ``(N, M, E, F)`` NCHW output of ``x``'s dtype; with ``max_pool`` ``(N, M, E // 2, F // 2)``.

        Raises:
            ValueError: for a layer :meth:`unsupported_reason` refuses, ``chunks`` < 1, ``min_blocks`` < 0,
                ``load_batch`` < 1, ``max_pool`` on an output plane below 2x2 or with a ``residual``, a
                ``residual`` not of the output's shape, dtype and device (naming ``residual``), or from
                :func:`~unsparse.runtime.generated_source.programs` (a weight that is not finite).
        """
        reason = self.unsupported_reason(x, csr, geometry)
        if reason is not None:
            raise ValueError(f"generated: {reason}")
        if chunks < 1 or min_blocks < 0 or load_batch < 1:
            raise ValueError(f"generated: chunks and load_batch must be at least 1 and min_blocks at least 0, got "
                             f"{chunks}, {load_batch} and {min_blocks}")
        layer = self.stride_one_layer(x, csr, geometry)
        if max_pool and min(layer.out_hw) < 2:
            raise ValueError("generated: max_pool needs an output plane of at least 2x2, not "
                             f"{layer.out_hw[0]}x{layer.out_hw[1]}")
        if residual is not None:
            if max_pool:
                raise ValueError("generated: residual: a residual add before a fused max pool is not supported")
            residual = kernel_residual(residual, (x.shape[0], csr.out_channels, *layer.out_hw), x)
        bias = None if bias is None else bias.to(x.dtype).contiguous()
        setting = Setting(rows, programs, streams, relu, max_pool, min_blocks, graph, load_batch=load_batch)
        return self._call(x, csr, bias, layer, setting, chunks, residual)

    def conv_call(self, x: torch.Tensor, csr: UniformCSR, bias: torch.Tensor | None, geometry: ConvGeometry,
                  residual: bool = False, **params: Any) -> Callable[..., torch.Tensor]:
        """:meth:`conv` bound but for the input (:meth:`~unsparse.runtime.backends.base.ConvBackend.conv_call`), and
        with ``residual`` True but for the input and the residual: ``f(x2, residual2)`` adds ``residual2`` in the
        kernels' epilogue (:meth:`conv`'s ``residual``), as :meth:`~unsparse.runtime.backends.base.ConvBackend.prepare`
        calls it for a layer fused with its residual add and ReLU."""
        if not residual:
            return super().conv_call(x, csr, bias, geometry, **params)
        return lambda x, residual: self.conv(x, csr, bias, geometry, residual=residual, **params)

    def _call(self, x: torch.Tensor, csr: UniformCSR, bias: torch.Tensor | None, layer: StrideOneLayer,
              setting: Setting, chunks: int, residual: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`conv` of a checked layer ``csr`` (its :meth:`stride_one_layer` ``layer``) and setting (``bias`` of
        ``x``'s dtype, contiguous, or None; ``residual`` as the kernels read it, or None): replayed (:meth:`_replay`)
        for a ``graph`` setting outside a capture, else queued (:meth:`_queue`)."""
        if setting.graph and not torch.cuda.is_current_stream_capturing():
            return self._replay(x, csr, bias, layer, setting, chunks, residual)
        return self._queue(x, csr, bias, layer, setting, chunks, residual)

    def _replay(self, x: torch.Tensor, csr: UniformCSR, bias: torch.Tensor | None, layer: StrideOneLayer,
                setting: Setting, chunks: int, residual: torch.Tensor | None) -> torch.Tensor:
        """:meth:`_queue` as a replay of its CUDA graph, captured (:func:`~unsparse.runtime.timing.capture_graph`)
        on static copies of ``x``, ``bias`` and ``residual`` at the first call of an input shape and dtype and kept
        per weight and setting (one capture: another shape, or a call with or without a bias or a residual, replaces
        it). Each call copies ``x``, ``bias`` and ``residual`` in, replays and
        returns a copy of the static output, all on the current stream, after the previous call's copy out, so that
        calls from several streams do not overwrite each other's static tensors."""
        state = self._cache.get(csr, ("graph", layer.original, setting, chunks), dict)
        signature = (tuple(x.shape), x.dtype, x.device, bias is None, residual is None)
        with torch.cuda.device(x.device):
            current = torch.cuda.current_stream(x.device)
            if state.get("signature") != signature:
                state.clear()
                static = torch.empty(x.shape, dtype=x.dtype, device=x.device)
                static_bias = None if bias is None else torch.empty_like(bias)
                static_residual = None if residual is None else torch.empty_like(residual)
                outputs: list[torch.Tensor] = []
                graph = capture_graph(lambda: outputs.append(
                    self._queue(static, csr, static_bias, layer, setting, chunks, static_residual)))
                state.update(signature=signature, graph=graph, x=static, bias=static_bias, residual=static_residual,
                             y=outputs[-1], done=torch.cuda.Event())
            else:
                current.wait_event(state["done"])
            state["x"].copy_(x)
            if bias is not None:
                state["bias"].copy_(bias)
            if residual is not None:
                state["residual"].copy_(residual)
            state["graph"].replay()
            y = state["y"].clone()
            state["done"].record(current)
        return y

    def _queue(self, x: torch.Tensor, csr: UniformCSR, bias: torch.Tensor | None, layer: StrideOneLayer,
               setting: Setting, chunks: int, residual: torch.Tensor | None = None) -> torch.Tensor:
        """Queue :meth:`conv`'s work for a checked layer and setting on the current stream (:meth:`_call`)."""
        N = x.shape[0]
        y = self._output(x, csr, layer, setting.max_pool)
        size = -(-N // chunks)
        if size == N:
            self._run_kernels(x, layer.kernel_input(x), bias, residual, y, csr, layer, setting)
            return y
        current = torch.cuda.current_stream(x.device)
        padder = side_streams(x.device, 1)[0]
        padder.wait_stream(current)
        for start in range(0, N, size):
            part = x[start:start + size]
            with torch.cuda.stream(padder):
                padded = layer.kernel_input(part)
            padded.record_stream(current)
            current.wait_stream(padder)
            self._run_kernels(part, padded, bias, None if residual is None else residual[start:start + size],
                              y[start:start + size], csr, layer, setting)
        return y

    def _run_kernels(self, x: torch.Tensor, padded: torch.Tensor, bias: torch.Tensor | None,
                     residual: torch.Tensor | None, y: torch.Tensor, csr: UniformCSR, layer: StrideOneLayer,
                     setting: Setting) -> None:
        """Queue the kernels of ``setting`` that compute ``y`` (``(n, M, E, F)``, or pooled, contiguous) from
        ``padded``, ``layer.kernel_input(x)`` of ``x`` (``(n, C, H, W)``), adding ``residual`` (contiguous, of
        ``y``'s shape, or None), after what the current stream holds (:meth:`conv`)."""
        launches = self._launches(x, csr, layer, setting)
        counters = (torch.zeros(len(launches), setting.programs, dtype=torch.int32, device=x.device)
                    if any(shared for _, shared in launches) else None)
        current = torch.cuda.current_stream(x.device)
        streams = setting.streams
        sides = side_streams(x.device, min(streams, len(launches))) if streams > 1 and len(launches) > 1 else ()
        for side in sides:
            side.wait_stream(current)
        targets = [side.cuda_stream for side in sides] or [current.cuda_stream]
        for index, (launch, shared) in enumerate(launches):
            launch(targets[index % len(targets)], padded, bias, residual, y,
                   *((counters[index],) if shared else ()))
        for side in sides:
            current.wait_stream(side)

    @staticmethod
    def _output(x: torch.Tensor, csr: UniformCSR, layer: StrideOneLayer, max_pool: bool) -> torch.Tensor:
        """An empty ``(N, M, E, F)`` output of ``x``'s dtype and device, ``(N, M, E // 2, F // 2)`` with
        ``max_pool``."""
        E, F_ = layer.out_hw
        return torch.empty(x.shape[0], csr.out_channels, *((E // 2, F_ // 2) if max_pool else (E, F_)),
                           dtype=x.dtype, device=x.device)

    def _programs(self, csr: UniformCSR, layer: StrideOneLayer, rows: int) -> list[gs.Program]:
        """The programs of ``layer`` (the stride-1 layer of ``csr``) for its input plane (cached per weight)."""

        def build() -> list[gs.Program]:
            weight = layer.csr.to_conv2d_weight().float().cpu().numpy()
            return gs.programs(weight, layer.geometry.padding, layer.in_hw, rows, layer.out_hw)

        return self._cache.get(csr, ("programs", rows, layer.in_hw, layer.original), build)

    def _probe(self, csr: UniformCSR, layer: StrideOneLayer, rows: int) -> gs.Program:
        """The program of ``rows`` output channels of ``layer`` that :meth:`estimate_ms` times: the median by
        products (the upper one of an even count), so the last program, partial where ``rows`` does not divide the
        output channels, stands for the rest only in a layer of one or two."""
        every = sorted(self._programs(csr, layer, rows), key=lambda program: program.products)
        return every[len(every) // 2]

    def _kernels(self, csr: UniformCSR, layer: StrideOneLayer, rows: int, programs: int) -> list[list[gs.Program]]:
        """The programs of ``layer``, ``programs`` per kernel (fewer in the last)."""
        every = self._programs(csr, layer, rows)
        return [every[start:start + programs] for start in range(0, len(every), programs)]

    @staticmethod
    def _sources(x: torch.Tensor, layer: StrideOneLayer, kernels: list[list[gs.Program]],
                 min_blocks: int, load_batch: int) -> list[tuple[str, str]]:
        """The CUDA source and entry name of each of ``kernels`` (:meth:`_kernels`) at ``x``'s dtype, ``min_blocks``
        and ``load_batch``."""
        return [(gs.kernel_source(kernel[0], x.dtype, min_blocks, load_batch), gs.ENTRY) if len(kernel) == 1 else
                (gs.shared_kernel_source(kernel, layer.csr.out_channels, x.dtype, min_blocks, load_batch),
                 gs.SHARED_ENTRY)
                for kernel in kernels]

    def _launches(self, x: torch.Tensor, csr: UniformCSR, layer: StrideOneLayer,
                  setting: Setting) -> list[tuple[cl.BoundLaunch, bool]]:
        """The bound launches of a setting, each with whether it takes tile counters (cached per weight, input
        shape, dtype, device, stride-1 layer, rows, programs, epilogue flags, ``min_blocks``, ``load_batch`` and
        ``probe``: a probe
        setting launches its probe, :meth:`_probe`, once per kernel of the setting)."""
        key = ("launches", setting.rows, setting.programs, tuple(x.shape), x.dtype, x.device, layer.original,
               setting.relu, setting.max_pool, setting.min_blocks, setting.probe, setting.load_batch)

        def bind() -> list[tuple[cl.BoundLaunch, bool]]:
            kernels = self._kernels(csr, layer, setting.rows, setting.programs)
            if setting.probe:
                return self._bind(x, csr, layer, setting, [[self._probe(csr, layer, setting.rows)]]) * len(kernels)
            return self._bind(x, csr, layer, setting, kernels)

        return self._cache.get(csr, key, bind)

    def _bind(self, x: torch.Tensor, csr: UniformCSR, layer: StrideOneLayer, setting: Setting,
              kernels: list[list[gs.Program]]) -> list[tuple[cl.BoundLaunch, bool]]:
        """Compile (:func:`compile_all`) and bind each of ``kernels`` (programs per kernel, :meth:`_kernels`): x,
        bias, residual, y (and the counters of a shared kernel) per call, the sizes and the epilogue flags fixed. A
        shared kernel's grid is every block that stays resident, since its blocks take their tiles from the
        counters. The pixel count ``total`` is the output's, or four per pooled output with ``max_pool`` (the
        pooled-out last row and column of an odd plane are not computed)."""
        sources = self._sources(x, layer, kernels, setting.min_blocks, setting.load_batch)
        functions = compile_all(sources)
        E, F_ = layer.out_hw
        total = x.shape[0] * ((E // 2) * (F_ // 2) * 4 if setting.max_pool else E * F_)
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        threads = gs.choose_threads(total, sms)
        import cupy

        launches = []
        for kernel_programs, kernel, (source, entry) in zip(kernels, functions, sources, strict=True):
            shared = len(kernel_programs) > 1
            resident = gs.resident_blocks(kernel.num_regs, threads)
            grid = (resident * sms, 1, 1) if shared else gs.launch_grid(total, threads, resident, sms)
            name = f"{entry}[{hashlib.sha256(source.encode()).hexdigest()[:12]}]"
            spec = Launch(name, grid, (threads, 1, 1))
            flags = (int(setting.relu), int(setting.max_pool))
            arguments = (cl.PER_CALL, cl.PER_CALL, cl.PER_CALL, cl.PER_CALL, total,
                         *((*flags, cl.PER_CALL) if shared else (csr.out_channels, kernel_programs[0].first, *flags)))
            parameters = cl.KernelParameters(arguments, x.device)
            with cupy.cuda.Device(x.device.index):
                function = kernel.kernel  # this device's handle (loaded here on first use)
            launches.append((cl.BoundLaunch(spec, x.device, parameters, function, ()), shared))
        return launches
