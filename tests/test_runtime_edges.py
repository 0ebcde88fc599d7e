"""Edges of the benchmark's entry point on the CPU (no GPU work runs: each case is refused before it would)."""

from __future__ import annotations

import pytest
import torch

from unsparse.runtime import bench


@pytest.mark.parametrize(("text", "field"), [("{not json", "not a plan file"),
                                             ('{"version": 2, "entries": {}}', "version: expected the integer 1"),
                                             (None, "Is a directory")])
def test_a_bad_plan_file_refuses_the_run_before_its_record_is_written(tmp_path, monkeypatch, text, field) -> None:
    """``run_bench`` wrote the job's record (the command line's config) and then failed on the plan file: the folder
    held a record of a run that did not happen, and the command line printed a traceback. The plan is now read
    before the record is written, and a bad one (``text``; None: a folder in its place) refuses the run naming the
    file and the field."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the refusal comes before any CUDA call
    plan = tmp_path / "plan.json"
    plan.mkdir() if text is None else plan.write_text(text)
    with pytest.raises(bench.BenchRefusedError, match=f"plan_path: .*{field}") as refused:
        bench.run_bench(tmp_path / "out", plan_path=plan, record={".hydra/config.yaml": "models: [vgg16]\n"})
    assert str(plan) in str(refused.value)
    assert not (tmp_path / "out").exists()  # no record, no folder
