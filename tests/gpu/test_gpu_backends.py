"""Every CUDA backend (every tuning setting of ``direct``) against a float64 CPU reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from unsparse.runtime import cupy_launcher as cl
from unsparse.runtime import get_backend, set_backend, sparsify
from unsparse.runtime import launch_geometry as lg
from unsparse.runtime.backends.direct import is_pointwise, pair_images, pair_images_on_device
from unsparse.runtime.backends.direct_arrays import longest_list
from unsparse.runtime.backends.direct_space import pointwise_space, rows_space, tile_space
from unsparse.runtime.comparator import plan_model, relative_error, tolerance
from unsparse.runtime.plan import Plan
from unsparse.runtime.precision import precision_mode
from unsparse.sparse import ConvGeometry, UniformCSR, sparse_conv
from unsparse.sparse.phases import phase_split

CUDA = torch.device("cuda")


def poison_allocator(numel: int, dtype: torch.dtype) -> None:
    """Fill a freed block of the caching allocator with NaN so that the next output of that size starts
    poisoned: an element a kernel forgets to write stays NaN and fails the check."""
    block = torch.full((numel,), float("nan"), dtype=dtype, device=CUDA)
    del block


def random_weight(M: int, C: int, R: int, S: int, sparsity: float, gen: torch.Generator,
                  empty_rows: int = 0, dense_rows: int = 0) -> torch.Tensor:
    """``(M, C, R, S)`` random weight with about ``sparsity`` zeros, the first ``empty_rows`` rows all zero and
    the next ``dense_rows`` rows without zeros."""
    weight = torch.randn(M, C, R, S, generator=gen, dtype=torch.float64)
    weight[torch.rand(M, C, R, S, generator=gen, dtype=torch.float64) < sparsity] = 0
    weight[:empty_rows] = 0
    weight[empty_rows:empty_rows + dense_rows] = torch.randn(dense_rows, C, R, S, generator=gen,
                                                             dtype=torch.float64)
    return weight


# (N, C, H, W, M, R, S, stride, padding, dilation, sparsity, empty_rows, dense_rows)
CASES = {
    "odd_3x3": (3, 5, 13, 11, 7, 3, 3, 1, 1, 1, 0.7, 0, 0),
    "stride2_3x3": (5, 6, 17, 15, 9, 3, 3, 2, 1, 1, 0.8, 0, 0),
    "one_by_one": (4, 24, 9, 7, 33, 1, 1, 1, 0, 1, 0.9, 0, 0),
    "alexnet_11x11_s4": (2, 3, 67, 67, 10, 11, 11, 4, 2, 1, 0.8, 0, 0),
    "dilation2": (2, 4, 15, 16, 6, 3, 3, 1, 2, 2, 0.6, 0, 0),
    "empty_and_dense_rows": (3, 8, 12, 12, 12, 3, 3, 1, 1, 1, 0.9, 3, 2),
    "all_zero_weight": (2, 4, 8, 8, 5, 3, 3, 1, 1, 1, 1.0, 0, 0),
    "fully_dense": (2, 16, 10, 10, 17, 3, 3, 1, 1, 1, 0.0, 0, 0),
    "five_by_five_pad2": (3, 7, 14, 14, 11, 5, 5, 1, 2, 1, 0.85, 0, 0),
    "conv1d_shape": (3, 6, 1, 37, 8, 1, 5, 1, 2, 1, 0.7, 0, 0),
    "groups_tiles_chunks": (5, 21, 30, 34, 70, 3, 3, 1, 1, 1, 0.9, 1, 1),
    # W % 4 == 0: the 16-byte staging ("stage": "vector"); partial right tile, no left halo, a 5x5 halo.
    "vector_edges": (3, 9, 10, 36, 20, 3, 3, 1, 1, 1, 0.8, 1, 1),
    "vector_pad0": (2, 5, 9, 40, 6, 3, 3, 1, 0, 1, 0.7, 0, 0),
    "vector_5x5": (2, 4, 12, 16, 6, 5, 5, 1, 2, 1, 0.8, 0, 0),
    # 1x1 "pointwise": 16-byte staging in both dtypes (P = 144), column tiles across images, partial chunks and
    # channel groups; an odd plane (P = 49) with more than 256 output channels, element-wise staging; batch 1
    # with few blocks, so split-K settings (with 16-byte staging in both dtypes).
    "pointwise_vector": (3, 40, 12, 12, 70, 1, 1, 1, 0, 1, 0.9, 1, 1),
    "pointwise_odd_plane": (2, 100, 7, 7, 300, 1, 1, 1, 0, 1, 0.95, 2, 1),
    "pointwise_split": (1, 200, 8, 8, 40, 1, 1, 1, 0, 1, 0.9, 1, 1),
    # Strided layers on tile and pointwise through their phase split: a 3x3 stride 2 whose phases are 16 wide
    # (16-byte staging), a ResNet downsampling 1x1 stride 2 (one phase, 12x12: 16-byte pointwise staging) and
    # one on an odd plane (13x13 -> 7x7 phases, zero-padded); "stride2_3x3" and the AlexNet case split too.
    "stride2_vector": (3, 9, 16, 32, 20, 3, 3, 2, 1, 1, 0.8, 1, 1),
    "stride2_1x1": (3, 40, 24, 24, 70, 1, 1, 2, 0, 1, 0.9, 1, 1),
    "stride2_1x1_odd": (2, 100, 13, 13, 33, 1, 1, 2, 0, 1, 0.9, 1, 0),
    # A stride beyond the (unpadded) input's size along both axes (one phase pixel per phase image, phases past
    # the input zero: ad6deff's PhaseSplit.input).
    "stride_beyond_input": (3, 4, 3, 2, 8, 5, 5, 5, 2, 1, 0.5, 1, 1),
}


def make_case(name: str, dtype: torch.dtype, seed: int):
    N, C, H, W, M, R, S, stride, padding, dilation, sparsity, empty, dense = CASES[name]
    gen = torch.Generator().manual_seed(seed)
    weight = random_weight(M, C, R, S, sparsity, gen, empty, dense)
    x = torch.randn(N, C, H, W, generator=gen, dtype=torch.float64)
    bias = torch.randn(M, generator=gen, dtype=torch.float64)
    spatial = 1 if name.startswith("conv1d") else 2
    if spatial == 1:
        geometry = ConvGeometry.of(stride, padding, dilation, 1, 1)
        weight_stored = weight[:, :, 0, :]
    else:
        geometry = ConvGeometry.of(stride, padding, dilation)
        weight_stored = weight
    # The reference sees the values the kernel sees: inputs and weights rounded to the storage dtype.
    x_q, w_q, b_q = x.to(dtype), weight_stored.to(dtype), bias.to(dtype)
    ref = F.conv2d(x_q.double(), w_q.double().reshape(weight.shape), b_q.double(), geometry.stride,
                   geometry.padding, geometry.dilation)
    return x_q.to(CUDA), UniformCSR.from_dense(w_q).to(CUDA), b_q.to(CUDA), geometry, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_direct_every_setting_matches_float64_reference(case: str, dtype: torch.dtype) -> None:
    """Every setting, unfused, fused with the ReLU after the layer (``relu=True``: in the kernel's epilogue, or in a
    pass after a wide tiling or split-K) and fused with a residual add, with and without that ReLU (``residual``,
    likewise): the float64 reference, and the fused output is exactly the unfused one through ``torch.relu`` (the
    same sums, negative ones stored as 0); with the residual in float32 exactly ``out + residual`` (through the ReLU)
    too (the kernel adds it to the same float32 sum), in float16 within the bound (the kernel rounds the sum once,
    torch twice)."""
    x, csr, bias, geometry, ref = make_case(case, dtype, seed=hash(case) % 1000)
    residual = torch.randn(ref.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64).to(dtype)
    expected_with_residual = torch.relu(ref + residual.double())
    residual = residual.to(CUDA)
    backend = get_backend("direct")
    assert backend.unsupported_reason(x, csr, geometry) is None
    out_hw = geometry.output_size(x.shape[2], x.shape[3], csr.kernel_size)
    space = rows_space(x.shape[0], out_hw[0] * out_hw[1], prune=False)
    if geometry.dilation == (1, 1) and geometry.spatial_dims == 2:
        split = phase_split(csr, geometry)  # the layer itself at stride 1
        in_hw = split.input_size(x.shape[2], x.shape[3])
        vector = lg.vector_staging_reason(in_hw[1], split.csr.kernel_size, split.geometry.padding) is None
        space += tile_space(x.shape[0], out_hw, split.csr.kernel_size, dtype, prune=False,
                            vector_pad=split.geometry.padding[1] if vector else None,
                            entry_capacity=lambda cc, union: longest_list(split.csr, cc, union))
        if is_pointwise(split.csr, split.geometry) and in_hw == out_hw:
            pixels = out_hw[0] * out_hw[1]
            space += pointwise_space(x.shape[0], csr.out_channels, pixels, dtype, prune=False,
                                     vector=lg.pointwise_vector_reason(dtype, pixels) is None,
                                     in_channels=split.csr.in_channels_per_group)
    assert all(p in space for p in backend.tuning_space(x, csr, geometry))
    if case.startswith("vector") or case in ("pointwise_vector", "stride2_vector", "stride2_1x1"):
        assert any(p.get("stage") == "vector" for p in space)
    if case in ("pointwise_odd_plane", "pointwise_split", "stride2_1x1_odd"):
        assert any(p.get("splits", 1) > 1 for p in space)
    if case.startswith("stride2") or case.startswith("alexnet"):
        assert any(p["variant"] == "tile" for p in space)
    backend.precompile(x, csr, geometry, space)
    for params in space:
        poison_allocator(ref.numel(), dtype)
        out = backend.conv(x, csr, bias, geometry, **params)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all(), f"{params}: unwritten or non-finite outputs"
        error = relative_error(out.cpu(), ref)
        assert error <= tolerance(dtype), f"{case} {params}: relative error {error:.3g}"
        poison_allocator(ref.numel(), dtype)
        fused = backend.conv(x, csr, bias, geometry, relu=True, **params)
        assert torch.equal(fused, torch.relu(out)), f"{case} {params}: the fused ReLU differs from torch.relu"
        error = relative_error(fused.cpu(), torch.relu(ref))
        assert error <= tolerance(dtype), f"{case} {params} relu: relative error {error:.3g}"
        for relu in (True, False):
            poison_allocator(ref.numel(), dtype)
            added = backend.conv(x, csr, bias, geometry, relu=relu, residual=residual, **params)
            summed = out + residual
            if dtype == torch.float32:
                expected = torch.relu(summed) if relu else summed
                assert torch.equal(added, expected), f"{case} {params} relu={relu}: the fused residual differs"
            reference = expected_with_residual if relu else ref + residual.double().cpu()
            error = relative_error(added.cpu(), reference)
            assert error <= tolerance(dtype), f"{case} {params} residual relu={relu}: relative error {error:.3g}"


@pytest.mark.parametrize("backend_name", ["direct", "direct_half2"])
@pytest.mark.parametrize("case", ["groups_tiles_chunks", "vector_edges", "vector_pad0", "stride2_vector"])
def test_staged_entries_give_the_unstaged_result_bit_for_bit(case: str, backend_name: str) -> None:
    """A ``stage_entries`` setting reads the same entries in the same order as its unstaged tiling, from shared
    memory instead of global memory, so both outputs agree bit for bit (float32 for ``direct``, float16 with half2
    products for ``direct_half2``); every such setting of the case's tuning space is checked (planes at least 16
    wide: the space leaves 32-wide warp tiles out of narrower ones, and every staged tiling has them; two cases hold
    an all-zero and a dense row)."""
    dtype = torch.float32 if backend_name == "direct" else torch.float16
    x, csr, bias, geometry, ref = make_case(case, dtype, seed=31)
    backend = get_backend(backend_name)
    staged = [p for p in backend.tuning_space(x, csr, geometry) if p.get("entries") == "shared"]
    assert staged, "no staged setting in the tuning space"
    for params in staged:
        unstaged = {k: v for k, v in params.items() if k not in ("entries", "min_blocks")}
        poison_allocator(ref.numel(), dtype)
        out = backend.conv(x, csr, bias, geometry, **params)
        expected = backend.conv(x, csr, bias, geometry, **unstaged)
        torch.cuda.synchronize()
        assert torch.equal(out, expected), params
        assert relative_error(out.cpu(), ref) <= tolerance(dtype), params


@pytest.mark.parametrize("case", sorted(c for c in CASES if CASES[c][9] == 1 and not c.startswith("conv1d")))
def test_half2_every_setting_matches_float64_reference(case: str) -> None:
    """``direct_half2``: every tile setting (phase split for strided layers) on float16, within the comparator's
    float16 bound; dense rows ("fully_dense", "empty_and_dense_rows") sum many runs of 16 float16 products."""
    x, csr, bias, geometry, ref = make_case(case, torch.float16, seed=hash(case) % 1000)
    backend = get_backend("direct_half2")
    assert backend.unsupported_reason(x, csr, geometry) is None
    assert "float16" in backend.unsupported_reason(x.float(), csr.to(dtype=torch.float32), geometry)
    split = phase_split(csr, geometry)
    in_hw = split.input_size(x.shape[2], x.shape[3])
    vector = lg.vector_staging_reason(in_hw[1], split.csr.kernel_size, split.geometry.padding) is None
    space = [{**p, "accumulate": "half2"} for p in tile_space(
        x.shape[0], geometry.output_size(x.shape[2], x.shape[3], csr.kernel_size), split.csr.kernel_size,
        torch.float16, prune=False, vector_pad=split.geometry.padding[1] if vector else None,
        entry_capacity=lambda cc, union: longest_list(split.csr, cc, union))]
    assert space and all(p in space for p in backend.tuning_space(x, csr, geometry))
    backend.precompile(x, csr, geometry, space)
    residual = torch.randn(ref.shape, device=CUDA, dtype=torch.float16)
    for params in space:
        poison_allocator(ref.numel(), torch.float16)
        out = backend.conv(x, csr, bias, geometry, **params)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all(), f"{params}: unwritten or non-finite outputs"
        error = relative_error(out.cpu(), ref)
        assert error <= tolerance(torch.float16), f"{case} {params}: relative error {error:.3g}"
        added = backend.conv(x, csr, bias, geometry, relu=True, residual=residual, **params)  # in passes after
        assert torch.equal(added, torch.relu(out + residual)), f"{case} {params}: the residual and ReLU passes"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("batch", "chw"), [(5, (3, 13, 11)), (128, (64, 56, 56)), (2, (8, 10, 36)), (1, (4, 4, 4)),
                                           (3, (4, 4, 4))])
def test_pairing_kernel_matches_torchs_pair_images(batch: int, chw: tuple[int, int, int], dtype: torch.dtype) -> None:
    """The ``pair_images`` kernel against torch's permuted copy, bit for bit: odd and even batches (a zero image
    past an odd one), planes whose element count is and is not a multiple of the 16-byte unit, and a misaligned
    view (the element-wise kernel)."""
    x = torch.randn(batch, *chw, device=CUDA).to(dtype)
    storage = torch.empty(x.numel() + 1, dtype=dtype, device=CUDA)
    shifted = storage[1:].view_as(x)
    shifted.copy_(x)
    assert not lg.vector_aligned(shifted)
    for source in (x, shifted):
        out = pair_images_on_device(source)
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), pair_images(source.cpu()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("shape", "kernel", "stride", "padding"), [
    ((3, 2, 9, 7), (3, 3), 2, 1), ((128, 3, 224, 224), (11, 11), 4, 2), ((5, 3, 230, 229), (7, 7), 2, 3),
    ((4, 5, 6, 5), (3, 1), (2, 1), (1, 0)), ((3, 2, 3, 2), (5, 5), (5, 4), (2, 2))])
def test_phase_pairing_kernel_matches_the_phase_split_then_pairing(shape, kernel, stride, padding, dtype) -> None:
    """``phase_pair_images`` against torch's two passes (:meth:`PhaseSplit.input`, then :func:`pair_images`), bit
    for bit: odd batches, sizes that are not multiples of the stride (zero phase rows and columns), AlexNet's stem
    at batch 128, ResNet-50's 7x7 stride-2 stem on odd sizes, a stride along rows only, and strides beyond the
    input's size (phases past the input are zero). The output is poisoned
    first, so an element the kernel skips fails."""
    from unsparse.runtime.backends.direct import bind_phase_pairing

    x = torch.randn(*shape, device=CUDA).to(dtype)
    split = phase_split(UniformCSR.from_dense(torch.randn(4, shape[1], *kernel)), ConvGeometry.of(stride, padding))
    launch, out_shape = bind_phase_pairing(shape, dtype, x.device, split)  # cuda:0, as the tensors say
    out = torch.full(out_shape, float("nan"), dtype=dtype, device=CUDA)
    launch(cl.current_stream(CUDA), x, out)
    torch.cuda.synchronize()
    assert torch.equal(out, pair_images(split.input(x)))


def test_direct_kernels_run_on_torchs_current_stream() -> None:
    """A kernel launched under ``torch.cuda.stream(s)`` runs on ``s``, after the work queued there before it: the
    input is copied on ``s`` behind about 5 ms of GPU sleep, which the kernel must wait for (on another stream it
    would read the zeros there before)."""
    x, csr, bias, geometry, ref = make_case("odd_3x3", torch.float32, seed=11)
    backend = get_backend("direct")
    params = {"variant": "tile", "wx": 8, "py": 2, "nb": 2, "mw": 4, "warps": 8, "cc": 2}
    backend.conv(x, csr, bias, geometry, **params)  # prepared and compiled outside the timed stream
    stream, stale = torch.cuda.Stream(), torch.zeros_like(x)
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(10**7)  # about 5 ms of GPU time before the input is written on this stream
        stale.copy_(x)
        out = backend.conv(stale, csr, bias, geometry, **params)
    stream.synchronize()
    assert relative_error(out.cpu(), ref) <= tolerance(torch.float32)


@pytest.mark.parametrize("backend", ["cudnn", "im2col_cublas", "im2col_cusparse", "reference"])
@pytest.mark.parametrize("case", ["odd_3x3", "stride2_3x3", "alexnet_11x11_s4", "empty_and_dense_rows",
                                  "conv1d_shape"])
def test_baselines_match_float64_reference(case: str, backend: str) -> None:
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    x, csr, bias, geometry, ref = make_case(case, torch.float32, seed=7)
    chosen = get_backend(backend)
    for params in chosen.tuning_space(x, csr, geometry):
        poison_allocator(ref.numel(), torch.float32)
        out = chosen.conv(x, csr, bias, geometry, **params)
        assert relative_error(out.cpu(), ref) <= tolerance(torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_cudnn_fuses_the_relu_in_its_call_and_matches_the_float64_reference(case: str, dtype: torch.dtype) -> None:
    """``relu=True`` on cuDNN (``torch.cudnn_convolution_relu``: convolution, bias and ReLU in one call) in both
    memory formats, every case's geometry (strides, dilation, 1x1, 11x11, a Conv1d, all-zero and fully dense
    weights), TF32 off: the reference's ReLU, negative sums stored as exactly 0, the output in the input's layout."""
    x, csr, bias, geometry, ref = make_case(case, dtype, seed=11)
    expected = torch.relu(ref)
    backend = get_backend("cudnn")
    with precision_mode(False):
        for params in backend.settings(x, csr, geometry, relu=True):  # both layouts, fused call and passes
            poison_allocator(expected.numel(), dtype)
            out = backend.run(x, csr, bias, geometry, relu=True, **params)
            assert relative_error(out.cpu(), expected) <= tolerance(dtype), params
            assert (out.cpu()[expected == 0] == 0).all() and out.is_contiguous(memory_format=torch.contiguous_format)
            last = backend.run(x.contiguous(memory_format=torch.channels_last), csr, bias, geometry, relu=True,
                               **params)
            assert relative_error(last.cpu(), expected) <= tolerance(dtype), params
            unbiased = backend.run(x, csr, None, geometry, relu=True, **params).cpu()  # a conv without bias
            reference = torch.relu(ref - bias.cpu().double().reshape(1, -1, *[1] * (ref.dim() - 2)))
            assert relative_error(unbiased, reference) <= tolerance(dtype), params


@pytest.mark.parametrize("groups", [4, 12])
def test_cudnn_fuses_the_relu_of_a_grouped_conv(groups: int) -> None:
    """Grouped (4 groups) and depthwise (12) 3x3 layers fused with their ReLU on cuDNN, FP32 with TF32 off, both
    layouts: the float64 reference's ReLU, and a channels-last input gets a channels-last output."""
    generator = torch.Generator().manual_seed(groups)
    weight = torch.randn(12, 12 // groups, 3, 3, generator=generator, dtype=torch.float64)
    weight *= torch.rand(weight.shape, generator=generator, dtype=torch.float64) < 0.6
    x, bias = torch.randn(3, 12, 9, 7, generator=generator, dtype=torch.float64), torch.randn(12, generator=generator,
                                                                                                dtype=torch.float64)
    geometry = ConvGeometry.of(1, 1, 1, groups)
    expected = torch.relu(F.conv2d(x, weight, bias, 1, 1, 1, groups))
    csr = UniformCSR.from_dense(weight.float()).to(CUDA)
    with precision_mode(False):
        for layout in (torch.contiguous_format, torch.channels_last):
            out = get_backend("cudnn").run(x.float().to(CUDA).contiguous(memory_format=layout), csr,
                                           bias.float().to(CUDA), geometry, relu=True)
            assert out.is_contiguous(memory_format=layout)
            assert relative_error(out.cpu(), expected) <= tolerance(torch.float32), layout


@pytest.mark.parametrize(("case", "variant"), [("vector_edges", "tile"), ("pointwise_vector", "pointwise")])
def test_vector_staging_on_a_misaligned_input_takes_the_scalar_kernel(case: str, variant: str) -> None:
    x, csr, bias, geometry, ref = make_case(case, torch.float32, seed=9)
    backend = get_backend("direct")
    params = next(p for p in backend.tuning_space(x, csr, geometry)
                  if p.get("stage") == "vector" and p["variant"] == variant)
    storage = torch.empty(x.numel() + 1, dtype=x.dtype, device=CUDA)
    shifted = storage[1:].view_as(x)  # 4 bytes past a 16-byte boundary
    shifted.copy_(x)
    assert shifted.data_ptr() % 16 == 4
    for source in (x, shifted):
        poison_allocator(ref.numel(), torch.float32)
        assert relative_error(backend.conv(source, csr, bias, geometry, **params).cpu(), ref) <= tolerance(
            torch.float32)
    with pytest.raises(ValueError, match="stage"):
        backend.conv(x[..., :-1, :-1].contiguous(), csr, bias, geometry, **params)  # width or plane not % 4
    residual = torch.randn(ref.shape, dtype=torch.float64)
    expected = torch.relu(ref + residual)
    residual = residual.float().to(CUDA)
    call = backend.prepare(x, csr, bias, geometry, relu=True, residual=residual, **params)  # what SparseConv keeps
    for source in (x, shifted, x):  # the residual call resolved again for the other alignment, and back
        assert relative_error(call(source, residual).cpu(), expected) <= tolerance(torch.float32)
    with pytest.raises(TypeError, match="residual=True takes 1 residual, got 0"):
        backend.conv_call(x, csr, bias, geometry, relu=True, residual=True, **params)(x)


def test_float16_pairing_follows_each_inputs_alignment() -> None:
    """float16 tile settings read image pairs made by the ``pair_images`` kernel, bound when the setting is first
    prepared for an input size: its 16-byte vector copy is bound for aligned inputs only, so an input of the same
    shape 2 bytes past a 16-byte boundary, run after an aligned one, gets the element-wise copy (a fault otherwise),
    and the aligned input after it the vector copy again; so does a call prepared once on the aligned input
    (``prepare``, what a ``SparseConv`` keeps between forwards)."""
    x, csr, bias, geometry, ref = make_case("vector_edges", torch.float16, seed=5)
    backend = get_backend("direct")
    params = next(p for p in backend.tuning_space(x, csr, geometry) if p["variant"] == "tile")
    storage = torch.empty(x.numel() + 1, dtype=x.dtype, device=CUDA)
    shifted = storage[1:].view_as(x)
    shifted.copy_(x)
    assert shifted.data_ptr() % 16 == 2 and (x[0].numel() * x.element_size()) % 16 == 0
    prepared = backend.prepare(x, csr, bias, geometry, **params)
    for call in (lambda source: backend.conv(source, csr, bias, geometry, **params), prepared):
        for source in (x, shifted, x):
            poison_allocator(ref.numel(), torch.float16)
            out = call(source)
            torch.cuda.synchronize()
            assert relative_error(out.cpu(), ref) <= tolerance(torch.float16)


def test_pointwise_rows_with_more_than_32_entries_in_a_chunk() -> None:
    """A hand-made matrix naming columns repeatedly puts 40 entries of a row in one chunk, more than the chunk's
    channels: every entry counts, and the sum matches the accumulated dense weight."""
    gen = torch.Generator().manual_seed(11)
    M, C, L = 9, 64, 48
    col_idx = torch.randint(0, 8, (M, L), generator=gen, dtype=torch.int32)  # every entry in chunk 0
    col_idx[:, -8:] = torch.randint(8, C, (M, 8), generator=gen, dtype=torch.int32)
    values = torch.randn(M, L, generator=gen, dtype=torch.float64).float()
    csr = UniformCSR(values, col_idx, (M, C, 1, 1))
    x = torch.randn(3, C, 8, 8, generator=gen, dtype=torch.float64).float()
    ref = F.conv2d(x.double(), csr.to_dense().double())
    backend, geometry = get_backend("direct"), ConvGeometry.of(1, 0)
    x, csr = x.to(CUDA), csr.to(CUDA)
    space = [p for p in backend.tuning_space(x, csr, geometry) if p["variant"] == "pointwise"]
    assert space
    for params in space:
        poison_allocator(ref.numel(), torch.float32)
        error = relative_error(backend.conv(x, csr, None, geometry, **params).cpu(), ref)
        assert error <= tolerance(torch.float32), f"{params}: relative error {error:.3g}"


def test_direct_rejects_bad_indices_before_launch() -> None:
    x, csr, bias, geometry, _ = make_case("odd_3x3", torch.float32, seed=3)
    forged = UniformCSR(csr.values, csr.col_idx, csr.weight_shape)
    object.__setattr__(forged, "col_idx", csr.col_idx + 10_000)
    with pytest.raises(ValueError, match="offsets"):
        get_backend("direct").conv(x, forged, bias, geometry, variant="rows")


@pytest.mark.parametrize("case", ["odd_3x3", "stride2_3x3", "pointwise_vector"])
def test_direct_settings_see_a_weight_changed_in_place(case: str) -> None:
    """Prepared kernel entries hold copies of the values; after ``csr.values.mul_`` every setting must rebuild them
    (the per-weight cache is keyed by the UniformCSR object, which the edit keeps)."""
    x, csr, bias, geometry, _ = make_case(case, torch.float32, seed=11)
    backend = get_backend("direct")
    space = backend.tuning_space(x, csr, geometry)
    for params in space:
        backend.conv(x, csr, bias, geometry, **params)
    csr.values.mul_(-2)
    expected = F.conv2d(x.double().cpu(), csr.to_conv2d_weight().double().cpu(), bias.double().cpu(),
                        geometry.stride, geometry.padding, geometry.dilation)
    for params in space:
        out = sparse_conv(x, csr, bias, geometry, "direct", **params)
        error = relative_error(out.cpu(), expected)
        assert error <= tolerance(torch.float32), f"{case} {params}: relative error {error:.3g}"


def test_fallback_for_groups_and_unsupported_dtype() -> None:
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(8, 2, 3, 3, generator=gen)
    x = torch.randn(2, 4, 9, 9, generator=gen)
    geometry = ConvGeometry.of(1, 1, 1, groups=2)
    csr = UniformCSR.from_dense(weight).to(CUDA)
    assert "groups" in get_backend("direct").unsupported_reason(x.to(CUDA), csr, geometry)
    out = sparse_conv(x.to(CUDA), csr, None, geometry, backend="direct")
    ref = F.conv2d(x.double(), weight.double(), None, 1, 1, 1, 2)
    assert relative_error(out.cpu(), ref) <= tolerance(torch.float32, tf32=True)
    x64 = torch.randn(2, 2, 9, 9, dtype=torch.float64, device=CUDA)
    csr64 = UniformCSR.from_dense(torch.randn(3, 2, 3, 3, dtype=torch.float64)).to(CUDA)
    assert "float64" in get_backend("direct").unsupported_reason(x64, csr64, ConvGeometry.of(1, 1))


class SmallNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, 2, 1),
                                      nn.BatchNorm2d(32), nn.ReLU(), nn.Conv2d(32, 32, 1), nn.ReLU(),
                                      nn.Conv2d(32, 32, 3, padding=2, dilation=2, groups=2))
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


