"""Phase decomposition: a strided Conv2d as a stride-1 Conv2d over the phases of its input.

A stride-``s`` convolution reads input row ``t = s*e - p + r`` for output row ``e`` and filter row ``r``.
Writing ``t = s*q + phi`` with phase ``phi = t mod s`` splits the input into ``s`` phase images
``x[..., phi::s, :]``, and filter row ``r`` becomes row ``d = (r - p - phi) / s`` of a shorter filter that
moves by one row per output row: ``q = e + d``. Doing this along both axes turns an ``R x S``, stride
``(s_h, s_w)`` layer over ``C`` channels into a stride-1 layer over ``C * P_h * P_w`` phase channels with an
``R' x S'`` filter (``R' = floor((R - 1 - p_h) / s_h) + ceil(p_h / s_h) + 1``: 2x2 for a 3x3 stride-2 layer,
1x1 for a 1x1 one, which only needs one phase). Every nonzero keeps its value and gets a new column, so the
weight keeps its nnz and uniform row length (UnSparse-Opt §5); no product is added or dropped.

Why: the stride-1 direct kernels (input tiles with halos in shared memory, contiguous per-lane loads) then
serve the strided layers too, instead of the strided ``rows`` kernel (Escoin §3, one global load per FMA),
whose stride-2 loads halve the useful bytes of every transaction; and the weight-specialised ``generated`` kernels,
stride 1 only, run the strided stems this way (``unsparse/runtime/backends/generated.py``). The price is one copy of
the input into its phases per call (:meth:`PhaseSplit.input`), which the runtime times with the kernel; the
``generated`` backend gathers the phases in its padding pass instead (``pad_planes``), and ``direct`` in its image
pairing where it pairs (``phase_pair_images``). This is the
space-to-depth rewriting of strided convolutions; neither source paper uses it (Escoin §3.4 lists stride only as a
parameter to specialise kernels on).
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from unsparse.sparse.format import UniformCSR
from unsparse.sparse.geometry import ConvGeometry


def _split_taps(tap: torch.Tensor, padding: int, stride: int,
                phases: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per filter tap (row or column index, int64): the position of its phase in ``phases`` (which holds every tap's
    phase, ascending: a search, not a table of ``stride`` entries, so a huge stride allocates nothing) and its offset
    ``floor((tap - padding) / stride)`` from the output row or column."""
    phase = (tap - padding) % stride
    position = torch.searchsorted(torch.tensor(phases, dtype=torch.long, device=tap.device), phase)
    return position, torch.div(tap - padding - phase, stride, rounding_mode="floor")


def _axis(kernel: int, padding: int, stride: int) -> tuple[tuple[int, ...], int, int]:
    """Along one axis: the phases some filter tap reads (ascending), the new filter size, its top/left
    padding. Tap ``r`` reads phase ``(r - padding) mod stride`` at row offset ``floor((r - padding) / stride)``
    from the output row; the new padding is minus the smallest offset."""
    phases = tuple(sorted({(r - padding) % stride for r in range(kernel)}))
    low, high = (-padding) // stride, (kernel - 1 - padding) // stride
    return phases, high - low + 1, -low


