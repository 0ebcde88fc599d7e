"""The task a data set asks for: its loss, metric, the score of a model that learned nothing, and the model check."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from unsparse import create_model
from unsparse.data import Splits, digits
from unsparse.task import CLASSIFICATION, RECONSTRUCTION, check_model_fits, task_of, trivial_score


def windows(count: int = 24, length: int = 64, seed: int = 0) -> Splits:
    """Levelled random-walk windows, targets equal to inputs (as :func:`unsparse.timeseries.timeseries` builds)."""
    walk = torch.randn(count, 1, length, generator=torch.Generator().manual_seed(seed)).cumsum(-1)
    walk = walk - walk.mean(-1, keepdim=True)
    parts = walk.split([count // 2, count // 4, count - count // 2 - count // 4])
    return Splits(*((part, part) for part in parts), num_classes=0, name="walk")


def test_labelled_data_is_classification_and_windows_are_reconstruction():
    assert task_of(digits(limit_train=50, limit_test=20)) is CLASSIFICATION
    assert task_of(windows()) is RECONSTRUCTION and not RECONSTRUCTION.higher_is_better


def test_trivial_scores_are_the_most_frequent_label_and_each_windows_mean():
    labels = torch.tensor([2, 2, 2, 1])
    images = torch.zeros(4, 1, 28, 28)
    splits = Splits((images, labels), (images, labels), (images, torch.tensor([2, 0, 2, 2])), 3, "toy")
    assert trivial_score(splits) == pytest.approx(75.0)
    series = windows()
    test = series.test[1].double()
    assert trivial_score(series) == pytest.approx(float((test ** 2).mean()))  # levelled: each window's mean is 0
    shifted = Splits(series.train, series.val, (series.test[0] + 5, series.test[1] + 5), 0, "shifted")
    assert trivial_score(shifted) == pytest.approx(trivial_score(series))


@pytest.mark.parametrize(("model", "data", "message"), [
    ("vgg_small", windows, r"model 'vgg_small' cannot take the inputs of data 'walk'"),
    ("autoencoder1d", lambda: digits(limit_train=50, limit_test=20), r"model 'autoencoder1d' cannot take"),
])
def test_a_model_of_another_task_is_refused_before_training(model, data, message):
    with pytest.raises(ValueError, match=message):
        check_model_fits(create_model(model, width=4), data())


def test_a_model_whose_output_does_not_fit_the_targets_is_refused():
    classifier = torch.nn.Sequential(torch.nn.Conv1d(1, 3, 3, padding=1), torch.nn.Flatten(), torch.nn.LazyLinear(5))
    with pytest.raises(ValueError, match=r"outputs of shape \(2, 5\) on data 'walk', which needs \(2, 1, 64\)"):
        check_model_fits(classifier, windows())
    model = create_model("autoencoder1d", width=4)
    model.train()
    check_model_fits(model, windows())
    assert model.training  # the check restores the mode


@pytest.mark.parametrize("split", ["train", "val", "test"])
def test_a_label_equal_to_the_number_of_classes_is_refused_before_any_training(tmp_path, monkeypatch, split):
    """The trainer refused such a label only when its batch reached the loss, after the epochs before it (or, in the
    test split, after training and pruning); the main job's model check now refuses it up front, naming it and C."""
    from unsparse.job import JobRefusedError
    from unsparse.pipeline import TimingSettings, TrainSettings, run_pipeline
    from unsparse.prune import MagnitudePruner
    from unsparse.train import Trainer

    splits = digits(limit_train=50, limit_test=20)
    images, labels = getattr(splits, split)
    bad = dataclasses.replace(splits, **{split: (images, torch.cat([labels[:-1], torch.tensor([10])]))})
    message = rf"model 'vgg_small' on data 'digits', split {split}: labels \[10\] outside \[0, 10\): .* C = 10 classes"
    with pytest.raises(ValueError, match=message):
        check_model_fits(create_model("vgg_small", width=4), bad)

    def trains(*args, **kwargs):
        raise AssertionError("trained despite the label")

    monkeypatch.setattr(Trainer, "train_epoch", trains)
    with pytest.raises(JobRefusedError, match=message):
        run_pipeline(bad, create_model("vgg_small", width=4), MagnitudePruner(0.5, fine_tune_epochs=0),
                     lambda model, loader: model, tmp_path, TrainSettings(epochs=1, batch_size=64), TimingSettings(),
                     progress=False)
    assert not any(tmp_path.iterdir())  # refused before the folder was claimed
    check_model_fits(create_model("vgg_small", width=4), splits)  # labels 0 ... 9 pass


def test_labels_the_loss_cannot_take_are_refused_up_front_naming_their_dtype():
    labelled = (torch.randn(4, 1, 28, 28), torch.tensor([0.0, 1.0, 2.0, 1.0]))
    with pytest.raises(ValueError, match=r"data 'toy', split train: labels of dtype torch.float32; class indices"):
        check_model_fits(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 3)),
                         Splits(labelled, labelled, labelled, 3, "toy"))


@pytest.mark.parametrize("labels", [torch.tensor([[0], [1], [2], [1]]), torch.tensor([0, 1, 2])])
def test_labels_that_are_not_one_per_image_are_refused_up_front(labels):
    """``(N, 1)`` test labels passed the up-front check and were refused only by the evaluation after training and
    pruning; one label short ended in the loader's AssertionError (a review's finds)."""
    images = torch.randn(4, 1, 28, 28)
    good = (images, torch.tensor([0, 1, 2, 1]))
    with pytest.raises(ValueError, match=rf"data 'toy', split test: labels of shape \({len(labels)}, ?(1)?\) for 4 "
                                         r"images; expected \(4,\)"):
        check_model_fits(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 3)),
                         Splits(good, good, (images, labels), 3, "toy"))


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")
def test_create_model_names_a_bad_argument_and_a_layer_built_empty(monkeypatch):
    """A misspelt keyword, a negative or fractional width (torch's TypeError or RuntimeError, or a misleading groups
    error before), and a factory argument that builds a layer without weights: each a ValueError naming it."""
    from unsparse.models import registry

    with pytest.raises(ValueError, match=r"'vgg_small' takes no \['widht'\]"):
        create_model("vgg_small", widht=8)
    for width in (-4, 2.5, True):
        with pytest.raises(ValueError, match=r"model\.width: expected an integer >= 1"):
            create_model("vgg_small", width=width)

    def scaled(scale: float = 1.0) -> torch.nn.Module:
        return torch.nn.Conv2d(1, int(8 * scale), 3)

    monkeypatch.setitem(registry._MODELS, "scaled", scaled)
    with pytest.raises(ValueError, match=r"'scaled' with \{'scale': 0.1\} has empty tensors"):
        create_model("scaled", scale=0.1)
