"""Training flags of a model's modules, recorded and put back: a model's modules can be in different modes (a frozen
batch norm in eval mode inside a training model), which ``model.train(flag)`` would overwrite with one flag. Used
wherever a function switches a caller's model to eval mode for a while (evaluation, calibration, model checks).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn


def module_modes(model: nn.Module) -> list[tuple[nn.Module, bool]]:
    """Every module of ``model`` (itself included) with its ``training`` flag, for :func:`restore_modes`: a model's
    modules can be in different modes (e.g. a frozen batch norm in eval mode inside a training model), which
    ``model.train(flag)`` would overwrite with one flag."""
    return [(module, module.training) for module in model.modules()]


def restore_modes(modes: list[tuple[nn.Module, bool]]) -> None:
    """Put back each module's ``training`` flag that :func:`module_modes` recorded (the module's own flag only)."""
    for module, training in modes:
        module.training = training


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode (``model.eval()``) inside the block, and every module back in its own mode afterwards
    (:func:`module_modes`, :func:`restore_modes`), however the block ends."""
    modes = module_modes(model)
    model.eval()
    try:
        yield
    finally:
        restore_modes(modes)
