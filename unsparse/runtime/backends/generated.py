"""The ``generated`` backend: weight-specialised direct sparse convolution (``kernels/generated_conv.cu``, v27).

Each nonzero of the layer's weight is compiled into the kernel as one fused multiply-add with an immediate operand
(:mod:`unsparse.runtime.generated_source`), one kernel per ``rows`` output channels, each looping over output pixels
(paper 004 §5 deploys one kernel per layer; Escoin paper 000 §3 is the direct method it specialises). The weight is
read once, on the host, when the kernels are generated; the kernels read no index at run time, so nothing from an
untrusted sparse file reaches a GPU address. Stride 1, dilation 1, groups 1, float32 or float16 storage (float32
arithmetic); other layers are refused with a reason and the comparator keeps cuDNN there.

Compiling costs seconds to minutes per layer (NVRTC, one module per kernel, compiled concurrently; CuPy also keeps
them in its disk cache), so the comparator leaves this backend out unless it is named
(:data:`~unsparse.runtime.comparator.COMPARED_BY_DEFAULT_EXCLUDES`).
"""

from __future__ import annotations

import functools
import hashlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.nn.functional as F

from unsparse.runtime import cupy_launcher as cl
from unsparse.runtime import generated_source as gs
from unsparse.runtime.backends.base import ConvBackend, WeightCache, register_backend
from unsparse.runtime.launch_geometry import Launch
from unsparse.sparse.format import UniformCSR
from unsparse.sparse.geometry import ConvGeometry

ROWS_SPACE = (32, 64)
"""Output channels per kernel (register accumulators per thread) the comparator times. The twenty-ninth session's
probe on VGG16 features.10 at 0.9 ran 8.1 / 10.7 / 19.3 TFLOP/s at 8 / 16 / 32 (``kernels/NOTES.md``)."""

MAX_PRODUCTS = 2**17
"""Most multiply-adds one kernel's body may hold (``rows`` x the row length): bounds the generated source (about 50
bytes per product) and the compile time; denser layers are refused."""

INDEX_LIMIT = 2**31
"""The kernels index output pixels (``N * E * F``) and the padded input plane of one image in int32."""


@functools.cache
def compiled(source: str) -> Any:
    """The ``generated_conv`` ``cupy.RawKernel`` of ``source``, compiled once per process (NVRTC through CuPy).

    Raises:
        ImportError: without CuPy.
    """
    import cupy

    return cupy.RawModule(code=source, options=cl.COMPILE_OPTIONS).get_function("generated_conv")


