"""The main job end to end on a small real subset (Fashion-MNIST if installed, else sklearn digits)."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from unsparse import create_model, load_sparse
from unsparse.data import DatasetUnavailableError, digits, fashion_mnist
from unsparse.pipeline import TimingSettings, TrainSettings, compare_layers, run_pipeline
from unsparse.prune import MagnitudePruner
from unsparse.prune.evolutionary import EvolutionaryPruner
from unsparse.prune.gradual import GradualMagnitudePruner
from unsparse.report import write_report
from unsparse.runtime import Plan, SparseConv, sparse_layers
from unsparse.runtime.comparator import plan_model
from unsparse.strict_json import loads_strict


def small_real_data():
    try:
        return fashion_mnist(limit_train=1500, limit_test=400, val_size=500)
    except DatasetUnavailableError:
        return digits()


def test_fashion_mnist_reads_the_debian_files():
    try:
        splits = fashion_mnist(limit_train=100, limit_test=50, val_size=100)
    except DatasetUnavailableError as error:
        assert "apt-get install dataset-fashion-mnist" in str(error)
        pytest.skip("Debian's dataset-fashion-mnist is not installed")
    assert splits.train[0].shape == (100, 1, 28, 28) and splits.test[0].shape == (50, 1, 28, 28)
    assert set(splits.train[1].tolist()) <= set(range(10))


def test_missing_dataset_error_names_the_package(tmp_path):
    with pytest.raises(DatasetUnavailableError, match="dataset-fashion-mnist"):
        fashion_mnist(root=tmp_path, limit_train=10)


def test_digits_shapes():
    splits = digits()
    assert splits.train[0].shape[1:] == (1, 28, 28)
    assert len(splits.test[1]) == 360


def test_pipeline_smoke_on_real_data(tmp_path):
    torch.manual_seed(0)
    splits = small_real_data()
    report = run_pipeline(
        splits, create_model("vgg_small", width=8), MagnitudePruner(0.9, fine_tune_epochs=1),
        lambda model, loader: model, tmp_path, TrainSettings(epochs=1, batch_size=64, deterministic=True),
        TimingSettings(batch_size=8, repeats=2, warmup=1), progress=False, record={".hydra/config.yaml": "first\n"})
    assert report["run"]["deterministic"] and not torch.are_deterministic_algorithms_enabled()  # training only
    for name in ("report.json", "report.md", "layers.png", "timings.png", "model.safetensors", "dense.pt"):
        assert (tmp_path / name).exists(), name
    assert report["pruning"]["weighted_sparsity"] == pytest.approx(0.9, abs=1e-3)
    assert report["pruning"]["target"] == 0.9 and report["pruning"]["target_reached"]
    accuracy = report["accuracy"]
    assert abs(accuracy["sparse_run"] - accuracy["pruned"]) <= 0.1
    assert accuracy["dense"] > 30.0  # one epoch on real data learns something
    backends = {entry["backend"] for entry in report["timings"]}
    assert {"dense_cpu", "im2col_cublas", "im2col_cusparse"} <= backends
    assert all(entry["status"] == "ok" and entry["rel_error"] < 1e-4 for entry in report["timings"])
    assert {verdict["layer"] for verdict in report["timing_verdicts"]} == {row["layer"] for row in report["layers"]}
    assert json.loads((tmp_path / "report.json").read_text())["accuracy"] == accuracy
    check = report["plan_check"]
    assert check["timing"] == "eager" and check["images"] == 8 and check["model_runs_on"] == "reference"
    assert check["planned_ms"] > 0 and check["default_ms"] > 0
    markdown = (tmp_path / "report.md").read_text()
    assert "sparse" in markdown and "## Whole model" in markdown and "not on the plan" in markdown
    assert "Target 90.00%: reached." in markdown
    assert load_sparse(tmp_path / "model.safetensors").unsparse_metadata["extra"]["accuracy"]["pruned"] == \
        accuracy["pruned"]
    # a diverged stage's NaN and an infinite history value: report.json stays strict JSON (NaN as null, the infinity
    # as -1e999, read back as itself) and renders the same page again, which names the stage and says n/a for it
    diverged = {**report, "accuracy": {**accuracy, "sparse_run": math.nan},
                "pruning": {**report["pruning"], "history": [{"relative_change": -math.inf}]}}
    first = write_report(tmp_path / "diverged", diverged, {})
    again = write_report(tmp_path / "again", loads_strict(first["json"].read_text()), {})
    assert loads_strict(again["json"].read_text())["pruning"]["history"] == [{"relative_change": -math.inf}]
    page = first["markdown"].read_text()
    assert page == again["markdown"].read_text()
    assert "| sparse_run | n/a |" in page and "No better than that: `sparse_run`" in page
    with pytest.raises(ValueError, match=r"job.json: written by .* settings \(pruner.target: 0.9 there, 0.8"):
        run_pipeline(splits, create_model("vgg_small", width=8), MagnitudePruner(0.8, fine_tune_epochs=1),
                     lambda model, loader: model, tmp_path, TrainSettings(epochs=1, batch_size=64, deterministic=True),
                     TimingSettings(batch_size=8, repeats=2, warmup=1), progress=False,
                     record={".hydra/config.yaml": "refused\n"})
    assert (tmp_path / ".hydra" / "config.yaml").read_text() == "first\n"  # the folder's record of its own job


def test_a_pruner_that_stops_below_its_target_says_so(tmp_path, caplog):
    """Evolutionary pruning without iterations stops at its initial sparsity: the log and the report say the target
    was not reached instead of presenting the result as the run asked for."""
    from unsparse.prune.evolutionary import EvolutionaryPruner

    torch.manual_seed(0)
    with caplog.at_level("WARNING"):
        report = run_pipeline(digits(limit_train=200, limit_test=60), create_model("vgg_small", width=4),
                              EvolutionaryPruner(0.9, iterations=0, initial_sparsity=0.5, fine_tune_epochs=0),
                              lambda model, loader: model, tmp_path, TrainSettings(epochs=0, batch_size=64),
                              TimingSettings(batch_size=2, repeats=1, warmup=0, backends=["dense_cpu"]),
                              progress=False)
    assert report["pruning"]["target"] == 0.9 and not report["pruning"]["target_reached"]
    assert report["pruning"]["weighted_sparsity"] == pytest.approx(0.5, abs=0.01)
    assert report["pruning"]["shortfall_reason"] == "its iteration budget of 0 iterations ran out"
    assert "**NOT reached**: the run stopped below it, at " in (tmp_path / "report.md").read_text()
    messages = " ".join(record.getMessage() for record in caplog.records)
    assert "below its target 0.9000 (its iteration budget of 0 iterations ran out)" in messages
    assert "train.epochs = 0" in messages


def test_a_resumed_job_removes_the_temporary_files_of_killed_writes_and_says_so(tmp_path, caplog):
    stale = [tmp_path / ".dense.pt.k1ll3d_0.tmp", tmp_path / "prune" / ".magnitude_finetune.pt.abcdefgh.tmp"]
    stale[1].parent.mkdir()
    (tmp_path / "notes").mkdir()
    foreign = [tmp_path / "notes" / ".todo.20241124.tmp", tmp_path / ".index.json.abcdefgh.tmp"]  # not the job's
    for path in stale + foreign:
        path.write_bytes(b"half a checkpoint")
    with caplog.at_level("WARNING", logger="unsparse.pipeline"):
        run_pipeline(digits(limit_train=200, limit_test=60), create_model("vgg_small", width=4),
                     MagnitudePruner(0.5, fine_tune_epochs=0), lambda model, loader: model, tmp_path,
                     TrainSettings(epochs=0, batch_size=64),
                     TimingSettings(batch_size=2, repeats=1, warmup=0, backends=["dense_cpu"]), progress=False)
    assert not any(path.exists() for path in stale) and all(path.exists() for path in foreign)
    assert ("removed 2 temporary files of writes an earlier process did not finish: .dense.pt.k1ll3d_0.tmp, "
            "prune/.magnitude_finetune.pt.abcdefgh.tmp") in caplog.text


def test_a_folder_takes_one_running_job_at_a_time(tmp_path):
    """A second start of a job in a folder where it is running (e.g. a resume typed while the first one still runs)
    is refused before it touches anything: it would have written over the running job's checkpoints."""
    from unsparse.job import JOB_FILE, only_job_in

    with only_job_in(tmp_path):  # the running job
        with pytest.raises(ValueError, match="another running job holds this folder"):
            run_pipeline(digits(limit_train=200, limit_test=60), create_model("vgg_small", width=4),
                         MagnitudePruner(0.5, fine_tune_epochs=0), lambda model, loader: model, tmp_path,
                         TrainSettings(epochs=0, batch_size=64), TimingSettings(batch_size=2, repeats=1, warmup=0),
                         progress=False)
        assert not (tmp_path / JOB_FILE).exists()
    with only_job_in(tmp_path):  # released with the block
        pass


