"""What a data set asks of a model: classification (top-1 %) or reconstruction (mean squared error).

:class:`~unsparse.data.Splits` with ``num_classes > 0`` are labelled images; ``num_classes == 0`` marks windows of a
time series whose targets are the inputs (:func:`unsparse.timeseries.timeseries`), which the 1D-CNN autoencoder of
paper 004 §6.1 reconstructs. The main job trains, prunes and reports each with its own loss and metric.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn

from unsparse.data import Splits
from unsparse.modes import eval_mode
from unsparse.train import check_class_labels


@dataclass(frozen=True)
class Task:
    """A training objective and the metric reported for it.

    Attributes:
        loss: :class:`~unsparse.train.Trainer`'s ``loss`` name.
        metric: the key of :meth:`~unsparse.train.Trainer.evaluate`'s result that is reported.
        label: the metric with its unit, for tables and plots.
        higher_is_better: the metric's direction.
    """

    loss: str
    metric: str
    label: str
    higher_is_better: bool


CLASSIFICATION = Task("cross_entropy", "top1", "top-1 (%)", True)
RECONSTRUCTION = Task("mse", "mse", "reconstruction MSE (lower is better)", False)


def task_of(splits: Splits) -> Task:
    """:data:`CLASSIFICATION` for labelled data (``num_classes > 0``), else :data:`RECONSTRUCTION`."""
    return CLASSIFICATION if splits.num_classes else RECONSTRUCTION


def trivial_score(splits: Splits) -> float:
    """The metric a model that learned nothing reaches on the test split: top-1 (%) of always naming the most
    frequent training label, or the MSE of predicting each window's own mean (0 for levelled windows). A result no
    better than this says the model has not learned the task, whatever its sparsity."""
    targets = splits.test[1]
    if splits.num_classes:
        most_frequent = torch.bincount(splits.train[1], minlength=splits.num_classes).argmax()
        return 100.0 * float((targets == most_frequent).double().mean())
    flat = targets.reshape(len(targets), -1).double()
    return float(((flat - flat.mean(dim=1, keepdim=True)) ** 2).mean())


@torch.no_grad()
def check_model_fits(model: nn.Module, splits: Splits) -> None:
    """Run two training inputs through ``model`` (eval mode; every module's mode restored after), on the device of its
    first parameter or buffer (the CPU for a model without either), and check its output against the task:
    ``(2, num_classes)`` logits for classification, the targets' shape for reconstruction. Catches a model of one
    task paired with the data of another before any training (e.g. a classifier on time-series windows, whose
    cross-entropy against its own one-channel output is always 0, so nothing would train).

    For classification, every split's labels must then be one per image, ``(N,)``, and int64 (or uint8) class indices in
    ``[0, num_classes)`` (:func:`~unsparse.train.check_class_labels`, which the trainer applies to every batch): a label
    outside would otherwise be refused only when its batch reaches the loss, after the epochs before it. One ``aminmax``
    over each split's ``(N,)`` label tensor, where the splits hold them, once per job: for Fashion-MNIST's 70000 CPU
    labels 0.04 ms on one free thread (11 ms measured with two threads on a loaded two-core machine).

    Raises:
        ValueError: naming the model and the data, when the forward fails or its output has the wrong shape; naming
            the data and the split, when its labels are not one per image (their shape and the image count); naming the
            model, the data, the split, its labels outside ``[0, num_classes)`` and ``num_classes`` (or the labels'
            dtype).
    """
    device = next(itertools.chain(model.parameters(), model.buffers()), torch.empty(0)).device
    inputs, targets = splits.train[0][:2].to(device), splits.train[1][:2]
    spec = getattr(model, "unsparse_spec", {"name": type(model).__name__})
    expected = (len(inputs), splits.num_classes) if splits.num_classes else tuple(targets.shape)
    try:
        with eval_mode(model):
            output = model(inputs)
    except RuntimeError as error:
        raise ValueError(f"model {spec['name']!r} cannot take the inputs of data {splits.name!r} "
                         f"({tuple(inputs.shape[1:])} per sample): {error}") from error
    if tuple(output.shape) != expected:
        raise ValueError(f"model {spec['name']!r} gives outputs of shape {tuple(output.shape)} on data "
                         f"{splits.name!r}, which needs {expected} ({task_of(splits).label})")
    if splits.num_classes:
        for split in ("train", "val", "test"):
            images, labels = getattr(splits, split)
            if labels.dim() != 1 or len(labels) != len(images):
                raise ValueError(f"data {splits.name!r}, split {split}: labels of shape {tuple(labels.shape)} for "
                                 f"{len(images)} images; expected ({len(images)},), one class index per image")
            check_class_labels(labels, splits.num_classes,
                               f"model {spec['name']!r} on data {splits.name!r}, split {split}")
