"""CPU tests of the break-even report: curves from benchmark records, the crossing, tables and the plot."""

from __future__ import annotations

import pytest

from unsparse.report.break_even import break_even, break_even_markdown, curves, describe, meets, plot_break_even


def record(layer: str, sparsity: float, precision: str, speedup: float | None, batch: int = 128) -> dict:
    return {"model": "vgg16", "layer": layer, "in_chw": [64, 56, 56], "weight_shape": [64, 64, 3, 3],
            "batch": batch, "precision": precision, "target_sparsity": sparsity, "speedup_vs_cudnn": speedup}


def test_curves_group_sort_and_skip() -> None:
    records = [record("a", 0.9, "fp32", 2.0), record("a", 0.5, "fp32", 0.5), record("a", 0.7, "tf32", None),
               record("a", 0.7, "fp32", 1.0, batch=1), record("b", 0.8, "fp16", 0.3)]
    assert curves(records, 128) == {("vgg16", "a"): {"fp32": [(0.5, 0.5), (0.9, 2.0)]},
                                    ("vgg16", "b"): {"fp16": [(0.8, 0.3)]}}


def test_break_even_interpolates_the_last_crossing() -> None:
    assert break_even([(0.5, 0.5), (0.7, 0.9), (0.9, 1.3)]) == pytest.approx(("at", 0.75))
    assert break_even([(0.5, 0.5), (0.6, 1.1), (0.7, 0.95), (0.8, 1.05)]) == pytest.approx(("at", 0.75))
    assert break_even([(0.5, 1.2), (0.9, 3.0)]) == ("below", 0.5)
    assert break_even([(0.5, 0.2), (0.98, 0.9)]) == ("above", 0.98)
    assert break_even([]) == ("none", None)
    assert [describe(break_even(c)) for c in ([(0.5, 1.2)], [(0.9, 0.5)], [])] == ["<= 0.50", "> 0.90", "n/a"]
    assert meets(("at", 0.7), 0.7) and meets(("below", 0.5), 0.7)
    assert not meets(("at", 0.71), 0.7) and not meets(("above", 0.98), 0.99) and not meets(("none", None), 1)


def test_markdown_says_missed_and_not_measured(tmp_path) -> None:
    records = [record("a", 0.8, "fp32", 0.8), record("a", 0.9, "fp32", 1.6), record("a", 0.9, "fp16", 0.4),
               record("a", 0.9, "fp16_half2", 1.2)]
    text = break_even_markdown(records, 128, lambda r: {"fp32": 0.7, "fp16": 0.95, "fp16_half2": 0.95})
    assert "| cuDNN FP32 (TF32 off) | 0.80 | 1.60 | 0.825 | <= 0.7: MISSED |" in text
    # no break-even up to 0.9 leaves 0.9-0.95 open: it was called MISSED
    assert ("| cuDNN FP16 (best layout) | not measured | 0.40 | > 0.90 | <= 0.95: not shown: not measured between "
            "0.9 and 0.95 |") in text
    half2 = "| cuDNN FP16 (best layout), direct with half2 products | not measured | 1.20 | <= 0.90 | <= 0.95: met |"
    assert half2 in text
    path = plot_break_even(records, 128, tmp_path / "b.png")
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_break_even_script_says_when_a_precision_was_not_measured(tmp_path, load_script) -> None:
    module = load_script("break_even")
    records = [{**record("a", s, "fp32", v), "direct_useful_tflops": 8.0} for s, v in ((0.8, 0.8), (0.9, 1.6))]
    result = {"environment": {"commit": "abc"}, "device": "GPU", "layers": records, "weights": "synthetic",
              "runs": 20}
    text = module.report([result], [tmp_path / "r.json"], 128, "r.png")
    assert "- Break-even against cuDNN FP32 (TF32 off) <= 0.7: met on 0 of 1 layers." in text
    assert "- Break-even against cuDNN TF32 <= 0.9: not measured in these runs." in text