def test_a_layer_subset_is_judged_on_the_layers_it_prunes(tmp_path):
    """Pruning two layers to 0.9 reaches the target; report.md gives the model-wide figure and the pruned layers'."""
    torch.manual_seed(0)
    model = create_model("vgg_small", width=4)
    subset = [name for name, layer in model.named_modules() if isinstance(layer, torch.nn.Conv2d)][:2]
    report = run_pipeline(digits(limit_train=200, limit_test=60), model,
                          MagnitudePruner(0.9, layers=subset, fine_tune_epochs=0), lambda model, loader: model,
                          tmp_path, TrainSettings(epochs=0, batch_size=64, eval_batch_size=30),
                          TimingSettings(batch_size=2, repeats=1, warmup=0, backends=["dense_cpu"]), backend="auto",
                          progress=False)
    layer_backends = report["plan_check"]["layer_backends"]  # the plan: each layer on dense_cpu in some layout
    assert len(layer_backends) == len(report["layers"])
    assert all(backend.startswith("dense_cpu") for backend in layer_backends.values())
    assert "model_runs_on_ms" not in report["plan_check"]
    assert report["run"]["weights"].startswith("NOT trained")
    pruning = report["pruning"]
    assert pruning["target_reached"] and pruning["masked_weighted_sparsity"] == pytest.approx(0.9, abs=1e-3)
    assert pruning["weighted_sparsity"] < 0.5
    markdown = (tmp_path / "report.md").read_text()
    assert "over the pruned layers only" in markdown and "Target 90.00%: reached." in markdown
    assert f"The test set ran on the plan: `{subset[0]}` on dense_cpu" in markdown


