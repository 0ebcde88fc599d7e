"""The ``generated`` backend's kernels against a float64 CPU reference, on the cases of ``test_gpu_backends`` it
supports (stride 1, dilation 1), every setting of its tuning space, with the output poisoned before each call."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_gpu_backends import CASES, CUDA, make_case, poison_allocator
from unsparse.runtime import get_backend
from unsparse.runtime.backends.generated import SETTINGS
from unsparse.runtime.comparator import compare_layer, relative_error, tolerance

SUPPORTED = sorted(name for name, case in CASES.items() if case[7] == 1 and case[9] == 1)
"""Cases with stride 1 and dilation 1 (odd shapes, 1x1, 5x5, a Conv1d, all-zero, fully dense and empty rows)."""


def check_settings(case: str, dtype: torch.dtype, seed: int, settings: list[dict] | None = None,
                   repeats: int = 1) -> None:
    """Run ``case`` at each of ``settings`` (default: the backend's tuning space, compiled first) ``repeats`` times,
    each output poisoned first, and compare with the float64 reference."""
    x, csr, bias, geometry, ref = make_case(case, dtype, seed=seed)
    backend = get_backend("generated")
    assert backend.unsupported_reason(x, csr, geometry) is None
    if settings is None:
        settings = backend.tuning_space(x, csr, geometry)
        backend.precompile(x, csr, geometry, settings)
    assert settings
    for params in settings:
        for _ in range(repeats):
            poison_allocator(ref.numel(), dtype)
            out = backend.run(x, csr, bias, geometry, **params)
            torch.cuda.synchronize()
            assert torch.isfinite(out).all(), f"{params}: unwritten or non-finite outputs"
            error = relative_error(out.cpu(), ref)
            assert error <= tolerance(dtype), f"{case} {params}: relative error {error:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", SUPPORTED)
def test_generated_every_setting_matches_float64_reference(case: str, dtype: torch.dtype) -> None:
    check_settings(case, dtype, seed=hash(case) % 1000)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("out_channels", [230, 200])
def test_shared_kernels_match_float64_reference(monkeypatch: pytest.MonkeyPatch, out_channels: int,
                                                dtype: torch.dtype) -> None:
    """3x3 layers of 8 and 7 programs of 32 rows (the last partial) at every setting of :data:`SETTINGS`, so that
    shared kernels of 8, 4 and 3 programs and a lone last program run, twice each (the counters start again from
    zero); 2 x 5 x 7 = 70 pixels leave threads past the last pixel; one empty and one dense row."""
    monkeypatch.setitem(CASES, "programs", (2, 6, 5, 7, out_channels, 3, 3, 1, 1, 1, 0.8, 1, 1))
    check_settings("programs", dtype, seed=out_channels, settings=list(SETTINGS), repeats=2)


def test_generated_on_a_channels_last_input_without_bias() -> None:
    x, csr, bias, geometry, ref = make_case("odd_3x3", torch.float32, seed=11)
    bias_free = ref - bias.cpu().double().reshape(1, -1, 1, 1)
    out = get_backend("generated").run(x.contiguous(memory_format=torch.channels_last), csr, None, geometry)
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert relative_error(out.cpu(), bias_free) <= tolerance(torch.float32)


def test_generated_sees_a_weight_changed_in_place() -> None:
    x, csr, bias, geometry, _ = make_case("odd_3x3", torch.float32, seed=12)
    backend = get_backend("generated")
    before = backend.run(x, csr, bias, geometry)
    csr.values.mul_(2.0)
    after = backend.run(x, csr, bias, geometry)
    expected = 2.0 * (before - bias.reshape(1, -1, 1, 1)) + bias.reshape(1, -1, 1, 1)
    assert relative_error(after.cpu(), expected.cpu().double()) <= tolerance(torch.float32)


def test_comparator_times_generated_when_named_and_refuses_a_strided_layer() -> None:
    x, csr, bias, geometry, _ = make_case("groups_tiles_chunks", torch.float32, seed=13)
    comparison = compare_layer(x, csr, bias, geometry, ["cudnn", "generated"], runs=3, warmup=1)
    assert comparison.fastest("generated") is not None
    x, csr, bias, geometry, _ = make_case("stride2_3x3", torch.float32, seed=14)
    assert "stride 1" in get_backend("generated").unsupported_reason(x.to(CUDA), csr, geometry)


def test_generated_converts_a_bias_of_another_dtype() -> None:
    """The kernels read the bias as the input's dtype: a float32 bias on a float16 layer is converted, not read as
    halves."""
    x, csr, bias, geometry, ref = make_case("odd_3x3", torch.float16, seed=15)
    out = get_backend("generated").run(x, csr, bias.float(), geometry)
    assert relative_error(out.cpu(), ref) <= tolerance(torch.float16)
