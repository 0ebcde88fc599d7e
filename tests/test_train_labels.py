"""A classifier's labels are checked by the trainer before the loss: a label outside ``[0, C)`` (C the logits' second
dimension) raised torch's "Target k is out of bounds" (an IndexError naming no data) on the CPU and tripped a
device-side assert on CUDA, after which the process's CUDA context was unusable; labels of a dtype ``cross_entropy``
does not take (int32, float) raised its RuntimeError. Both are now a ValueError naming the labels (or dtype) and C,
raised for every batch, not only a loader's first one, and before that batch's optimizer step."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from unsparse.train import Trainer, check_class_labels


def trainer(targets: torch.Tensor, device: str = "cpu") -> Trainer:
    """A trainer whose train and val loaders yield ``(4 random features, targets)`` in batches of 4."""
    data = DataLoader(TensorDataset(torch.randn(len(targets), 4), targets), batch_size=4)
    return Trainer({"train": data, "val": data}, device=torch.device(device), progress=False)


def classifier(device: str = "cpu") -> nn.Module:
    """``(N, 4)`` features to ``(N, 3)`` logits: C = 3."""
    torch.manual_seed(0)
    return nn.Linear(4, 3).to(device)


@pytest.mark.parametrize(("targets", "named"), [
    ([0, 1, 2, 3], r"labels \[3\] outside \[0, 3\)"),
    ([0, -1, 2, 1], r"labels \[-1\] outside \[0, 3\)"),
    ([0, 1, 2, 1, 2, 7, -2, 7], r"labels \[-2, 7\] outside \[0, 3\)"),  # in the second batch only
])
def test_labels_outside_the_classes_are_refused_naming_them_and_c(targets, named):
    labels = torch.tensor(targets)
    message = named + r": the logits have C = 3 classes"
    with pytest.raises(ValueError, match=message):
        trainer(labels).evaluate(classifier())
    model = classifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    first_batch_bad = bool(((labels[:4] < 0) | (labels[:4] >= 3)).any())
    before = [parameter.clone() for parameter in model.parameters()]
    with pytest.raises(ValueError, match=message):
        trainer(labels).train_epoch(model, optimizer)
    unchanged = all(torch.equal(old, new) for old, new in zip(before, model.parameters(), strict=True))
    assert unchanged == first_batch_bad  # the bad batch made no step; a good first batch did


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.float32, torch.bool])
def test_labels_of_a_dtype_cross_entropy_does_not_take_are_refused_naming_it(dtype):
    labels = torch.tensor([0, 1, 1, 0]).to(dtype)
    with pytest.raises(ValueError, match=rf"labels of dtype {dtype}; class indices must be torch.int64"):
        trainer(labels).evaluate(classifier())


@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8])
def test_labels_from_zero_to_c_minus_one_pass(dtype):
    labels = torch.tensor([0, 1, 2, 2, 1, 0, 2, 0]).to(dtype)
    model = classifier()
    assert trainer(labels).train_epoch(model, torch.optim.SGD(model.parameters(), lr=0.1)) > 0
    assert 0.0 <= trainer(labels).evaluate(model)["top1"] <= 100.0


def test_many_labels_outside_are_named_up_to_ten_and_counted():
    check_class_labels(torch.empty(0, dtype=torch.long), 3)  # an empty batch has no label to refuse
    with pytest.raises(ValueError, match=r"labels \[3, 4, 5, 6, 7, 8, 9, 10, 11, 12\] and 5 more outside \[0, 3\)"):
        check_class_labels(torch.arange(18), 3)
