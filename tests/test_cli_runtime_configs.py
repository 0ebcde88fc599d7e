"""Every ``runtime=`` option spells out every timing setting, so each can be overridden without a ``+``."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from unsparse.cli import CONFIG_DIR
from unsparse.pipeline import TimingSettings

RUNTIMES = sorted(path.stem for path in (Path(CONFIG_DIR) / "runtime").glob("*.yaml"))


@pytest.mark.parametrize("option", RUNTIMES)
@pytest.mark.parametrize("setting", [setting.name for setting in fields(TimingSettings)])
def test_every_timing_setting_takes_an_override_without_a_plus(option, setting):
    """``runtime=gpu runtime.timing.batch_size=128`` was refused by Hydra ("Could not override"): gpu.yaml lacked the
    key, so the batch that a named backend is timed on was the dataclass's hidden 64."""
    value = {"backends": "[dense_cpu]"}.get(setting, "7")
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        cfg = compose(config_name="config", overrides=[f"runtime={option}", f"runtime.timing.{setting}={value}"])
    assert str(getattr(TimingSettings(**cfg.runtime.timing), setting)) in (value, "['dense_cpu']")
