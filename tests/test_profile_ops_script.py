"""``scripts/profile_ops.py``: the operator table from profiler events, and its refusals before any GPU work."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType, SimpleNamespace

import pytest
import torch


def event(key: str, count: int, self_us: float) -> SimpleNamespace:
    return SimpleNamespace(key=key, count=count, self_device_time_total=self_us)


def test_the_table_gives_each_operator_its_own_kernel_time_per_forward(
        load_script: Callable[[str], ModuleType]) -> None:
    """Per forward (4 here), slowest first; operators without kernels of their own (a wrapper such as
    ``aten::conv2d``, whose kernels belong to ``aten::cudnn_convolution``) are left out, and so are the kernels
    listed by name and the profiler's own activities, so nothing counts twice."""
    events = [event("aten::conv2d", 52, 0.0), event("aten::add_", 52, 18400.0),
              event("sm90_xmma_fprop_implicit_gemm_tf32", 52, 42000.0), event("Command Buffer Full", 27, 15000.0),
              event("aten::cudnn_convolution", 52, 42000.0), event("aten::clamp_min_", 60, 18000.0)]
    table = load_script("profile_ops").op_table(events, forwards=4)
    assert [row["op"] for row in table] == ["aten::cudnn_convolution", "aten::add_", "aten::clamp_min_"]
    assert table[0] == {"op": "aten::cudnn_convolution", "calls_per_forward": 13.0, "ms_per_forward": 10.5}
    assert table[1]["ms_per_forward"] == pytest.approx(4.6) and table[2]["calls_per_forward"] == 15.0


def test_the_table_refuses_zero_forwards(load_script: Callable[[str], ModuleType]) -> None:
    with pytest.raises(ValueError, match="forwards: 0, expected at least 1"):
        load_script("profile_ops").op_table([], forwards=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_without_cuda_or_with_a_bad_batch_it_stops_before_any_work(load_script: Callable[[str], ModuleType],
                                                                   run_script, tmp_path) -> None:
    script = load_script("profile_ops")
    code, text = run_script(script, ["--out", str(tmp_path / "ops.json")])
    assert code == 2 and "profile_ops.py: needs a CUDA GPU" in text
    code, text = run_script(script, ["--out", str(tmp_path / "ops.json"), "--batch", "0"])
    assert code == 2 and "argument --batch: expected an integer >= 1, got '0'" in text
    code, text = run_script(script, ["--out", str(tmp_path / "ops.json"), "--precision", "tf32_generated"])
    assert code == 2 and "invalid choice" in text
    assert not (tmp_path / "ops.json").exists()
