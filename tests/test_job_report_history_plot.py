"""The pruning plot draws the validation metric above the weighted sparsity of its twin axis: with one history entry
(magnitude pruning with one fine-tuning epoch, the smoke run) both markers sat on the same pixel and the sparsity's
square hid the metric, so the plot seemed to show the sparsity alone. The legend, placed "best" for one axis' points
only, covered the other's (the first MSE points, or the last sparsity): it sits below the axes now."""

from __future__ import annotations

import unsparse.report.plots
from unsparse.report.plots import plot_history


def test_the_metric_is_drawn_over_the_sparsity(tmp_path, monkeypatch) -> None:
    drawn = {}
    write = unsparse.report.plots.save_figure

    def capture(figure, path, dpi=110):
        figure.tight_layout()
        figure.canvas.draw()
        (legend,) = [axis.get_legend() for axis in figure.axes if axis.get_legend() is not None]
        drawn["legend above the axes' bottom"] = any(
            legend.get_window_extent().y1 > axis.get_window_extent().y0 for axis in figure.axes)
        for axis in figure.axes:
            for line in axis.get_lines():
                drawn[line.get_label()] = axis.get_zorder()
        return write(figure, path, dpi)

    monkeypatch.setattr(unsparse.report.plots, "save_figure", capture)
    plot_history([{"iteration": 1, "val_top1": 35.2, "weighted_sparsity": 0.9}], tmp_path / "p.png", "val_top1",
                 "magnitude pruning", "validation top-1 (%)", "fine-tuning epoch")
    assert drawn["validation top-1 (%)"] > drawn["weighted sparsity (%)"]
    assert not drawn["legend above the axes' bottom"]
