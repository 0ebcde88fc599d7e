"""Strict JSON: read for files taken as untrusted input (sparse model files, plans, benchmark results), written for
the files the package writes (:func:`dumps_strict`).

Python's ``json`` accepts the literals ``NaN``, ``Infinity`` and ``-Infinity`` and keeps the last of duplicate object
keys; in a file that is checked field by field, either lets two readers see different content (a duplicate layer
entry with other counts, a NaN that compares false everywhere). It also writes those literals, which no JSON
standard has and strict readers (:func:`loads_strict`, browsers, ``jq``) refuse.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from typing import Any


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    counts = Counter(key for key, _ in pairs)  # one pass: a message built with list.count was quadratic in the keys
    if len(counts) != len(pairs):
        raise ValueError(f"duplicate keys {sorted(key for key, count in counts.items() if count > 1)[:10]}")
    return dict(pairs)


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def loads_strict(text: str | bytes, constants: bool = False) -> Any:
    """``json.loads`` that refuses duplicate object keys and, unless ``constants``, ``NaN``/``Infinity`` literals.

    Raises:
        ValueError: naming the duplicate keys (the first ten, sorted) or the literal, or ``json``'s own error (syntax,
            UTF-8, an integer beyond Python's digit limit). RecursionError: nesting deeper than the parser.
    """
    return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=None if constants else _refuse_constant)


def finite_or_none(value: Any) -> Any:
    """``value`` (nested dicts, lists and tuples of JSON values) with every float that is NaN or infinite replaced by
    None, and tuples as lists: what strict JSON can hold. Nothing else changes; ``value`` is not modified."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite_or_none(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_none(item) for item in value]
    return value


def dumps_strict(data: Any, **kwargs: Any) -> str:
    """``json.dumps`` (``kwargs``: its options, e.g. ``indent``) of :func:`finite_or_none` ``(data)``: NaN and
    infinities are written as ``null``, so that :func:`loads_strict` and other strict readers accept the text.

    Raises:
        TypeError: a value JSON cannot hold (e.g. a set), from ``json.dumps``. ValueError: a circular reference, or
            a dict key that is a non-finite float.
    """
    return json.dumps(finite_or_none(data), allow_nan=False, **kwargs)
