"""scripts/prune_select.py: a validation-only grid over evolutionary settings and fine-tuning learning rate."""

from __future__ import annotations

import pytest
import torch

from unsparse.data import Splits
from unsparse.train import Trainer


@pytest.fixture(scope="module")
def selector(load_script):
    return load_script("prune_select")


def test_grid_is_scored_on_validation_only_and_best_takes_the_highest(selector, tmp_path, monkeypatch):
    generator = torch.Generator().manual_seed(0)

    def split(count: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.rand(count, 1, 28, 28, generator=generator), torch.randint(0, 10, (count,), generator=generator)

    splits = Splits(train=split(256), val=split(64), test=split(64), num_classes=10, name="noise")
    seen: list[str] = []
    evaluate = Trainer.evaluate

    def spy(self, model, split_name="val", desc=None):
        seen.append(split_name)
        return evaluate(self, model, split_name, desc)

    monkeypatch.setattr(Trainer, "evaluate", spy)
    budget = {**selector.TABLE.BUDGETS["quick"], "iterations": 4, "batches": 1}
    recorded: list[int] = []
    candidates = selector.select(
        "vgg_small", budget, {"epsilon": [0.015, 0.005]}, [0.01, 0.05],
        lambda: Trainer(splits.loaders(32, seed=0), lr=0.05, progress=False), tmp_path, 0,
        lambda found: recorded.append(len(found)))
    assert [(c["epsilon"], c["fine_tune_lr"]) for c in candidates] == [(0.015, 0.01), (0.015, 0.05),
                                                                       (0.005, 0.01), (0.005, 0.05)]
    assert recorded == [1, 2, 3, 4]
    assert all(0.0 <= c["val_top1"] <= 100.0 and c["iterations"] <= 4 for c in candidates)
    assert seen and "test" not in seen
    assert selector.best([{"val_top1": 80.0, "k": 1}, {"val_top1": 81.0, "k": 2}, {"val_top1": 81.0, "k": 3}])["k"] == 2


def test_page_has_a_column_per_grid_setting(selector):
    meta = {"budget_name": "quick", "budget": {}, "seed": 0, "device_name": "cpu", "commit": "abc1234",
            "grid": {"epsilon": [0.015], "alpha": [0.1, 1.0], "fine_tune_lr": [0.05]}}
    candidates = [{"model": "resnet_small", "epsilon": 0.015, "alpha": alpha, "fine_tune_lr": 0.05, "val_top1": top1,
                   "stalls": 1, "iterations": 40} for alpha, top1 in ((0.1, 91.5), (1.0, 92.25))]
    lines = selector.markdown([{"meta": meta, "candidates": {"resnet_small": candidates}}]).splitlines()
    header = lines.index("| model | epsilon | alpha | fine-tune lr | val top1 | stalls / iterations | chosen |")
    assert lines[header + 1].count("---") == 7
    assert lines[header + 3] == "| resnet_small | 0.015 | 1.0 | 0.05 | 92.25 | 1 / 40 | yes |"


def test_jobs_of_one_selection_join_into_one_table_with_one_choice(selector):
    def job(alpha: float, top1: float, commit: str = "abc1234") -> dict:
        meta = {"budget_name": "quick", "budget": {}, "seed": 0, "device_name": "cpu", "commit": commit,
                "grid": {"alpha": [alpha], "fine_tune_lr": [0.05]}}
        candidate = {"model": "resnet_small", "alpha": alpha, "fine_tune_lr": 0.05, "val_top1": top1, "stalls": 0,
                     "iterations": 30}
        return {"meta": meta, "candidates": {"resnet_small": [candidate]}}

    merged = selector.merge([job(0.1, 91.0), job(10.0, 92.0), job(1.0, 93.0, commit="other")])
    assert len(merged) == 2
    assert merged[0]["meta"]["grid"] == {"alpha": [0.1, 10.0], "fine_tune_lr": [0.05]}
    assert [c["alpha"] for c in merged[0]["candidates"]["resnet_small"]] == [0.1, 10.0]
    lines = selector.markdown([job(0.1, 91.0), job(10.0, 92.0)]).splitlines()
    assert lines.count("| model | alpha | fine-tune lr | val top1 | stalls / iterations | chosen |") == 1
    assert "| resnet_small | 10.0 | 0.05 | 92.00 | 0 / 30 | yes |" in lines
    assert "| resnet_small | 0.1 | 0.05 | 91.00 | 0 / 30 |  |" in lines


def test_a_finished_dense_checkpoint_is_loaded_not_trained_again(selector, tmp_path, monkeypatch):
    generator = torch.Generator().manual_seed(0)
    data = (torch.rand(64, 1, 28, 28, generator=generator), torch.randint(0, 10, (64,), generator=generator))
    splits = Splits(train=data, val=data, test=data, num_classes=10, name="noise")
    budget = {**selector.TABLE.BUDGETS["quick"], "dense_epochs": 1}

    def trainer() -> Trainer:
        return Trainer(splits.loaders(32, seed=0), lr=0.05, progress=False)

    first = selector.train_dense("vgg_small", budget, trainer(), tmp_path, seed=0)
    monkeypatch.setattr(Trainer, "train_epoch", lambda *args, **kwargs: pytest.fail("trained again"))
    again = selector.train_dense("vgg_small", budget, trainer(), tmp_path, seed=1)
    for key, value in first.state_dict().items():
        assert torch.equal(value, again.state_dict()[key]), key
