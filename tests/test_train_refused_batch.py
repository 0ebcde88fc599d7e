"""A batch the trainer refuses leaves no trace in the model: its labels were checked only after the forward, which in
train mode had already updated the batch norms' running statistics (``running_mean``, ``running_var``,
``num_batches_tracked``), so a caller that caught the error went on with statistics of a batch it never trained on.
The labels are now checked before the forward (their range against C of the batches before), and a first batch,
whose C only its forward tells, gets its running statistics back when refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from unsparse.train import Trainer

GOOD = torch.tensor([0, 1, 2, 1])
"""Labels of a batch of 4 that a C = 3 classifier takes."""


def model() -> nn.Module:
    """``(N, 2, 4, 4)`` images to ``(N, 3)`` logits through a batch norm: C = 3."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(4, 3))


def trainer(labels: list[torch.Tensor]) -> Trainer:
    """A trainer whose loaders yield one batch of 4 random images per entry of ``labels``, with those labels."""
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 2, 4, 4, generator=generator), targets) for targets in labels]
    data = DataLoader(batches, batch_size=None)  # each batch as it is, targets of any shape or dtype
    return Trainer({"train": data, "val": data}, progress=False)


def state(network: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers (the batch norm's running statistics), copied."""
    return {name: value.detach().clone() for name, value in network.state_dict().items()}


def assert_same(found: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert found.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(found[name], value), name


BAD = [
    (torch.tensor([0, 3, 1, 2]), r"labels \[3\] outside \[0, 3\): the logits have C = 3 classes"),
    (torch.tensor([0, -1, 1, 2]), r"labels \[-1\] outside \[0, 3\)"),
    (torch.tensor([0, 1, 1, 2], dtype=torch.int32), r"labels of dtype torch.int32; class indices must be torch.int64"),
    (torch.tensor([[0], [1], [1], [2]]), r"targets of shape \(4, 1\) for 4 inputs"),
    (torch.tensor([0, 1, 2]), r"targets of shape \(3,\) for 4 inputs"),
]


@pytest.mark.parametrize(("bad", "named"), BAD)
def test_a_refused_second_batch_leaves_the_model_as_the_first_batch_left_it(bad, named):
    refused, reference = model(), model()
    optimizer = torch.optim.SGD(refused.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match=named):
        trainer([GOOD, bad]).train_epoch(refused, optimizer)
    trainer([GOOD]).train_epoch(reference, torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9))
    assert_same(state(refused), state(reference))
    assert refused[1].num_batches_tracked == 1
    with pytest.raises(ValueError, match=named):
        trainer([GOOD, bad]).evaluate(refused)
    assert_same(state(refused), state(reference))


@pytest.mark.parametrize("bad", [torch.tensor([0, 3, 1, 2]), torch.tensor([[0], [1], [1], [2]])])
def test_a_refused_first_batch_leaves_the_running_statistics_as_they_were(bad):
    """A first batch's labels are checked against C after its forward (only the logits tell C), and its shape is
    named with theirs; the batch norm's running statistics then come back."""
    network = model()
    before = state(network)
    with pytest.raises(ValueError, match=r"outside \[0, 3\)|logits of shape \(4, 3\) for targets of shape \(4, 1\)"):
        trainer([bad, GOOD]).train_epoch(network, torch.optim.SGD(network.parameters(), lr=0.1))
    assert_same(state(network), before)


def test_the_running_statistics_of_a_lazy_batch_norm_are_not_copied_before_they_exist():
    """Before its first forward a lazy batch norm's buffers hold no values; copying them raised a ValueError."""
    network = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.LazyBatchNorm2d(affine=False), nn.AdaptiveAvgPool2d(1),
                            nn.Flatten(), nn.Linear(4, 3))
    assert trainer([GOOD, GOOD]).train_epoch(network, torch.optim.SGD(network.parameters(), lr=0.1)) > 0
    assert network[1].num_batches_tracked == 2


def test_a_batch_refused_before_its_forward_keeps_the_gradients_of_the_step_before():
    network = model()
    with pytest.raises(ValueError, match="outside"):
        trainer([GOOD, torch.tensor([0, 3, 1, 2])]).train_epoch(network, torch.optim.SGD(network.parameters(), lr=0.1))
    reference = model()
    trainer([GOOD]).train_epoch(reference, torch.optim.SGD(reference.parameters(), lr=0.1))
    for found, expected in zip(network.parameters(), reference.parameters(), strict=True):
        assert found.grad is not None and torch.equal(found.grad, expected.grad)