def pruned_small_net(seed: int, sparsity: float, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A :class:`SmallNet` on CUDA in ``dtype`` with about ``sparsity`` of each convolution's weights zeroed; TF32
    off."""
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(seed)
    model = SmallNet().eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Conv2d):
                module.weight[torch.rand_like(module.weight) < sparsity] = 0
    return model.to(CUDA, dtype)


def test_whole_model_auto_matches_dense_and_plan_is_reused(tmp_path) -> None:
    model = pruned_small_net(11, 0.8)
    x = torch.randn(6, 3, 20, 20, device=CUDA)
    sparse = sparsify(model)
    plan, comparisons = plan_model(sparse, x, runs=3)
    assert len(comparisons) == 4 and all(layer.backend == "auto" for layer in sparse.modules()
                                         if hasattr(layer, "plan_key"))
    with torch.no_grad():
        error = relative_error(sparse(x).double(), model(x).double())
    assert error <= 10 * tolerance(torch.float32)
    plan.save(tmp_path / "plan.json")
    again, comparisons = plan_model(sparsify(model), x, Plan.load(tmp_path / "plan.json"), runs=3)
    assert comparisons == [] and again.entries.keys() == plan.entries.keys()


@pytest.mark.parametrize("backend", ["direct", "im2col_cublas", "cudnn"])
def test_a_model_sparsified_under_inference_mode_runs_on_cuda(backend: str) -> None:
    """Buffers made under ``torch.inference_mode()`` have no version counter; the layers still run (they crashed
    on every forward) and match the dense model, inside and outside the mode."""
    model = pruned_small_net(17, 0.8)
    x = torch.randn(4, 3, 20, 20, device=CUDA)
    with torch.inference_mode():
        sparse = set_backend(sparsify(model), backend)
        inside = sparse(x)
    with torch.no_grad():  # outside the mode torch refuses inference tensors in autograd (the copy's BatchNorm)
        expected, outside = model(x), sparse(x)
    for output in (inside, outside):
        assert relative_error(output.double(), expected.double()) <= 10 * tolerance(torch.float32)


@pytest.mark.parametrize("backend", ["direct", "im2col_cublas", "im2col_cusparse", "cudnn", "auto"])
def test_an_unbatched_input_runs_as_a_batch_of_one(backend: str) -> None:
    """``(C, H, W)`` inputs, which ``nn.Conv2d`` accepts, give the dense model's ``(M, E, F)`` on every backend
    (``auto`` planned on that input)."""
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(23)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 6, 3, stride=2)).to(CUDA).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Conv2d):
                module.weight[torch.rand_like(module.weight) < 0.8] = 0
    x = torch.randn(3, 21, 19, device=CUDA)
    sparse = set_backend(sparsify(model), backend)
    if backend == "auto":
        plan_model(sparse, x, Plan(), runs=3)
    with torch.no_grad():
        expected, output = model(x), sparse(x)
    assert output.shape == expected.shape == (6, 10, 9)
    assert relative_error(output.double(), expected.double()) <= 10 * tolerance(torch.float32)


def test_check_plan_times_cuda_graphs_and_keeps_the_model_correct() -> None:
    from unsparse.runtime.comparator import check_plan

    model = pruned_small_net(13, 0.9)
    x = torch.randn(6, 3, 20, 20, device=CUDA)
    sparse = sparsify(model)
    plan, comparisons = plan_model(sparse, x, runs=3)
    check = check_plan(sparse, x, plan, comparisons, runs=5)
    assert check.timing == "graph" and check.planned_ms > 0 and check.default_ms > 0
    for key in check.reverted:  # a reverted layer runs cuDNN in the input's (NCHW) layout, whatever was chosen
        assert (plan.get(key).backend, plan.get(key).params) == ("cudnn", {"memory_format": "contiguous"})
    with torch.no_grad():
        assert relative_error(sparse(x).double(), model(x).double()) <= 10 * tolerance(torch.float32)


def test_the_direct_kernels_refuse_a_bias_shorter_than_the_output_channels() -> None:
    """``conv`` itself (not only ``run``) checks the bias: the kernels read ``bias[m]`` for every output channel."""
    weight = torch.randn(6, 4, 3, 3, device=CUDA)
    csr, x = UniformCSR.from_dense(weight), torch.randn(2, 4, 9, 9, device=CUDA)
    for params in get_backend("direct").tuning_space(x, csr, ConvGeometry.of(1, 1))[:3]:
        with pytest.raises(ValueError, match=r"bias: shape \(1,\)"):
            get_backend("direct").conv(x, csr, torch.zeros(1, device=CUDA), ConvGeometry.of(1, 1), **params)


def test_main_job_on_auto_checks_its_plan_as_cuda_graphs(tmp_path) -> None:
    """The main job on CUDA with ``backend="auto"``: the report's whole-model check is GPU time, and the test set
    run on the (checked) plan scores what the pruned model scores."""
    from unsparse.data import digits
    from unsparse.models import create_model
    from unsparse.pipeline import TimingSettings, TrainSettings, run_pipeline
    from unsparse.prune import MagnitudePruner

    torch.manual_seed(0)
    report = run_pipeline(digits(), create_model("vgg_small", width=8), MagnitudePruner(0.9, fine_tune_epochs=1),
                          lambda model, loader: model, tmp_path, TrainSettings(epochs=1, batch_size=64),
                          TimingSettings(batch_size=64, repeats=5, warmup=1), backend="auto", device=CUDA,
                          progress=False)
    check = report["plan_check"]
    assert check["timing"] == "graph" and check["model_runs_on"] == "auto" and check["images"] == 360
    assert check["planned_ms"] > 0 and check["default_ms"] > 0
    assert abs(report["accuracy"]["sparse_run"] - report["accuracy"]["pruned"]) <= 0.6  # two of 360 images
    assert set(check["layer_backends"]) == {row["layer"] for row in report["layers"]}
    assert "## Whole model" in (tmp_path / "report.md").read_text()


@pytest.mark.parametrize(("backend", "timing"), [("reference", "eager"), ("direct", "graph")])
def test_main_job_on_a_named_backend_times_the_model_on_it(tmp_path, backend: str, timing: str) -> None:
    """The report times the model on the backend the test set ran on, against its dense default, both the same way:
    as CUDA graphs, or eagerly for the reference backend, whose torch.unique cannot be captured (the job crashed
    at its end on any GPU with the default runtime.backend=reference)."""
    from unsparse.data import digits
    from unsparse.models import create_model
    from unsparse.pipeline import TimingSettings, TrainSettings, run_pipeline
    from unsparse.prune import MagnitudePruner

    torch.manual_seed(0)
    report = run_pipeline(digits(limit_train=300, limit_test=60), create_model("vgg_small", width=8),
                          MagnitudePruner(0.9, fine_tune_epochs=0), lambda model, loader: model, tmp_path,
                          TrainSettings(epochs=1, batch_size=64), TimingSettings(batch_size=16, repeats=3, warmup=1),
                          backend=backend, device=CUDA, progress=False)
    check = report["plan_check"]
    assert check["model_runs_on"] == backend and check["model_runs_on_timing"] == timing
    assert check["model_runs_on_ms"] > 0 and check["model_runs_on_default_ms"] > 0
    assert abs(report["accuracy"]["sparse_run"] - report["accuracy"]["pruned"]) <= 100 / 60 + 1e-9


def test_a_model_from_a_file_is_benchmarked_with_its_plan_checked(tmp_path) -> None:
    """The benchmark's trained-model path (``--sparse-file``) checks its plan end to end like the synthetic one."""
    from unsparse.models import create_model
    from unsparse.prune import MagnitudePruner
    from unsparse.runtime.end_to_end import bench_end_to_end_sparse
    from unsparse.sparse.io import load_sparse, save_sparse

    torch.manual_seed(0)
    model = create_model("vgg_small", width=8).eval()
    pruner = MagnitudePruner(0.9)
    pruner.prepare(model)
    pruner.step()
    path = save_sparse(sparsify(pruner.squash_mask()), tmp_path / "model.safetensors")
    record = bench_end_to_end_sparse(load_sparse(path).to(CUDA), (1, 28, 28), 16, CUDA, 5, Plan())
    check = record["plan_check"]
    assert check["timing"] == "graph" and check["planned_ms"] > 0 and check["default_ms"] > 0
    assert record["rel_error"] <= record["tolerance"] and record["layers_planned_now"] > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", ["odd_3x3", "stride2_vector", "pointwise_vector", "alexnet_11x11_s4",
                                  "empty_and_dense_rows"])
