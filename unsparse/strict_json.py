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
    None, and tuples as lists: what strict JSON can hold. Nothing else changes; ``value`` is not modified.

    Raises:
        ValueError: a container that holds itself (``json``'s "Circular reference detected"; without the check the
            walk recursed until Python's limit and raised RecursionError).
    """
    return _finite_or_none(value, set())


def nan_if_none(value: float | None) -> float:
    """A number read back from a file :func:`dumps_strict` wrote: ``None`` (its ``null``, written for a NaN or an
    infinity) as NaN, so that arithmetic and comparisons on it go on as they would on the value before writing
    (where the sign of an infinity is lost, NaN is what is left)."""
    return math.nan if value is None else value


def _finite_or_none(value: Any, open_containers: set[int]) -> Any:
    """:func:`finite_or_none`; ``open_containers``: the ids of the containers being walked, enclosing ``value``."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if not isinstance(value, dict | list | tuple):
        return value
    if id(value) in open_containers:
        raise ValueError("Circular reference detected")
    open_containers.add(id(value))
    try:
        if isinstance(value, dict):
            return {key: _finite_or_none(item, open_containers) for key, item in value.items()}
        return [_finite_or_none(item, open_containers) for item in value]
    finally:
        open_containers.discard(id(value))


def dumps_strict(data: Any, **kwargs: Any) -> str:
    """``json.dumps`` (``kwargs``: its options, e.g. ``indent``) of :func:`finite_or_none` ``(data)``: NaN and
    infinities are written as ``null``, so that :func:`loads_strict` and other strict readers accept the text.

    Raises:
        TypeError: a value JSON cannot hold (e.g. a set), from ``json.dumps``. ValueError: a circular reference, or
            a dict key that is a non-finite float.
    """
    return json.dumps(finite_or_none(data), allow_nan=False, **kwargs)
