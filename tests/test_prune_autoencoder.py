"""1D-CNN autoencoder (paper 004 §6.1) and the statsmodels time-series windows it trains on."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from unsparse.models import create_model
from unsparse.prune.masks import prunable_layers


def test_autoencoder_has_twelve_conv1d_and_keeps_shape():
    model = create_model("autoencoder1d", channels=3, width=4, latent=2)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv1d)]
    assert len(convs) == 12
    assert [c.kernel_size[0] for c in convs] == [3, 1] * 6
    assert len([m for m in model[0].modules() if isinstance(m, nn.Conv1d)]) == 6
    assert len(prunable_layers(model)) == 12
    x = torch.randn(2, 3, 32)
    assert model[0](x).shape == (2, 2, 8)
    assert model(x).shape == x.shape


def test_timeseries_windows_reconstruct_themselves():
    pytest.importorskip("statsmodels")
    from unsparse.timeseries import timeseries, windows

    splits = timeseries("co2", window=32, stride=8)
    for inputs, targets in (splits.train, splits.val, splits.test):
        assert inputs.shape[1:] == (1, 32) and inputs.dtype == torch.float32
        assert torch.equal(inputs, targets)
        assert torch.isfinite(inputs).all()
    assert splits.train[0].std() == pytest.approx(1.0, rel=1e-4)
    assert len(splits.train[0]) > len(splits.val[0]) > 0
    cut = windows(torch.arange(10.0), 4, 3)
    assert cut.shape == (3, 1, 4) and torch.allclose(cut.mean(dim=2), torch.zeros(3, 1))
    with pytest.raises(ValueError):
        timeseries("nope")


def test_exported_series_reads_back_exactly(tmp_path):
    pytest.importorskip("statsmodels")
    from unsparse.timeseries import export_series, read_series, statsmodels_series, timeseries

    path = export_series("co2", tmp_path / "co2.txt")
    assert torch.equal(read_series(path), statsmodels_series("co2"))
    from_file, from_statsmodels = timeseries("co2", 64, 2, source=path), timeseries("co2", 64, 2)
    for split in ("train", "val", "test"):
        assert torch.equal(getattr(from_file, split)[0], getattr(from_statsmodels, split)[0])
    (tmp_path / "bad.txt").write_text("1.0\nnan\n")
    with pytest.raises(ValueError):
        read_series(tmp_path / "bad.txt")


def test_time_series_settings_are_refused_naming_the_field(tmp_path):
    """A zero stride, a one-point window (every window levels to 0, then NaN after scaling), fractions that leave a
    split empty, and a file with a word that is not a number: each named (some ran on to NaN or a bare error)."""
    from unsparse.timeseries import read_series, timeseries, windows

    with pytest.raises(ValueError, match="window: expected an integer >= 2"):
        windows(torch.arange(10.0), 1, 1)
    with pytest.raises(ValueError, match="stride: expected an integer >= 1"):
        windows(torch.arange(10.0), 4, 0)
    with pytest.raises(ValueError, match=r"val split: 3 points, shorter than the window of 4"):
        windows(torch.arange(3.0), 4, 1, "val split")
    with pytest.raises(ValueError, match=r"val_fraction: expected a number in \(0, 1\), got 0"):
        timeseries(val_fraction=0)
    with pytest.raises(ValueError, match=r"val_fraction \+ test_fraction: 1.2 leaves no training points"):
        timeseries(val_fraction=0.6, test_fraction=0.6)
    with pytest.raises(ValueError, match=r"test_fraction: expected a number in \(0, 1\), got '0.1'"):
        timeseries(test_fraction="0.1")
    path = tmp_path / "series.txt"
    path.write_text("1.0\n2.5\nabc\n")
    with pytest.raises(ValueError, match=r"series.txt: not a series of numbers"):
        read_series(path)
    path.write_text("1.0\n1e39\n")  # finite in float64, inf in float32
    with pytest.raises(ValueError, match=r"series.txt: series holds values that are not finite in float32"):
        read_series(path)
    path.write_text("400.0\n" * 300)  # every window levels to 0: scaled by a standard deviation of 0, all NaN
    with pytest.raises(ValueError, match=r"training windows: standard deviation 0.0"):
        timeseries("flat", window=16, stride=4, source=path)
