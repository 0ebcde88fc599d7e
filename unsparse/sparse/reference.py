"""CPU reference direct sparse convolution over a UniformCSR weight (Escoin Algorithm 2, §3.1).

This is the algorithm the GPU kernels implement, written with torch gathers: the input is zero padded and
flattened per image, each stored entry's stretched offset selects a shifted window of it, and the window is
scaled by the entry's value and accumulated into its output channel. It is deliberately independent of
``torch.nn.functional.conv2d`` so that tests comparing the two catch indexing errors.
"""

from __future__ import annotations

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
                          geometry: ConvGeometry, entries_per_step: int = 8) -> torch.Tensor:
    """Direct sparse convolution, ``groups == 1``.

    Args:
        x: ``(N, C, H, W)`` float tensor (NCHW; a Conv1d input is ``(N, C, 1, L)``), same device as ``csr``.
        csr: weight with ``C`` input channels and kernel ``(R, S)``.
        bias: ``(M,)`` or None.
        geometry: stride, padding, dilation (``groups`` must be 1).
        entries_per_step: stored entries gathered per vectorised step (memory ~ N*M*E*F*entries_per_step).

    Returns:
        ``(N, M, E, F)`` tensor of ``x``'s dtype; float16/bfloat16 inputs accumulate in float32.

    Raises:
        ValueError: if ``groups != 1`` or ``x``'s channels do not match the weight.
    """
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
    flat = padded.reshape(N, -1)
    offsets = geometry.stretched_offsets(csr.col_idx, csr.kernel_size, padded_hw)
    pixels = output_pixel_offsets(geometry, (E, F_), padded_hw, x.device)
    values = csr.values.to(accumulate)
    out = torch.zeros(N, csr.out_channels, E * F_, dtype=accumulate, device=x.device)
    for start in range(0, csr.row_length, entries_per_step):
        stop = min(start + entries_per_step, csr.row_length)
        index = offsets[:, start:stop, None] + pixels  # (M, j, E*F)
        window = flat[:, index]  # (N, M, j, E*F)
        out += torch.einsum("nmjp,mj->nmp", window, values[:, start:stop])
    if bias is not None:
        out += bias.to(accumulate)[None, :, None]
    return out.reshape(N, csr.out_channels, E, F_).to(x.dtype)