def test_test_images_outside_the_plans_batch_size_are_reported_as_run_dense(tmp_path, caplog):
    """Under auto, 60 test images in batches of 25 end in a batch of 10 that the plan (for 25) has no entry for; the
    report said the whole test set ran on the plan (an audit's find)."""
    from unsparse.pipeline import unplanned_images

    assert unplanned_images(60, 25, 25) == 10 and unplanned_images(60, 30, 30) == 0 and unplanned_images(7, 25, 7) == 0
    torch.manual_seed(0)
    report = run_pipeline(digits(limit_train=200, limit_test=60), create_model("vgg_small", width=4),
                          MagnitudePruner(0.5, fine_tune_epochs=0), lambda model, loader: model, tmp_path,
                          TrainSettings(epochs=0, batch_size=64, eval_batch_size=25),
                          TimingSettings(batch_size=2, repeats=1, warmup=0, backends=["dense_cpu"]), backend="auto",
                          progress=False)
    assert report["plan_check"]["unplanned_images"] == 10
    plan = Plan.load(tmp_path / "plan.json")  # the checked plan, to run the exported model on auto elsewhere
    loaded = load_sparse(tmp_path / "model.safetensors").eval()
    again, _ = plan_model(loaded, digits(limit_train=200, limit_test=60).test[0][:25], backends=["dense_cpu"], runs=1,
                          warmup=0)
    assert set(plan.entries) == set(again.entries)  # the keys the exported model looks up for the test batches
    assert {entry.backend for entry in plan.entries.values()} == {"dense_cpu"}
    assert ("**10 test images ran on the dense default instead**: they came in a batch of another size than the "
            "plan's 25 images") in (tmp_path / "report.md").read_text()


def test_the_dense_default_named_as_backend_is_what_the_test_set_runs_on(tmp_path, monkeypatch):
    """Planning left every layer on auto, and only other named backends were set back: the report said the test set
    ran on dense_cpu while it ran on the plan (an audit's find)."""
    from unsparse.train import Trainer

    seen = {}
    evaluate = Trainer.evaluate

    def recording(self, model, split="val", desc=None):
        if desc is not None and desc.startswith("test sparse"):
            seen["backends"] = {layer.backend for layer in sparse_layers(model).values()}
        return evaluate(self, model, split, desc)

    monkeypatch.setattr(Trainer, "evaluate", recording)
    torch.manual_seed(0)
    run_pipeline(digits(limit_train=200, limit_test=60), create_model("vgg_small", width=4),
                 MagnitudePruner(0.5, fine_tune_epochs=0), lambda model, loader: model, tmp_path,
                 TrainSettings(epochs=0, batch_size=64),
                 TimingSettings(batch_size=2, repeats=1, warmup=0, backends=["dense_cpu", "reference"]),
                 backend="dense_cpu", progress=False)
    assert seen["backends"] == {"dense_cpu"}


def test_the_report_names_the_commit_the_job_started_from(tmp_path, monkeypatch):
    """The commit was read when the report was written, so a commit made while the job trained was named (an
    audit's find)."""
    import unsparse.pipeline as pipeline

    head = {"commit": "started"}
    monkeypatch.setattr(pipeline, "git_commit", lambda: head["commit"])  # where run_pipeline looks it up

    class CommittingWhilePruning(MagnitudePruner):
        def run(self, *args, **kwargs):
            head["commit"] = "made while the job ran"
            return super().run(*args, **kwargs)

    torch.manual_seed(0)
    report = run_pipeline(digits(limit_train=200, limit_test=60), create_model("vgg_small", width=4),
                          CommittingWhilePruning(0.5, fine_tune_epochs=0), lambda model, loader: model, tmp_path,
                          TrainSettings(epochs=0, batch_size=64),
                          TimingSettings(batch_size=2, repeats=1, warmup=0, backends=["dense_cpu"]),
                          backend="dense_cpu", progress=False)
    assert report["run"]["commit"] == "started"


class EmptyingPruner(MagnitudePruner):
    """Zeroes every mask after its step: the magnitude pruners keep each layer's largest weight, and a user's own
    pruner (or a layer whose weights are all zero) can still leave a layer without weights."""

    def step(self, sparsity: float | None = None) -> None:
        super().step(sparsity)
        for mask in self.masks.values():
            mask.set(torch.zeros_like(mask.mask))


