"""CPU tests of benchmark result files: plain and xz-compressed JSON read the same; bad names and contents fail
with a ValueError."""

from __future__ import annotations

import json
import lzma

import pytest

from unsparse.report.results import beside, load_result, result_stem


def test_plain_and_compressed_results_read_the_same(tmp_path) -> None:
    result = {"device": "GPU", "layers": [{"layer": "features.5", "best_ms": {"direct": 1.25, "cudnn": None}}]}
    plain = tmp_path / "run.json"
    plain.write_text(json.dumps(result))
    packed = tmp_path / "run.json.xz"
    with lzma.open(packed, "wt") as handle:
        json.dump(result, handle)
    assert load_result(plain) == load_result(packed) == result
    assert result_stem(plain) == result_stem(packed) == tmp_path / "run"


def test_bad_result_files_raise_value_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="ends in neither"):
        result_stem(tmp_path / "run.txt")
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        load_result(listed)
    broken = tmp_path / "broken.json.xz"
    broken.write_bytes(b"not xz")
    with pytest.raises(ValueError):
        load_result(broken)
    for text in ('{"layers": [{"speedup_vs_cudnn": NaN}]}', '{"a": Infinity}', '{"a": 1'):
        listed.write_text(text)
        with pytest.raises(ValueError, match=r"list.json: not valid JSON"):
            load_result(listed)


def test_break_even_script_reads_a_compressed_sweep(tmp_path, load_script) -> None:
    records = [{"model": "vgg16", "layer": "a", "in_chw": [64, 56, 56], "weight_shape": [64, 64, 3, 3],
                "batch": 128, "precision": "fp32", "target_sparsity": s, "speedup_vs_cudnn": v,
                "baseline": {"layout": "nchw"}, "direct_useful_tflops": 9.0} for s, v in ((0.6, 0.8), (0.8, 1.2))]
    result = {"environment": {"commit": "abc"}, "device": "GPU", "layers": records, "weights": "synthetic",
              "runs": 20}
    packed = tmp_path / "sweep.json.xz"
    with lzma.open(packed, "wt") as handle:
        json.dump(result, handle)
    load_script("break_even").main([str(packed), "--out", str(tmp_path / "page_s0.9")])
    assert "| cuDNN FP32 (TF32 off) | 0.80 | 1.20 | 0.700 | <= 0.7: met |" in (tmp_path / "page_s0.9.md").read_text()
    assert (tmp_path / "page_s0.9.png").exists()  # the prefix keeps its dot


def test_break_even_refuses_a_sweep_from_before_the_baseline(tmp_path, load_script, capsys) -> None:
    """A sweep written before the cuDNN-alone baseline (no ``baseline`` in its records) yields no break-even: its
    speedups were against the cuDNN call. Alone it stops the script with the file named and no page; beside a
    newer file it is named on stderr and left out of the page (a scripts audit's find: it wrote a page of "not
    measured" and exited 0)."""
    records = [{"model": "vgg16", "layer": "a", "in_chw": [64, 56, 56], "weight_shape": [64, 64, 3, 3],
                "batch": 128, "precision": "fp32", "target_sparsity": s, "speedup_vs_cudnn": v,
                "direct_useful_tflops": 9.0} for s, v in ((0.6, 0.8), (0.8, 1.2))]
    result = {"environment": {"commit": "abc"}, "device": "GPU", "layers": records, "weights": "synthetic",
              "runs": 20}
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    old.write_text(json.dumps(result))
    with pytest.raises(SystemExit) as stopped:
        load_script("break_even").main([str(old), "--out", str(tmp_path / "page")])
    assert stopped.value.code == 2 and not (tmp_path / "page.md").exists() and not (tmp_path / "page.png").exists()
    assert f"nothing to report: {old}: no record has a speedup over cuDNN's" in capsys.readouterr().err
    new.write_text(json.dumps({**result, "layers": [{**r, "baseline": {"layout": "nchw"}} for r in records]}))
    load_script("break_even").main([str(old), str(new), "--out", str(tmp_path / "page")])
    assert f"break_even: left out {old}: no record has a speedup" in capsys.readouterr().err
    text = (tmp_path / "page.md").read_text()
    assert "| cuDNN FP32 (TF32 off) | 0.80 | 1.20 | 0.700 | <= 0.7: met |" in text
    assert "`new.json`" in text and "`old.json`" not in text


