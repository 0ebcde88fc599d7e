"""A classifier's output is checked by the trainer: logits that are not ``(N, num_classes)`` are refused naming their
shape (``cross_entropy`` read ``(N, C, 1)`` or ``(N, C, H, W)`` as logits per position, and top-1 counted positions:
400 % for ``(N, C, 2, 2)`` logits that name every label), and NaN or ``+inf`` logits score as a diverged model
(NaN top-1, as NaN logits already did): an ``inf`` logit won every argmax, so top-1 was a number beside a NaN loss."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from unsparse.prune.base import metric_score
from unsparse.train import Trainer


class Shaped(nn.Module):
    """``(N, 4)`` inputs to ``(N, 3)`` logits, reshaped to ``(N, 3, *extra)`` by repetition."""

    def __init__(self, *extra: int) -> None:
        super().__init__()
        self.linear, self.extra = nn.Linear(4, 3), extra

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        logits = self.linear(inputs)
        return logits.reshape(*logits.shape, *(1,) * len(self.extra)).expand(*logits.shape, *self.extra)


def trainer(targets: torch.Tensor) -> Trainer:
    data = DataLoader(TensorDataset(torch.randn(len(targets), 4), targets), batch_size=4)
    return Trainer({"train": data, "val": data}, progress=False)


@pytest.mark.parametrize(("extra", "target_shape"), [((1,), (8, 1)), ((2, 2), (8, 2, 2)), ((1,), (8,)),
                                                     ((), (8, 1))])
def test_logits_that_are_not_n_by_classes_are_refused_naming_the_shape(extra, target_shape):
    targets = torch.zeros(target_shape, dtype=torch.long)
    logits = (4, 3, *extra)
    message = rf"cross_entropy: logits of shape \({', '.join(map(str, logits))}\) for targets of shape "
    with pytest.raises(ValueError, match=message + r".*must be \(N, num_classes\) logits"):
        trainer(targets).evaluate(Shaped(*extra))
    model = Shaped(*extra)
    before = [parameter.clone() for parameter in model.parameters()]
    with pytest.raises(ValueError, match=message):
        trainer(targets).train_epoch(model, torch.optim.SGD(model.parameters(), lr=1.0))
    assert all(torch.equal(old, new) for old, new in zip(before, model.parameters(), strict=True))  # no step


def test_n_by_classes_logits_pass():
    metrics = trainer(torch.zeros(8, dtype=torch.long)).evaluate(Shaped())
    assert 0.0 <= metrics["top1"] <= 100.0 and math.isfinite(metrics["loss"])


@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_nan_or_infinite_logits_score_as_a_diverged_model(value):
    model = Shaped()
    with torch.no_grad():
        model.linear.bias[1] = value  # class 1's logit of every sample
    metrics = trainer(torch.ones(8, dtype=torch.long)).evaluate(model)
    assert math.isnan(metrics["top1"]) and metric_score(metrics) == -math.inf


def test_a_minus_inf_logit_is_scored_as_it_is():
    """A ``-inf`` logit never wins an argmax, so it is no sign of divergence: a class that no sample has can be ruled
    out that way (a review found such a model scored NaN beside a finite loss)."""
    model = Shaped()
    with torch.no_grad():
        model.linear.weight.zero_()
        model.linear.bias.copy_(torch.tensor([1.0, 0.0, -math.inf]))  # class 0 wins, class 2 never does
    metrics = trainer(torch.tensor([0, 0, 0, 1, 0, 1, 0, 0])).evaluate(model)
    assert metrics["top1"] == 75.0 and math.isfinite(metrics["loss"])


def test_a_row_of_minus_inf_logits_scores_as_a_diverged_model():
    """argmax names class 0 for a row of ``-inf``, and the loss is NaN: 67f6165 scored it 100 % beside that loss (a
    review's find)."""
    model = Shaped()
    with torch.no_grad():
        model.linear.weight.zero_()
        model.linear.bias.fill_(-math.inf)
    metrics = trainer(torch.zeros(8, dtype=torch.long)).evaluate(model)
    assert math.isnan(metrics["top1"]) and metric_score(metrics) == -math.inf
