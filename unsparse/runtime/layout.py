"""Activation memory layouts: NCHW (``torch.contiguous_format``) and NHWC (``torch.channels_last``).

A model runs in one layout from end to end: the input's. Every backend call returns its output in its input's
layout (:meth:`~unsparse.runtime.backends.base.ConvBackend.run`), converting where the backend computes in
the other one, so a planned model fed a channels-last input stays in channels-last between layers and
the conversion around a layer is part of that layer's measured time. cuDNN's NHWC kernels are 1.2-2.5x faster
than its NCHW ones in FP16 and TF32 on VGG16 (twelfth session, ``kernels/NOTES.md``); the direct kernels
compute in NCHW (paper 000, Escoin §3: CHW input planes, one output plane per channel).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from unsparse.runtime.hooks import forward_with_pre_hooks

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


def layout_switch(model: nn.Module, x: torch.Tensor) -> tuple[str | None, list[str]]:
    """Where a model fed ``x`` in NCHW can switch to channels-last for the rest of its forward: the name of the first
    ``nn.MaxPool2d`` it calls (after the stem of ResNet, GoogLeNet and AlexNet, after VGG's first two convs; a pool
    that returns its indices is passed over) or of the first layer it calls with a max pool fused into it (a
    ``SparseConv`` whose ``max_pool`` is set, :func:`~unsparse.runtime.modules.fuse_max_pool_`: VGG's second conv
    where its pools are fused), and the names of the modules called before it that hold a 4-D parameter (convolution
    weights) themselves or in a submodule (a fused conv module that reads its child's weight without calling the child
    counts), in call order, leaving out the modules that contain the pool (the model itself, a ``features``
    container). ``(None, [])`` where the model calls neither. A sparse copy's layers hold CSR buffers, not 4-D
    parameters, so they are not listed (:func:`~unsparse.runtime.end_to_end.switched_input_layouts` gives the layout
    each of them receives). One forward pass under ``torch.no_grad()``; ``model`` is not modified.

    A stem's input has three channels, where cuDNN's channels-last kernels are slow (ResNet-50's 7x7 stem in TF32:
    0.790 ms channels-last, where the NCHW ``direct`` kernel takes 0.313 ms, ``kernels/NOTES.md``, fifty-first
    session), and its output is the model's largest activation, so a conversion after the stem's pool moves a quarter
    of the bytes a conversion after the stem would.
    """
    called: list[str] = []
    switch: list[str] = []

    def record(name: str, module: nn.Module) -> None:
        if switch:
            return
        pools = isinstance(module, nn.MaxPool2d) and not module.return_indices
        if pools or getattr(module, "max_pool", None) is True:  # a SparseConv with its pool fused
            switch.append(name)
        elif any(parameter.dim() == 4 for parameter in module.parameters()):
            called.append(name)

    forward_with_pre_hooks(model, x, [(module, lambda module, inputs, name=name: record(name, module))
                                      for name, module in model.named_modules()])
    if not switch:
        return None, []
    return switch[0], [name for name in called if name and not switch[0].startswith(name + ".")]


@contextmanager
def channels_last_after(model: nn.Module, name: str) -> Iterator[None]:
    """Within the context, ``model``'s submodule ``name`` returns its output in channels-last
    (:func:`in_layout`), so the layers after it receive NHWC while those before it run in the input's layout."""
    handle = model.get_submodule(name).register_forward_hook(lambda module, inputs, out: in_layout(out, "nhwc"))
    try:
        yield
    finally:
        handle.remove()
