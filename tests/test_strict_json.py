"""Strict JSON as the package writes and reads it: an infinity written on request reads back as that infinity."""

from __future__ import annotations

import json
import math

import pytest

from unsparse.strict_json import INFINITY_TEXT, dumps_strict, loads_strict, nan_if_none


def test_infinities_written_on_request_read_back_as_infinities() -> None:
    """A diverged reconstruction's MSE is infinite; written as null it read back as NaN (``nan_if_none``), which says
    "not measured" and sorts nowhere. Kept, it is the number ``1e999`` (strict JSON: no ``Infinity`` literal) that
    Python's ``json`` reads as infinity; NaN stays null, strings that spell an infinity stay strings."""
    data = {"mse": math.inf, "history": [{"relative_change": -math.inf}], "nan": math.nan, "pair": (1.5, math.inf),
            "texts": ["1e999", "Infinity", "inf"], "count": 3}
    text = dumps_strict(data, infinities=True, indent=2)
    assert f'"mse": {INFINITY_TEXT}' in text and f'"relative_change": -{INFINITY_TEXT}' in text
    assert "Infinity," not in text and "NaN" not in text
    back = loads_strict(text)
    assert back == {"mse": math.inf, "history": [{"relative_change": -math.inf}], "nan": None,
                    "pair": [1.5, math.inf], "texts": ["1e999", "Infinity", "inf"], "count": 3}
    assert nan_if_none(back["mse"]) == math.inf and math.isnan(nan_if_none(back["nan"]))
    assert json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} written"))["mse"] == math.inf
    assert math.isinf(data["mse"]) and isinstance(data["pair"], tuple)  # the input is not modified


def test_without_the_request_infinities_are_still_null() -> None:
    assert loads_strict(dumps_strict({"a": [math.inf, -math.inf, math.nan]})) == {"a": [None, None, None]}


def test_a_non_finite_key_is_refused_either_way() -> None:
    for infinities in (False, True):
        with pytest.raises(ValueError):
            dumps_strict({math.inf: 1}, infinities=infinities)
