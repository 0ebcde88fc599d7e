"""The speedup plot's axes name the cuDNN mode each panel's speedup is over: fp16_half2 records are against cuDNN
FP16 (the half2-product direct kernel is what differs), and FP32 is cuDNN with TF32 off."""

from __future__ import annotations

from test_bench_report import layer

import unsparse.report.plots
from unsparse.report.benchmark import plot_results


def test_each_panel_names_the_cudnn_mode_it_is_against(tmp_path, monkeypatch) -> None:
    """The label read "speedup over cuDNN fp16_half2", a cuDNN mode that does not exist."""
    labels = {}

    write = unsparse.report.plots.save_figure

    def capture(figure, path, dpi=110):  # reads the figure, then writes and closes it
        if path.name == "speedup.png":
            labels.update({axis.get_title(): axis.get_ylabel() for axis in figure.axes})
        return write(figure, path, dpi)

    monkeypatch.setattr(unsparse.report.plots, "save_figure", capture)
    records = [layer("vgg16", "features.2", [64, 224, 224], 3, 10.0, 4.0, precision=precision)
               for precision in ("fp32", "tf32", "fp16", "fp16_half2")]
    plot_results({"layers": records, "end_to_end": []}, tmp_path)
    assert labels == {"vgg16 fp32 b128 (synthetic weights)": "speedup over cuDNN FP32 (TF32 off)",
                      "vgg16 tf32 b128 (synthetic weights)": "speedup over cuDNN TF32",
                      "vgg16 fp16 b128 (synthetic weights)": "speedup over cuDNN FP16",
                      "vgg16 fp16_half2 b128 (synthetic weights)": "speedup over cuDNN FP16"}
