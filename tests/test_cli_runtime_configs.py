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


@pytest.mark.parametrize("option", RUNTIMES)
@pytest.mark.parametrize("policy", ["off", "all", "epilogue"])
def test_the_fold_policy_is_a_string_in_every_runtime_and_from_the_command_line(option, policy):
    """The YAML default is the string "off" (a bare off would read as false) and each policy overrides it as written;
    the job's settings hand it to run_pipeline, which checks it before any work."""
    from unsparse.cli import build_job
    from unsparse.pipeline import check_fold_policy

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        default = compose(config_name="config", overrides=[f"runtime={option}"])
        chosen = compose(config_name="config", overrides=[f"runtime={option}", f"runtime.fold_batch_norm={policy}",
                                                          "data=digits", "device=cpu"])
    assert default.runtime.fold_batch_norm == "off" and chosen.runtime.fold_batch_norm == policy
    assert build_job(chosen)["fold_batch_norm"] == policy
    check_fold_policy(policy, "auto")
