"""The benchmark's breakdown plot sums a backend's layer times per model only where every layer was timed: a
partial sum drew a shorter bar, a backend that failed or was skipped on the large layers looking faster."""

from __future__ import annotations

from test_bench_report import layer

import unsparse.report.plots
from unsparse.report.benchmark import plot_results


def test_a_backend_not_timed_on_every_layer_of_a_model_gets_no_bar(tmp_path, monkeypatch) -> None:
    """im2col is skipped where its matrix exceeds the memory limit (the large early layers) and a direct kernel can
    fail a layer's check; their sums over the other layers were drawn as the model's total."""
    bars = {}

    write = unsparse.report.plots.save_figure

    def capture(figure, path, dpi=110):  # reads the figure, then writes and closes it
        if path.name == "breakdown.png":
            (axis,) = figure.axes
            bars.update({container.get_label(): [bar.get_height() for bar in container]
                         for container in axis.containers})
        return write(figure, path, dpi)

    monkeypatch.setattr(unsparse.report.plots, "save_figure", capture)
    big = layer("alexnet", "features.0", [3, 224, 224], 11, 10.0, 5.0, None, None)  # lowering skipped
    small = layer("alexnet", "features.3", [64, 27, 27], 5, 1.0, 2.0, 4.0, 8.0)
    failed = layer("resnet50", "layer1.0.conv1", [64, 56, 56], 1, 1.0, 1.0, 3.0, 3.0)
    failed["best_ms"]["direct"] = None
    timed = layer("resnet50", "layer1.0.conv2", [64, 56, 56], 3, 2.0, 1.0, 3.0, 3.0)
    plot_results({"layers": [big, small, failed, timed], "end_to_end": []}, tmp_path)
    assert bars["cuDNN alone"] == [11.0, 3.0]
    assert bars["direct"] == [7.0, 0]  # alexnet, resnet50 (one layer not timed)
    assert bars["im2col_cublas"] == [0, 6.0]  # alexnet's first layer was not run
