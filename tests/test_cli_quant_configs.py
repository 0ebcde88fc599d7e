"""Every ``quant=`` option with activations spells out every activation setting: each documents the formats
``none | fp16 | fixed``, and a ``fixed`` choice's bits, quantile, ... must take an override without a ``+``."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from unsparse.cli import CONFIG_DIR
from unsparse.quant.activations import ActivationSpec

OPTIONS = sorted(path.stem for path in (Path(CONFIG_DIR) / "quant").glob("*.yaml")
                 if "activations:" in path.read_text())
VALUES = {"format": "fixed", "bits": 6, "quantile": 0.9, "bins": 512, "power_of_two": True, "calibration_batches": 2,
          "rule": "fraction_of_max"}


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("setting", [setting.name for setting in fields(ActivationSpec)])
def test_every_activation_setting_takes_an_override_without_a_plus(option, setting):
    """``quant=kmeans quant.activations.format=fixed quant.activations.bits=6`` was refused by Hydra ("Could not
    override"): kmeans.yaml and fp16.yaml held the format only, so a fixed choice ran on hidden defaults."""
    overrides = [f"quant={option}", "quant.activations.format=fixed", f"quant.activations.{setting}={VALUES[setting]}"]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    assert getattr(instantiate(cfg.quant.activations), setting) == VALUES[setting]


@pytest.mark.parametrize("option", OPTIONS)
def test_the_spelled_out_defaults_are_the_specs_own(option):
    """Spelling the settings out changes no quantizer: the values are ActivationSpec's defaults."""
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        spec = instantiate(compose(config_name="config", overrides=[f"quant={option}"]).quant.activations)
    assert spec == ActivationSpec(format=spec.format)
