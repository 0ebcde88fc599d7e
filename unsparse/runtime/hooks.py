"""One forward pass with temporary forward pre-hooks: how the runtime learns what a model calls, in which order and
with which inputs, without leaving hooks behind."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn


def forward_with_pre_hooks(model: nn.Module, x: torch.Tensor,
                           hooks: Iterable[tuple[nn.Module, Callable[..., Any]]], with_kwargs: bool = False) -> None:
    """Run ``model(x)`` once under ``torch.no_grad()`` with each ``(module, hook)`` registered as a forward pre-hook
    (``nn.Module.register_forward_pre_hook``, ``with_kwargs`` as there); every hook is removed afterwards, also when
    the forward raises. The output is dropped: the hooks record what the caller needs."""
    handles = [module.register_forward_pre_hook(hook, with_kwargs=with_kwargs) for module, hook in hooks]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for handle in handles:
            handle.remove()
