"""CUDA training under ``deterministic_algorithms``: the same seed gives the same weights bit for bit, every model
family trains without an operation lacking a deterministic implementation, and an evolutionary run resumed after a
crash equals the uninterrupted one (the CPU tests' exact-resume property, on the GPU)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from unsparse.data import digits
from unsparse.models import create_model
from unsparse.prune import evolutionary as evo
from unsparse.prune.evolutionary import EvolutionaryPruner
from unsparse.train import Trainer, deterministic_algorithms

DEVICE = torch.device("cuda")


def digit_trainer() -> Trainer:
    return Trainer(digits(limit_train=256).loaders(64, seed=1), device=DEVICE, lr=0.05, progress=False)


def series_trainer() -> Trainer:
    """Random (N, 1, 64) windows as their own targets: the autoencoder's operations (Conv1d, BatchNorm1d,
    Upsample), not its metric, are under test."""
    data = torch.Generator().manual_seed(5)
    windows = torch.randn(192, 1, 64, generator=data)
    loaders = {split: DataLoader(TensorDataset(part, part), batch_size=32, shuffle=split == "train",
                                 generator=torch.Generator().manual_seed(6))
               for split, part in (("train", windows[:128]), ("val", windows[128:160]), ("test", windows[160:]))}
    return Trainer(loaders, device=DEVICE, loss="mse", lr=0.01, progress=False)


def trained(name: str, width: int, checkpoint) -> dict[str, torch.Tensor]:
    """Model ``name`` trained from seed 2 for two epochs on CUDA (a fresh ``checkpoint`` path: a finished one would
    only be loaded); its state on the CPU."""
    torch.manual_seed(2)
    model = create_model(name, width=width)
    trainer = series_trainer() if name == "autoencoder1d" else digit_trainer()
    trainer.fit(model, 2, checkpoint)
    return {key: value.cpu() for key, value in model.state_dict().items()}


@pytest.mark.parametrize(("name", "width"), [("vgg_small", 8), ("resnet_small", 8), ("autoencoder1d", 8)])
def test_cuda_training_repeats_bit_for_bit(name: str, width: int, tmp_path) -> None:
    with deterministic_algorithms():
        first, second = trained(name, width, tmp_path / "first.pt"), trained(name, width, tmp_path / "second.pt")
    assert torch.are_deterministic_algorithms_enabled() is False  # restored on exit
    assert first.keys() == second.keys()
    assert all(torch.equal(first[key], second[key]) for key in first), name


def test_cuda_evolutionary_resume_equals_uninterrupted_run(tmp_path, crash_at_save) -> None:
    settings = {"target": 0.8, "iterations": 5, "batches_per_iteration": 2, "unit_step": 0.2, "fine_tune_epochs": 1,
                "seed": 3, "epsilon": 0.0}

    def run(workdir) -> tuple[dict[str, torch.Tensor], list]:
        torch.manual_seed(4)
        model = create_model("resnet_small", width=8)
        result = EvolutionaryPruner(**settings).run(model, digit_trainer(), workdir)
        return {key: value.cpu() for key, value in model.state_dict().items()}, result.history

    with deterministic_algorithms():
        reference_state, reference_history = run(tmp_path / "a")
        with crash_at_save(evo, 3):
            run(tmp_path / "b")
        resumed_state, resumed_history = run(tmp_path / "b")
    assert resumed_history == reference_history
    assert all(torch.equal(reference_state[key], resumed_state[key]) for key in reference_state)


def test_cuda_training_with_dropout_resumes_exactly_after_ctrl_c(tmp_path, interrupt_at_epoch) -> None:
    """Dropout on the GPU draws from the CUDA generator, so a resumed run must get it back from the checkpoint: the
    process's seed alone would give the second epoch the first epoch's dropout masks."""
    def trained(checkpoint, interrupt_in_epoch: int | None = None) -> dict[str, torch.Tensor]:
        torch.manual_seed(7)
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 64), torch.nn.ReLU(),
                                    torch.nn.Dropout(0.5), torch.nn.Linear(64, 10))
        trainer = digit_trainer()
        if interrupt_in_epoch is not None:
            interrupt_at_epoch(trainer, interrupt_in_epoch)
        trainer.fit(model, 3, checkpoint)
        return {key: value.cpu() for key, value in model.state_dict().items()}

    with deterministic_algorithms():
        straight = trained(tmp_path / "a.pt")
        with pytest.raises(KeyboardInterrupt):
            trained(tmp_path / "b.pt", interrupt_in_epoch=2)
        resumed = trained(tmp_path / "b.pt")
    assert all(torch.equal(straight[key], resumed[key]) for key in straight)
