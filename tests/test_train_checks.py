"""Checks of ``unsparse.train`` and ``unsparse.atomic`` on tiny synthetic data: resuming only with the settings of
the checkpoint, clear errors for damaged or foreign checkpoints, scoped deterministic settings, checkpoints
streamed to disk, evaluation edge cases, and atomic writes through symlinks and under long names."""

from __future__ import annotations

import os
import pickle
import re
import tracemalloc
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from unsparse.atomic import atomic_write_text
from unsparse.train import (
    CUBLAS_WORKSPACE_CONFIG,
    CheckpointRefusedError,
    Trainer,
    deterministic_algorithms,
    load_checkpoint,
    save_checkpoint,
)


def loaders(samples: int = 32) -> dict[str, DataLoader]:
    """Train and val loaders of ``samples`` random 4-feature inputs in 3 classes."""
    generator = torch.Generator().manual_seed(0)
    inputs, targets = torch.randn(samples, 4, generator=generator), torch.randint(0, 3, (samples,), generator=generator)
    data = DataLoader(TensorDataset(inputs, targets), batch_size=8)
    return {"train": data, "val": data}


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3))


def trainer(**settings) -> Trainer:
    return Trainer(loaders(), progress=False, **settings)


def weights(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in module.state_dict().items()}


def shown(error: BaseException | None) -> str:
    """The messages a traceback of ``error`` prints: its own and those of the errors it was raised from."""
    if error is None:
        return ""
    below = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
    return f"{error}\n{shown(below)}"


def no_leftovers(folder: Path) -> bool:
    return not [path for path in folder.iterdir() if path.name.endswith(".tmp")]


# Finding 1: a resumed run must have the settings of the checkpoint.

@pytest.mark.parametrize(("changed", "field"), [
    ({"epochs": 3}, "epochs"), ({"epochs": 1}, "epochs"), ({"lr": 0.5}, "lr"),
    ({"trainer": {"lr": 0.5}}, "lr"), ({"trainer": {"momentum": 0.5}}, "momentum"),
    ({"trainer": {"weight_decay": 0.0}}, "weight_decay"), ({"trainer": {"loss": "mse"}}, "loss")])
def test_resume_refuses_other_settings(tmp_path, changed, field):
    checkpoint = tmp_path / "fit.pt"
    trainer().fit(model(), 2, checkpoint)
    resumed = model()
    before = weights(resumed)
    with pytest.raises(CheckpointRefusedError, match=rf"{re.escape(str(checkpoint))}: .*\b{field}: "):
        trainer(**changed.get("trainer", {})).fit(resumed, changed.get("epochs", 2), checkpoint, lr=changed.get("lr"))
    assert all(torch.equal(value, resumed.state_dict()[name]) for name, value in before.items())


def test_resume_with_the_same_settings_returns_the_finished_run(tmp_path):
    checkpoint = tmp_path / "fit.pt"
    history = trainer(lr=0.1).fit(model(), 2, checkpoint)
    assert trainer().fit(model(), 2, checkpoint, lr=0.1) == history  # the same lr, given another way


def _without_settings(state: dict) -> None:
    del state["settings"]


def _without_elapsed_s(state: dict) -> None:
    for entry in state["history"]:
        del entry["elapsed_s"]


@pytest.mark.parametrize(("strip", "identity", "lacking"), [
    (_without_settings, None, "'settings'"), (lambda state: None, "pruner", "'identity'"),
    (_without_elapsed_s, None, "'elapsed_s' in its history")], ids=["settings", "identity", "elapsed_s"])
@pytest.mark.parametrize("epochs", [2, 4])
def test_checkpoint_of_an_older_version_is_refused(tmp_path, strip, identity, lacking, epochs):
    """Older versions wrote no settings (a resume with more epochs trained on under the saved 2-epoch cosine
    schedule: epoch 3 at learning rate 0, epoch 4 at a rising one), no identity (a run of other settings resumed
    it) or no elapsed_s (the wall time counted only the epochs after the resume). A helper's find; refused like
    the evolutionary pruner's old checkpoints, before anything is loaded."""
    checkpoint = tmp_path / "fit.pt"
    trainer().fit(model(), 2, checkpoint)
    state = load_checkpoint(checkpoint)
    strip(state)
    save_checkpoint(checkpoint, state)
    resumed = model()
    before = weights(resumed)
    with pytest.raises(CheckpointRefusedError, match=rf"{re.escape(str(checkpoint))}: records no {lacking} .*; "
                                                     "start the run in a new folder"):
        trainer().fit(resumed, epochs, checkpoint, identity=identity)
    assert all(torch.equal(value, resumed.state_dict()[name]) for name, value in before.items())


