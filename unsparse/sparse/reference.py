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

from unsparse.sparse.format import UniformCSR
from unsparse.sparse.geometry import ConvGeometry


def output_pixel_offsets(geometry: ConvGeometry, out_hw: tuple[int, int], padded_hw: tuple[int, int],
                         device: torch.device) -> torch.Tensor:
    """Offset of output pixel ``(e, f)``'s window origin in a padded image: ``e*stride_h*Wp + f*stride_w``.

    Returns:
        ``(E * F,)`` int64 tensor, row-major over ``(e, f)`` (Escoin eq. for ``f(0, h, w)``).
    """
    E, F_ = out_hw
    wp = padded_hw[1]
    e = torch.arange(E, device=device) * (geometry.stride[0] * wp)
    f = torch.arange(F_, device=device) * geometry.stride[1]
    return (e[:, None] + f[None, :]).reshape(-1)


def reference_sparse_conv(x: torch.Tensor, csr: UniformCSR, bias: torch.Tensor | None,
                          geometry: ConvGeometry, images_per_step: int = 64) -> torch.Tensor:
    """Direct sparse convolution, ``groups == 1``.

    Args:
        x: ``(N, C, H, W)`` float tensor in any memory layout (a Conv1d input is ``(N, C, 1, L)``), same device as
            ``csr``.
        csr: weight with ``C`` input channels and kernel ``(R, S)``.
        bias: ``(M,)`` or None.
        geometry: stride, padding, dilation (``groups`` must be 1).
        images_per_step: images gathered at once (memory ~ images_per_step * distinct offsets * E * F).

    Returns:
        ``(N, M, E, F)`` tensor of ``x``'s dtype, autocast or not (a float32 input under CPU bfloat16 autocast
        gives float32, where ``F.conv2d`` gives bfloat16); float16/bfloat16 inputs accumulate in float32. Only stored
        weights are multiplied, so an infinite input under a pruned weight adds nothing, where ``F.conv2d``'s
        ``inf * 0`` gives NaN (as in every sparse backend that skips zeros).

    Raises:
        ValueError: if ``groups != 1``, ``x``'s channels do not match the weight, or ``images_per_step`` is not a
            positive integer (a negative one would leave the output unwritten).
    """
    if type(images_per_step) is not int or images_per_step < 1:
        raise ValueError(f"images_per_step: expected a positive integer, got {images_per_step!r}")
    if geometry.groups != 1:
        raise ValueError("reference_sparse_conv: groups must be 1 (callers fall back to dense for groups > 1)")
    N, C, H, W = x.shape
    if csr.in_channels_per_group != C:
        raise ValueError(f"x: {C} channels, weight expects {csr.in_channels_per_group}")
    accumulate = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    padded = F.pad(x.to(accumulate), (geometry.padding[1], geometry.padding[1],
                                      geometry.padding[0], geometry.padding[0]))
    padded_hw = (padded.shape[2], padded.shape[3])
    E, F_ = geometry.output_size(H, W, csr.kernel_size)
    flat = padded.reshape(N, math.prod(padded.shape[1:]))  # -1 cannot be inferred for N = 0
    offsets = geometry.stretched_offsets(csr.col_idx, csr.kernel_size, padded_hw)  # (M, L)
    distinct, slot = torch.unique(offsets, return_inverse=True)  # (U,), (M, L)
    rows = torch.arange(csr.out_channels, device=x.device)[:, None].expand_as(slot)
    combine = torch.zeros(csr.out_channels, len(distinct), dtype=accumulate, device=x.device)
    combine.index_put_((rows, slot), csr.values.to(accumulate), accumulate=True)  # (M, U)
    index = distinct[:, None] + output_pixel_offsets(geometry, (E, F_), padded_hw, x.device)  # (U, E*F)
    out = torch.empty(N, csr.out_channels, E * F_, dtype=accumulate, device=x.device)
    for start in range(0, N, images_per_step):
        out[start:start + images_per_step] = combine @ flat[start:start + images_per_step, index]
    if bias is not None:
        out += bias.to(accumulate)[None, :, None]
    return out.reshape(N, csr.out_channels, E, F_).to(x.dtype)