@pytest.mark.parametrize(("name", "content", "says"), [
    ("missing.json", None, "cannot be read (No such file or directory)"),
    ("binary.json", b"\xff\xfe\x00", "not UTF-8 text"),
    ("cut.json", b'{"layers": [', "not valid JSON"),
    ("list.json", b"[]", "expected a JSON object"),
    ("other.json", b'{"environment": {}, "layers": []}', "not a bench result, no device, weights, runs"),
    ("record.json", b'{"environment": {}, "device": "GPU", "weights": "w", "runs": 20, "layers": [{"model": "m"}]}',
     "layers[0] has no layer, in_chw, weight_shape, batch, precision, target_sparsity"),
    ("types.json", b'{"environment": {}, "device": "GPU", "weights": "w", "runs": 20, "layers": [{"model": "m", '
                   b'"layer": "l", "in_chw": null, "weight_shape": [4, 3, 3.0, 3], "batch": true, "precision": "fp32", '
                   b'"target_sparsity": 0.9, "speedup_vs_cudnn": 1.0}]}',
     "layers[0] has in_chw, weight_shape, batch of the wrong type"),
])
def test_break_even_script_names_a_bad_file_in_one_line(tmp_path, load_script, capsys, name: str,
                                                        content: bytes | None, says: str) -> None:
    """A missing, undecodable, non-JSON or incomplete result stops the script with status 2 and one error line that
    names the file and what is wrong, not a traceback (a scripts audit's find), and no page is written."""
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(SystemExit) as stopped:
        load_script("break_even").main([str(path), "--out", str(tmp_path / "page")])
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert stopped.value.code == 2 and f"error: result {path}: {says}" in line
    assert not (tmp_path / "page.md").exists() and not (tmp_path / "page.png").exists()


def test_a_goal_the_measured_sparsities_leave_open_is_neither_met_nor_missed() -> None:
    from unsparse.report.break_even import goal_verdict

    assert goal_verdict(("above", 0.9), 0.95) == "not shown: not measured between 0.9 and 0.95"
    assert goal_verdict(("above", 0.95), 0.95) == "MISSED" and goal_verdict(("above", 0.98), 0.9) == "MISSED"
    assert goal_verdict(("below", 0.8), 0.7) == "not shown: not measured below 0.8"
    assert goal_verdict(("below", 0.7), 0.7) == "met" and goal_verdict(("at", 0.71), 0.7) == "MISSED"


def test_a_missed_break_even_beside_its_goal_reads_above_it() -> None:
    """The crossing at 0.7004 read "0.700" beside "<= 0.7: MISSED", a value on the goal called a miss."""
    records = [record("a", 0.7, "fp32", 0.999), record("a", 0.8, "fp32", 1.249)]
    assert describe(break_even([(0.7, 0.999), (0.8, 1.249)])) == "0.700"  # without a goal: three decimals
    text = break_even_markdown(records, 128, lambda r: {"fp32": 0.7})
    assert "| 1.00 | 1.25 | 0.7004 | <= 0.7: MISSED |" in text


@pytest.mark.parametrize(("result", "goal", "text"), [
    (("at", 0.7004), 0.7, "0.7004"),
    (("at", 0.70000004), 0.7, "0.70000004"),
    (("at", 0.7 + 5e-10), 0.7, "0.700"),  # met within the tolerance of meets
    (("at", 0.6995), 0.6995, "0.6995"),  # met: three decimals read 0.700, above the goal
    (("at", 0.69951), 0.6995, "0.700"),  # missed, and three decimals already read above the goal
    (("at", 0.6996), 0.7, "0.700"),  # met: on the goal is still met
    (("at", 0.812), 0.7, "0.812"),
    (("above", 0.9), 0.95, "> 0.90"),
    (("at", 0.6000000010003487), 0.6, "0.6000000010003487"),  # a miss twelve decimals cannot tell: every digit
])
def test_describe_against_a_goal_never_rounds_onto_or_across_it(result, goal, text) -> None:
    assert describe(result, goal) == text
    if result[0] == "at" and len(text) <= 14:
        assert (float(text) <= goal + 1e-9) == meets(result, goal)