def test_every_backend_returns_a_channels_last_input_in_channels_last(case: str, dtype: torch.dtype) -> None:
    """``run`` on an NHWC input: every setting of every CUDA backend returns NHWC and the reference values (the
    direct kernels compute in NCHW and convert on both sides)."""
    from unsparse.runtime.backends import available_backends
    from unsparse.runtime.layout import in_layout, layout_of

    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    x, csr, bias, geometry, ref = make_case(case, dtype, seed=5)
    x = in_layout(x, "nhwc")
    for name in available_backends(CUDA):
        backend = get_backend(name)
        if name == "auto" or backend.unsupported_reason(x, csr, geometry) is not None:
            continue
        for params in backend.tuning_space(x, csr, geometry):
            out = backend.run(x, csr, bias, geometry, **params)
            assert layout_of(out) == "nhwc", (name, params)
            assert relative_error(out.cpu(), ref) <= tolerance(dtype), (name, params)


def test_whole_model_planned_in_channels_last_stays_in_it_and_matches_dense() -> None:
    from unsparse.runtime.layout import in_layout, layout_of
    from unsparse.runtime.modules import sparse_layers

    model = pruned_small_net(12, 0.9, torch.float16)
    x = in_layout(torch.randn(6, 3, 20, 20, device=CUDA, dtype=torch.float16), "nhwc")
    sparse = sparsify(model)
    _, comparisons = plan_model(sparse, x, runs=3)
    assert len(comparisons) == 4 and all(c.layout == "nhwc" and c.key.endswith("|fmt=nhwc") for c in comparisons)
    layouts: list[str] = []
    hooks = [layer.register_forward_hook(lambda m, args, out: layouts.append(layout_of(out)))
             for layer in sparse_layers(sparse).values()]
    with torch.no_grad():
        error = relative_error(sparse(x).double(), model(x.contiguous()).double())
    for hook in hooks:
        hook.remove()
    assert layouts == ["nhwc"] * 4
    assert error <= 10 * tolerance(torch.float16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("case", "variant"), [("odd_3x3", "rows"), ("vector_edges", "tile"),
                                               ("pointwise_vector", "pointwise"), ("stride2_vector", "tile")])
