"""The evolutionary pruner's ``unit_step`` and ``crossover_max_regress`` are finite, as ``alpha``, ``beta`` and the
learning rates already were: ``inf`` passed their ``> 0`` / ``>= 0`` checks, was clipped (``Δ_l`` to ``max_step``,
paper 004 eq. 11) or read as "any donor" unseen, and went into the checkpoint identity as JSON's ``Infinity``."""

from __future__ import annotations

import math

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import InstantiationException
from hydra.utils import instantiate

from unsparse.cli import CONFIG_DIR
from unsparse.prune.evolutionary import EvolutionaryPruner


@pytest.mark.parametrize(("settings", "message"), [
    ({"unit_step": math.inf}, r"^unit_step: expected a number > 0 and finite \(or a mapping\), got inf$"),
    ({"unit_step": -math.inf}, r"^unit_step: expected a number > 0 and finite \(or a mapping\), got -inf$"),
    ({"unit_step": {"0": 0.1, "2": math.inf}}, r"^unit_step\.2: expected a number > 0 and finite, got inf$"),
    ({"crossover_max_regress": math.inf}, r"^crossover_max_regress: expected a number >= 0 and finite .*got inf$"),
    ({"crossover_max_regress": math.nan}, r"^crossover_max_regress: expected a number >= 0 and finite .*got nan$"),
])
def test_an_infinite_step_or_regress_is_refused_naming_it(settings, message):
    with pytest.raises(ValueError, match=message):
        EvolutionaryPruner(**settings)


def test_the_config_refuses_them_too():
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        for override in ("prune.unit_step=inf", "prune.crossover_max_regress=inf"):
            cfg = compose(config_name="config", overrides=["prune=evolutionary", override])
            with pytest.raises(InstantiationException) as refusal:
                instantiate(cfg.prune)
            assert str(refusal.value.__cause__).startswith(override.split("=")[0].removeprefix("prune.") + ": ")


def test_finite_values_pass():
    pruner = EvolutionaryPruner(unit_step={"0": 1e6}, crossover_max_regress=1e6)
    assert pruner.unit_step == {"0": 1e6} and pruner.crossover_max_regress == 1e6
