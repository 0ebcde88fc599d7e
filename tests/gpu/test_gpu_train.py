"""The trainer on CUDA: a classifier's out-of-range label tripped a device-side assert, after which the process's
CUDA context was unusable; the trainer now refuses it before the loss (:func:`~unsparse.train.check_class_labels`)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from unsparse.train import Trainer


@pytest.mark.parametrize("labels_on_cuda", [False, True])
def test_a_bad_label_on_cuda_leaves_the_cuda_context_usable(labels_on_cuda: bool) -> None:
    """Refused before the loss, the process goes on using the GPU: for CPU labels (the Splits loaders', no device
    sync) and for labels already on CUDA."""
    labels = torch.tensor([0, 1, 2, 3]).to("cuda" if labels_on_cuda else "cpu")
    data = DataLoader(TensorDataset(torch.randn(len(labels), 4), labels), batch_size=4)
    trainer = Trainer({"train": data, "val": data}, device=torch.device("cuda"), progress=False)
    with pytest.raises(ValueError, match=r"labels \[3\] outside \[0, 3\)"):
        trainer.evaluate(nn.Linear(4, 3).to("cuda"))  # C = 3
    torch.cuda.synchronize()
    assert float(torch.ones(2, device="cuda").sum()) == 2.0
