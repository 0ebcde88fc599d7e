"""The main job's ``train:`` and ``runtime.timing:`` blocks: a key they do not have, or no block at all, is refused
naming it (it was a ``TypeError`` from the settings' dataclass, printed as Hydra's traceback); so is a config group
left without an option."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir

from unsparse.cli import CONFIG_DIR, build_job
from unsparse.job import JobRefusedError


def composed(*overrides: str):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(config_name="config", overrides=["experiment=smoke", "data=digits", "device=cpu", *overrides])


@pytest.mark.parametrize(("override", "message"), [
    ("+train.epoch=5", r"^train: unknown setting\(s\) \['epoch'\]; known: epochs, batch_size, "),
    ("+runtime.timing.repeat=5", r"^runtime.timing: unknown setting\(s\) \['repeat'\]; known: batch_size, repeats, "),
    ("runtime.timing=null", r"^runtime.timing: expected a mapping of settings, got None$"),
    ("train=null", r"^train: expected a mapping of settings, got None$"),
])
def test_an_unknown_or_missing_settings_block_is_refused_naming_it(override, message):
    with pytest.raises(JobRefusedError, match=message):
        build_job(composed(override))


@pytest.mark.parametrize(("override", "message"), [
    ("~quant", r"^quant: no option chosen \(the config holds no such block\); choose one with quant=<name>, one of "
               r"fp16, kmeans, linear, none$"),
    ("~data", r"^data: no option chosen \(the config holds only \{'limit_train': 3000, 'limit_test': 1000\}\)"),
    ("~runtime", r"^runtime: no option chosen \(the config holds only \{'timing': \{'batch_size': 16, "),
    # the experiment's model.width stayed, and instantiate returned it as a plain mapping instead of a model
    ("~model", r"^model: no option chosen \(the config holds only \{'width': 8\}\); choose one with model=<name>, "
               r"one of autoencoder1d, resnet_small, vgg_small$"),
])
def test_a_config_group_without_an_option_is_refused_naming_its_options(override, message):
    """``~quant`` ended in omegaconf's ConfigAttributeError (a traceback); ``~model`` built a job whose model was a
    mapping."""
    with pytest.raises(JobRefusedError, match=message):
        build_job(composed(override))


def test_an_unknown_training_key_is_one_line_and_exit_status_2(tmp_path):
    command = [sys.executable, "-c", "from unsparse.cli import main; main()", "experiment=smoke", "data=digits",
               "device=cpu", "progress=false", "+train.epoch=5", f"hydra.run.dir={tmp_path}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "unsparse: refused: train: unknown setting(s) ['epoch']" in done.stderr
