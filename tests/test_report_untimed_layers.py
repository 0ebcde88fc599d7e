"""The benchmark page's "Where sparse is slower" section counts the layer settings where the sparse kernel or
cuDNN alone has no time, instead of leaving them out of its "N of M layer settings"."""

from __future__ import annotations

from test_bench_report import layer

from unsparse.report.benchmark import evaluate_targets, markdown_report


def page(layers: list[dict]) -> list[str]:
    result = {"environment": {"gpu": "test", "driver": "0", "torch": "x", "cuda": "x", "cudnn": 1, "cupy": "x",
                              "commit": "abc", "date_utc": "today"},
              "weights": "synthetic", "runs": 20, "layers": layers, "end_to_end": []}
    result["targets"] = evaluate_targets(result)
    return [line for line in markdown_report(result).splitlines() if line.startswith("- fp")]


def untimed(record: dict, *, sparse: bool = True, baseline: bool = False) -> dict:
    """``record`` as bench_layer writes it where the sparse kernel (or cuDNN alone) had no correct timed setting."""
    if sparse:
        record["best_ms"]["direct"] = None
        record["direct_useful_tflops"] = record["direct_params"] = None
    if baseline:
        record["baseline"] = {"layout": None, "median_ms": None}
    record["speedup_vs_cudnn"] = None
    if sparse:
        record["speedup_vs_cudnn_call"] = None
    return record


def test_layers_where_the_sparse_kernel_was_not_timed_are_counted() -> None:
    """A layer whose direct kernel failed every setting read as if it did not exist: "SLOWER ... on 0 of 1 layer
    settings" for two layers, one of them without any correct sparse result."""
    lines = page([layer("vgg16", "features.2", [64, 224, 224], 3, 10.0, 4.0),
                  untimed(layer("vgg16", "features.5", [64, 112, 112], 3, 10.0, 4.0)),
                  untimed(layer("vgg16", "features.7", [128, 112, 112], 3, 10.0, 4.0), sparse=False,
                          baseline=True)])
    assert lines == ["- fp32: direct is SLOWER than cuDNN (alone, best layout) on 0 of 1 layer settings (geomean "
                     "direct/cuDNN speedup 2.50x, best 2.50x, worst 2.50x); no speedup on 2 more: no direct time on 1, "
                     "no cuDNN alone time on 1."]


def test_a_precision_whose_sparse_kernel_was_never_timed_is_named() -> None:
    """With no speedup at all in a precision, the section said nothing about it."""
    lines = page([layer("vgg16", "features.2", [64, 224, 224], 3, 10.0, 4.0),
                  untimed(layer("vgg16", "features.2", [64, 224, 224], 3, 10.0, 4.0, precision="fp16"))])
    assert lines[1] == "- fp16: no speedup on any of its 1 layer settings: no direct time on 1."