def test_records_before_the_baseline_keep_their_speedup_as_the_call_figure(tmp_path) -> None:
    """A layer record without ``baseline`` (written before it existed) is read with its speedup under
    ``speedup_vs_cudnn_call``; a record with one is read unchanged."""
    old = {"layer": "features.7", "speedup_vs_cudnn": 0.98}
    new = {"layer": "features.12", "speedup_vs_cudnn": 0.61, "speedup_vs_cudnn_call": 0.9,
           "baseline": {"layout": "nhwc", "median_ms": 0.64}}
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"layers": [old, new]}))
    first, second = load_result(path)["layers"]
    assert first == {"layer": "features.7", "speedup_vs_cudnn": None, "speedup_vs_cudnn_call": 0.98}
    assert second == new


def test_pages_keep_a_dot_in_the_result_name(tmp_path, load_script) -> None:
    """A result named after its sparsity (``..._s0.9.json``) is rendered beside itself as ``..._s0.9.md``."""
    assert beside(tmp_path / "run_s0.9", ".md") == tmp_path / "run_s0.9.md"
    result = {"environment": {"gpu": "g", "driver": "0", "torch": "x", "cuda": "x", "commit": "abc",
                              "date_utc": "today"}, "weights": "synthetic", "runs": 20, "layers": [],
              "end_to_end": []}
    (tmp_path / "run_s0.9.json").write_text(json.dumps(result))
    load_script("render_bench").main([str(tmp_path / "run_s0.9.json")])
    assert (tmp_path / "run_s0.9.md").exists() and not (tmp_path / "run_s0.md").exists()


def test_render_bench_skips_other_results_names_a_broken_one_and_renders_the_rest(tmp_path, load_script,
                                                                                  capsys) -> None:
    """One result of another script, one with a null field and a good one: the good one is rendered with its plots
    under its own name, the broken one is named with its error, and the exit status says a file failed."""
    good = {"environment": {"gpu": "g", "driver": "0", "torch": "x", "cuda": "x", "commit": "abc",
                            "date_utc": "today"}, "weights": "synthetic", "runs": 20, "layers": [],
            "end_to_end": [{"model": "m.safetensors", "weights": "trained", "batch": 4, "precision": "fp32",
                            "dense_ms": 1.0, "planned_ms": 0.5, "speedup": 2.0, "rel_error": 0.0}]}
    (tmp_path / "good.json").write_text(json.dumps(good))
    good["end_to_end"][0]["planned_ms"] = None
    (tmp_path / "broken.json").write_text(json.dumps(good))
    (tmp_path / "layouts.json").write_text(json.dumps({"environment": {}, "layers": [{"ms": {}}]}))
    (tmp_path / "folder.json").mkdir()  # an unreadable path stopped the batch (a scripts audit's find)
    paths = [str(tmp_path / name) for name in ("layouts.json", "missing.json", "folder.json", "broken.json",
                                               "good.json")]
    assert load_script("render_bench").main([*paths, "--plots"]) == 1
    out, err = capsys.readouterr()
    assert f"FAILED {tmp_path / 'missing.json'}: FileNotFoundError" in err
    assert f"FAILED {tmp_path / 'folder.json'}: IsADirectoryError" in err
    assert f"skipped {tmp_path / 'layouts.json'}: not a run_bench result" in out
    assert f"FAILED {tmp_path / 'broken.json'}: ValueError: end-to-end record 'm.safetensors': planned_ms is null" \
        in err
    assert f"rendered {tmp_path / 'good.md'}" in out
    assert (tmp_path / "good_end_to_end.png").exists() and not (tmp_path / "end_to_end.png").exists()
