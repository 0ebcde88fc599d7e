"""A job's output folder and identity (:mod:`unsparse.job`): the claim that binds a folder to one job
(``job.json``), the lock that lets one job at a time run there, and the commit a job names."""

from __future__ import annotations

import re

import pytest

from unsparse import create_model
from unsparse.data import digits
from unsparse.pipeline import TrainSettings
from unsparse.prune import MagnitudePruner


def test_an_output_folder_binds_to_its_job_only_once_it_holds_checkpoints(tmp_path, caplog):
    """A failed first run (no checkpoint yet) leaves the folder free; once checkpoints exist, the same job resumes
    (evaluation batch size and determinism may change), and another one is refused before any checkpoint is
    read; checkpoints without the file (an older version's folder) are resumed with a warning, the file left to
    the caller to write once they have loaded."""
    import logging

    from unsparse.job import JOB_FILE, claim_output_folder, job_identity

    splits = digits()

    def identity(**train):
        settings = TrainSettings(**{"epochs": 1, "batch_size": 64, **train})
        return job_identity(splits, create_model("vgg_small", width=4), MagnitudePruner(0.9), settings, 0)

    claim_output_folder(tmp_path, identity(batch_size=32))  # say it then failed before its first checkpoint
    claim_output_folder(tmp_path, identity())
    (tmp_path / "dense.pt").write_bytes(b"not read")  # a checkpoint: the folder is bound now
    claim_output_folder(tmp_path, identity(lr=0.05, eval_batch_size=10, deterministic=True))
    other_subset = job_identity(digits(seed=1), create_model("vgg_small", width=4), MagnitudePruner(0.9),
                                TrainSettings(epochs=1, batch_size=64), 0)
    with pytest.raises(ValueError, match=r"data.train: '\d+:\w+' there, '\d+:\w+' here"):
        claim_output_folder(tmp_path, other_subset)
    with pytest.raises(ValueError, match=r"job.json: written by a run with other settings \(train.batch_size: 64 "
                                         r"there, 32 here\)"):
        claim_output_folder(tmp_path, identity(batch_size=32))
    (tmp_path / JOB_FILE).unlink()
    with caplog.at_level(logging.WARNING, logger="unsparse.job"):
        assert claim_output_folder(tmp_path, identity())  # the caller writes the file once the checkpoints loaded
    assert "no job.json" in caplog.text and not (tmp_path / JOB_FILE).exists()


def test_a_digits_folder_with_limit_test_resumes_and_one_of_the_old_validation_split_is_refused(tmp_path):
    """A helper's report had digits folders made with limit_test refused on resume. A resume builds the splits
    again, equal to the first run's; the folders refused were made before limit_test limited digits' validation
    split too (c005f5b: 180 images then, the first 60 now). Their checkpoints were pruned and fine-tuned against
    that other validation split, so the refusal, naming data.val, is right."""
    import dataclasses

    from unsparse.job import JOB_FILE, claim_output_folder, job_identity

    def identity(splits) -> str:
        return job_identity(splits, create_model("vgg_small", width=4), MagnitudePruner(0.9), TrainSettings(), 0)

    claim_output_folder(tmp_path, identity(digits(limit_test=60)))
    (tmp_path / "dense.pt").write_bytes(b"not read")  # a checkpoint: the folder is bound now
    claim_output_folder(tmp_path, identity(digits(limit_test=60)))  # the resume
    limited = digits(limit_test=60)
    (tmp_path / JOB_FILE).write_text(identity(dataclasses.replace(limited, val=digits().val)) + "\n")
    with pytest.raises(ValueError, match=r"data.val: '180:\w+' there, '60:\w+' here"):
        claim_output_folder(tmp_path, identity(limited))


def test_git_commit_prefers_the_environment(monkeypatch):
    from unsparse.job import git_commit

    monkeypatch.setenv("UNSPARSE_COMMIT", " 0123456789abcdef ")
    assert git_commit() == "0123456789abcdef"
    monkeypatch.setenv("UNSPARSE_COMMIT", "")
    assert git_commit() != "0123456789abcdef"


def test_every_result_file_says_whether_its_commit_names_the_code_that_ran(monkeypatch):
    """``environment()`` records ``tree_modified``: unknown (None) where ``$UNSPARSE_COMMIT`` names the commit or the
    commit recorded is not HEAD, else git's answer, True as soon as a tracked file differs from HEAD (a lent GPU
    machine's stale checkout)."""
    from unsparse import job
    from unsparse.runtime import bench

    monkeypatch.setenv("UNSPARSE_COMMIT", "0123456789abcdef")
    assert bench.environment(job.git_commit())["tree_modified"] is None
    monkeypatch.setenv("UNSPARSE_COMMIT", "")
    monkeypatch.setattr(bench, "git_commit", lambda: "abc")
    outputs = iter([" M unsparse/runtime/bench.py\n", ""])
    monkeypatch.setattr(job.subprocess, "run", lambda *a, **k: type("Done", (), {"stdout": next(outputs)})())
    assert bench.environment("abc")["tree_modified"] is True
    assert bench.environment("abc")["tree_modified"] is False
    assert bench.environment("def")["tree_modified"] is None  # git cannot compare the tree with another commit


def test_the_folder_lock_holds_across_processes_and_ends_with_a_killed_one(tmp_path):
    import subprocess
    import sys

    from unsparse.job import only_job_in

    code = ("import sys, time; from pathlib import Path; from unsparse.job import only_job_in\n"
            "with only_job_in(Path(sys.argv[1])):\n    print('locked', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ValueError, match="another running job"), only_job_in(tmp_path):
            pass
    finally:
        holder.kill()  # SIGKILL: no cleanup runs in the holder
        holder.wait(timeout=30)
    with only_job_in(tmp_path):
        pass


@pytest.mark.parametrize(("content", "reason"), [
    ("half", r"not JSON: .*"),  # the first half of the job's own file: a full disk, a copy that stopped
    (b"\xff\xfe{}", r"not JSON: .*"),
    ("[1, 2]\n", r"holds a list, not a JSON object"),
    (None, r"cannot be read: Is a directory"),
], ids=["cut in half", "not UTF-8", "a list", "a folder"])
def test_a_job_file_that_is_no_job_record_is_refused_as_damaged(tmp_path, content, reason):
    """A job.json cut in half was refused as "written by a run with other settings", its text against this job's:
    the user was sent to their settings instead of to the file."""
    from unsparse.job import JOB_FILE, claim_output_folder, job_identity

    identity = job_identity(digits(limit_train=100), create_model("vgg_small", width=4), MagnitudePruner(0.9),
                            TrainSettings(), 0)
    path = tmp_path / JOB_FILE
    if content is None:
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(identity[:len(identity) // 2] if content == "half" else content)
    (tmp_path / "dense.pt").write_bytes(b"not read")  # a checkpoint: the folder is bound
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: not a job record \({reason}\); it is damaged or "
                                         r"not one this program wrote: delete it to resume the folder's checkpoints "
                                         r"as this job, unchecked, or start in another folder$"):
        claim_output_folder(tmp_path, identity)
