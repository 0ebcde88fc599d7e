"""The pipeline report's verdicts: per layer, speedups are against the baseline's fastest entry and a slower sparse
backend is called slower."""

from __future__ import annotations

import pytest

from unsparse.report import timing_verdicts
from unsparse.report.document import sparsity_percent


def test_verdicts_use_the_fastest_baseline_entry_and_say_slower() -> None:
    timings = [
        {"layer": "a", "backend": "dense_alone", "time_ms": 2.0, "sparse": False},
        {"layer": "a", "backend": "dense_alone", "time_ms": 1.0, "sparse": False},
        {"layer": "a", "backend": "direct", "time_ms": 4.0, "sparse": True},
        {"layer": "a", "backend": "direct", "time_ms": 0.5, "sparse": True},
        {"layer": "b", "backend": "dense_alone", "time_ms": 1.0, "sparse": False},
        {"layer": "b", "backend": "direct", "time_ms": 2.0, "sparse": True},
        {"layer": "c", "backend": "direct", "time_ms": 2.0, "sparse": True},
    ]
    a, b, c = timing_verdicts(timings, "dense_alone")
    assert a["baseline_ms"] == 1.0 and a["sparse_speedup"] == pytest.approx(2.0) and a["fastest"] == "direct"
    assert a["verdict"] == "sparse faster (2.00x)"
    assert b["sparse_speedup"] == pytest.approx(0.5) and b["verdict"] == "sparse SLOWER (2.00x the baseline time)"
    assert b["fastest"] == "direct"  # the baseline is not a backend a plan can choose
    assert c["baseline_ms"] is None and c["verdict"] == "no sparse/baseline pair measured"


def test_a_sparse_backend_that_ties_the_baseline_is_called_neither_faster_nor_slower() -> None:
    (tie,) = timing_verdicts([{"layer": "a", "backend": "dense_alone", "time_ms": 1.5, "sparse": False},
                              {"layer": "a", "backend": "direct", "time_ms": 1.5, "sparse": True}], "dense_alone")
    assert tie["sparse_speedup"] == 1.0 and tie["verdict"] == "sparse as fast as the baseline (1.00x)"
    for base, sparse in ((1.5, 1.501), (1.501, 1.5)):  # a ratio the page prints as 1.00 is a tie too
        (near,) = timing_verdicts([{"layer": "a", "backend": "dense_alone", "time_ms": base, "sparse": False},
                                   {"layer": "a", "backend": "direct", "time_ms": sparse, "sparse": True}],
                                  "dense_alone")
        assert near["verdict"] == "sparse as fast as the baseline (1.00x)"


def test_plan_check_text_says_whether_the_plan_is_slower_and_what_was_set_back() -> None:
    from unsparse.report.document import plan_check_text

    faster = plan_check_text({"planned_ms": 2.0, "default_ms": 3.0, "reverted": [], "timing": "graph",
                              "margin": 0.03, "images": 128, "model_runs_on": "auto"})
    assert "1.50x the default's speed" in faster and "CUDA-graph" in faster
    assert "SLOWER" not in faster and "set back" not in faster and "not on the plan" not in faster
    slower = plan_check_text({"planned_ms": 4.0, "default_ms": 2.0, "reverted": ["a", "b"], "timing": "eager",
                              "margin": 0.03, "images": 8, "model_runs_on": "reference"})
    assert "0.50x the default's speed, so the plan is SLOWER" in slower and "eagerly" in slower
    assert "2 new layer entries were set back" in slower and "`reference`, not on the plan" in slower
    noise = plan_check_text({"planned_ms": 1.02, "default_ms": 1.0, "reverted": [], "timing": "graph",
                             "margin": 0.03, "images": 8, "model_runs_on": "auto"})
    assert "0.98x the default's speed: slower, within the 3 % noise margin" in noise and "SLOWER" not in noise
    runs_on = {"planned_ms": 1.0, "default_ms": 1.0, "reverted": [], "timing": "graph", "margin": 0.03, "images": 8,
               "model_runs_on": "direct", "model_runs_on_default_ms": 1.0, "model_runs_on_timing": "graph"}
    assert plan_check_text({**runs_on, "model_runs_on_ms": 1.02}).endswith(
        "1.02 ms per forward against 1 ms on the dense default, both timed as CUDA-graph replays, 0.98x its speed "
        "(slower, within the 3 % noise margin).")
    assert plan_check_text({**runs_on, "model_runs_on_ms": 1.2}).endswith("0.83x its speed (SLOWER).")
    assert plan_check_text({**runs_on, "model_runs_on_ms": 0.9}).endswith("1.11x its speed.")
    default_everywhere = plan_check_text({"planned_ms": 1.2, "default_ms": 1.0, "reverted": [], "timing": "eager",
                                          "margin": 0.03, "images": 8, "model_runs_on": "auto"})
    assert "SLOWER" in default_everywhere and "already runs its dense default, so nothing was set back" in \
        default_everywhere


