"""The ``direct`` backend: our CuPy direct sparse convolution kernels (``kernels/direct_conv.cu``).

Three kernel variants share the backend and its tuning space (parameter ``variant``):

* ``"rows"``: Escoin §3 / UnSparse-Opt §5 (uniform nnz, sub-batch), any geometry.
* ``"tile"``: input tiles with halos in shared memory, each warp accumulating several output channels over
  a pixel x image tile; stride 1, dilation 1, Conv2d. float16 inputs, and float32 inputs of ``"paired"``
  settings, are first re-laid as image pairs (on CUDA by the ``pair_images`` kernel, bound at prepare time by
  :func:`bind_pairing` into the layer's :class:`PreparedCall`: a copy timed with the convolution; a strided layer's
  phase images are paired in the same pass as its phase split, :func:`bind_phase_pairing`).
  ``"stage": "vector"`` settings copy each staged row's interior as 16-byte vectors (32-column warp rows, input
  width a multiple of 4; see :func:`~unsparse.runtime.launch_geometry.vector_staging_reason`).
* ``"pointwise"``: 1x1, stride 1, unpadded Conv2d as a sparse x dense product over the flattened
  ``n * P + p`` columns; ``"stage": "vector"`` settings stage 16-byte vectors where the plane allows
  (:func:`~unsparse.runtime.launch_geometry.pointwise_vector_reason`); grids too small to fill the GPU (batch 1)
  also get split-K settings (``"splits"``: float32 partial sums per share of the input channels, summed here).

A second backend, ``direct_half2`` (:class:`DirectHalf2Backend`), runs the ``tile`` kernel on float16 with half2
products (``"accumulate": "half2"``: ``HFMA2`` runs of at most
:data:`~unsparse.runtime.launch_geometry.HALF2_RUN` products, summed in float32). It changes the numerics, so the
comparator leaves it out unless it is named.

The settings each variant is tuned over are listed in :mod:`unsparse.runtime.backends.direct_space`. Everything a
kernel reads through an index is built and checked at plan time (:mod:`unsparse.runtime.backends.direct_arrays`:
``prepare_rows``, ``prepare_tile``, which also serves ``pointwise``) and cached here per UniformCSR object and input
size, so no kernel sees an unchecked index.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from unsparse.runtime import cupy_launcher as cl
from unsparse.runtime import launch_geometry as lg
from unsparse.runtime.backends.base import (
    ConvBackend,
    T,
    WeightCache,
    check_bias,
    kernel_input_reason,
    register_backend,
)
from unsparse.runtime.backends.direct_arrays import check_capacity, longest_list, prepare_rows, prepare_tile
from unsparse.runtime.backends.direct_space import (
    ROWS_CHANNELS,
    half_run_of,
    pointwise_space,
    pointwise_tiling_of,
    reads_pairs,
    rows_space,
    tile_space,
    tiling_of,
)
from unsparse.sparse.format import UniformCSR
from unsparse.sparse.geometry import ConvGeometry
from unsparse.sparse.phases import PhaseSplit, phase_split


def pair_images(x: torch.Tensor) -> torch.Tensor:
    """The image-paired input of ``direct_tile`` on float16 and of its ``paired`` float32 tilings: ``(N, C, H, W)``
    to ``(ceil(N / 2), C, H, W, 2)`` with element ``[i, c, h, w, q] = x[2i + q, c, h, w]`` (a zero image pads an
    odd N), so that one ``__half2`` or ``float2`` holds the same pixel of two images and the kernel stages it
    asynchronously, one element (or one 16-byte vector of 4 or 2 pixels) per ``cp.async``. Returns a fresh
    contiguous (so 16-byte aligned) tensor; ``x`` is not modified."""
    if x.shape[0] % 2:
        x = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
    return x.reshape(x.shape[0] // 2, 2, *x.shape[1:]).permute(0, 2, 3, 4, 1).contiguous()


def stride_one_reason(geometry: ConvGeometry) -> str | None:
    """Why the ``tile`` and ``pointwise`` kernels cannot run a layer, or None: they need an undilated Conv2d
    (strided ones reach them through their phase split); ``rows`` runs the rest."""
    if geometry.spatial_dims != 2 or geometry.dilation != (1, 1):
        return f"tile and pointwise need an undilated Conv2d, got {geometry}"
    return None


def bind_pairing(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 aligned: bool) -> tuple[cl.BoundLaunch, tuple[int, ...]]:
    """The ``pair_images`` kernel for contiguous ``(N, C, H, W)`` inputs of ``shape`` on ``device``: the bound launch
    (per-call arguments: the input, then a fresh output of the returned shape ``(ceil(N / 2), C, H, W, 2)``).
    ``aligned``: whether the inputs' data start on a 16-byte boundary; with whole 16-byte vectors per image the
    kernel then moves vectors (:func:`~unsparse.runtime.launch_geometry.pairing_launch`)."""
    N, P = shape[0], math.prod(shape[1:])
    spec = lg.pairing_launch(dtype, N, P, lg.pairing_vector(P * dtype.itemsize, aligned))
    return cl.bind(spec, (cl.PER_CALL, cl.PER_CALL, N, P), device), ((N + 1) // 2, *shape[1:], 2)


def bind_phase_pairing(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                       split: PhaseSplit) -> tuple[cl.BoundLaunch, tuple[int, ...]]:
    """The ``phase_pair_images`` kernel for contiguous ``(N, C, H, W)`` inputs of ``shape`` on ``device`` and a phase
    split that reads every phase (:attr:`~unsparse.sparse.phases.PhaseSplit.every_phase`): the bound launch
    (per-call arguments: the input, then a fresh output of the returned shape ``(ceil(N / 2), C * s_h * s_w, HQ, WQ,
    2)``), equal to :func:`pair_images` of ``split.input(x)`` in one pass instead of two.

    Raises:
        ValueError: for a split that skips a phase, or from
            :func:`~unsparse.runtime.launch_geometry.phase_pairing_launch`.
    """
    if not split.every_phase:
        raise ValueError(f"split: phase_pair_images needs every phase, got {split.phases_h} x {split.phases_w}")
    N, C, H, W = shape
    (hq, wq), (sh, sw) = split.input_size(H, W), split.stride
    spec = lg.phase_pairing_launch(dtype, N, C, (hq, wq), split.stride)
    return (cl.bind(spec, (cl.PER_CALL, cl.PER_CALL, N, C, H, W, sh, sw, hq, wq), device),
            ((N + 1) // 2, C * sh * sw, hq, wq, 2))


def pair_images_on_device(x: torch.Tensor) -> torch.Tensor:
    """:func:`pair_images` of a contiguous ``x``: on CUDA by the ``pair_images`` kernel (about copy speed; torch's
    permuted copy moved float16 at half of it on the H100, kernels/NOTES.md eleventh session), elsewhere by torch.
    Returns a fresh ``(ceil(N / 2), C, H, W, 2)`` tensor; ``x`` is not modified."""
    if x.device.type != "cuda" or x.shape[0] == 0:
        return pair_images(x)
    pairing, shape = bind_pairing(tuple(x.shape), x.dtype, x.device, lg.vector_aligned(x))
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    pairing(cl.current_stream(x.device), x, out)
    return out


def is_pointwise(csr: UniformCSR, geometry: ConvGeometry) -> bool:
    """Whether a layer is a 1x1, stride 1, dilation 1, unpadded Conv2d (the ``pointwise`` variant's domain)."""
    return (geometry.spatial_dims == 2 and csr.kernel_size == (1, 1) and geometry.stride == (1, 1)
            and geometry.dilation == (1, 1) and geometry.padding == (0, 0))


@dataclass(frozen=True)
class KernelView:
    """What the ``tile`` and ``pointwise`` kernels see of a layer: a stride-1 layer, either the layer itself or
    its :class:`~unsparse.sparse.phases.PhaseSplit` (strided layers), and how a setting stages it.

    Attributes:
        csr, geometry: the stride-1 layer (for a split: phase channels, ``R' x S'`` filter, top/left padding).
        split: the phase split of a strided layer, None for a stride-1 layer.
        in_hw: ``(H, W)`` of the input the kernel reads (the phase images' size for a split).
        out_hw: ``(E, F)`` of the original layer, the outputs the kernel computes.
        source_aligned: whether the tensor the setting reads first (``x``, or the fresh phase images of a split)
            starts on a 16-byte boundary.
        staging: ``tile``: the ``pad_w`` of 16-byte staging or None (scalar); ``pointwise``: whether it stages
            16-byte vectors.
    """

    csr: UniformCSR
    geometry: ConvGeometry
    split: PhaseSplit | None
    in_hw: tuple[int, int]
    out_hw: tuple[int, int]
    source_aligned: bool
    staging: int | bool | None


def aligned_copy(fresh: torch.Tensor) -> torch.Tensor:
    """``fresh``, a tensor this backend allocated (phase images, image pairs), after checking that its data start on
    a 16-byte boundary, as :meth:`DirectBackend._prepare` assumed when it chose 16-byte staging and pairing copies
    for it (torch's caching allocator aligns to 512 bytes; an allocator that does not would otherwise fault on the
    GPU).

    Raises:
        ValueError: for a misaligned allocation.
    """
    if not lg.vector_aligned(fresh):
        raise ValueError(f"allocation at {fresh.data_ptr():#x} is not 16-byte aligned; the direct kernels' staging "
                         "of fresh copies needs 16-byte aligned allocations")
    return fresh


@dataclass(frozen=True)
class PreparedCall:
    """One setting of :class:`DirectBackend` on one weight and input size, resolved once, so that an eager call
    pays only for what changes per call: the input transform (phase split, image pairing), the output
    allocation and the launches, each bound with its fixed arguments converted
    (:class:`~unsparse.runtime.cupy_launcher.BoundLaunch`).

    Attributes:
        kernel: the convolution kernel, its validated index arrays (and, for ``rows``, the weight values) and
            scalar arguments bound; per call the input, the bias (None for split-K) and the output.
        split: the phase split ``x`` is copied into first (a strided ``tile`` or ``pointwise`` setting), None
            where the kernel or the pairing reads ``x`` itself (a fused phase pairing reads ``x``).
        out_shape: ``(N, M, E, F)``.
        splits: split-K shares of ``pointwise`` (float32 partial sums, summed here), 1 otherwise.
        pairing: where the kernel reads the input as image pairs (float16, or a ``paired`` float32 tiling), the
            bound pairing kernel and the paired shape: ``phase_pair_images`` on ``x`` for a strided setting that
            reads every phase (:func:`bind_phase_pairing`), else ``pair_images`` (:func:`bind_pairing`); None
            otherwise.
        relu: the layer's fused ReLU (the kernel's bound ``relu`` argument unless ``epilogue_after``).
        epilogue_after: the kernel stores the convolution and its bias only, and the residual add and the ReLU
            follow in passes: split-K (its float32 partial sums take none of them; bias, residual and ReLU are applied
            to their float32 sum) and a ``tile`` tiling whose kernel stores without them (a wide one, or with a
            residual a half2 one: :meth:`~unsparse.runtime.launch_geometry.TileTiling.fuses_epilogue`); else the
            kernel adds the residual and applies the ReLU as it stores.
    """

    kernel: cl.BoundLaunch
    split: PhaseSplit | None
    out_shape: tuple[int, int, int, int]
    splits: int = 1
    pairing: tuple[cl.BoundLaunch, tuple[int, ...]] | None = None
    relu: bool = False
    epilogue_after: bool = False

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        """Run on ``x`` (contiguous ``(N, C, H, W)`` of the prepared size, dtype and 16-byte alignment) with
        ``bias`` (``(M,)`` of ``x``'s dtype, contiguous, or None) and ``residual`` (contiguous ``(N, M, E, F)`` of
        ``x``'s dtype, 16-byte aligned: :func:`kernel_residual`; or None), added to the convolution and its bias
        before the ReLU; returns a new ``(N, M, E, F)`` tensor of ``x``'s dtype."""
        stream = cl.current_stream(x.device)
        source = x if self.split is None else aligned_copy(self.split.input(x))
        if self.pairing is not None:
            pairing, shape = self.pairing
            paired = aligned_copy(torch.empty(shape, dtype=x.dtype, device=x.device))
            pairing(stream, source, paired)
            source = paired
        if self.splits == 1:
            out = torch.empty(self.out_shape, dtype=x.dtype, device=x.device)
            self.kernel(stream, source, bias, None if self.epilogue_after else residual, out)
            return self._epilogue(out, residual) if self.epilogue_after else out
        partial = torch.empty((self.splits, *self.out_shape), dtype=torch.float32, device=x.device)
        self.kernel(stream, source, None, None, partial)
        summed = partial.sum(0)  # float32 partial sums of each share of the input channels
        summed = summed if bias is None else summed.add_(bias.float()[:, None, None])
        return self._epilogue(summed, residual).to(x.dtype)

    def _epilogue(self, out: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """The residual add and the ReLU, in place on ``out``, after a kernel that stored without them."""
        out = out if residual is None else out.add_(residual)
        return out.relu_() if self.relu else out


def kernel_residual(residual: torch.Tensor, out_shape: tuple[int, ...], x: torch.Tensor) -> torch.Tensor:
    """``residual`` as the kernels read it, beside the output they write: contiguous ``(N, M, E, F)``, 16-byte
    aligned (``direct_pointwise`` loads it by vectors), so a view at an odd offset or in channels-last is copied.

    Raises:
        ValueError: for a residual that is not a tensor of shape ``out_shape`` with ``x``'s dtype and device (the
            kernels read one element per output, so a smaller one would be read past its end on the GPU).
    """
    if (not isinstance(residual, torch.Tensor) or tuple(residual.shape) != out_shape or residual.dtype != x.dtype
            or residual.device != x.device):
        described = (f"{tuple(residual.shape)} {residual.dtype} on {residual.device}"
                     if isinstance(residual, torch.Tensor) else type(residual).__name__)
        raise ValueError(f"residual: expected {out_shape} {x.dtype} on {x.device}, got {described}")
    residual = residual.contiguous()
    return residual if lg.vector_aligned(residual) else aligned_copy(residual.clone())


@register_backend
class DirectBackend(ConvBackend):
    """Direct sparse convolution on CUDA through CuPy; float32 and float16 storage, float32 arithmetic.

    Strided, undilated Conv2d layers can also run on the stride-1 ``tile`` and ``pointwise`` kernels through
    their phase split (:mod:`unsparse.sparse.phases`): the setting is the same dict, and :meth:`conv` copies the
    input into its phase images first, inside the timed call.
    """

    name = "direct"
    device_types = frozenset({"cuda"})
    fuses_relu = True
    fuses_residual_relu = True

    def __init__(self) -> None:
        self._cache = WeightCache()

    def adds_bias_in_epilogue(self, params: Mapping[str, Any]) -> bool:
        """True unless ``params`` is a split-K setting (``splits`` > 1), whose float32 partial sums are summed and
        take the bias in passes after the kernel (:class:`PreparedCall`)."""
        return params.get("splits", 1) == 1

    def unsupported_reason(self, x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry) -> str | None:
        reason = super().unsupported_reason(x, csr, geometry)
        if reason is not None:
            return reason
        reason = kernel_input_reason("direct", x, csr, lg.supported_dtypes())
        if reason is not None:
            return reason
        N, C, H, W = x.shape
        if C * H * W >= 2**31 or N * csr.out_channels * math.prod(self._out_hw(x, csr, geometry)) >= 2**62:
            return "tensor too large for 32-bit image addressing"
        return None

    @staticmethod
    def _out_hw(x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry) -> tuple[int, int]:
        return geometry.output_size(x.shape[2], x.shape[3], csr.kernel_size)

    def _stride_one(self, x: torch.Tensor, csr: UniformCSR,
                    geometry: ConvGeometry) -> tuple[UniformCSR, ConvGeometry, PhaseSplit | None, tuple[int, int]]:
        """The stride-1 layer the ``tile`` and ``pointwise`` kernels run, with its input size: the layer itself,
        or its phase split (cached per weight and geometry).

        Raises:
            ValueError: for a Conv1d or dilated layer, which only ``rows`` runs.
        """
        reason = stride_one_reason(geometry)
        if reason is not None:
            raise ValueError(f"variant: {reason}")
        if geometry.stride == (1, 1):
            return csr, geometry, None, (x.shape[2], x.shape[3])
        split = self._arrays(csr, ("phases", geometry), lambda: phase_split(csr, geometry))
        return split.csr, split.geometry, split, split.input_size(x.shape[2], x.shape[3])

    def _view(self, x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry, params: dict[str, Any]) -> KernelView:
        """The :class:`KernelView` of a ``tile`` or ``pointwise`` setting on input ``x`` (a phase split's input
        is a fresh, so 16-byte aligned, copy; ``x`` itself may be a misaligned view).

        Raises:
            ValueError: from :meth:`_stride_one`; for ``pointwise`` on a layer that is not 1x1 and unpadded once
                split; from :meth:`_vector_requested`.
        """
        csr1, geometry1, split, in_hw = self._stride_one(x, csr, geometry)
        out_hw = self._out_hw(x, csr, geometry)
        source_aligned = split is not None or lg.vector_aligned(x)  # a split's phases are a fresh copy of x
        if params.get("variant") == "pointwise":
            if not is_pointwise(csr1, geometry1) or in_hw != out_hw:
                raise ValueError(f"variant: pointwise needs a 1x1, unpadded Conv2d, got {csr.kernel_size} {geometry}")
            pixels = in_hw[0] * in_hw[1]
            vector = self._vector_requested(params, lambda: lg.pointwise_vector_reason(x.dtype, pixels))
            return KernelView(csr1, geometry1, split, in_hw, out_hw, source_aligned, vector and source_aligned)
        vector = self._vector_requested(
            params, lambda: lg.vector_staging_reason(in_hw[1], csr1.kernel_size, geometry1.padding))
        aligned = source_aligned or reads_pairs(params, x.dtype)  # the kernel then reads a fresh pairing copy
        return KernelView(csr1, geometry1, split, in_hw, out_hw, source_aligned,
                          geometry1.padding[1] if vector and aligned else None)

    def tuning_space(self, x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry) -> list[dict[str, Any]]:
        """Rows settings always; tile settings for undilated Conv2d (strided ones through their phase split);
        pointwise settings for 1x1 unpadded Conv2d (likewise)."""
        out_hw = self._out_hw(x, csr, geometry)
        space = rows_space(x.shape[0], out_hw[0] * out_hw[1])
        if stride_one_reason(geometry) is not None:
            return space
        csr1, geometry1, _, in_hw = self._stride_one(x, csr, geometry)
        if is_pointwise(csr1, geometry1) and in_hw == out_hw:
            pixels = out_hw[0] * out_hw[1]
            space += pointwise_space(x.shape[0], csr.out_channels, pixels, x.dtype,
                                     vector=lg.pointwise_vector_reason(x.dtype, pixels) is None,
                                     in_channels=csr1.in_channels_per_group)
        return space + self._tile_space(x, csr, geometry)

    def _tile_space(self, x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry) -> list[dict[str, Any]]:
        """The ``tile`` settings of an undilated Conv2d
        (:func:`~unsparse.runtime.backends.direct_space.tile_space` of its stride-1 view)."""
        csr1, geometry1, _, in_hw = self._stride_one(x, csr, geometry)
        vector = lg.vector_staging_reason(in_hw[1], csr1.kernel_size, geometry1.padding) is None
        return tile_space(x.shape[0], self._out_hw(x, csr, geometry), csr1.kernel_size, x.dtype,
                          vector_pad=geometry1.padding[1] if vector else None,
                          shared_limit=lg.tile_shared_limit(x.device),
                          entry_capacity=lambda chunk, union: self._longest_list(csr1, chunk, union))

    def _longest_list(self, csr: UniformCSR, chunk: int, union: int) -> int:
        """:func:`~unsparse.runtime.backends.direct_arrays.longest_list` of a stride-1 layer's weight, cached with
        it."""
        return self._arrays(csr, ("longest", chunk, union), lambda: longest_list(csr, chunk, union))

    def _entry_capacity(self, csr: UniformCSR, tiling: lg.TileTiling) -> int:
        """The slot size of a ``stage_entries`` tiling on a stride-1 layer's weight (its longest list), else 0."""
        return self._longest_list(csr, tiling.cc, tiling.union) if tiling.stage_entries else 0

    def kernel_names(self, x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry,
                     space: list[dict[str, Any]] | None = None) -> list[str]:
        """Template instantiations a list of settings (default: the tuning space) uses, with both
        ``pair_images`` kernels of the dtype, and ``phase_pair_images`` for a strided layer whose split reads every
        phase, where a setting pairs its input."""
        space = space if space is not None else self.tuning_space(x, csr, geometry)
        names = {self._launch(x, csr, geometry, params)[0].name for params in space}
        if any(params.get("variant") == "tile" and reads_pairs(params, x.dtype) for params in space):
            names.update(lg.pairing_launch(x.dtype, 2, 1, vector).name for vector in (False, True))
            split = self._stride_one(x, csr, geometry)[2]
            if split is not None and split.every_phase:
                names.add(lg.phase_pairing_launch(x.dtype, 2, 1, (1, 1), (1, 1)).name)
        return sorted(names)

    def precompile(self, x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry,
                   space: list[dict[str, Any]]) -> None:
        """Compile the instantiations ``space`` needs, concurrently (before timing anything)."""
        cl.precompile(self.kernel_names(x, csr, geometry, space))

    def _launch(self, x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry,
                params: dict[str, Any]) -> tuple[lg.Launch, KernelView | None]:
        """The launch of a setting on input ``x``, with its :class:`KernelView` (None for ``rows``).

        Raises:
            ValueError: for an unknown variant, or from
                :func:`~unsparse.runtime.backends.direct_space.half_run_of` and :meth:`_view`.
        """
        N = x.shape[0]
        variant = params.get("variant", "rows")
        half_run = half_run_of(params, x.dtype)
        if variant == "rows":
            E, F_ = self._out_hw(x, csr, geometry)
            return lg.rows_launch(x.dtype, N, csr.out_channels, E * F_, params.get("threads", 128),
                                  params.get("pixels", 1), params.get("sub_batch", 1),
                                  params.get("channels", ROWS_CHANNELS)), None
        if variant not in ("tile", "pointwise"):
            raise ValueError(f"variant: unknown {variant!r}, expected 'rows', 'tile' or 'pointwise'")
        view = self._view(x, csr, geometry, params)
        E, F_ = view.out_hw
        if variant == "pointwise":
            tiling = pointwise_tiling_of(params)
            _, splits = lg.split_chunks(view.csr.in_channels_per_group, tiling.cc, params.get("splits", 1))
            return lg.pointwise_launch(x.dtype, N, csr.out_channels, E * F_, tiling, view.staging, splits), view
        tiling = tiling_of(params)
        return lg.tile_launch(x.dtype, N, csr.out_channels, (E, F_), view.csr.kernel_size, tiling, view.staging,
                              half_run, lg.tile_shared_limit(x.device),
                              self._entry_capacity(view.csr, tiling)), view

    @staticmethod
    def _vector_requested(params: dict[str, Any], reason: Callable[[], str | None]) -> bool:
        """Whether a ``tile`` or ``pointwise`` setting asks for 16-byte staging (``"stage": "vector"``);
        ``reason`` says why the layer can never stage vectors (None if it can). A float32 input that is merely
        not 16-byte aligned (a view at an odd offset) then takes the scalar kernel of the same tiling, which
        computes the same result (:meth:`_view`).

        Raises:
            ValueError: for an unknown ``stage``, or ``vector`` on a layer that can never stage vectors.
        """
        stage = params.get("stage", "scalar")
        if stage not in ("scalar", "vector"):
            raise ValueError(f"stage: unknown {stage!r}, expected 'scalar' or 'vector'")
        if stage == "scalar":
            return False
        why = reason()
        if why is not None:
            raise ValueError(f"stage: vector staging impossible here: {why}")
        return True

    def _arrays(self, csr: UniformCSR, key: tuple, build: Callable[[], T]) -> T:
        return self._cache.get(csr, key, build)

    def _prepare(self, x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry, params: dict[str, Any],
                 relu: bool, residual: bool) -> PreparedCall:
        """Resolve a setting for this input size once: launch, phase split, validated index arrays (shared through
        the per-weight cache) and scalar arguments, the last of them the kernel's ``relu`` flag (0 where
        :class:`PreparedCall` applies the residual and the ReLU in passes: split-K partial sums, a wide tiling, with
        a ``residual`` a half2 tiling).

        Raises:
            ValueError: from :meth:`_launch`, or indices that fail validation.
        """
        spec, view = self._launch(x, csr, geometry, params)
        N, C, H, W = x.shape
        M, (E, F_) = csr.out_channels, self._out_hw(x, csr, geometry)
        out_shape = (N, M, E, F_)

        def bound(arrays: tuple[torch.Tensor, ...], scalars: tuple[int, ...], kernel_relu: bool) -> cl.BoundLaunch:
            """The kernel bound with its fixed arguments and its ``relu`` flag; per call: input, bias, residual,
            output."""
            return cl.bind(spec, (cl.PER_CALL, *arrays, cl.PER_CALL, cl.PER_CALL, cl.PER_CALL, *scalars,
                                  int(kernel_relu)), x.device)

        if view is None:
            rows = self._arrays(csr, ("rows", H, W, geometry), lambda: prepare_rows(csr, geometry, (H, W)))
            return PreparedCall(bound((rows.offsets, rows.taps, csr.values.contiguous()),
                                      (N, C, H, W, M, csr.row_length, E, F_, *geometry.stride, *geometry.padding,
                                       params.get("channels", ROWS_CHANNELS)), relu), None, out_shape,
                                relu=relu)
        C, (H, W) = view.csr.in_channels_per_group, view.in_hw
        if params["variant"] == "tile":
            tiling = tiling_of(params)
            layout = lg.tile_layout(x.dtype, view.csr.kernel_size, tiling, view.staging)
            half2 = half_run_of(params, x.dtype) > 0
            tile = self._arrays(view.csr, ("tile", layout, half2, tiling.union),
                                lambda: prepare_tile(view.csr, layout, half2, tiling.union))
            capacity = self._entry_capacity(view.csr, tiling)
            if tiling.stage_entries:
                check_capacity(tile, capacity)
            in_kernel = tiling.fuses_epilogue(residual, half_run_of(params, x.dtype))
            pairing, split = None, view.split
            if reads_pairs(params, x.dtype):
                if split is not None and split.every_phase:  # one pass from x
                    pairing, split = bind_phase_pairing(tuple(x.shape), x.dtype, x.device, split), None
                else:
                    pairing = bind_pairing((N, C, H, W), x.dtype, x.device, view.source_aligned)
            return PreparedCall(bound((tile.chunk_ptr, tile.entries),
                                      (N, C, H, W, M, E, F_, *view.geometry.padding,
                                       math.ceil(F_ / tiling.tile_hw[1]), math.ceil(M / tiling.channels),
                                       capacity), relu and in_kernel),
                                split, out_shape, pairing=pairing, relu=relu, epilogue_after=not in_kernel)
        tiling = pointwise_tiling_of(params)
        layout = lg.pointwise_layout(x.dtype, tiling, view.staging)
        tile = self._arrays(view.csr, ("tile", layout, False, 1), lambda: prepare_tile(view.csr, layout))
        per_split, splits = lg.split_chunks(C, tiling.cc, params.get("splits", 1))
        return PreparedCall(bound((tile.chunk_ptr, tile.entries),
                                  (N, C, H * W, M, math.ceil(M / tiling.channels), per_split), relu and splits == 1),
                            view.split, out_shape, splits=splits, relu=relu, epilogue_after=splits > 1)

    def conv(self, x: torch.Tensor, csr: UniformCSR, bias: torch.Tensor | None, geometry: ConvGeometry,
             relu: bool = False, residual: torch.Tensor | None = None, **params: Any) -> torch.Tensor:
        """Run one variant; ``params`` is an entry of :meth:`tuning_space` (default: rows, no sub-batch). With
        ``relu`` (:attr:`fuses_relu`: a layer fused with the ReLU after it) the kernel applies that ReLU as it stores
        each output, after the bias, which saves the ReLU's pass over the ``(N, M, E, F)`` output; with ``residual``
        (:attr:`fuses_residual_relu`: a residual block's end, ``(N, M, E, F)`` of ``x``'s dtype, either layout) it
        adds the residual before the ReLU, which saves the add's pass too (a split-K setting applies bias, residual and
        ReLU in the float32 pass that sums its shares, a wide ``tile`` tiling residual and ReLU in passes of their own:
        :class:`PreparedCall`). The first call of a setting on an input size prepares it (:meth:`_prepare`, cached
        per weight); later calls only transform the input, allocate the output and launch.

        Raises:
            ValueError: for a variant this layer does not support, indices that fail validation, a bias that is
                not ``(M,)`` (:func:`~unsparse.runtime.backends.base.check_bias`), or a residual that is not the
                output's shape, dtype and device (:func:`kernel_residual`).
        """
        if residual is None:
            return self.conv_call(x, csr, bias, geometry, relu, **params)(x)
        return self.conv_call(x, csr, bias, geometry, relu, True, **params)(x, residual)

    def conv_call(self, x: torch.Tensor, csr: UniformCSR, bias: torch.Tensor | None, geometry: ConvGeometry,
                  relu: bool = False, residual: bool = False, **params: Any) -> Callable[..., torch.Tensor]:
        """:meth:`conv` for inputs like ``x`` with the :class:`PreparedCall` and the bias (``x``'s dtype, contiguous)
        resolved once (:meth:`~unsparse.runtime.backends.base.ConvBackend.conv_call`): a call ``f(x2, residual2)``
        where ``residual`` says calls pass a residual (prepared so that it is added before the ReLU: a half2 tiling
        then stores without both, :class:`PreparedCall`), else ``f(x2)``. The setting was prepared for ``x``'s
        16-byte alignment (:func:`~unsparse.runtime.launch_geometry.vector_aligned`), which the shape does not fix: an
        input of the other alignment is resolved again. Raises as :meth:`conv`."""
        check_bias(bias, csr)
        x = x.contiguous()
        shape = (x.shape[0], csr.out_channels, *self._out_hw(x, csr, geometry))
        if csr.out_channels == 0 or x.shape[0] == 0:  # E, F >= 1 (output_size raises otherwise)
            def empty(x: torch.Tensor, *identity: torch.Tensor) -> torch.Tensor:
                check_residual_count(identity, residual)
                if identity:  # checked as a non-empty call checks it, though no kernel reads it
                    kernel_residual(identity[0], shape, x)
                return torch.empty(shape, dtype=x.dtype, device=x.device)

            return empty
        aligned = lg.vector_aligned(x)
        key = ("call", tuple(x.shape), x.dtype, geometry, tuple(sorted(params.items())), aligned, relu, residual)
        prepared = self._arrays(csr, key, lambda: self._prepare(x, csr, geometry, params, relu, residual))
        bias = None if bias is None else bias.to(x.dtype).contiguous()

        def call(x: torch.Tensor, *identity: torch.Tensor) -> torch.Tensor:
            check_residual_count(identity, residual)
            x = x.contiguous()
            if lg.vector_aligned(x) != aligned:
                return self.conv_call(x, csr, bias, geometry, relu, residual, **params)(x, *identity)
            return prepared(x, bias, kernel_residual(identity[0], shape, x) if identity else None)

        return call


def check_residual_count(identity: tuple[torch.Tensor, ...], residual: bool) -> None:
    """That a call :meth:`DirectBackend.conv_call` prepared with ``residual`` got one residual tensor if so, none
    otherwise.

    Raises:
        TypeError: naming both counts, as a call of the wrong arity does.
    """
    if len(identity) != residual:
        raise TypeError(f"a call prepared with residual={residual} takes {int(residual)} residual, got {len(identity)}")


@register_backend
class DirectHalf2Backend(DirectBackend):
    """The ``tile`` kernel on float16 with half2 products: one ``HFMA2`` multiplies a weight pair ``(w, w)`` by the
    staged pair of images, in runs of at most :data:`~unsparse.runtime.launch_geometry.HALF2_RUN` products summed in
    float16, each run then added to float32 accumulators (kernels/NOTES.md v17). Issue 6's FP16 target counts the
    FP16 (``HFMA2``) peak, which float32 products cannot reach; the price is a float16 rounding per product, a
    relative error of about 6e-4 on dense rows (the CPU emulation in ``tests/test_runtime_direct.py``; cuDNN FP16
    accumulates in float32, 2e-4 from the output's rounding alone). Opt-in: the comparator leaves it out unless
    named (:data:`~unsparse.runtime.comparator.COMPARED_BY_DEFAULT_EXCLUDES`); the benchmark's precision
    ``fp16_half2`` names it.
    """

    name = "direct_half2"
    dtypes = frozenset({torch.float16})  # half2 products need float16 storage

    def unsupported_reason(self, x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry) -> str | None:
        reason = super().unsupported_reason(x, csr, geometry)
        if reason is not None:
            return reason
        reason = stride_one_reason(geometry)
        return None if reason is None else f"half2 products run on the tile kernel: {reason}"

    def tuning_space(self, x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry) -> list[dict[str, Any]]:
        """The tile settings of :class:`DirectBackend` with ``"accumulate": "half2"``."""
        return [{**params, "accumulate": "half2"} for params in self._tile_space(x, csr, geometry)]
