"""The report's history plot: a PNG for pruner iterations and fine-tuning epochs; an empty history is refused; a
figure's format comes from its path's image suffix."""

from __future__ import annotations

import re

import pytest

from unsparse.report.plots import plot_backend_times, plot_history, plot_layers, save_figure


@pytest.mark.parametrize("history", [
    [{"iteration": 0, "val_top1": 90.0, "weighted_sparsity": 0.5}, {"iteration": 1, "val_top1": 89.0,
                                                                    "weighted_sparsity": 0.6}],
    [{"epoch": 1, "val_top1": 88.0}, {"epoch": 2, "val_top1": 89.5}],
])
def test_plot_history_writes_a_png(tmp_path, history):
    path = plot_history(history, tmp_path / "history.png", "val_top1", "pruning", "validation top-1")
    assert path.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize(("history", "ends"), [
    ([{"iteration": 1, "val_top1": 35.2, "weighted_sparsity": 0.9}], (0, 2)),  # magnitude, one fine-tuning epoch
    ([{"epoch": 3, "val_top1": 88.0}, {"epoch": 3, "val_top1": 88.5}], (2, 4)),  # one step, twice
    ([{"iteration": 0, "val_top1": 90.0, "weighted_sparsity": 0.5},
      {"iteration": 1, "val_top1": 89.0, "weighted_sparsity": 0.6}], (0, 1)),
    ([{"iteration": step, "val_top1": 90.0 - step / 10, "weighted_sparsity": step / 50} for step in range(43)],
     (0, 40)),
])
def test_the_history_axis_is_ticked_at_integers(tmp_path, monkeypatch, history, ends):
    """Iterations and epochs are counts, but the ticks fell on fractions: 0.96 to 1.04 for a single fine-tuning
    epoch, 0.2 apart for two iterations. A single step gets one step of room either side, where there are integers
    to tick (``MaxNLocator(integer=True)`` falls back to fractions with fewer than two in view)."""
    import unsparse.report.plots

    ticks = {}
    write = unsparse.report.plots.save_figure

    def capture(figure, path, dpi=110):
        figure.canvas.draw()
        (axis,) = [axis for axis in figure.axes if axis.get_xlabel()]
        low, high = axis.get_xlim()
        ticks["all"] = [float(tick) for tick in axis.get_xticks()]
        ticks["visible"] = [tick for tick in ticks["all"] if low <= tick <= high]
        return write(figure, path, dpi)

    monkeypatch.setattr(unsparse.report.plots, "save_figure", capture)
    plot_history(history, tmp_path / "history.png", "val_top1", "pruning", "validation top-1")
    assert all(tick.is_integer() for tick in ticks["all"]), ticks["all"]
    assert (ticks["visible"][0], ticks["visible"][-1]) == ends


def test_an_empty_history_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="history: no entries"):
        plot_history([], tmp_path / "history.png", "val_top1", "pruning", "validation top-1")
    assert not (tmp_path / "history.png").exists()


def test_a_plot_write_that_fails_keeps_the_previous_png_and_closes_its_figure(tmp_path, monkeypatch):
    """The PNG was written in place: a write stopped midway left a torn file that report.md linked to, and the
    figure stayed open."""
    import matplotlib.pyplot as plt
    from matplotlib.figure import Figure

    history = [{"epoch": 1, "val_top1": 88.0}, {"epoch": 2, "val_top1": 89.5}]
    path = plot_history(history, tmp_path / "history.png", "val_top1", "pruning", "validation top-1")
    before = path.read_bytes()

    def torn(self, handle, **kwargs):
        handle.write(before[:100])
        raise KeyboardInterrupt

    monkeypatch.setattr(Figure, "savefig", torn)
    with pytest.raises(KeyboardInterrupt):
        plot_history(history, path, "val_top1", "pruning", "validation top-1")
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["history.png"]
    assert plt.get_fignums() == []



@pytest.mark.parametrize("name", ["page_s0.9", "page", "page.md"])
def test_a_path_without_an_image_suffix_is_refused_by_name(tmp_path, name):
    """The format was whatever followed the last dot, PNG for none: ``page_s0.9`` asked matplotlib for format "9",
    and ``page`` or ``page.md`` got PNG bytes under a name no link or viewer reads as an image. Refused, naming the
    path, before anything is written; the figure is closed."""
    import matplotlib.pyplot as plt

    path = tmp_path / "plots" / name
    figure, _ = plt.subplots()
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: expected an image suffix \(.*\.png.*\)"):
        save_figure(figure, path)
    assert not (tmp_path / "plots").exists() and plt.get_fignums() == []


@pytest.mark.parametrize(("name", "start"), [("page_s0.9.svg", b"<?xml"), ("page_s0.9.PDF", b"%PDF"),
                                             ("page_s0.9.png", b"\x89PNG")])
def test_the_suffix_names_the_format_in_any_case(tmp_path, name, start):
    import matplotlib.pyplot as plt

    figure, _ = plt.subplots()
    assert save_figure(figure, tmp_path / name).read_bytes().startswith(start)


@pytest.mark.parametrize(("plot", "error"), [
    (lambda path: plot_layers([{"layer": "conv", "row_length": 3}], path), KeyError),  # no sparsity
    (lambda path: plot_backend_times([{"layer": "conv", "backend": "direct"}], path), KeyError),  # no time_ms
    (lambda path: plot_history([{"iteration": 1, "top1": 0.5, "weighted_sparsity": None}], path, "top1", "t", "l"),
     TypeError),
])
def test_a_plot_of_malformed_rows_raises_and_closes_its_figure(tmp_path, plot, error):
    """A row missing a field raised after the figure was made, which stayed open in pyplot (a long job that
    caught the error kept every such figure in memory)."""
    import matplotlib.pyplot as plt

    open_before = len(plt.get_fignums())
    with pytest.raises(error):
        plot(tmp_path / "plot.png")
    assert len(plt.get_fignums()) == open_before
    assert not (tmp_path / "plot.png").exists()


@pytest.mark.parametrize("draw", ["benchmark", "break_even"])
def test_a_benchmark_plot_that_fails_while_drawing_closes_its_figure(tmp_path, monkeypatch, draw):
    """``plot_results`` and ``plot_break_even`` made their figures with ``plt.subplots`` and closed them only in
    ``save_figure``: an error while drawing left each one open in pyplot."""
    import matplotlib.pyplot as plt
    from matplotlib.axes import Axes

    from unsparse.report.benchmark import plot_results
    from unsparse.report.break_even import plot_break_even

    record = {"model": "vgg16", "layer": "features.0", "batch": 8, "precision": "fp32", "count": 1,
              "target_sparsity": 0.9, "speedup_vs_cudnn": 1.5, "direct_ms": 1.0, "cudnn_ms": 1.5,
              "baseline": {"median_ms": 1.5}, "best_ms": {"direct": 1.0}}
    run = {"model": "vgg16", "precision": "fp32", "batch": 8, "dense_ms": 2.0, "planned_ms": 1.0}

    def broken(self, *args, **kwargs):
        raise RuntimeError("drawing failed")

    monkeypatch.setattr(Axes, "axhline", broken)
    monkeypatch.setattr(Axes, "bar", broken)
    open_before = len(plt.get_fignums())
    with pytest.raises(RuntimeError, match="drawing failed"):
        if draw == "benchmark":
            plot_results({"layers": [record], "end_to_end": [run]}, tmp_path)
        else:
            plot_break_even([record], 8, tmp_path / "break_even.png")
    assert len(plt.get_fignums()) == open_before
    assert list(tmp_path.iterdir()) == []
