"""Seeds are refused outside ``[0, 2^32)``: torch reads a negative seed modulo 2^64 and its CPU generator keeps only
the low 32 bits, so ``seed=-1``, ``seed=2**32 - 1`` and ``seed=2**64 - 1`` trained the same model, yet each was a job
identity of its own (``job_identity`` records the seed as given), and ``seed=0`` and ``seed=2**32`` too."""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_dir

from unsparse.cli import CONFIG_DIR, build_job
from unsparse.data import digits
from unsparse.job import JobRefusedError
from unsparse.prune.evolutionary import EvolutionaryPruner
from unsparse.settings import SEED_MAX, check_seed

ALIASES = [(-1, SEED_MAX), (2**64 - 1, SEED_MAX), (2**32, 0), (2**32 + 5, 5), (-2**63, 0)]


def draws(seed: int) -> list[float]:
    torch.manual_seed(seed)
    return torch.rand(4).tolist()


@pytest.mark.parametrize(("seed", "alias"), ALIASES)
def test_the_refused_seeds_are_those_torch_cannot_tell_from_another(seed, alias):
    """Why the range: each seed refused here draws exactly what a seed inside it draws, as the message says."""
    assert draws(seed) == draws(alias)
    with pytest.raises(ValueError, match=rf"^seed: expected an integer in \[0, 4294967295\], got {seed}: .* would "
                                         rf"draw what seed {alias} draws$"):
        check_seed(seed)


def test_every_seed_in_range_is_taken_and_draws_its_own_numbers():
    assert [check_seed(seed) for seed in (0, 1, SEED_MAX)] == [0, 1, SEED_MAX]
    assert len({tuple(draws(seed)) for seed in (0, 1, SEED_MAX)}) == 3


@pytest.mark.parametrize("seed", [-1, 2**32, 2**64 - 1])
def test_the_job_refuses_such_a_seed_before_building_anything(seed):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        cfg = compose(config_name="config", overrides=["experiment=smoke", "data=digits", "device=cpu",
                                                       f"seed={seed}"])
    with pytest.raises(JobRefusedError, match=rf"^seed: expected an integer in \[0, 4294967295\], got {seed}: "):
        build_job(cfg)


def test_the_pruner_and_the_data_refuse_it_too():
    with pytest.raises(ValueError, match=r"^seed: .* got -1: "):
        EvolutionaryPruner(seed=-1)
    with pytest.raises(ValueError, match=r"^seed: .* got 4294967296: "):
        digits(seed=2**32)
    assert EvolutionaryPruner(seed=SEED_MAX).seed == SEED_MAX