def shuffled(generator: torch.Generator | None) -> dict[str, DataLoader]:
    """:func:`loaders` whose train loader shuffles, with ``generator`` (None: torch's global one)."""
    data = loaders()
    return {**data, "train": DataLoader(data["train"].dataset, batch_size=8, shuffle=True, generator=generator)}


@pytest.mark.parametrize(("before", "after", "shown"), [
    (None, torch.Generator().manual_seed(0), "had no generator .*this run's has a generator of a 5056-byte state"),
    (torch.Generator().manual_seed(0), None, "had a generator of a 5056-byte state, this run's has no generator")],
    ids=["generator added", "generator dropped"])
def test_resume_with_another_kind_of_loader_generator_is_refused(tmp_path, before, after, shown):
    """The train loader's generator draws the training order: a checkpoint without one resumed by a loader with
    one failed in torch after loading the model ("RNG state must be a torch.ByteTensor"), and the other way round
    the run went on in another order than the one that wrote it, silently (a helper's find). A generator of the
    same kind resumes, whatever its seed: the checkpoint's state replaces it."""
    checkpoint = tmp_path / "fit.pt"
    Trainer(shuffled(before), progress=False).fit(model(), 2, checkpoint)
    resumed = model()
    with pytest.raises(CheckpointRefusedError, match=rf"{re.escape(str(checkpoint))}: loader_rng: .*{shown}"):
        Trainer(shuffled(after), progress=False).fit(resumed, 2, checkpoint)
    assert all(torch.equal(value, resumed.state_dict()[name]) for name, value in weights(model()).items())
    history = Trainer(shuffled(torch.Generator().manual_seed(1)), progress=False).fit(model(), 3, tmp_path / "g.pt")
    assert Trainer(shuffled(torch.Generator()), progress=False).fit(model(), 3, tmp_path / "g.pt") == history


# Finding 2: damaged or foreign checkpoints give a ValueError naming the file and change nothing.

def _truncated(path: Path) -> None:
    trainer().fit(model(), 1, path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _bare_state_dict(path: Path) -> None:
    torch.save(model().state_dict(), path)


def _without_optimizer(path: Path) -> None:
    torch.save({"model": model().state_dict()}, path)


@pytest.mark.parametrize("damage", [
    _truncated, lambda path: path.write_bytes(b""), lambda path: path.write_bytes(b"not a checkpoint\n" * 10),
    _bare_state_dict, _without_optimizer, lambda path: torch.save([1, 2], path), lambda path: path.mkdir()],
    ids=["truncated", "empty", "garbage", "bare state dict", "no optimizer", "a list", "a folder"])
def test_unreadable_checkpoints_are_named_and_change_nothing(tmp_path, damage):
    checkpoint = tmp_path / "fit.pt"
    damage(checkpoint)
    resumed = model()
    with torch.no_grad():
        resumed[0].weight.add_(1.0)
    before = weights(resumed)
    with pytest.raises(ValueError, match=re.escape(str(checkpoint))) as error:
        trainer().fit(resumed, 1, checkpoint)
    assert "delete it to start over" in str(error.value)
    assert "weights_only" not in shown(error.value)  # torch's advice to unpickle code is not passed on
    assert all(torch.equal(value, resumed.state_dict()[name]) for name, value in before.items())


def test_load_checkpoint_names_the_file_and_keeps_missing_files_apart(tmp_path):
    (tmp_path / "garbage.pt").write_bytes(b"\x80\x02garbage")
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "garbage.pt"))):
        load_checkpoint(tmp_path / "garbage.pt")
    save_checkpoint(tmp_path / "state.pt", {"history": []})
    with pytest.raises(ValueError, match="no model"):
        load_checkpoint(tmp_path / "state.pt", required=("history", "model"))
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "missing.pt")


