"""Activation memory layouts: NCHW (``torch.contiguous_format``) and NHWC (``torch.channels_last``).

A model runs in one layout from end to end: the input's. Every backend call returns its output in its input's
layout (:meth:`~unsparse.runtime.backends.base.ConvBackend.run`), converting where the backend computes in
the other one, so a planned model fed a channels-last input stays in channels-last between layers and
the conversion around a layer is part of that layer's measured time. cuDNN's NHWC kernels are 1.2-2.5x faster
than its NCHW ones in FP16 and TF32 on VGG16 (twelfth session, ``kernels/NOTES.md``); the direct kernels
compute in NCHW (paper 000, Escoin §3: CHW input planes, one output plane per channel).
"""

from __future__ import annotations

import torch

LAYOUTS = {"nchw": torch.contiguous_format, "nhwc": torch.channels_last}
"""Layout name -> torch memory format of a 4-D ``(N, C, H, W)`` tensor."""


def layout_of(x: torch.Tensor) -> str:
    """``"nhwc"`` for a 4-D tensor stored channels-last and not also contiguous, else ``"nchw"``.

    A tensor that is both (one channel, or one pixel per channel) counts as NCHW: its bytes are the same in
    either layout.
    """
    if x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):
        return "nhwc"
    return "nchw"


def in_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """``x`` stored in ``layout`` (a copy only if it is not already).

    Raises:
        ValueError: for a name not in :data:`LAYOUTS`.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout: unknown {layout!r}, expected one of {sorted(LAYOUTS)}")
    return x.contiguous(memory_format=LAYOUTS[layout])
