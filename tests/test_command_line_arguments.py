"""The argparse ``type`` checks of :mod:`unsparse.settings` that scripts share: a bad value stops the command line
with argparse's message naming the option, before any work."""

from __future__ import annotations

import argparse
import functools
import json

import pytest

from unsparse.settings import generated_setting_argument, positive_integer_argument, sparsity_argument


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="script", exit_on_error=False)
    parser.add_argument("--runs", type=positive_integer_argument, default=5)
    parser.add_argument("--sparsity", type=sparsity_argument, default=0.9)
    parser.add_argument("--settings", nargs="+", type=functools.partial(generated_setting_argument,
                                                                        keys=("rows", "programs", "min_blocks")))
    return parser.parse_args(argv)


@pytest.mark.parametrize("text", ["1", "128", " 7"])
def test_positive_integers_are_read(text: str) -> None:
    assert parse(["--runs", text]).runs == int(text)


@pytest.mark.parametrize("text", ["0", "-3", "2.5", "ten", "", "True"])
def test_a_count_below_one_or_not_an_integer_names_the_option(text: str) -> None:
    with pytest.raises(argparse.ArgumentError, match=f"argument --runs: expected an integer >= 1, got {text!r}"):
        parse(["--runs", text])


@pytest.mark.parametrize(("text", "valid"), [("0", True), ("0.95", True), ("1", False), ("-0.1", False),
                                             ("nan", False), ("x", False)])
def test_a_sparsity_must_lie_in_zero_to_one(text: str, valid: bool) -> None:
    if valid:
        assert parse(["--sparsity", text]).sparsity == float(text)
    else:
        with pytest.raises(argparse.ArgumentError, match="argument --sparsity: expected a sparsity in"):
            parse(["--sparsity", text])


@pytest.mark.parametrize(("text", "accepted"), [
    ('{"rows": 32}', True), ('{"rows": 32, "programs": 4, "min_blocks": 0}', True),
    ('{"programs": 4}', False), ('{"rows": 0}', False), ('{"rows": 32, "min_blocks": -1}', False),
    ('{"rows": 32, "streams": 8}', False), ('{"rows": 32.0}', False), ('{"rows": true}', False), ("[32]", False),
    ("rows=32", False)])
def test_a_generated_setting_is_a_json_object_of_the_keys_given_with_rows(text: str, accepted: bool) -> None:
    if accepted:
        assert parse(["--settings", text]).settings[0] == json.loads(text)
    else:
        with pytest.raises(argparse.ArgumentError, match="argument --settings: setting"):
            parse(["--settings", text])


@pytest.mark.parametrize("text", ["7" * 100_000, "[" * 100_000, '{"rows": "' + "7" * 100_000 + '"}'])
def test_a_huge_setting_is_refused_with_a_short_message(text: str) -> None:
    """Also the JSON that Python's parser refuses with other errors than a decode error: an integer beyond its 4300
    digits, and nesting beyond its recursion limit."""
    with pytest.raises(argparse.ArgumentError, match="argument --settings: setting") as refused:
        parse(["--settings", text])
    assert len(str(refused.value)) < 500