@pytest.mark.parametrize("other", [
    lambda: nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 3)),  # the first layer alone would load
    lambda: nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3)),
    lambda: nn.Sequential(nn.Linear(5, 3))],  # the same tensors in number, so the optimizer state would load
    ids=["one more layer", "other widths", "other shapes"])
def test_checkpoint_of_another_model_is_refused_before_loading_anything(tmp_path, other):
    checkpoint = tmp_path / "fit.pt"
    trainer().fit(model(), 1, checkpoint)
    resumed = other()
    before = weights(resumed)
    with pytest.raises(CheckpointRefusedError, match=rf"{re.escape(str(checkpoint))}: written for another model"):
        trainer().fit(resumed, 1, checkpoint)
    assert all(torch.equal(value, resumed.state_dict()[name]) for name, value in before.items())


def test_checkpoint_whose_optimizer_state_does_not_fit_is_refused_before_loading_anything(tmp_path):
    checkpoint = tmp_path / "fit.pt"
    trainer().fit(model(), 1, checkpoint)
    resumed = model()
    resumed[0].bias.requires_grad_(False)  # the same model, but the optimizer now has one parameter, not two
    before = weights(resumed)
    with pytest.raises(CheckpointRefusedError, match=rf"{re.escape(str(checkpoint))}: its optimizer state does not "
                                                     "fit"):
        trainer().fit(resumed, 1, checkpoint)
    assert all(torch.equal(value, resumed.state_dict()[name]) for name, value in before.items())


# Finding 3: deterministic_algorithms puts CUBLAS_WORKSPACE_CONFIG back.

@pytest.mark.parametrize("previous", [None, ":16:8"])
def test_deterministic_algorithms_restores_the_cublas_workspace(monkeypatch, previous):
    if previous is None:
        monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    else:
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", previous)
    with deterministic_algorithms():
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == (previous or CUBLAS_WORKSPACE_CONFIG)
    assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") == previous
    with pytest.raises(KeyboardInterrupt), deterministic_algorithms():
        raise KeyboardInterrupt
    assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") == previous


# Finding 4: checkpoints stream to disk, atomically.

def test_save_checkpoint_streams_to_disk_and_stays_atomic(tmp_path):
    path = tmp_path / "state.pt"
    tensor = torch.arange(2_000_000, dtype=torch.float32)  # 8 MB
    tracemalloc.start()
    try:
        save_checkpoint(path, {"tensor": tensor})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < tensor.nbytes // 4  # no copy of the serialised checkpoint in Python memory
    assert torch.equal(load_checkpoint(path)["tensor"], tensor)
    before = path.read_bytes()
    with pytest.raises((AttributeError, pickle.PicklingError)):  # a lambda, by Python version
        save_checkpoint(path, {"tensor": tensor, "code": lambda: None})
    assert path.read_bytes() == before and no_leftovers(tmp_path)


# Finding 5: evaluate and the loss setting.

@pytest.mark.parametrize(("loss", "targets"), [("mse", torch.empty(0, 3)),
                                               ("cross_entropy", torch.empty(0, dtype=torch.long))])
def test_evaluate_refuses_an_empty_split(loss, targets):
    empty = DataLoader(TensorDataset(torch.empty(0, 4), targets), batch_size=8)
    with pytest.raises(ValueError, match="'holdout'"):
        Trainer({"holdout": empty}, loss=loss, progress=False).evaluate(model(), "holdout")


@pytest.mark.parametrize("samples", [0, 5])  # 5 samples with drop_last and batches of 8: no batch either
def test_fit_refuses_a_training_loader_without_batches_before_changing_anything(tmp_path, samples):
    """It used to train nothing and report a loss of 0 for every epoch."""
    data = TensorDataset(torch.randn(samples, 4), torch.zeros(samples, dtype=torch.long))
    net = model().eval()
    before = weights(net)
    with pytest.raises(ValueError, match="'train' loader yielded no batch"):
        Trainer({"train": DataLoader(data, batch_size=8, drop_last=True), "val": loaders()["val"]},
                progress=False).fit(net, 2, tmp_path / "fit.pt")
    assert all(torch.equal(value, before[name]) for name, value in net.state_dict().items())
    assert not net.training and not (tmp_path / "fit.pt").exists()