def compile_all(sources: list[str], workers: int = 16) -> list[Any]:
    """:func:`compiled` of each source, concurrently (NVRTC runs outside the GIL)."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(compiled, sources))


@register_backend
class GeneratedBackend(ConvBackend):
    """Weight-specialised kernels; tuning parameter ``rows`` (:data:`ROWS_SPACE`)."""

    name = "generated"
    device_types = frozenset({"cuda"})

    def __init__(self) -> None:
        self._cache = WeightCache()

    def unsupported_reason(self, x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry) -> str | None:
        reason = super().unsupported_reason(x, csr, geometry)
        if reason is not None:
            return reason
        if x.dtype not in gs.STORAGE_TYPES:
            return f"generated kernels exist for float32 and float16, not {x.dtype}"
        if csr.values.dtype != x.dtype:
            return f"weight dtype {csr.values.dtype} differs from input dtype {x.dtype}"
        if geometry.stride != (1, 1) or geometry.dilation != (1, 1):
            return f"generated kernels run stride 1 and dilation 1, not {geometry.stride} and {geometry.dilation}"
        if csr.row_length * ROWS_SPACE[0] > MAX_PRODUCTS:
            return (f"{csr.row_length} nonzeros per row x {ROWS_SPACE[0]} rows exceed {MAX_PRODUCTS} products per "
                    "generated kernel")
        N, C, H, W = x.shape
        E, F_ = geometry.output_size(H, W, csr.kernel_size)
        padded = C * (H + 2 * geometry.padding[0]) * (W + 2 * geometry.padding[1])
        if N * E * F_ >= INDEX_LIMIT or padded >= INDEX_LIMIT:
            return "tensor too large for the generated kernels' 32-bit pixel and offset indexing"
        try:
            import cupy  # noqa: F401
        except ImportError:
            return "CuPy is not installed"
        return None

    def tuning_space(self, x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry) -> list[dict[str, Any]]:
        """``{"rows": r}`` for each ``r`` of :data:`ROWS_SPACE` within :data:`MAX_PRODUCTS`; beyond the first, only
        those below twice the layer's output channels (from twice on, at least half the accumulators stay empty)."""
        return [{"rows": r} for r in ROWS_SPACE if r * csr.row_length <= MAX_PRODUCTS
                and (r == ROWS_SPACE[0] or r < 2 * csr.out_channels)]

    def precompile(self, x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry,
                   space: list[dict[str, Any]]) -> None:
        """Compile every kernel of every setting in ``space``, concurrently, before anything is timed."""
        sources = [source for params in space for source in self._sources(x, csr, geometry, params["rows"])]
        compile_all(sources)

    def conv(self, x: torch.Tensor, csr: UniformCSR, bias: torch.Tensor | None, geometry: ConvGeometry,
             rows: int = ROWS_SPACE[0]) -> torch.Tensor:
        """Pad the input (``F.pad``, timed with the call), then run one kernel per ``rows`` output channels.

        The kernels read the bias as ``x``'s dtype, so a bias of another dtype (or not contiguous) is converted first,
        as the ``direct`` backend does.

        Returns:
            ``(N, M, E, F)`` NCHW output of ``x``'s dtype.

        Raises:
            ValueError: for a layer :meth:`unsupported_reason` refuses, or from
                :func:`~unsparse.runtime.generated_source.programs` (a weight that is not finite).
        """
        reason = self.unsupported_reason(x, csr, geometry)
        if reason is not None:
            raise ValueError(f"generated: {reason}")
        launches = self._launches(x, csr, geometry, rows)
        pad_h, pad_w = geometry.padding
        x = x.contiguous()
        padded = F.pad(x, (pad_w, pad_w, pad_h, pad_h)) if pad_h or pad_w else x
        E, F_ = geometry.output_size(x.shape[2], x.shape[3], csr.kernel_size)
        y = torch.empty(x.shape[0], csr.out_channels, E, F_, dtype=x.dtype, device=x.device)
        stream = cl.current_stream(x.device)
        bias = None if bias is None else bias.to(x.dtype).contiguous()
        for launch in launches:
            launch(stream, padded, bias, y)
        return y

    def _programs(self, x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry, rows: int) -> list[gs.Program]:
        """The layer's programs for input plane ``x.shape[2:]`` (cached per weight)."""
        in_hw = (x.shape[2], x.shape[3])

        def build() -> list[gs.Program]:
            weight = csr.to_conv2d_weight().float().cpu().numpy()
            return gs.programs(weight, geometry.padding, in_hw, rows)

        return self._cache.get(csr, ("programs", rows, in_hw, geometry.padding), build)

    def _sources(self, x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry, rows: int) -> list[str]:
        """CUDA sources of the layer's kernels at ``x``'s batch, dtype and device."""
        threads = self._threads(x, csr, geometry)
        return [gs.kernel_source(program, x.dtype, threads) for program in self._programs(x, csr, geometry, rows)]

    @staticmethod
    def _threads(x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry) -> int:
        E, F_ = geometry.output_size(x.shape[2], x.shape[3], csr.kernel_size)
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        return gs.choose_threads(x.shape[0] * E * F_, sms)

    def _launches(self, x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry, rows: int) -> list[cl.BoundLaunch]:
        """The bound launches of a setting (cached per weight, input shape, dtype and device)."""
        key = ("launches", rows, tuple(x.shape), x.dtype, x.device, geometry.padding)
        return self._cache.get(csr, key, lambda: self._bind(x, csr, geometry, rows))

    def _bind(self, x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry, rows: int) -> list[cl.BoundLaunch]:
        """Compile (:func:`compile_all`) and bind each kernel: x, bias and y per call, the sizes fixed."""
        programs = self._programs(x, csr, geometry, rows)
        threads = self._threads(x, csr, geometry)
        sources = self._sources(x, csr, geometry, rows)
        functions = compile_all(sources)
        E, F_ = geometry.output_size(x.shape[2], x.shape[3], csr.kernel_size)
        total = x.shape[0] * E * F_
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        import cupy

        launches = []
        for program, kernel, source in zip(programs, functions, sources, strict=True):
            grid = gs.launch_grid(total, threads, gs.resident_blocks(kernel.num_regs, threads), sms)
            name = f"generated_conv[{hashlib.sha256(source.encode()).hexdigest()[:12]}]"
            spec = Launch(name, grid, (threads, 1, 1))
            parameters = cl.KernelParameters((cl.PER_CALL, cl.PER_CALL, cl.PER_CALL, total, csr.out_channels,
                                              program.first), x.device)
            with cupy.cuda.Device(x.device.index):
                function = kernel.kernel  # this device's handle (loaded here on first use)
            launches.append(cl.BoundLaunch(spec, x.device, parameters, function, ()))
        return launches