def test_a_time_series_trains_an_autoencoder_and_reports_its_mse(tmp_path, caplog):
    """Windows without labels train with MSE and the report gives reconstruction MSE per stage next to predicting
    each window's mean (cross-entropy against a one-channel output was always 0: nothing trained, top-1 0 was
    reported); a fully pruned layer is warned about; the test set's backend is timed as a whole model."""
    from test_task import windows

    torch.manual_seed(0)
    model = create_model("autoencoder1d", width=4)
    first = next(name for name, layer in model.named_modules() if isinstance(layer, torch.nn.Conv1d))
    untrained = {key: value.clone() for key, value in model.state_dict().items()}
    with caplog.at_level("WARNING"):
        report = run_pipeline(windows(count=48), model, EmptyingPruner(0.9, layers=[first], fine_tune_epochs=0),
                              lambda model, loader: model, tmp_path, TrainSettings(epochs=2, batch_size=8),
                              TimingSettings(batch_size=4, repeats=2, warmup=0, backends=["dense_cpu"]), progress=False)
    assert report["run"]["metric"] == "mse" and report["run"]["weights"].startswith("trained on the data set, 2 epochs")
    assert report["run"]["metric_trivial"] > 0
    assert all(len(row["stride"]) == len(row["padding"]) == 1 for row in report["layers"])  # a Conv1d's length
    assert all(math.isfinite(value) and value > 0 for value in report["accuracy"].values())
    trained = model.state_dict()
    assert not torch.equal(trained["1.7.0.weight"], untrained["1.7.0.weight"])  # the last conv, not masked
    assert all(entry["train_loss"] > 0 for entry in report["dense_training"])
    assert report["pruning"]["fully_pruned_layers"] == [first] and f"every weight of {first}" in caplog.text
    check = report["plan_check"]
    assert check["model_runs_on"] == "reference" and check["model_runs_on_ms"] > 0
    assert set(check["layer_backends"].values()) == {"reference"}
    markdown = (tmp_path / "report.md").read_text()
    assert "| stage | reconstruction MSE (lower is better) |" in markdown and "A model that learned nothing" in markdown
    assert "1 layer(s) fully pruned" in markdown and "The test set ran on `reference`, not on the plan: " in markdown
    assert "every output channel stores `L` entries" in markdown  # the export table's L and padding explained


@pytest.mark.parametrize(("make", "field"), [
    (lambda: TrainSettings(epochs=-1), r"train.epochs: expected an integer >= 0, got -1"),
    (lambda: TrainSettings(batch_size=0), r"train.batch_size: expected an integer >= 1, got 0"),
    (lambda: TrainSettings(eval_batch_size=0), r"train.eval_batch_size: expected an integer >= 1, got 0"),
    (lambda: TrainSettings(lr=-1.0), r"train.lr: expected a number > 0, got -1.0"),
    (lambda: TrainSettings(momentum=1.0), r"train.momentum: expected a number in \[0, 1\), got 1.0"),
    (lambda: TrainSettings(weight_decay=-0.1), "train.weight_decay"),
    # types the comparisons let through (a helper's finds): "True epoch" in report.md, a float epoch count that
    # failed after the folder was claimed, a string that switched deterministic mode on
    (lambda: TrainSettings(epochs=True), r"train.epochs: expected an integer >= 0, got True"),
    (lambda: TrainSettings(epochs=1.5), r"train.epochs: expected an integer >= 0, got 1.5"),
    (lambda: TrainSettings(batch_size=64.5), "train.batch_size"),
    (lambda: TrainSettings(epochs="abc"), "train.epochs"),
    (lambda: TrainSettings(deterministic="maybe"), r"train.deterministic: expected a bool, got 'maybe'"),
    (lambda: TimingSettings(repeats=0), "runtime.timing.repeats: expected an integer >= 1, got 0"),
    (lambda: TimingSettings(batch_size=0), "runtime.timing.batch_size"),
    (lambda: TimingSettings(warmup=-1), "runtime.timing.warmup: expected an integer >= 0, got -1"),
    (lambda: TimingSettings(backends="dense_cpu"), "runtime.timing.backends: expected a list of backend names"),
    (lambda: TimingSettings(backends=[]), "runtime.timing.backends: empty; name the backends to time, or null"),
    # pruner settings torch refused only after dense training, or took without a word (a helper's finds)
    (lambda: MagnitudePruner(lr=-1), r"lr: expected a number > 0 and finite \(or null\), got -1"),
    # inf passed and pruned NaN weights (lr), or made every importance inf and its ranking arbitrary (alpha)
    (lambda: MagnitudePruner(lr=float("inf")), r"lr: expected a number > 0 and finite \(or null\), got inf"),
    (lambda: EvolutionaryPruner(alpha=float("inf")), "alpha: expected a number >= 0 and finite, got inf"),
    (lambda: EvolutionaryPruner(beta=float("inf")), "beta: expected a number >= 0 and finite, got inf"),
    (lambda: MagnitudePruner(lr=0), "lr: expected a number > 0"),
    (lambda: MagnitudePruner(fine_tune_epochs=-1), "fine_tune_epochs: expected an integer >= 0, got -1"),
    (lambda: MagnitudePruner(fine_tune_epochs=1.5), "fine_tune_epochs: expected an integer >= 0, got 1.5"),
    (lambda: MagnitudePruner(target="abc"), r"target: expected a number in \[0, 1\) \(a sparsity\), got 'abc'"),
    (lambda: MagnitudePruner(layers="7.0"), "layers: expected a list of layer names"),
    (lambda: MagnitudePruner(layers=5), "layers: expected a list of layer names, got 5"),  # was a TypeError
    (lambda: MagnitudePruner(layers={"7.0": 1}), "layers: expected a list of layer names"),
    (lambda: MagnitudePruner(scope="layer", layer_targets={"7.0": "x"}), r"layer_targets.7.0: expected a number"),
    (lambda: EvolutionaryPruner(fine_tune_lr=-1), "fine_tune_lr: expected a number > 0"),
    (lambda: EvolutionaryPruner(epsilon=float("nan")), r"epsilon: expected a number \(not NaN\)"),
    (lambda: EvolutionaryPruner(iterations=2.5), "iterations: expected an integer >= 0, got 2.5"),
    (lambda: EvolutionaryPruner(unit_step={"0.0": -0.1}), r"unit_step.0.0: expected a number > 0"),
    (lambda: EvolutionaryPruner(rewind="no"), "rewind: expected a bool"),
    (lambda: GradualMagnitudePruner(target=0.9, initial_sparsity=0.95),
     r"initial_sparsity: expected a number in \[0, target = 0.9\], got 0.95"),
    (lambda: GradualMagnitudePruner(frequency=0), "frequency: expected an integer >= 1, got 0"),
    (lambda: digits(limit_test=0), "limit_test: 0 keeps no example"),
    (lambda: digits(test_size=0), r"test_size: expected an integer in \[1, 1796\]"),
    (lambda: digits(val_size=-100), r"val_size: expected an integer in \[1, 1436\]"),
    (lambda: digits(val_size=5000), "val_size"),
    (lambda: digits(limit_train=-5), "limit_train"),
    (lambda: create_model("vgg_small", width=0), r"model.width: expected an integer >= 1, got 0"),
])
@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
def test_settings_out_of_range_are_refused_naming_the_field(make, field):
    with pytest.raises(ValueError, match=field):
        make()