def test_a_plan_of_dense_defaults_only_is_not_called_faster_or_slower() -> None:
    """A CPU run whose plan kept every layer on dense_cpu read "12.56x the default's speed" (8.4 against 105.8 ms,
    timed eagerly on a loaded machine): both forwards ran the same layers, so the gap can only be noise or dispatch."""
    from unsparse.report.document import plan_check_text

    check = {"planned_ms": 8.4, "default_ms": 105.8, "reverted": [], "timing": "eager", "margin": 0.03, "images": 8,
             "model_runs_on": "auto", "layer_backends": {"0": "dense_cpu", "1": "dense default (not planned)"}}
    for planned_ms in (8.4, 150.0):
        text = plan_check_text({**check, "planned_ms": planned_ms})
        assert "but every layer of the plan runs its dense default, so both forwards ran the same layers" in text
        assert "SLOWER" not in text and "set back" not in text
    assert "12.60x the default's speed, but" in plan_check_text(check)
    mixed = plan_check_text({**check, "layer_backends": {"0": "dense_cpu", "1": "direct"}})
    assert "12.60x the default's speed." in mixed and "same layers" not in mixed
    converted = plan_check_text({**check, "layer_backends": {"0": "cudnn, converted to nhwc"}})
    assert "same layers" not in converted


def test_stages_no_better_than_a_model_that_learned_nothing_are_named_per_task() -> None:
    """A smoke run on digits reported pruned 10 and sparse_run 10 next to a trivial score of 10 without a word, and
    the sentence named both tasks' trivial models at once."""
    from unsparse.report.document import _trivial_text

    text = _trivial_text({"metric": "top1", "metric_trivial": 10.0}, {"dense": 90.0, "pruned": 10.0, "sparse_run": 9.5})
    assert text == ("A model that learned nothing scores 10 here (always the most frequent training label). "
                    "**No better than that: `pruned`, `sparse_run`.**")
    text = _trivial_text({"metric": "mse", "metric_trivial": 1.19}, {"dense": 0.03, "pruned": 1.2})
    assert text.startswith("A model that learned nothing scores 1.19 here (each window predicted by its own mean).")
    assert text.endswith("**No better than that: `pruned`.**")
    assert "No better" not in _trivial_text({"metric": "mse", "metric_trivial": 1.19}, {"dense": 0.03})
    assert _trivial_text({"metric": "mse", "metric_trivial": 1.19}, {"dense": float("nan")}).endswith(
        "**No better than that: `dense`.**")  # a diverged stage


def test_not_timed_names_backends_that_could_not_run_not_settings_the_screening_left_out() -> None:
    """The comparator times a backend's best three settings; the others stay "ok" without a time, and the line
    named every layer of a timed backend (once per dropped setting)."""
    from unsparse.report.document import not_timed_text

    rows = [{"layer": layer, "backend": "direct", "status": "ok", "reason": None} for layer in ("0", "0", "1")]
    rows += [{"layer": layer, "backend": "direct_half2", "status": "unsupported", "reason": "float16 only"}
             for layer in ("0", "0", "1")]
    assert not_timed_text(rows) == "Not timed: `direct_half2` on `0`, `1` (unsupported: float16 only)."
    assert not_timed_text(rows[:3]) == ""


@pytest.mark.parametrize(("fraction", "text"), [(0.99996, ">99.99"), (1.0, "100.00"), (0.9, "90.00"),
                                                (0.99994, "99.99"), (0.00004, "<0.01"), (0.0, "0.00")])
def test_a_sparsity_reads_as_complete_only_when_it_is(fraction, text) -> None:
    """With 4 significant digits a layer of 2.4M weights with 94 left printed as 100 % sparse."""
    assert sparsity_percent(fraction) == text


def test_a_target_missed_by_a_hair_reads_below_it() -> None:
    """A run stopped at 89.997 % printed its target as 90.00 % beside "NOT reached" and no figure below it."""
    from unsparse.report.document import short_of

    assert short_of(0.89997, 0.9) == "89.997" and short_of(0.85, 0.9) == "85.00"
    assert short_of(0.8999999, 0.9) == "89.99999"