def test_direct_kernels_replay_in_a_cuda_graph(case: str, variant: str, dtype: torch.dtype) -> None:
    """The end-to-end benchmark's graph timings replay the direct kernels (driver launches on torch's stream,
    float16 tiles' image pairing): a replay must recompute the captured output."""
    from unsparse.runtime.timing import capture_graph

    x, csr, bias, geometry, ref = make_case(case, dtype, seed=21)
    backend = get_backend("direct")
    params = next(p for p in backend.tuning_space(x, csr, geometry) if p["variant"] == variant)
    outputs: list[torch.Tensor] = []
    graph = capture_graph(lambda: outputs.append(backend.conv(x, csr, bias, geometry, **params)))
    captured = outputs[-1]
    captured.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert relative_error(captured.cpu(), ref) <= tolerance(dtype), params


def test_a_bound_launch_reuses_its_parameter_block_back_to_back_and_across_threads() -> None:
    """``cuLaunchKernel`` copies the parameter block when called, so the block of a bound launch may be refilled by
    the next call before the previous kernel ran: back-to-back calls on different inputs without a synchronisation
    (behind about 5 ms of GPU sleep, so every launch is queued before any runs), then calls from four threads at
    once, each output against its own float64 reference."""
    from concurrent.futures import ThreadPoolExecutor

    x, csr, bias, geometry, _ = make_case("stride2_vector", torch.float16, seed=31)
    backend = get_backend("direct")
    params = next(p for p in backend.tuning_space(x, csr, geometry) if p["variant"] == "tile")
    inputs = [torch.randn(x.shape, generator=torch.Generator().manual_seed(i)).to(CUDA, torch.float16)
              for i in range(8)]
    weight = csr.to_conv2d_weight().double().cpu()
    refs = [F.conv2d(v.double().cpu(), weight, bias.double().cpu(), geometry.stride, geometry.padding)
            for v in inputs]
    backend.conv(inputs[0], csr, bias, geometry, **params)  # prepared and compiled before the queue
    torch.cuda.synchronize()
    torch.cuda._sleep(10**7)
    outputs = [backend.conv(v, csr, bias, geometry, **params) for v in inputs]
    torch.cuda.synchronize()
    for out, ref in zip(outputs, refs, strict=True):
        assert relative_error(out.cpu(), ref) <= tolerance(torch.float16)

    def run(i: int) -> torch.Tensor:
        with torch.cuda.stream(torch.cuda.Stream()):
            out = torch.stack([backend.conv(inputs[(i + k) % 8], csr, bias, geometry, **params)
                               for k in range(8)])
            torch.cuda.current_stream().synchronize()
            return out

    with ThreadPoolExecutor(4) as pool:
        for i, stacked in enumerate(pool.map(run, range(4))):
            for k in range(8):
                assert relative_error(stacked[k].cpu(), refs[(i + k) % 8]) <= tolerance(torch.float16), (i, k)