@dataclass(frozen=True)
class PhaseSplit:
    """A strided Conv2d rewritten as a stride-1 Conv2d over phase channels (see the module docstring).

    ``conv2d(x, W, stride=geometry.stride, padding=p)`` equals the first ``E x F`` outputs (the original
    layer's size) of ``conv2d(self.input(x), self.csr.to_dense(), stride=1, padding=self.geometry.padding)``;
    the stride-1 layer may have a row or column more, which reads only zero padding and is never computed
    by a kernel that is given ``E x F``.

    Attributes:
        csr: ``(M, C * P_h * P_w * R' * S')`` UniformCSR with the original values and row length; phase
            channel ``(c * P_h + i) * P_w + j`` is channel ``c`` at row phase ``phases_h[i]`` and column phase
            ``phases_w[j]``.
        geometry: stride 1, dilation 1, padding ``(ceil(p_h / s_h), ceil(p_w / s_w))``, the original groups.
        stride: ``(s_h, s_w)`` of the original layer.
        phases_h, phases_w: the row and column phases some tap reads, ascending (all ``s`` of them once the
            filter is at least as large as the stride).
    """

    csr: UniformCSR
    geometry: ConvGeometry
    stride: tuple[int, int]
    phases_h: tuple[int, ...]
    phases_w: tuple[int, ...]

    @property
    def every_phase(self) -> bool:
        """Whether some tap reads every phase of both axes (always once the filter is at least as large as the
        stride): the phase channels are then all ``C * s_h * s_w`` in order."""
        return (len(self.phases_h), len(self.phases_w)) == self.stride

    @property
    def one_run_per_axis(self) -> bool:
        """Whether the phases of each axis are consecutive (always in practice): phase image ``(i, j)`` is then
        the input at row phase ``phases_h[0] + i`` and column phase ``phases_w[0] + j``, which the generated
        kernels' padding pass reads directly (``pad_planes``, ``kernels/direct_conv.cu``)."""
        return all(phases[-1] - phases[0] + 1 == len(phases) for phases in (self.phases_h, self.phases_w))

    def input_size(self, height: int, width: int) -> tuple[int, int]:
        """``(ceil(H / s_h), ceil(W / s_w))``: the size of each phase image of an ``H x W`` input."""
        return -(-height // self.stride[0]), -(-width // self.stride[1])  # in integers: a float rounds past 2^53

    def input(self, x: torch.Tensor) -> torch.Tensor:
        """The phase images of ``x``: one strided copy when the phases along each axis are consecutive (always
        in practice; a filter smaller than the stride whose phases wrap around takes one copy per run of
        consecutive phases; where every phase is read, the copy is one ``clone``, the fewest torch calls), plus
        a zero pad when ``H`` or ``W`` is larger than its stride and not a multiple of it. Along an axis no longer
        than its stride the phase images are one pixel long (``ceil(H / s_h) = 1``): phase ``phi`` is row ``phi``
        of ``x`` where ``phi < H`` and zero elsewhere, so ``x`` is not padded up to the stride (a stride of
        ``2**40`` would ask for terabytes). No host to device transfer, so it can be captured in a CUDA graph.

        Args:
            x: ``(N, C, H, W)`` NCHW input of the original layer, any dtype and device.

        Returns:
            A fresh ``(N, C * P_h * P_w, ceil(H / s_h), ceil(W / s_w))`` contiguous tensor of ``x``'s dtype
            with ``[n, (c * P_h + i) * P_w + j, q, u] = x[n, c, s_h * q + phases_h[i], s_w * u + phases_w[j]]``
            (zero beyond ``x``); ``x`` is not modified.
        """
        N, C, H, W = x.shape
        hq, wq = self.input_size(H, W)
        # rows and columns per step of the grid: the stride, or the whole axis where it is no larger (one step)
        gh, gw = min(H, self.stride[0]), min(W, self.stride[1])
        if (hq * gh, wq * gw) != (H, W):
            x = F.pad(x, (0, wq * gw - W, 0, hq * gh - H))
        grid = x.reshape(N, C, hq, gh, wq, gw).permute(0, 1, 3, 5, 2, 4)  # (N, C, gh, gw, hq, wq), a view
        if self.every_phase and (gh, gw) == self.stride:  # in order: one copy of the grid
            return grid.clone(memory_format=torch.contiguous_format).view(N, -1, hq, wq)
        in_h, in_w = _below(self.phases_h, gh), _below(self.phases_w, gw)  # the images of the others stay zero
        shape = (N, C, len(self.phases_h), len(self.phases_w), hq, wq)
        whole = (len(in_h), len(in_w)) == shape[2:4]
        phases = x.new_empty(shape) if whole else x.new_zeros(shape)
        for (i, first_h, rows), (j, first_w, cols) in itertools.product(_runs(in_h), _runs(in_w)):
            phases[:, :, i:i + rows, j:j + cols] = grid[:, :, first_h:first_h + rows, first_w:first_w + cols]
        return phases.view(N, -1, hq, wq)


def _below(phases: tuple[int, ...], limit: int) -> tuple[int, ...]:
    """The phases below ``limit``, those inside a grid of ``limit`` rows (or columns) per step: a prefix of the
    ascending ``phases``, so that each keeps its position."""
    return phases[:bisect.bisect_left(phases, limit)]


def _runs(phases: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """``(position in phases, first phase, length)`` of each run of consecutive phases in ``phases``."""
    runs: list[tuple[int, int, int]] = []
    for position, phase in enumerate(phases):
        if runs and runs[-1][1] + runs[-1][2] == phase:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((position, phase, 1))
    return runs


def phase_split(csr: UniformCSR, geometry: ConvGeometry) -> PhaseSplit:
    """Rewrite a strided, undilated Conv2d's weight for :class:`PhaseSplit` (column indices only; the
    values are shared with ``csr``, not copied).

    Args:
        csr: validated ``(M, C/groups * R * S)`` UniformCSR, columns ``(c * R + r) * S + s``.
        geometry: the layer's geometry: Conv2d, dilation 1, any stride and padding.

    Raises:
        ValueError: for a Conv1d or a dilated layer (a dilated strided layer would need phases per tap).
    """
    if geometry.spatial_dims != 2 or geometry.dilation != (1, 1):
        raise ValueError(f"geometry: phase decomposition needs an undilated Conv2d, got {geometry}")
    (R, S), (sh, sw), (ph, pw) = csr.kernel_size, geometry.stride, geometry.padding
    phases_h, rows, pad_h = _axis(R, ph, sh)
    phases_w, cols, pad_w = _axis(S, pw, sw)
    k = csr.col_idx.long()
    c, r, s = k // (R * S), (k // S) % R, k % S
    i, dr = _split_taps(r, ph, sh, phases_h)
    j, ds = _split_taps(s, pw, sw, phases_w)
    channel = (c * len(phases_h) + i) * len(phases_w) + j
    col_idx = (channel * rows + dr + pad_h) * cols + ds + pad_w
    split_csr = UniformCSR(csr.values, col_idx.to(csr.col_idx.dtype).contiguous(),
                           (csr.out_channels, csr.in_channels_per_group * len(phases_h) * len(phases_w), rows, cols))
    return PhaseSplit(split_csr, ConvGeometry((1, 1), (pad_h, pad_w), (1, 1), geometry.groups, 2), (sh, sw),
                      phases_h, phases_w)
