"""``train.lr`` and ``train.weight_decay`` are finite: ``inf`` passed the ``> 0`` / ``>= 0`` checks, trained and
pruned NaN weights, and ended in a traceback at the export (``load_sparse would refuse its file``)."""

from __future__ import annotations

import math

import pytest

from unsparse.pipeline import TrainSettings


@pytest.mark.parametrize(("field", "value"), [("lr", math.inf), ("weight_decay", math.inf), ("lr", math.nan)])
def test_a_training_setting_that_is_not_finite_is_refused_naming_it(field, value):
    with pytest.raises(ValueError, match=rf"^train\.{field}: expected a number \(finite\), got {value!r}$"):
        TrainSettings(**{field: value})


def test_finite_settings_pass():
    assert TrainSettings(lr=1e3, weight_decay=0.0).lr == 1e3