def test_layer_names_the_model_lacks_are_refused_before_training_binds_the_folder(tmp_path):
    """A typo in a per-layer setting failed after dense training, and the folder then refused the corrected run
    (a helper's find). Hydra reads a command-line key ``7.0`` as a float: it names layer "7.0"."""
    for pruner, message in (
            (MagnitudePruner(scope="layer", layer_targets={"bogus": 0.5}), r"layer_targets: \['bogus'\]"),
            (MagnitudePruner(layers=["0.0", "7.1"]), r"layers: \['7.1'\] are not prunable"),
            (EvolutionaryPruner(layers=["0.0"], unit_step={"0.0": 0.1, "9.9": 0.1}),
             r"unit_step: \['9.9'\] are not prunable layers of the model"),
            (EvolutionaryPruner(unit_step={"0.0": 0.02}), r"unit_step: no step for the masked layers \['1.0', "),
    ):
        with pytest.raises(ValueError, match=message):
            run_pipeline(digits(limit_train=200, limit_test=60), create_model("vgg_small", width=4), pruner,
                         lambda model, loader: model, tmp_path, TrainSettings(epochs=1, batch_size=64),
                         TimingSettings(), progress=False)
        assert not any(tmp_path.iterdir())
    assert MagnitudePruner(scope="layer", layer_targets={7.0: 0.5, 10: 0.2}).layer_targets == {"7.0": 0.5, "10": 0.2}
    # a step for a prunable layer outside a subset is accepted, as it was before the check
    EvolutionaryPruner(layers=["0.0"], unit_step={"0.0": 0.1, "6.0": 0.1}).check_layers(create_model("vgg_small"))


def test_a_float_key_that_could_name_several_layers_is_refused():
    """Hydra and YAML read an unquoted key ``1.10`` as the float 1.1, whose ``str`` is "1.1": with layers 1.1 and
    1.10 the setting went to 1.1 unasked, and with 1.10 alone it was refused as naming no layer (a helper's find).
    A float key that reads as one layer only keeps working, and a quoted name is taken as written."""
    def conv() -> torch.nn.Module:
        return torch.nn.Conv2d(1, 2, 3)

    both = torch.nn.Sequential(conv(), torch.nn.Sequential(*(conv() for _ in range(11))))  # 1.0 ... 1.10
    longer_only = torch.nn.Sequential(conv(), torch.nn.Sequential(conv(), torch.nn.ReLU(), *(conv() for _ in range(9))))
    for pruner, model, layers in (
            (MagnitudePruner(scope="layer", layer_targets={1.1: 0.5}), both, r"\['1.1', '1.10'\]"),
            (GradualMagnitudePruner(scope="layer", layer_targets={1.1: 0.5}), both, r"\['1.1', '1.10'\]"),
            (EvolutionaryPruner(unit_step={1.1: 0.02}), longer_only, r"\['1.10'\]"),
    ):
        field = "unit_step" if isinstance(pruner, EvolutionaryPruner) else "layer_targets"
        with pytest.raises(ValueError, match=rf"{field}: the key 1.1 is a number .* could stand for the layers "
                                             rf"{layers}; quote the layer's name, in a YAML config as {field}: "):
            pruner.check_layers(model)
    for layer_targets in ({1.2: 0.5}, {"1.1": 0.5, "1.10": 0.4}):
        MagnitudePruner(scope="layer", layer_targets=layer_targets).check_layers(both)
    assert MagnitudePruner(scope="layer", layer_targets={1.2: 0.5}).layer_targets == {"1.2": 0.5}
    # a layer "7" reads as the integer 7, never as the float 7.0: no ambiguity (the message claimed one); the
    # suggestion keeps the mapping's other keys (every masked layer needs a step); 1.1 and "1.1" are one name
    flat = torch.nn.Sequential(*(conv() for _ in range(8)))  # 0 ... 7
    with pytest.raises(ValueError, match=r"layer_targets: \['7.0'\] are not masked"):
        MagnitudePruner(scope="layer", layer_targets={7.0: 0.5}).check_layers(flat)
    with pytest.raises(ValueError, match=r'unit_step: \{"0": 0.02, "1.10": 0.03\}'):
        EvolutionaryPruner(unit_step={"0": 0.02, 1.1: 0.03}).check_layers(both)
    with pytest.raises(ValueError, match=r"layer_targets: the keys 1.1 and '1.1' name the same layer '1.1'"):
        MagnitudePruner(scope="layer", layer_targets={1.1: 0.5, "1.1": 0.4})