def test_a_bound_launch_runs_from_a_thread_that_has_no_cuda_context_yet() -> None:
    """``cuLaunchKernel`` launches in the calling thread's current driver context, and a fresh thread has none: the
    launcher makes the device's primary context current there first (otherwise ``CUDA_ERROR_INVALID_CONTEXT``)."""
    import threading

    from cupy.cuda import driver

    from unsparse.runtime.backends.direct import bind_pairing

    x = torch.randn(3, 4, 5, 8, device=CUDA)
    launch, shape = bind_pairing(tuple(x.shape), x.dtype, x.device, lg.vector_aligned(x))
    out = torch.full(shape, float("nan"), device=CUDA)
    stream = cl.current_stream(CUDA)
    torch.cuda.synchronize()
    seen: dict[str, object] = {}

    def work() -> None:
        seen["context"] = driver.ctxGetCurrent()
        launch(stream, x, out)
        seen["launched"] = True

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    torch.cuda.synchronize()
    assert seen == {"context": 0, "launched": True}
    assert torch.equal(out.cpu(), pair_images(x.cpu()))


def test_compare_layer_times_cuda_graph_replays() -> None:
    """Graph timing (the batch-1 benchmark's GPU-only mode) times every correct setting from graph replays and
    still names a correct fastest setting."""
    from unsparse.runtime.comparator import compare_layer

    x, csr, bias, geometry, _ = make_case("pointwise_split", torch.float32, seed=5)
    result = compare_layer(x, csr, bias, geometry, ["direct", "cudnn"], runs=5, timing="graph")
    timed = [m for m in result.measurements if m.timing is not None]
    assert timed and result.best is not None and result.best.status == "ok"
    assert any(m.params.get("splits", 1) > 1 for m in result.measurements if m.status == "ok")


@pytest.mark.parametrize("timing", ["eager", "graph"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_compare_layer_times_the_cudnn_baseline_in_both_layouts(dtype: torch.dtype, timing: str) -> None:
    """cuDNN's convolution alone (no bias, NCHW and NHWC) is checked against the float64 reference with the bias
    added and timed in both layouts, eagerly and as graph replays; its fastest layout is named."""
    from unsparse.runtime.comparator import compare_layer
    from unsparse.runtime.layout import LAYOUTS
    from unsparse.runtime.precision import precision_mode

    x, csr, bias, geometry, _ = make_case("empty_and_dense_rows", dtype, seed=11)
    with precision_mode(False):  # TF32 off: the float32 bound is FP32's (cuDNN allows TF32 by default)
        result = compare_layer(x, csr, bias, geometry, ["cudnn"], runs=5, timing=timing, baseline=True)
    baseline = result.baseline
    assert set(baseline.timings) == set(LAYOUTS), baseline.rel_error
    assert max(baseline.rel_error.values()) <= tolerance(dtype)
    assert baseline.median_ms == min(t.median_ms for t in baseline.timings.values()) > 0
