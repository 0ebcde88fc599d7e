"""Hydra front end: every config-group option composes and instantiates; a multirun sweep runs end to end."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from tests.one_python import outcomes_in_one_python
from unsparse.cli import CONFIG_DIR
from unsparse.prune.base import Pruner
from unsparse.quant.base import Quantizer

GROUPS = {group.name: sorted(path.stem for path in group.glob("*.yaml"))
          for group in Path(CONFIG_DIR).iterdir() if group.is_dir()}


def composed(*overrides: str):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize("option", GROUPS["prune"])
def test_every_prune_config_builds_a_pruner(option):
    assert isinstance(instantiate(composed(f"prune={option}").prune), Pruner)


@pytest.mark.parametrize("option", GROUPS["prune"])
def test_every_prune_config_takes_layers_without_a_plus(option):
    """The README's ``prune.layers``: Hydra refused the override ("Key 'layers' is not in struct") while the config
    files lacked the key, although every pruner takes it."""
    assert instantiate(composed(f"prune={option}", "prune.layers=['0.0','10']").prune).layer_names == ["0.0", "10"]


@pytest.mark.parametrize("option", GROUPS["quant"])
def test_every_quant_config_builds_a_quantizer(option):
    assert isinstance(instantiate(composed(f"quant={option}").quant), Quantizer)


NO_SETTINGS = {"source_field"}
"""Factory parameters that are no settings: the name of a setting, which errors give (``timeseries``'s
``source_field``, ``data.source`` by default, a script's option where a script calls it)."""


@pytest.mark.parametrize(("group", "option"), [(group, option) for group in ("data", "prune", "quant")
                                                for option in GROUPS[group]])
def test_every_config_spells_out_each_setting_of_what_it_builds(group, option):
    """A setting the file lacks cannot be overridden (Hydra: "Could not override ... Key is not in struct") and runs
    on the factory's hidden default: data=co2 lacked val_fraction, test_fraction and source."""
    import importlib
    import inspect

    block = OmegaConf.to_container(composed(f"{group}={option}")[group])
    module, name = block.pop("_target_").rsplit(".", 1)
    parameters = set(inspect.signature(getattr(importlib.import_module(module), name)).parameters)
    assert set(block) == parameters - NO_SETTINGS


@pytest.mark.parametrize("option", GROUPS["model"])
def test_every_model_config_builds_a_model(option):
    model = instantiate(composed(f"model={option}").model)
    assert sum(parameter.numel() for parameter in model.parameters()) > 0


@pytest.mark.parametrize("option", GROUPS["data"])
def test_every_data_config_builds_splits_a_model_config_fits(option):
    """Each data set with the model config made for its task (the autoencoder for the time series)."""
    from unsparse.data import DatasetUnavailableError
    from unsparse.task import check_model_fits

    if option == "co2":
        pytest.importorskip("statsmodels")
    try:
        splits = instantiate(composed(f"data={option}", "data.limit_train=40", "data.limit_test=20").data)
    except DatasetUnavailableError:
        pytest.skip(f"{option} is not installed")
    assert len(splits.train[0]) == 40 and len(splits.test[0]) == 20
    model = "autoencoder1d" if option == "co2" else "vgg_small"
    check_model_fits(instantiate(composed(f"model={model}").model), splits)


def test_a_job_built_twice_from_one_seed_starts_from_the_same_weights():
    """The seed reaches the model's initialisation: two runs of one config train the same dense model."""
    from unsparse.cli import build_job

    def weights(*overrides: str):
        return build_job(composed("experiment=smoke", "data=digits", "device=cpu", *overrides))["model"].state_dict()

    first, again, other = weights(), weights(), weights("seed=1")
    assert all(torch.equal(first[key], again[key]) for key in first)
    assert not all(torch.equal(first[key], other[key]) for key in first)


@pytest.mark.parametrize(("override", "message"), [
    # torch.manual_seed said "invalid literal for int()"
    ("seed=abc", r"seed: expected an integer in \[0, 4294967295\], got 'abc'"),
    ("train.epochs=true", "train.epochs: expected an integer >= 0, got True"),  # ran 1 epoch, "True epoch"
    ("progress=maybe", "progress: expected a bool, got 'maybe'"),  # ran, with bars: a non-empty string is true
    # torch's RuntimeError "manual_seed expected a long", which Hydra's wrapping turned into three lines
    ("data.seed=1.5", r"^data: seed: expected an integer in \[0, 4294967295\], got 1.5$"),
    ("+prune.layer_targets={7.0: 0.5}", None),  # Hydra reads the key as a float: it names layer "7.0"
])
def test_command_line_values_are_read_or_refused_by_name(override, message):
    from unsparse.cli import build_job

    cfg = composed("experiment=smoke", "data=digits", "device=cpu", "prune.scope=layer", override)
    if message is None:
        assert build_job(cfg)["pruner"].layer_targets == {"7.0": 0.5}
        return
    with pytest.raises(ValueError, match=message):
        build_job(cfg)


@pytest.mark.parametrize(("overrides", "message"), [
    (["prune.target=1.5"], r"prune: target: expected a number in \[0, 1\) \(a sparsity\), got 1.5"),
    (["quant=kmeans", "quant.clusters=0"], r"quant: clusters: expected an integer in \[2, 65536\], got 0"),
    (["data.val_size=-1"], r"data: val_size: expected an integer in \[1, 1436\], got -1"),
    (["prune.layers=foo"], r"prune: layers: expected a list of layer names, got 'foo'"),
    (["prune.layers=[foo]"], r"prune: layers: \['foo'\] are not prunable .* of the model; it has 0\.0, .*"),
    (["prune=evolutionary", "prune.unit_step={foo: 1}"], r"prune: unit_step: \['foo'\] are not prunable .*"),
    (["model.width=0"], r"model\.width: expected an integer >= 1, got 0"),  # named with its group already
    (["data=co2", "data.source=missing.txt"], r"data\.source: missing\.txt: cannot be read .*"),
])
def test_a_refused_setting_of_a_config_group_is_named_with_its_group(overrides, message):
    """Its factory's message named the setting alone (``target: ...``, as if a top-level setting; ``seed`` could
    be the job's or the data's), and so did the pruner's check of its layer names against the model."""
    from unsparse.cli import build_job
    from unsparse.job import JobRefusedError

    with pytest.raises(JobRefusedError) as refusal:
        build_job(composed("experiment=smoke", "data=digits", "device=cpu", *overrides))
    assert re.fullmatch(message, str(refusal.value)), refusal.value


def test_a_data_root_without_the_files_is_refused_in_one_line(tmp_path):
    """Hydra's wrapping of the missing data set's error printed three lines ("Error in call to target ...")."""
    from unsparse.cli import build_job
    from unsparse.job import JobRefusedError

    with pytest.raises(JobRefusedError, match=r"^data: Fashion-MNIST file .* not found") as refusal:
        build_job(composed("experiment=smoke", "device=cpu", f"data.root={tmp_path}"))
    assert "\n" not in str(refusal.value) and "dataset-fashion-mnist" in str(refusal.value)


@pytest.mark.parametrize("factory", ["fashion_mnist", "digits"])
def test_a_data_seed_that_is_no_integer_is_refused_by_name(factory):
    import unsparse.data

    with pytest.raises(ValueError, match=r"^seed: expected an integer in \[.*\], got 'abc'$"):
        getattr(unsparse.data, factory)(seed="abc")


def test_the_refusal_of_an_ambiguous_float_key_gives_an_override_that_passes_the_name():
    """Hydra's command line quotes no mapping key (``{"1.10": 0.02}`` does not parse), so the refusal of a float key
    that could name several layers (:meth:`~unsparse.prune.base.LayerMapping.check_float_keys`) gives a shell word
    that passes the quoted name through ``oc.create``: it must reach the pruner as written."""
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 1, 1),
                                torch.nn.Sequential(*(torch.nn.Conv2d(1, 1, 1) for _ in range(11))))
    with pytest.raises(ValueError, match="on the command line") as refusal:
        instantiate(composed("prune=evolutionary", "prune.unit_step={1.10: 0.02}").prune).check_layers(model)
    override = shlex.split(str(refusal.value).rsplit(" as ", 1)[1])
    assert instantiate(composed("prune=evolutionary", *override).prune).unit_step == {"1.10": 0.02}


