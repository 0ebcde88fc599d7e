"""Files the command line reads that are missing or damaged are refused like a bad setting: one line
``unsparse: refused: ...`` naming the setting or the file, exit status 2, no traceback (the command line runs
in-process here)."""

from __future__ import annotations

import re
import sys

import pytest

from unsparse.cli import main


def refusal(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *words: str) -> tuple[int, str]:
    """Run ``unsparse *words`` and return its exit status and what it printed to stderr (it must exit)."""
    monkeypatch.setattr(sys, "argv", ["unsparse", *words])
    with pytest.raises(SystemExit) as exited:
        main()
    return exited.value.code, capsys.readouterr().err


def assert_one_line(code: int, err: str, pattern: str, status: int = 2) -> None:
    """``err`` is one line that ``pattern`` matches whole, and the exit status ``status``."""
    assert code == status and "Traceback" not in err, err
    assert len(err.splitlines()) == 1 and re.fullmatch(pattern, err.strip()), err


@pytest.mark.parametrize(("source", "reason"), [("missing.txt", "No such file or directory"), (".", "Is a directory")])
def test_a_time_series_source_that_cannot_be_read_is_refused_naming_it(monkeypatch, capsys, tmp_path, source,
                                                                       reason):
    """Hydra's wrapping of the OSError printed three lines naming neither ``data.source`` nor the file."""
    path = tmp_path / source
    code, err = refusal(monkeypatch, capsys, "experiment=smoke", "data=co2", "model=autoencoder1d", "device=cpu",
                        f"data.source={path}", f"hydra.run.dir={tmp_path / 'job'}")
    assert_one_line(code, err, rf"unsparse: refused: data\.source: {re.escape(str(path))}: cannot be read "
                               rf"\({reason}\)")


def test_a_fashion_mnist_root_without_its_files_is_still_refused_naming_it(monkeypatch, capsys, tmp_path):
    code, err = refusal(monkeypatch, capsys, "experiment=smoke", "data=fashion_mnist", "device=cpu",
                        f"data.root={tmp_path / 'missing'}", f"hydra.run.dir={tmp_path / 'job'}")
    assert_one_line(code, err, rf"unsparse: refused: Fashion-MNIST file {re.escape(str(tmp_path))}/missing/\S+ not "
                               r"found\. .*data\.root.*")
