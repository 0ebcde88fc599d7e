"""``scripts/gpu_check.py`` hands its benchmark options to ``run_bench`` (no GPU needed: the benchmark is replaced)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch

from unsparse.runtime import bench


def test_benchmark_options_reach_run_bench(load_script: Callable[[str], ModuleType], monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    """The per-layer options, ``--end-to-end-sparsity`` and ``--end-to-end-batch`` arrive as ``run_bench`` arguments;
    without the latter two, ``run_bench``'s own defaults apply. A run filtered to some layers times no model end to end
    unless ``--end-to-end`` names one (the thirty-second session's filtered runs were cut off compiling all four
    models)."""
    calls: list[dict] = []
    monkeypatch.setattr(bench, "require_cuda", lambda script: None)
    monkeypatch.setattr(bench, "run_bench", lambda out, **kwargs: calls.append(kwargs) or {"targets": {}})
    gpu_check = load_script("gpu_check")
    common = ["--skip-tests", "--out", str(tmp_path), "--models", "vgg16", "--sparsities", "0.7"]
    assert gpu_check.main([*common, "--end-to-end", "vgg16", "--end-to-end-sparsity", "0.7",
                           "--end-to-end-batch", "1"]) == 0
    assert gpu_check.main([*common, "--end-to-end"]) == 0
    assert gpu_check.main([*common, "--layer-filter", "features"]) == 0
    assert gpu_check.main([*common, "--layer-filter", "features", "--end-to-end", "vgg16"]) == 0
    assert gpu_check.main(common) == 0
    assert gpu_check.main([*common, "--end-to-end", "vgg16", "--fuse-relu"]) == 0
    assert gpu_check.main([*common, "--end-to-end", "resnet50", "--fold-batch-norm", "epilogue"]) == 0
    assert gpu_check.main([*common, "--end-to-end", "resnet50", "--end-to-end-backends", "generated"]) == 0
    assert gpu_check.main([*common, "--end-to-end", "resnet50", "--no-channels-last-plan"]) == 0
    assert gpu_check.main([*common, "--end-to-end", "resnet50", "--compile-shared-kernels"]) == 0
    first, second, filtered, filtered_named, plain, fused, folded, combined, nchw_only, shared = calls
    assert nchw_only["end_to_end_channels_last"] is False and plain["end_to_end_channels_last"] is True
    assert shared["compile_shared_kernels"] is True and plain["compile_shared_kernels"] is False
    assert combined["end_to_end_backends"] == ["generated"] and plain["end_to_end_backends"] == []
    assert fused["end_to_end_fuse_relu"] is True and plain["end_to_end_fuse_relu"] is False
    assert folded["end_to_end_fold_batch_norm"] == "epilogue" and plain["end_to_end_fold_batch_norm"] == "off"
    assert first["end_to_end"] == ["vgg16"] and first["end_to_end_sparsity"] == 0.7 and first["end_to_end_batch"] == 1
    assert first["models"] == ["vgg16"] and first["sparsities"] == [0.7]
    assert second["end_to_end"] == [] and "end_to_end_sparsity" not in second  # run_bench's default applies
    assert "end_to_end_batch" not in second
    assert filtered["end_to_end"] == [] and filtered["layer_filter"] == "features"
    assert filtered_named["end_to_end"] == ["vgg16"] and "end_to_end" not in plain


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_the_gpu_tests_on_a_machine_without_cuda_are_a_failure_not_a_pass(load_script: Callable[[str], ModuleType],
                                                                          tmp_path: Path) -> None:
    """Every GPU test skips there, and pytest's exit 0 read as "GPU tests passed" (a scripts audit's find)."""
    assert load_script("gpu_check").main(["--skip-bench", "--out", str(tmp_path)]) == 2
    assert "no CUDA device here; no GPU test ran" in (tmp_path / "gpu_check.log").read_text()


@pytest.mark.parametrize("options", [["--skip-tests"], []])
def test_the_benchmark_on_a_machine_without_cuda_is_refused_before_anything_is_written(
        load_script: Callable[[str], ModuleType], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
        tmp_path: Path, options: list[str]) -> None:
    """``--skip-tests`` there ended in ``run_bench``'s traceback (a scripts audit's find); like the GPU-only scripts,
    it is one line and exit status 2 before the log is written, as is a run of tests and benchmark."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(bench, "run_bench", lambda out, **kwargs: pytest.fail("the benchmark ran"))
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as stopped:
        load_script("gpu_check").main([*options, "--quick", "--out", str(out)])
    assert stopped.value.code == 2 and not out.exists()
    assert capsys.readouterr().err == "gpu_check.py: needs a CUDA GPU, and torch sees none here\n"