def test_evaluate_puts_every_module_back_in_its_mode():
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 3))
    net.train()
    net[1].eval()  # e.g. frozen batch-norm statistics
    before = [module.training for module in net.modules()]
    first = trainer().evaluate(net)
    assert [module.training for module in net.modules()] == before
    assert trainer().evaluate(net) == first  # evaluated in eval mode: no dropout, no statistics updated
    net.eval()
    trainer().evaluate(net)
    assert not any(module.training for module in net.modules())


def interrupt() -> None:
    raise KeyboardInterrupt


@pytest.mark.parametrize(("labels", "loss", "after_step", "raised"), [
    ([0, 1, 2, 1, 0, 7, 2, 1], "cross_entropy", None, ValueError),  # the second batch's label: after one step
    ([0, 1, 2, 1, 0, 1, 2, 1], "mse", None, ValueError),  # (N, 3) outputs against (N,) targets
    ([], "cross_entropy", None, ValueError),  # no batch
    ([0, 1, 2, 1, 0, 1, 2, 1], "cross_entropy", interrupt, KeyboardInterrupt),  # Ctrl-C after the first step
])
@pytest.mark.parametrize("mixed", [True, False])
def test_an_epoch_that_raises_puts_every_module_back_in_its_mode(labels, loss, after_step, raised, mixed):
    """train_epoch left the whole model in train mode where it raised partway: a caller that caught the error and
    went on evaluating an eval-mode model got batch statistics and dropout. The modes come back as evaluate's do."""
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 3))
    net.train()
    net[1].eval()  # e.g. frozen batch-norm statistics
    if not mixed:
        net.eval()
    before = [module.training for module in net.modules()]
    targets = torch.tensor(labels, dtype=torch.long)
    data = DataLoader(TensorDataset(torch.randn(len(targets), 4), targets), batch_size=4)
    with pytest.raises(raised):
        Trainer({"train": data}, loss=loss, progress=False).train_epoch(
            net, torch.optim.SGD(net.parameters(), lr=0.1), after_step)
    assert [module.training for module in net.modules()] == before
    trainer().train_epoch(net, torch.optim.SGD(net.parameters(), lr=0.1))  # a whole epoch ends in train mode
    assert all(module.training for module in net.modules())


def test_evaluate_mse_is_per_target_element_with_uneven_batches():
    inputs = torch.randn(13, 4)
    targets = torch.randn(13, 3)
    net = model()
    metrics = Trainer({"val": DataLoader(TensorDataset(inputs, targets), batch_size=5)}, loss="mse",
                      progress=False).evaluate(net)
    with torch.no_grad():
        assert metrics["mse"] == pytest.approx(float(nn.functional.mse_loss(net(inputs), targets)), rel=1e-5)


def test_unknown_loss_is_refused_at_construction():
    with pytest.raises(ValueError, match=r"loss 'l1'.*cross_entropy, mse"):
        Trainer(loaders(), loss="l1")


# Finding 6: atomic writes through symlinks and under long names.

def test_atomic_write_through_a_symlink_replaces_the_target_and_keeps_the_link(tmp_path):
    (tmp_path / "data").mkdir()
    target = tmp_path / "data" / "real.txt"
    target.write_text("old")
    link = tmp_path / "link.txt"
    link.symlink_to(Path("data") / "real.txt")  # relative, as `ln -s` makes them
    chained = tmp_path / "chained.txt"
    chained.symlink_to(link.name)
    assert atomic_write_text(link, "new") == link
    assert link.is_symlink() and target.read_text() == "new"
    atomic_write_text(chained, "newer")
    assert chained.is_symlink() and link.is_symlink() and target.read_text() == "newer"
    assert no_leftovers(tmp_path) and no_leftovers(tmp_path / "data")
    dangling = tmp_path / "dangling.txt"
    dangling.symlink_to(tmp_path / "data" / "created.txt")
    atomic_write_text(dangling, "created")
    assert dangling.is_symlink() and (tmp_path / "data" / "created.txt").read_text() == "created"