def test_smoke_experiment_overrides_the_defaults():
    cfg = composed("experiment=smoke")
    assert cfg.train.epochs == 1 and cfg.model.width == 8 and cfg.prune.fine_tune_epochs == 1


def test_multirun_sweeps_pruners_and_targets(tmp_path):
    command = [sys.executable, "-c", "from unsparse.cli import main; main()", "-m", "experiment=smoke",
               "prune=magnitude,gradual", "prune.target=0.8", "prune.fine_tune_epochs=1", "prune.lr=0.01",
               "data=digits", "progress=false", "runtime.timing.repeats=1", "runtime.timing.warmup=0",
               f"hydra.sweep.dir={tmp_path}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    reports = sorted(tmp_path.glob("*/report.json"))
    assert len(reports) == 2
    methods = {json.loads(path.read_text())["pruning"]["method"] for path in reports}
    assert methods == {"magnitude", "gradual"}
    for path in reports:
        report = json.loads(path.read_text())
        assert report["pruning"]["weighted_sparsity"] == pytest.approx(0.8, abs=0.01)
        assert f"- prune={report['pruning']['method']}\n" in (path.parent / ".hydra" / "overrides.yaml").read_text()
        assert "_target_: unsparse.prune" in (path.parent / ".hydra" / "config.yaml").read_text()
        assert "_target_: unsparse.prune" in (path.parent / "cli.log").read_text()  # logged once the folder is held


def test_a_job_refused_by_the_folder_lock_leaves_the_running_jobs_log_alone(tmp_path):
    from unsparse.job import only_job_in

    (tmp_path / "cli.log").write_text("running job\n")
    command = [sys.executable, "-c", "from unsparse.cli import main; main()", "experiment=smoke", "data=digits",
               "progress=false", f"hydra.run.dir={tmp_path}"]
    with only_job_in(tmp_path):  # the running job
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "another running job holds this folder" in done.stderr
    assert "_target_" not in (tmp_path / "cli.log").read_text()


REFUSED_SETTINGS = {
    "train.epochs=-1": "unsparse: refused: train.epochs: expected an integer >= 0, got -1",
    "prune.lr=-1": "unsparse: refused: prune: lr: expected a number > 0 and finite (or null), got -1 (the pruner's "
                   "learning rate: prune.lr in the job's config, not train.lr)",  # inside instantiate
    "runtime.backend=direct": "unsparse: refused: runtime.backend: 'direct' runs on ['cuda'], the job on cpu",
}


@pytest.fixture(scope="module")
def refused_settings(tmp_path_factory) -> dict[str, tuple[int, str, Path]]:
    folders = {override: tmp_path_factory.mktemp("refused") for override in REFUSED_SETTINGS}
    outcomes = outcomes_in_one_python([["unsparse", "experiment=smoke", "data=digits", "device=cpu", "progress=false",
                                        override, f"hydra.run.dir={folder}"] for override, folder in folders.items()])
    return {override: (*outcome, folders[override]) for override, outcome in zip(folders, outcomes, strict=True)}


@pytest.mark.parametrize("override", REFUSED_SETTINGS)
def test_a_refused_setting_is_one_line_and_exit_status_2(refused_settings, override):
    """Hydra printed its traceback above the message of every refusal; nothing has run when one is raised."""
    status, stderr, _ = refused_settings[override]
    assert status == 2 and REFUSED_SETTINGS[override] in stderr and "Traceback" not in stderr


REFUSED_BENCH_SETTINGS = {
    "sparsities=[0.9,1.0]": "unsparse bench: refused: sparsities: expected a number in [0, 1) (a sparsity), got 1.0",
    "models=[vgg17]": "unsparse bench: refused: models: ['vgg17'] not among vgg16, resnet50, alexnet, googlenet",
    "layer_filter='features.(1'": "unsparse bench: refused: layer_filter: 'features.(1' is no regular expression",
    "sparse_file=pyproject.toml": "unsparse bench: refused: sparse_input_shape: needed with sparse_file",
    "sparse_file=missing.safetensors": "unsparse bench: refused: sparse_file: missing.safetensors is no file",
    "batches=128": "unsparse bench: refused: batches: expected a list, e.g. [128], got 128",
    "layer_filter=5": "unsparse bench: refused: layer_filter: expected a regular expression (a string), got 5",
    "batches=[0]": "unsparse bench: refused: batches: expected an integer >= 1, got 0",
    # torch.manual_seed took it as 1
    "seed=1.5": "unsparse bench: refused: seed: expected an integer in [0, 4294967295], got 1.5",
}


@pytest.fixture(scope="module")
def refused_bench_settings(tmp_path_factory) -> dict[str, tuple[int, str, Path]]:
    folders = {override: tmp_path_factory.mktemp("refused_bench") for override in REFUSED_BENCH_SETTINGS}
    outcomes = outcomes_in_one_python([["unsparse", "bench", override, f"hydra.run.dir={folder}"]
                                       for override, folder in folders.items()])
    return {override: (*outcome, folders[override]) for override, outcome in zip(folders, outcomes, strict=True)}


@pytest.mark.parametrize("override", REFUSED_BENCH_SETTINGS)
def test_a_refused_bench_setting_is_one_line_and_exit_status_2(refused_bench_settings, override):
    """``unsparse bench`` checks its settings before any GPU work (this machine has none, so a setting that passed
    would end in the CUDA refusal instead); a missing ``sparse_input_shape`` used to stop the run after every
    per-layer timing."""
    status, stderr, folder = refused_bench_settings[override]
    assert status == 2 and REFUSED_BENCH_SETTINGS[override] in stderr and "Traceback" not in stderr
    assert not (folder / ".hydra").exists()  # Hydra's copy of the refused run's config used to be written


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_bench_without_cuda_is_one_line_and_exit_status_2(tmp_path):
    command = [sys.executable, "-c", "from unsparse.cli import main; main()", "bench", f"hydra.run.dir={tmp_path}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "unsparse bench: refused: run_bench needs a CUDA GPU, and torch sees none here" in done.stderr
    assert not (tmp_path / ".hydra").exists()


def test_every_bench_option_is_a_run_bench_argument():
    import inspect

    from unsparse.runtime.bench import run_bench

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        settings = OmegaConf.to_container(compose(config_name="bench"), resolve=True)
    settings.pop("hydra", None)
    settings.pop("quick")
    assert set(settings) <= set(inspect.signature(run_bench).parameters)


@pytest.mark.parametrize("folder", ["outputs/2026-11-24/20-00-00", "multirun/prune.target=0.9,train.epochs=5",
                                    "runs/it's [1]", "a b\\c\\", "é/${x}"])
def test_the_printed_resume_command_reads_back_as_the_same_overrides(folder):
    """The interrupted job prints it to be pasted: a folder named by Hydra's override_dirname (``=``, ``,``) made
    Hydra's parser refuse the command, and spaces split it in the shell."""
    import shlex

    from hydra.core.override_parser.overrides_parser import OverridesParser

    from unsparse.cli import resume_command

    overrides = ["prune=gradual", "prune.target=0.8", "data=digits"]
    words = shlex.split(resume_command(overrides, Path(folder), "my venv/bin/unsparse"))
    assert words[0] == "my venv/bin/unsparse" and words[1:-1] == overrides
    parsed = OverridesParser.create().parse_overrides(words[1:])
    assert parsed[-1].key_or_group == "hydra.run.dir" and parsed[-1].value() == folder


def interrupted_resume_command(words: list[str]) -> list[str]:
    """Run ``unsparse *words``, send Ctrl-C once its first job trains, and return the resume command it printed."""
    import signal

    command = [sys.executable, "-c", "from unsparse.cli import main; main()", *words]
    # Unbuffered, so that the "epoch 1:" line arrives while the first job trains. A signal that arrived while the
    # epoch's checkpoint was written ran the sweep on to its end (torch.save's cleanup error hid the interruption),
    # until atomic_write passed the interruption on.
    environment = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # Ctrl-C's default action in the job: a suite started in the background of a shell without job control
    # (`pytest &`) ignores SIGINT, its children inherit that, and Python then installs no KeyboardInterrupt handler,
    # so the job ran to its end and the test failed for the way it was started.
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) as job:
        for line in job.stdout:
            if "epoch 1:" in line:  # the first job is training
                job.send_signal(signal.SIGINT)
                break
        output = job.communicate(timeout=120)[0]
    assert job.returncode == 130, output[-3000:]
    return shlex.split(output.split("written so far run: ")[1].splitlines()[0])


def test_an_interrupted_sweep_prints_the_sweeps_command(tmp_path):
    """Ctrl-C in a sweep's first job printed that job's own command, which drops the jobs not yet started; the
    printed command is the sweep's, with its folder, and runs every job again."""
    sweep = ["-m", "experiment=smoke", "data=digits", "prune=magnitude,gradual", "progress=false",
             "train.epochs=50"]
    printed = interrupted_resume_command([*sweep, f"hydra.sweep.dir={tmp_path / 'sweep'}"])
    assert printed == ["unsparse", *sweep, f"hydra.sweep.dir='{tmp_path / 'sweep'}'"]


def test_an_interrupted_job_prints_its_config_dir(tmp_path):
    """With an experiment from ``--config-dir``, the printed command dropped the flag: Hydra then found no such
    experiment, and the job could not be resumed as printed."""
    extra = tmp_path / "extra"
    (extra / "experiment").mkdir(parents=True)
    (extra / "experiment" / "long.yaml").write_text("# @package _global_\ntrain:\n  epochs: 50\n")
    words = ["--config-dir", str(extra), "data=digits", "device=cpu", "progress=false", "experiment=long",
             "data.limit_train=300"]
    printed = interrupted_resume_command([*words, f"hydra.run.dir={tmp_path / 'job'}"])
    assert printed == ["unsparse", *words, f"hydra.run.dir='{tmp_path / 'job'}'"]
