"""``report.md`` rendered again from a ``report.json`` of an older job, which lacks fields added since: the run's
``timing_runs`` and ``timing_warmup`` and the plan check's ``margin``. Rendering raised a bare KeyError; now the page
says the figure was not recorded instead of stating one."""

from __future__ import annotations

import pytest

from unsparse.report import write_report
from unsparse.strict_json import loads_strict


def old_report(check: dict | None = None, **run: object) -> dict:
    """The fields :func:`write_report` reads, with ``run`` overriding the run's and ``check`` as ``plan_check``."""
    return {"run": {"data": "digits", "model": {"name": "vgg_small"}, "device": "cpu", "torch": "2", "weights": "w",
                    "commit": None, "metric": "top1", "metric_label": "top-1", "metric_trivial": 0.1,
                    "timing_runs": 20, "timing_warmup": 3, **run},
            "accuracy": {"dense": 0.9, "pruned": 0.9, "sparse_run": 0.9},
            "pruning": {"method": "one_shot", "weighted_sparsity": 0.9, "wall_time_s": 1.0,
                        "layer_sparsity": {"conv": 0.9}},
            "file": {"path": "model.safetensors", "bytes": 10, "dense_conv_fp32_bytes": 8, "sparse_conv_bytes": 4},
            "layers": [], "timings": [], "timing_baseline": "dense_alone", "timing_verdicts": [],
            **({"plan_check": check} if check else {})}


def render(tmp_path, report: dict) -> str:
    """report.md of ``report``, checked to render the same again from the report.json written beside it."""
    first = write_report(tmp_path / "first", report, {})
    page = first["markdown"].read_text()
    again = write_report(tmp_path / "again", loads_strict(first["json"].read_text()), {})
    assert again["markdown"].read_text() == page
    return page


@pytest.mark.parametrize(("missing", "said"), [
    ("timing_runs", "Median of timed calls (how many: not recorded) after 3 warm-up calls on cpu"),
    ("timing_warmup", "Median of 20 timed calls after warm-up calls (how many: not recorded) on cpu"),
])
def test_a_run_without_its_timing_counts_says_they_were_not_recorded(tmp_path, missing, said) -> None:
    report = old_report()
    del report["run"][missing]
    assert said in render(tmp_path, report)


def test_a_run_with_its_timing_counts_states_them(tmp_path) -> None:
    assert "Median of 20 timed calls after 3 warm-up calls on cpu" in render(tmp_path, old_report())


CHECK = {"planned_ms": 1.0, "default_ms": 1.0, "reverted": [], "timing": "graph", "images": 8,
         "model_runs_on": "auto"}
"""A plan check as an older job wrote it: no ``margin``."""


@pytest.mark.parametrize(("check", "said"), [
    ({**CHECK, "planned_ms": 0.5}, "2.00x the default's speed."),
    ({**CHECK, "planned_ms": 1.02}, "0.98x the default's speed: slower (the noise margin it was checked against was "
                                    "not recorded)."),
    ({**CHECK, "planned_ms": 2.0, "reverted": ["a"]}, "0.50x the default's speed, so the plan is SLOWER. Being slower "
                                                      "by more than the planning margin, the plan's 1 new layer "
                                                      "entries were set back"),
])
def test_a_plan_check_without_its_margin_renders_without_a_noise_verdict(tmp_path, check, said) -> None:
    """A slower plan that was kept may have been within the margin or beyond it with nothing to set back: without
    the margin neither is said. One set back was beyond it (check_plan reverts only then): SLOWER."""
    page = render(tmp_path, old_report(check))
    assert said in page and "% noise margin" not in page
    if not check["reverted"]:
        assert "SLOWER" not in page and "so nothing was set back" not in page


def test_a_backend_timed_against_its_default_without_the_margin_is_called_slower_not_judged(tmp_path) -> None:
    check = {**CHECK, "model_runs_on": "direct", "layer_backends": {"conv": "direct"}, "model_runs_on_ms": 1.2,
             "model_runs_on_default_ms": 1.0, "model_runs_on_timing": "graph"}
    page = render(tmp_path, old_report(check))
    assert ("1.2 ms per forward against 1 ms on the dense default, both timed as CUDA-graph replays, 0.83x its speed "
            "(slower; the noise margin it was checked against was not recorded).") in page
    assert "SLOWER" not in page


def test_a_report_json_from_before_the_metric_was_recorded_renders(tmp_path) -> None:
    """Jobs before 6152685 wrote no ``metric``, ``metric_label`` or ``metric_trivial`` either (nor the timing counts,
    added with them): their report.json raised KeyError on the metric before reaching the timing line."""
    report = old_report({**CHECK, "margin": 0.03})
    for field in ("metric", "metric_label", "metric_trivial", "timing_runs", "timing_warmup"):
        del report["run"][field]
    page = render(tmp_path, report)
    assert "| stage | test metric (which: not recorded) |" in page and "| dense | 0.9 |" in page
    assert "What a model that learned nothing scores here was not recorded." in page and "No better" not in page
    assert "Median of timed calls (how many: not recorded) after warm-up calls (how many: not recorded)" in page


def test_a_backend_timed_without_its_default_states_its_time_alone(tmp_path) -> None:
    """Jobs from 6152685 up to 4b0071b on a backend other than auto timed the model on it but not on the dense
    default: their report.json has ``model_runs_on_ms`` without ``model_runs_on_default_ms`` or
    ``model_runs_on_timing`` (a review's find: KeyError)."""
    check = {**CHECK, "margin": 0.03, "model_runs_on": "reference", "layer_backends": {"conv": "reference"},
             "model_runs_on_ms": 1.2}
    page = render(tmp_path, old_report(check))
    assert ("The test set ran on `reference`, not on the plan: 1.2 ms per forward (its time on the dense default was "
            "not recorded).") in page


def test_a_backend_timed_against_its_default_without_how_says_so(tmp_path) -> None:
    check = {**CHECK, "margin": 0.03, "model_runs_on": "direct", "layer_backends": {"conv": "direct"},
             "model_runs_on_ms": 0.5, "model_runs_on_default_ms": 1.0}
    assert "0.5 ms per forward against 1 ms on the dense default, both timed (how: not recorded), 2.00x its speed." \
        in render(tmp_path, old_report(check))