def test_numpy_scalars_are_refused_by_name_and_seeds_are_those_torch_tells_apart():
    """Settings go into JSON records: a numpy integer accepted here failed only when the file was saved, after the
    training (a reread's find); numpy's float64 is a Python float."""
    import numpy as np

    with pytest.raises(ValueError, match=r"train.epochs: expected an integer >= 0, got np.int64\(2\)"):
        TrainSettings(epochs=np.int64(2))
    with pytest.raises(ValueError, match="fine_tune_epochs: expected an integer"):
        MagnitudePruner(0.9, fine_tune_epochs=np.int64(1))
    assert TrainSettings(lr=np.float64(0.05)).lr == 0.05
    assert EvolutionaryPruner(seed=2**32 - 1).seed == 2**32 - 1
    with pytest.raises(ValueError, match=r"seed: expected an integer in \[0, 4294967295\], got -1"):
        EvolutionaryPruner(seed=-1)


def test_devices_and_backends_are_checked_before_any_work(tmp_path):
    from unsparse.job import resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="device: 'gpu' is not a device"):
        resolve_device("gpu")
    with pytest.raises(ValueError, match="device: 'meta'; expected"):
        resolve_device("meta")
    with pytest.raises(ValueError, match=r"device: 'cuda:7' requested, but torch sees"):
        resolve_device("cuda:7" if torch.cuda.device_count() < 8 else "cuda:99")
    with pytest.raises(ValueError, match=r"runtime\.backend: unknown 'foo'"):
        run_pipeline(None, None, None, None, tmp_path, TrainSettings(), TimingSettings(), backend="foo")
    for backend in ("direct", "direct_half2", "cudnn"):  # they ran every layer dense, and the report named them
        with pytest.raises(ValueError, match=rf"runtime\.backend: '{backend}' runs on \['cuda'\], the job on cpu"):
            run_pipeline(None, None, None, None, tmp_path, TrainSettings(), TimingSettings(), backend=backend,
                         device=torch.device("cpu"))
    with pytest.raises(ValueError, match=r"seed: expected an integer in \[0, 4294967295\], got -1"):
        run_pipeline(None, None, None, None, tmp_path, TrainSettings(), TimingSettings(), seed=-1)
    assert not any(tmp_path.iterdir())  # refused before the folder was claimed


def test_the_same_settings_written_differently_are_the_same_job():
    from unsparse.train import check_resumable

    check_resumable("x.pt", {"identity": '{"lr": 1, "sizes": [1, 2]}'}, '{"sizes": [1.0, 2], "lr": 1.0}')
    with pytest.raises(ValueError, match=r"x.pt: .*\(a.b: 1 there, 2 here\)"):
        check_resumable("x.pt", {"identity": '{"a": {"b": 1, "c": 3}}'}, '{"a": {"b": 2, "c": 3}}')


def test_timing_settings_choose_the_compared_backends():
    from unsparse.runtime import sparsify

    model = sparsify(create_model("vgg_small", width=4).eval())
    example = torch.randn(2, 1, 28, 28)
    rows, check, _ = compare_layers(model, example,
                                    TimingSettings(repeats=1, warmup=0, backends=["dense_cpu", "reference"]))
    assert check.timing == "eager" and check.planned_ms > 0 and check.default_ms > 0
    assert rows and {row["backend"] for row in rows} == {"dense_cpu", "reference", "dense_alone"}
    assert {row["params"]["layout"] for row in rows if row["backend"] == "dense_alone"} == {"nchw", "nhwc"}
    assert {row["backend"] for row in compare_layers(model, example, TimingSettings(repeats=1, warmup=0))[0]} == \
        {"dense_cpu", "im2col_cublas", "im2col_cusparse", "dense_alone"}  # the default leaves the reference out
    with pytest.raises(ValueError, match="backends: unknown \\['direct_half'\\]"):
        TimingSettings(backends=["direct_half"])