@pytest.mark.parametrize("name", ["n" * 250, "n" * 255, "é" * 127])  # 250, 255 and 254 bytes
def test_atomic_write_accepts_names_of_up_to_255_bytes(tmp_path, name):
    assert atomic_write_text(tmp_path / name, "x").read_text() == "x"
    assert no_leftovers(tmp_path)


def test_a_write_killed_before_its_rename_leaves_a_temporary_file_that_remove_stale_temporaries_finds(tmp_path):
    """SIGKILL (or a power loss) between writing and renaming skips atomic_write's cleanup; the file stayed for good,
    one more per kill. The resumed job now removes such files from its own folder; other files stay."""
    import subprocess
    import sys

    from unsparse.atomic import remove_stale_temporaries

    (tmp_path / "prune").mkdir()
    code = ("import os, signal, sys; from unsparse.atomic import atomic_write; "
            "atomic_write(sys.argv[1], lambda file: (file.write(b'x' * 4096), os.kill(os.getpid(), signal.SIGKILL)))")
    for name in ("dense.pt", "prune/evolutionary.pt"):
        done = subprocess.run([sys.executable, "-c", code, str(tmp_path / name)], capture_output=True, timeout=60)
        assert done.returncode == -9
    left = sorted(path.relative_to(tmp_path) for path in tmp_path.rglob("*") if path.is_file())
    assert len(left) == 2 and all(path.name.endswith(".tmp") for path in left)
    (tmp_path / "notes").mkdir()
    keep = [tmp_path / "notes.tmp", tmp_path / ".notes.tmp", tmp_path / "prune" / ".log.abc.tmp",
            tmp_path / "dense.pt", tmp_path / ".todo.20241124.tmp", tmp_path / "notes" / ".dense.pt.abcdefgh.tmp",
            tmp_path / "prune" / ".prune_log.jsonl.abcdefgh.tmp"]  # not targets, or in another folder
    for path in keep:
        path.write_text("kept")
    (tmp_path / ".dense.pt.linkedto.tmp").symlink_to(keep[0])
    removed = remove_stale_temporaries(tmp_path, ["dense.pt", "prune/*.pt"])
    assert [path.relative_to(tmp_path) for path in removed] == left
    assert sorted(path for path in tmp_path.rglob("*") if path.is_file() and not path.is_symlink()) == sorted(keep)


def test_fit_seconds_count_the_checkpoint_writes(tmp_path, monkeypatch):
    """Pruning wall time comes from fit's elapsed_s; it counted training and evaluation only, so slow checkpoint
    writes (fsync of a large model) went missing from it. On a clock that only the writes move (0.2 s each), the
    figures are exact."""
    from types import SimpleNamespace

    import unsparse.train as train_module
    from unsparse.train import fit_seconds

    clock = SimpleNamespace(seconds=0.0)
    monkeypatch.setattr(train_module, "time", SimpleNamespace(perf_counter=lambda: clock.seconds))
    original = train_module.save_checkpoint

    def slow(path, state):
        clock.seconds += 0.2
        original(path, state)

    monkeypatch.setattr(train_module, "save_checkpoint", slow)
    history = trainer().fit(model(), 3, tmp_path / "fit.pt")
    assert [entry["elapsed_s"] for entry in history] == pytest.approx([0.0, 0.2, 0.4])
    assert fit_seconds(history) == pytest.approx(2 * 0.2)  # the writes after epochs 1 and 2; the last follows its entry


def test_a_resume_removes_a_temporary_whatever_its_time(tmp_path):
    """Under a job's lock every leftover temporary is stale, also one whose time lies ahead (clock skew)."""
    from unsparse.atomic import remove_stale_temporaries

    leftover = tmp_path / ".x.pt.abcd1234.tmp"
    leftover.write_bytes(b"partial")
    ahead = leftover.stat().st_mtime + 5
    os.utime(leftover, (ahead, ahead))
    assert remove_stale_temporaries(tmp_path, ["x.pt"], older_than_s=60) == []
    assert remove_stale_temporaries(tmp_path, ["x.pt"]) == [leftover] and not leftover.exists()