MODELS = "'vgg16', 'resnet50', 'alexnet', 'googlenet'"


def invalid_choice(value: str, allowed: str) -> str:
    return f"invalid choice: '{value}' (choose from {allowed})"


def out_of_range(value: str) -> str:
    return f"expected a sparsity in [0, 1), got '{value}'"


@pytest.mark.parametrize(("option", "values", "message"), [
    ("--models", ["vgg16", "vgg19"], invalid_choice("vgg19", MODELS)),
    ("--end-to-end", ["resnet18"], invalid_choice("resnet18", MODELS)),
    ("--precisions", ["fp32", "bf16"], invalid_choice("bf16", "'fp32', 'tf32', 'fp16', 'fp16_half2', 'fp32_generated', "
                                                      "'tf32_generated', 'fp16_generated'")),
    ("--sparsities", ["0.9", "1"], out_of_range("1")),
    ("--sparsities", ["-0.1"], out_of_range("-0.1")),
    ("--sparsities", ["nan"], out_of_range("nan")),
    ("--end-to-end-sparsity", ["1.5"], out_of_range("1.5")),
])
def test_a_bad_model_precision_or_sparsity_stops_before_anything_runs(load_script: Callable[[str], ModuleType],
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       capsys: pytest.CaptureFixture, tmp_path: Path,
                                                                       option: str, values: list[str],
                                                                       message: str) -> None:
    """A misspelt model or precision, or a sparsity outside magnitude pruning's [0, 1), is refused while parsing,
    naming the option and the value (and the allowed choices), before the GPU tests (minutes) run and the benchmark
    fails on it with a traceback (scripts audits' finds); nothing is written."""
    monkeypatch.setattr(bench, "run_bench", lambda out, **kwargs: pytest.fail("the benchmark ran"))
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as stopped:
        load_script("gpu_check").main(["--out", str(out), option, *values])
    assert stopped.value.code == 2 and not out.exists()
    assert f"argument {option}: {message}" in capsys.readouterr().err


@pytest.mark.parametrize(("options", "message"), [
    (["--batches", "0"], "batches: expected an integer >= 1, got 0"),
    (["--runs", "0"], "runs: expected an integer >= 1, got 0"),
    (["--time-budget", "-1"], "time_budget_s: expected a number > 0 (or null), got -1.0"),
    (["--layer-filter", "("], "layer_filter: '(' is no regular expression"),
    (["--sparse-file", "missing.safetensors"], "sparse_file: missing.safetensors is no file"),
])
def test_a_bad_benchmark_setting_stops_before_the_gpu_tests(load_script: Callable[[str], ModuleType],
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture, tmp_path: Path,
                                                             options: list[str], message: str) -> None:
    """run_bench refuses these, but only after the GPU tests had run for minutes, with a traceback and the log
    written (a reread's find); they are refused while the command line is read, before anything is written."""
    monkeypatch.setattr(bench, "require_cuda", lambda script: pytest.fail("got past the option checks"))
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as stopped:
        load_script("gpu_check").main(["--out", str(out), *options])
    assert stopped.value.code == 2 and not out.exists()
    assert message in capsys.readouterr().err


def test_every_gpu_test_lives_where_gpu_check_collects() -> None:
    """``gpu_check.py`` runs ``pytest -m gpu tests/gpu`` (the other test files import Hydra, which the GPU machine
    lacks): a ``gpu``-marked test elsewhere never runs there, as the trainer's CUDA label test did not at 3c13ea7.
    pytest itself selects them, so every way of marking (decorator, ``pytestmark``, ``pytest.param``) counts."""
    tests = Path(__file__).resolve().parent
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p",
                                "no:cacheprovider", f"--ignore={tests / 'gpu'}", str(tests)],
                               capture_output=True, text=True, cwd=tests.parent)
    assert collected.returncode == 5, collected.stdout[-2000:] + collected.stderr[-2000:]  # 5: nothing selected
