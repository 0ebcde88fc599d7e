"""GPU tests: marked ``gpu`` and skipped cleanly where CUDA or CuPy is missing."""

import importlib.util

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = None
    if not torch.cuda.is_available():
        reason = "no CUDA device"
    elif importlib.util.find_spec("cupy") is None:
        reason = "CuPy is not installed"
    for item in items:
        if "tests/gpu" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=reason))
