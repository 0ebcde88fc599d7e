"""``report.md`` rendered again from a ``report.json`` of an older job, which lacks fields added since: the run's
``timing_runs`` and ``timing_warmup`` and the plan check's ``margin``, where rendering raised a bare KeyError, and its
``layer_backends``, ``unplanned_images`` and ``model_runs_on_ms``, of which the page said nothing, as if there were
nothing to say. Now the page says the figure was not recorded instead of stating one."""

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
"""A plan check as jobs from 370a8ce up to 7a6912f wrote it: no ``margin``."""


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



FIGURES = {"planned_ms": 1.25, "default_ms": 2.5, "reverted": [], "timing": "eager", "images": 16}
"""PlanCheck's fields and ``images``, which every version of the main job wrote (370a8ce on)."""


def timed(planned: str = "1.25", verdict: str = "2.00x the default's speed") -> str:
    """The paragraph's first sentence for :data:`FIGURES` with ``planned_ms`` as ``planned``."""
    return (f"The planned model took {planned} ms per forward of 16 images, against 2.5 ms with every layer on its "
            f"dense default, timed eagerly (host clock included) in the same run: {verdict}.")


def whole_model(page: str) -> str:
    """The paragraph under ``## Whole model`` of ``page``."""
    return page.split("## Whole model\n\n")[1].split("\n\n")[0].strip()


ON_THE_PLAN_NOT_RECORDED = (" The test set ran on the plan (which backend each layer ran on: not recorded). How many "
                            "test images ran on the dense default instead, in a batch of another size than the plan's "
                            "16 images, which the plan has no entry for: not recorded.")
ON_REFERENCE_NOT_RECORDED = (" The test set ran on `reference`, not on the plan (which layers it declined, running "
                             "them on the dense default instead: not recorded): its time per forward was not recorded.")


@pytest.mark.parametrize(("check", "paragraph"), [
    # 370a8ce up to 7a6912f: {**asdict(check), "images", "model_runs_on"}; PlanCheck had no margin yet
    ({**FIGURES, "model_runs_on": "auto"}, timed() + ON_THE_PLAN_NOT_RECORDED),
    ({**FIGURES, "model_runs_on": "reference"}, timed() + ON_REFERENCE_NOT_RECORDED),
    # 7a6912f up to 6152685: the same with "margin" (written beside PlanCheck's fields, one of them from c8c15ee)
    ({**FIGURES, "planned_ms": 2.55, "margin": 0.03, "model_runs_on": "auto"},
     timed("2.55", "0.98x the default's speed: slower, within the 3 % noise margin") + ON_THE_PLAN_NOT_RECORDED),
    ({**FIGURES, "planned_ms": 5.0, "reverted": ["k1"], "margin": 0.03, "model_runs_on": "reference"},
     timed("5", "0.50x the default's speed, so the plan is SLOWER") + " Being slower by more than the planning "
     "margin, the plan's 1 new layer entries were set back to the dense default." + ON_REFERENCE_NOT_RECORDED),
    # 6152685 up to dcb4d97 under auto: with "layer_backends" (labels as from b6bd5fa), without "unplanned_images"
    ({**FIGURES, "margin": 0.03, "model_runs_on": "auto",
      "layer_backends": {"features.0": "direct", "features.3": "dense default (not planned)"}},
     timed() + " The test set ran on the plan: `features.0` on direct, `features.3` on dense default (not planned). "
     "How many test images ran on the dense default instead, in a batch of another size than the plan's 16 images, "
     "which the plan has no entry for: not recorded."),
    # 6152685 up to 4b0071b on a named backend: "model_runs_on_ms" alone
    ({**FIGURES, "margin": 0.03, "model_runs_on": "reference",
      "layer_backends": {"features.0": "reference", "features.3": "reference"}, "model_runs_on_ms": 3.75},
     timed() + " The test set ran on `reference`, not on the plan: 3.75 ms per forward (its time on the dense default "
     "was not recorded)."),
])
def test_every_older_plan_check_renders_its_figures_and_says_what_was_not_recorded(tmp_path, check,
                                                                                  paragraph) -> None:
    """Each shape of ``plan_check`` the main job wrote before the fields it lacks were added (the commits that
    wrote it in each case's comment). The paragraph keeps every recorded figure and says "not recorded" where a
    field is missing instead of filling one in: the test set ran on the plan under ``auto`` in every version
    (compare_layers leaves the layers on it), but which backend each layer ran on, or how many test images came in
    batches the plan has no entry for, is not in such a report."""
    assert whole_model(render(tmp_path, old_report(check))) == paragraph


@pytest.mark.parametrize(("check", "tail"), [
    # dcb4d97 on, under auto
    ({**FIGURES, "margin": 0.03, "model_runs_on": "auto", "layer_backends": {"features.0": "direct"},
      "unplanned_images": 0}, " The test set ran on the plan: `features.0` on direct."),
    ({**FIGURES, "margin": 0.03, "model_runs_on": "auto", "layer_backends": {"features.0": "direct"},
      "unplanned_images": 24},
     " The test set ran on the plan: `features.0` on direct. **24 test images ran on the dense default instead**: they "
     "came in a batch of another size than the plan's 16 images, which the plan has no entry for."),
    # 4b0071b on, on a named backend other than the dense default
    ({**FIGURES, "margin": 0.03, "model_runs_on": "reference", "layer_backends": {"features.0": "reference"},
      "model_runs_on_ms": 3.75, "model_runs_on_default_ms": 2.5, "model_runs_on_timing": "eager"},
     " The test set ran on `reference`, not on the plan: 3.75 ms per forward against 2.5 ms on the dense default, "
     "both timed eagerly, 0.67x its speed (SLOWER)."),
    # 7b85fc0 on, on the dense default
    ({**FIGURES, "margin": 0.03, "model_runs_on": "dense_cpu", "layer_backends": {"features.0": "dense_cpu"},
      "model_runs_on_is_default": True},
     " The test set ran on `dense_cpu`, not on the plan, which is the dense default itself (not timed against "
     "itself)."),
])
def test_a_current_plan_check_says_nothing_is_missing(tmp_path, check, tail) -> None:
    """What a job of today writes reads as before: "not recorded" only stands for a field that is absent."""
    assert whole_model(render(tmp_path, old_report(check))) == timed() + tail
