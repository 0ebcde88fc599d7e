"""CPU reference direct sparse convolution over a UniformCSR weight (Escoin §3.1, Algorithm 2).

The input is zero padded and flattened per image (NCHW). Each stored entry's stretched offset (weight
stretching) plus the offset of output pixel ``(e, f)`` addresses the input element it multiplies
(Escoin's dynamic indexing). Entries of different rows that share a filter position share an offset, so the
windows are gathered once per distinct offset and the rows combine them with one small product: the work
is proportional to the distinct filter positions actually stored, and nothing is lowered for positions
that no row uses. It is independent of ``torch.nn.functional.conv2d``, so tests comparing the two catch
indexing errors, and fast enough to run a whole test set on the CPU.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from unsparse.settings import check_integer
from unsparse.sparse.format import SIZE_LIMIT, SparseFormatError, UniformCSR, bounded_product
from unsparse.sparse.geometry import ConvGeometry

GATHER_BUDGET_BYTES = 256 * 2**20
"""Default bound, in bytes, of the windows :func:`reference_sparse_conv` gathers at once (a VGG16 28x28 layer of 512
channels gathered about 0.9 GB for a batch of 64)."""
BLOCK_PIXELS = 1024
"""Output pixels per block, at least (whole output rows, or the whole ofmap where it has fewer): the unit of
:func:`reference_sparse_conv`'s products, fixed by the layer's output size alone, so the gather budget and
``images_per_step`` change how many blocks are gathered at once but never a result bit."""
PRODUCT_IMAGES = 8
"""Images per batched product (``torch.bmm`` of the combined weights with their gathered windows), in fixed groups
from image 0: a batched product's rounding depends on how many images it holds and where each starts in memory
(MKL picks its path by size and 16-byte alignment), so the groups, not the gathers, decide it. An image's low bits
can therefore depend on the batch it comes in, as with ``F.conv2d``; one product per image (06108e3) ran 2.5x as
long on the smallest layer timed (256 images, 1 -> 8 channels, 28x28) and depends on alignment too."""


def output_pixel_offsets(geometry: ConvGeometry, out_hw: tuple[int, int], padded_hw: tuple[int, int],
                         device: torch.device) -> torch.Tensor:
    """Offset of output pixel ``(e, f)``'s window origin in a padded image: ``e*stride_h*Wp + f*stride_w``.

    Returns:
        ``(E * F,)`` int64 tensor, row-major over ``(e, f)`` (Escoin eq. for ``f(0, h, w)``).

    Raises:
        SparseFormatError: naming ``stride``, if the last pixel's offset is 2^63 or more (beyond torch's int64).
    """
    E, F_ = out_hw
    wp = padded_hw[1]
    sh, sw = geometry.stride
    if E and F_ and (E - 1) * sh * max(wp, 1) + (F_ - 1) * sw >= SIZE_LIMIT:
        raise SparseFormatError(f"stride: {geometry.stride} over {(E, F_)} output pixels of a padded input of "
                                f"{tuple(padded_hw)} gives offsets of 2^63 or more, beyond torch's int64")
    e = torch.arange(E, device=device) * sh * wp  # stride first: no partial product exceeds the last offset
    f = torch.arange(F_, device=device) * sw
    return (e[:, None] + f[None, :]).reshape(-1)


def reference_sparse_conv(x: torch.Tensor, csr: UniformCSR, bias: torch.Tensor | None,
                          geometry: ConvGeometry, images_per_step: int = 64,
                          gather_budget_bytes: int = GATHER_BUDGET_BYTES) -> torch.Tensor:
    """Direct sparse convolution, ``groups == 1``.

    The output pixels are cut into blocks of whole output rows, at least :data:`BLOCK_PIXELS` pixels each (the
    whole ofmap where it has fewer); for each block, the windows of whole groups of :data:`PRODUCT_IMAGES` images are
    gathered at once, as many groups as fit ``images_per_step`` and ``gather_budget_bytes`` (at least one), and
    multiplied one group at a time. The blocks depend on the output size only and the groups on the image index
    only, so the result is bit-identical whatever the budget and ``images_per_step`` (but not whatever the batch:
    :data:`PRODUCT_IMAGES`).

    Args:
        x: ``(N, C, H, W)`` float tensor in any memory layout (a Conv1d input is ``(N, C, 1, L)``), same device as
            ``csr``.
        csr: weight with ``C`` input channels and kernel ``(R, S)``.
        bias: ``(M,)`` or None.
        geometry: stride, padding, dilation (``groups`` must be 1).
        images_per_step: images gathered at most at once, rounded down to whole groups of :data:`PRODUCT_IMAGES`
            (at least one group).
        gather_budget_bytes: bound of the gathered windows in bytes (``images * U * block pixels`` elements of the
            accumulation dtype, ``U`` the distinct filter positions the weight stores), exceeded only by a single
            group's block where that alone is larger. Besides them, a block's int64 gather index
            (``U * block pixels * 8`` bytes), the padded input and the output are held.

    Returns:
        ``(N, M, E, F)`` tensor of ``x``'s dtype, autocast or not (a float32 input under CPU bfloat16 autocast
        gives float32, where ``F.conv2d`` gives bfloat16); float16/bfloat16 inputs accumulate in float32. Only stored
        weights are multiplied, so an infinite input under a pruned weight adds nothing, where ``F.conv2d``'s
        ``inf * 0`` gives NaN (as in every sparse backend that skips zeros).

    Raises:
        ValueError: if ``groups != 1``, ``x``'s channels do not match the weight, or ``images_per_step`` or
            ``gather_budget_bytes`` is not a positive integer (a negative ``images_per_step`` would leave the output
            unwritten); ``SparseFormatError`` (a ValueError) for a geometry whose padded input (its sizes or its
            element count) or offsets reach 2^63 (:meth:`ConvGeometry.padded_size`, :func:`output_pixel_offsets`).
    """
    check_integer(images_per_step, "images_per_step")
    check_integer(gather_budget_bytes, "gather_budget_bytes")
    if geometry.groups != 1:
        raise ValueError("reference_sparse_conv: groups must be 1 (callers fall back to dense for groups > 1)")
    N, C, H, W = x.shape
    if csr.in_channels_per_group != C:
        raise ValueError(f"x: {C} channels, weight expects {csr.in_channels_per_group}")
    E, F_ = geometry.output_size(H, W, csr.kernel_size)  # before padding: refuses a padded size torch cannot hold
    if bounded_product((N, C, *geometry.padded_size(H, W))) >= SIZE_LIMIT:
        raise SparseFormatError(f"padding: {geometry.padding} pads an input of shape {tuple(x.shape)} to 2^63 "
                                "elements or more, beyond torch's int64 sizes")
    accumulate = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    padded = F.pad(x.to(accumulate), (geometry.padding[1], geometry.padding[1],
                                      geometry.padding[0], geometry.padding[0]))
    padded_hw = (padded.shape[2], padded.shape[3])
    flat = padded.reshape(N, math.prod(padded.shape[1:]))  # -1 cannot be inferred for N = 0
    offsets = geometry.stretched_offsets(csr.col_idx, csr.kernel_size, padded_hw)  # (M, L)
    distinct, slot = torch.unique(offsets, return_inverse=True)  # (U,), (M, L)
    rows = torch.arange(csr.out_channels, device=x.device)[:, None].expand_as(slot)
    combine = torch.zeros(csr.out_channels, len(distinct), dtype=accumulate, device=x.device)
    combine.index_put_((rows, slot), csr.values.to(accumulate), accumulate=True)  # (M, U)
    pixels = output_pixel_offsets(geometry, (E, F_), padded_hw, x.device)  # (E*F,)
    block = min(E, -(-BLOCK_PIXELS // max(F_, 1))) * F_  # whole output rows
    per_image = max(len(distinct) * block * padded.itemsize, 1)  # bytes of one image's gathered block
    groups = max(1, min(images_per_step, gather_budget_bytes // per_image) // PRODUCT_IMAGES)
    images = groups * PRODUCT_IMAGES  # gathered at once: whole product groups
    out = torch.empty(N, csr.out_channels, E * F_, dtype=accumulate, device=x.device)
    for first in range(0, E * F_, block):
        index = distinct[:, None] + pixels[None, first:first + block]  # (U, pixels of the block)
        for start in range(0, N, images):
            windows = flat[start:start + images, index]  # (images, U, pixels of the block)
            for group in range(0, len(windows), PRODUCT_IMAGES):  # groups start at multiples of PRODUCT_IMAGES
                chunk = windows[group:group + PRODUCT_IMAGES]
                out[start + group:start + group + len(chunk), :, first:first + block] = torch.bmm(
                    combine.expand(len(chunk), *combine.shape), chunk)
    if bias is not None:
        out += bias.to(accumulate)[None, :, None]
    return out.reshape(N, csr.out_channels, E, F_).to(x.dtype)