def test_training_resumes_exactly_after_ctrl_c(tmp_path, interrupt_at_epoch):
    from unsparse.train import Trainer

    splits = digits(limit_train=300)

    def trained(checkpoint, interrupt_in_epoch=None):
        torch.manual_seed(1)
        model = create_model("vgg_small", width=4)
        trainer = Trainer(splits.loaders(32, seed=1), progress=False)
        if interrupt_in_epoch is not None:
            interrupt_at_epoch(trainer, interrupt_in_epoch)
        trainer.fit(model, 2, checkpoint)
        return model

    straight = trained(tmp_path / "a.pt")
    with pytest.raises(KeyboardInterrupt):
        trained(tmp_path / "b.pt", interrupt_in_epoch=2)
    resumed = trained(tmp_path / "b.pt")
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_deterministic_algorithms_are_scoped(monkeypatch):
    from unsparse.train import CUBLAS_WORKSPACE_CONFIG, deterministic_algorithms

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    with deterministic_algorithms(False):
        assert not torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.benchmark
    with deterministic_algorithms():
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
        assert not torch.backends.cudnn.benchmark
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE_CONFIG
    assert not torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.deterministic
    assert torch.backends.cudnn.benchmark
    with pytest.raises(KeyError), deterministic_algorithms():  # restored on an exception too
        raise KeyError
    assert not torch.are_deterministic_algorithms_enabled()


def test_layers_a_named_backend_declines_are_reported_on_their_dense_fallback():
    """A layer the named backend cannot run (here a grouped one on a sparse backend) runs dense; the report said the
    whole test set ran on the named backend."""
    from torch import nn

    from unsparse.report.document import plan_check_text
    from unsparse.runtime import sparsify

    model = sparsify(nn.Sequential(nn.Conv2d(4, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3, groups=2)).eval())
    example, settings = torch.randn(2, 4, 9, 9), TimingSettings(repeats=1, warmup=0, backends=["dense_cpu"])
    backends = compare_layers(model, example, settings, "im2col_cusparse")[2]
    assert backends == {"0": "im2col_cusparse",
                        "2": "dense_cpu (dense fallback: groups=2 is not supported by sparse backends)"}
    assert compare_layers(model, example, settings)[2] == {"0": "dense_cpu", "2": "dense_cpu"}  # auto: the plan
    text = plan_check_text({"timing": "eager", "planned_ms": 1.0, "default_ms": 1.0, "margin": 0.03, "images": 2,
                            "reverted": [], "model_runs_on": "im2col_cusparse", "layer_backends": backends})
    assert ("The test set ran on `im2col_cusparse`, not on the plan (**1 of 2 layers ran dense instead**: `2` on "
            "dense_cpu (dense fallback: groups=2 is not supported by sparse backends))") in text


def test_report_md_lists_the_backends_that_were_not_timed(tmp_path):
    """A backend named for timing that cannot run here was listed only in report.json's not_timed."""
    run_pipeline(digits(limit_train=200, limit_test=60), create_model("vgg_small", width=4),
                 MagnitudePruner(0.5, fine_tune_epochs=0), lambda model, loader: model, tmp_path,
                 TrainSettings(epochs=0, batch_size=64),
                 TimingSettings(batch_size=2, repeats=1, warmup=0, backends=["direct_half2", "dense_cpu"]),
                 progress=False)
    report = json.loads((tmp_path / "report.json").read_text())
    layers = list(dict.fromkeys(entry["layer"] for entry in report["not_timed"]))
    assert layers and {entry["backend"] for entry in report["not_timed"]} == {"direct_half2"}
    assert ("Not timed: `direct_half2` on " + ", ".join(f"`{layer}`" for layer in layers)
            + " (unsupported: direct_half2 runs on ['cuda'], input is on cpu).") in (tmp_path / "report.md").read_text()


def test_report_md_counts_the_weights_quantization_rounds_to_zero(tmp_path):
    """The report gave only the pruning's sparsity, while 2-bit weights drop every |w| under half a step (a helper
    found k-means and linear quantization removing nonzeros without a word)."""
    from unsparse.quant import ActivationSpec, LinearQuantizer

    torch.manual_seed(0)
    report = run_pipeline(digits(limit_train=200, limit_test=60), create_model("vgg_small", width=4),
                          MagnitudePruner(0.1, fine_tune_epochs=0),
                          LinearQuantizer(bits=2, activations=ActivationSpec("none"), progress=False).quantize,
                          tmp_path, TrainSettings(epochs=0, batch_size=64),
                          TimingSettings(batch_size=2, repeats=1, warmup=0, backends=["dense_cpu"]),
                          backend="dense_cpu", progress=False)
    # the named backend is the CPU's dense default: timed against itself it read "0.55x (SLOWER)" on a busy machine
    assert report["plan_check"]["model_runs_on_is_default"] and "model_runs_on_ms" not in report["plan_check"]
    assert ("The test set ran on `dense_cpu`, not on the plan, which is the dense default itself (not timed against "
            "itself).") in (tmp_path / "report.md").read_text()
    counts = report["conv_nonzeros"]
    assert counts["exported"] == sum(row["nnz"] for row in report["layers"]) < counts["pruned"]
    # the weights as stored are sparser than after pruning; the report and the file's metadata give that figure (an
    # audit found both giving the pruning's)
    from unsparse.prune.masks import weighted_sparsity
    from unsparse.report.document import sparsity_percent

    loaded = load_sparse(tmp_path / "model.safetensors")
    sizes = {name: module.weight.numel() if isinstance(module, torch.nn.Linear) else math.prod(module.weight_shape)
             for name, module in loaded.named_modules() if isinstance(module, torch.nn.Linear | SparseConv)}
    zeros = {name: int((module.weight == 0).sum()) if isinstance(module, torch.nn.Linear)
             else sizes[name] - int((module.csr.to_dense() != 0).sum())
             for name, module in loaded.named_modules() if name in sizes}
    stored = weighted_sparsity({name: zeros[name] / sizes[name] for name in sizes}, sizes)
    assert report["file"]["weighted_sparsity"] == pytest.approx(stored) and stored > report["pruning"][
        "weighted_sparsity"]
    assert loaded.unsparse_metadata["extra"]["weighted_sparsity"] == pytest.approx(stored)
    assert (f"Weighted sparsity of the weights as stored (eq. 7-8, conv and linear): **{sparsity_percent(stored)}%**"
            in (tmp_path / "report.md").read_text())
    assert (f"quantization rounded {counts['pruned'] - counts['exported']} of them to zero, so the exported file "
            f"holds {counts['exported']}") in (tmp_path / "report.md").read_text()


