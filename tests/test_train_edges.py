"""Edge cases of ``unsparse.train``, ``unsparse.task`` and ``unsparse.timeseries`` found in review: a diverged
classifier's score, a model without parameters, module modes after the model check, and undecodable series files."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from unsparse.data import Splits
from unsparse.prune.base import metric_score
from unsparse.task import check_model_fits
from unsparse.timeseries import read_series
from unsparse.train import Trainer


def test_a_diverged_classifier_scores_nan_not_the_share_of_class_0():
    """NaN logits made argmax name class 0 for every sample, so a diverged model scored the share of class 0 in
    top-1 (100 % here) and the pruners, which take a NaN top-1 for divergence, never saw it."""
    inputs, targets = torch.randn(20, 4), torch.zeros(20, dtype=torch.long)
    data = DataLoader(TensorDataset(inputs, targets), batch_size=8)
    net = nn.Linear(4, 3)
    with torch.no_grad():
        net.weight[0, 0] = math.nan
    metrics = Trainer({"val": data}, progress=False).evaluate(net)
    assert math.isnan(metrics["top1"]) and math.isnan(metrics["loss"])
    assert metric_score(metrics) == -math.inf


def test_the_model_check_takes_a_model_without_parameters():
    """``next(model.parameters())`` raised StopIteration for a model without parameters (one of pooling and
    reshaping only), instead of checking it on the CPU."""
    labelled = (torch.randn(4, 1, 28, 28), torch.zeros(4, dtype=torch.long))
    check_model_fits(nn.Sequential(nn.AvgPool2d(28), nn.Flatten()), Splits(labelled, labelled, labelled, 1, "toy"))
    with pytest.raises(ValueError, match=r"outputs of shape \(2, 1\) on data 'toy', which needs \(2, 3\)"):
        check_model_fits(nn.Sequential(nn.AvgPool2d(28), nn.Flatten()), Splits(labelled, labelled, labelled, 3, "toy"))


def test_the_model_check_puts_every_module_back_in_its_mode():
    """``model.train(was_training)`` put every submodule into the model's mode: a batch norm frozen in eval mode
    inside a training model (or a dropout left training inside an eval one) came out of the check changed."""
    labelled = (torch.randn(4, 1, 28, 28), torch.zeros(4, dtype=torch.long))
    net = nn.Sequential(nn.Flatten(), nn.Linear(784, 3), nn.BatchNorm1d(3), nn.Dropout(0.5))
    net.train()
    net[2].eval()
    before = [module.training for module in net.modules()]
    check_model_fits(net, Splits(labelled, labelled, labelled, 3, "toy"))
    assert [module.training for module in net.modules()] == before


def test_a_series_file_that_is_not_text_is_named(tmp_path):
    """A binary file (e.g. a ``.npy`` given as ``source``) raised the codec's UnicodeDecodeError, which names no
    file."""
    path = tmp_path / "series.npy"
    path.write_bytes(b"\x93NUMPY\x01\x00" + bytes(range(128, 256)))
    with pytest.raises(ValueError, match=rf"{path}: not a series of numbers"):
        read_series(path)


@pytest.mark.parametrize("frozen", [False, True])
def test_training_a_model_without_trainable_parameters_is_refused_by_name(tmp_path, frozen):
    """torch's "optimizer got an empty parameter list" named neither the model nor why; nothing was written."""
    data = DataLoader(TensorDataset(torch.randn(8, 4), torch.zeros(8, dtype=torch.long)), batch_size=4)
    net = nn.Linear(4, 3).requires_grad_(False) if frozen else nn.Sequential(nn.Flatten())
    with pytest.raises(ValueError, match=r"Trainer: the model \((Linear|Sequential)\) has no trainable parameters"):
        Trainer({"train": data, "val": data}, progress=False).fit(net, 1, tmp_path / "fit.pt")
    assert not (tmp_path / "fit.pt").exists()


@pytest.mark.filterwarnings("error::UserWarning")
def test_mse_against_targets_of_another_shape_is_refused_not_broadcast(tmp_path):
    """Outputs ``(N, 1, T)`` against targets ``(N, T)``: mse_loss broadcast them to ``(N, N, T)`` with only a warning
    and trained on, and reported, the mean over every pair of samples."""
    inputs = torch.randn(6, 1, 5)
    data = DataLoader(TensorDataset(inputs, inputs.squeeze(1)), batch_size=3)
    trainer = Trainer({"train": data, "val": data}, loss="mse", progress=False)
    with pytest.raises(ValueError, match=r"mse: outputs of shape \(3, 1, 5\) against targets of shape \(3, 5\)"):
        trainer.evaluate(nn.Conv1d(1, 1, 1))
    with pytest.raises(ValueError, match=r"mse: outputs of shape \(3, 1, 5\) against targets of shape \(3, 5\)"):
        trainer.fit(nn.Conv1d(1, 1, 1), 1, tmp_path / "fit.pt")
    assert not (tmp_path / "fit.pt").exists()


@pytest.mark.parametrize("epochs", [-1, 2.0, True])
def test_fit_names_an_epoch_count_that_is_no_count(tmp_path, epochs):
    """A negative count trained nothing and returned an empty history as if done; 2.0 failed in range() with a
    TypeError; True trained one epoch."""
    data = DataLoader(TensorDataset(torch.randn(8, 4), torch.zeros(8, dtype=torch.long)), batch_size=4)
    with pytest.raises(ValueError, match=rf"epochs: expected an integer >= 0, got {epochs!r}"):
        Trainer({"train": data, "val": data}, progress=False).fit(nn.Linear(4, 3), epochs, tmp_path / "fit.pt")
