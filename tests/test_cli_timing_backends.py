"""``runtime.timing.backends``: the backends the report times per layer are checked before any work, naming the
setting as the config spells it."""

from __future__ import annotations

import pytest
import torch

from unsparse.cli import build_job
from unsparse.job import JobRefusedError
from unsparse.pipeline import TimingSettings, compare_layers


def test_auto_is_no_backend_to_time():
    """``auto`` is the plan the comparator makes: timing it while planning recursed without end (RecursionError),
    after the whole training and pruning."""
    with pytest.raises(ValueError, match=r"^runtime.timing.backends: 'auto' is the plan, not a backend to time"):
        TimingSettings(backends=["dense_cpu", "auto"])


def test_an_unknown_backend_is_refused_naming_the_setting():
    with pytest.raises(ValueError, match=r"^runtime.timing.backends: unknown \['direct_half'\]"):
        TimingSettings(backends=["direct_half"])


def test_the_command_line_refuses_auto_in_one_line():
    from hydra import compose, initialize_config_dir

    from unsparse.cli import CONFIG_DIR

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        cfg = compose(config_name="config", overrides=["experiment=smoke", "data=digits", "device=cpu",
                                                       "runtime.timing.backends=[auto]"])
    with pytest.raises(JobRefusedError, match=r"^runtime\.timing\.backends: 'auto'"):
        build_job(cfg)


def test_the_named_backends_are_timed():
    from unsparse.models import create_model
    from unsparse.runtime import sparsify

    model = sparsify(create_model("vgg_small", width=4).eval())
    rows, _, _ = compare_layers(model, torch.randn(2, 1, 28, 28),
                                TimingSettings(repeats=1, warmup=0, backends=["dense_cpu"]))
    assert {row["backend"] for row in rows} == {"dense_cpu", "dense_alone"}
