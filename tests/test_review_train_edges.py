"""Edge cases of ``unsparse.train``, ``unsparse.task`` and ``unsparse.timeseries`` found in review: a diverged
classifier's score, a model without parameters, module modes after the model check, and undecodable series files."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from unsparse.prune.base import metric_score
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