def test_the_example_batch_runs_through_the_model_once_besides_its_timings(tmp_path, monkeypatch):
    """The planning forward already saw every layer's input; naming the backend each layer runs on took a second,
    identical forward of the example (a review's find). Timed forwards are stubbed out here: what is left is the
    planning forward, and the test set's batches of another size."""
    import unsparse.pipeline as pipeline
    from unsparse.runtime import comparator

    forwards = []

    def loaded(*args, **kwargs):
        model = load_sparse(*args, **kwargs)
        model.register_forward_pre_hook(lambda module, inputs: forwards.append(len(inputs[0])))
        return model

    monkeypatch.setattr(pipeline, "load_sparse", loaded)
    monkeypatch.setattr(comparator, "time_forward", lambda *args, **kwargs: 1.0)
    torch.manual_seed(0)
    report = run_pipeline(digits(limit_train=100, limit_test=40), create_model("vgg_small", width=4),
                          MagnitudePruner(0.5, fine_tune_epochs=0), lambda model, loader: model, tmp_path,
                          TrainSettings(epochs=0, batch_size=64, eval_batch_size=20),
                          TimingSettings(batch_size=2, repeats=1, warmup=0, backends=["dense_cpu"]),
                          backend="dense_cpu", progress=False)
    assert forwards == [2, 20, 20]
    assert len(report["plan_check"]["layer_backends"]) == len(report["layers"])


@pytest.mark.parametrize("policy", ["all", "epilogue"])
def test_the_test_set_runs_on_the_model_folded_as_the_policy_says(tmp_path, monkeypatch, policy):
    """``all`` folds every BatchNorm of the reloaded model before the comparisons; ``epilogue`` folds after the plan
    check where the planned backend adds the bias in its epilogue (here the CPU dense backend, made to claim it).
    The report names the folded layers, the test-set accuracy is the pruned model's up to one image of rounding, and
    the file keeps the unfolded model."""
    from unsparse.runtime.backends.dense import DenseCpuBackend
    from unsparse.runtime.batch_norm_folding import FOLDED_ATTRIBUTE

    monkeypatch.setattr(DenseCpuBackend, "adds_bias_in_epilogue", lambda self, params: True)
    torch.manual_seed(0)
    report = run_pipeline(digits(limit_train=200, limit_test=60), create_model("vgg_small", width=4),
                          MagnitudePruner(0.5, fine_tune_epochs=0), lambda model, loader: model, tmp_path,
                          TrainSettings(epochs=1, batch_size=64, eval_batch_size=60),
                          TimingSettings(batch_size=2, repeats=1, warmup=0, backends=["dense_cpu"]), backend="auto",
                          progress=False, fold_batch_norm=policy)
    loaded = load_sparse(tmp_path / "model.safetensors")
    convs = list(sparse_layers(loaded))
    folding = report["plan_check"]["batch_norm_folding"]
    assert folding["policy"] == policy and folding["folded"] == convs and len(convs) == 6
    assert not hasattr(loaded, FOLDED_ATTRIBUTE)  # the file holds the unfolded model
    assert abs(report["accuracy"]["sparse_run"] - report["accuracy"]["pruned"]) <= 100 / 60 + 1e-9  # percent
    assert f"BatchNorms folded ({policy}:" in (tmp_path / "report.md").read_text()


@pytest.mark.parametrize(("policy", "backend", "message"), [
    ("sometimes", "auto", r"runtime\.fold_batch_norm: 'sometimes' not among off, all, epilogue"),
    (False, "auto", r"runtime\.fold_batch_norm: False not among .* \(in YAML write 'off' quoted"),
    ("epilogue", "dense_cpu", r"runtime\.fold_batch_norm: 'epilogue' folds by the plan, so it needs runtime\.backend"),
])
def test_a_fold_policy_it_cannot_follow_is_refused_before_any_work(tmp_path, policy, backend, message):
    with pytest.raises(ValueError, match=message):
        run_pipeline(None, None, None, None, tmp_path, TrainSettings(), TimingSettings(), backend=backend,
                     fold_batch_norm=policy)
    assert not any(tmp_path.iterdir())
