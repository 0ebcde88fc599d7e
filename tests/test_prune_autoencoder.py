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
