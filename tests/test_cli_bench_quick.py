"""``unsparse bench quick=true``: the quick settings fill in what the command line leaves, and ``quick`` is a bool;
a setting that ``run_bench`` does not take is refused by name."""

from __future__ import annotations

import sys

import pytest

import unsparse.runtime.bench
from unsparse.cli import main
from unsparse.runtime.bench import QUICK


def bench_settings(monkeypatch, tmp_path, *overrides: str) -> dict:
    """The settings ``unsparse bench`` hands to ``run_bench`` (replaced: this machine has no GPU)."""
    received = {}

    def fake_run_bench(out_dir, commit=None, record=None, **settings):
        received.update(settings)

    monkeypatch.setattr(unsparse.runtime.bench, "run_bench", fake_run_bench)
    monkeypatch.setattr(sys, "argv", ["unsparse", "bench", *overrides, f"hydra.run.dir={tmp_path}"])
    main()
    return received


def test_quick_fills_in_its_settings(monkeypatch, tmp_path):
    settings = bench_settings(monkeypatch, tmp_path, "quick=true")
    assert {key: settings[key] for key in QUICK} == QUICK


@pytest.mark.parametrize(("override", "key", "value"), [
    ("models=[alexnet]", "models", ["alexnet"]),
    ("precisions=[fp16]", "precisions", ["fp16"]),
    ("batches=[1]", "batches", [1]),
    ("++end_to_end=[]", "end_to_end", []),
])
def test_a_setting_given_on_the_command_line_wins_over_quick(monkeypatch, tmp_path, override, key, value):
    """``quick=true models=[alexnet]`` timed all four models: quick's values replaced the command line's."""
    settings = bench_settings(monkeypatch, tmp_path, "quick=true", override)
    assert settings[key] == value
    assert all(settings[other] == QUICK[other] for other in QUICK if other != key)


def test_quick_removed_is_quick_off(monkeypatch, tmp_path):
    """``~quick`` crashed with a KeyError under Hydra's traceback: the setting was taken as always there. Removed, it
    is off, as another removed setting leaves ``run_bench``'s default."""
    off = bench_settings(monkeypatch, tmp_path / "off", "quick=false")
    assert bench_settings(monkeypatch, tmp_path, "~quick") == off


def test_a_quick_that_is_no_bool_is_refused_in_one_line(monkeypatch, tmp_path, capsys):
    """``quick=maybe`` ran the quick benchmark: a non-empty string is true to ``if``."""
    with pytest.raises(SystemExit) as done:
        bench_settings(monkeypatch, tmp_path, "quick=maybe")
    assert done.value.code == 2
    assert "unsparse bench: refused: quick: expected a bool, got 'maybe'" in capsys.readouterr().err


@pytest.mark.parametrize(("override", "unknown"), [("+foo=1", "['foo']"), ("+commit=abc", "['commit']")])
def test_a_setting_run_bench_does_not_take_is_refused_in_one_line(monkeypatch, tmp_path, capsys, override, unknown):
    """``+foo=1`` reached ``run_bench`` as a keyword argument: its TypeError under Hydra's traceback, exit status 1,
    before the CUDA check (``+commit``, which the command line passes itself, as "multiple values")."""
    with pytest.raises(SystemExit) as done:
        bench_settings(monkeypatch, tmp_path, override)
    err = capsys.readouterr().err
    assert done.value.code == 2 and "Traceback" not in err and len(err.splitlines()) == 1
    assert err.startswith(f"unsparse bench: refused: unknown setting(s) {unknown}; known: quick, models, sparsities, ")
