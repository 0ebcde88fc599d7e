"""Strict JSON: read for files taken as untrusted input (sparse model files, plans, benchmark results), written for
the files the package writes (:func:`dumps_strict`).

Python's ``json`` accepts the literals ``NaN``, ``Infinity`` and ``-Infinity`` and keeps the last of duplicate object
keys; in a file that is checked field by field, either lets two readers see different content (a duplicate layer
entry with other counts, a NaN that compares false everywhere). It also writes those literals, which no JSON
standard has and strict readers (:func:`loads_strict`, browsers, ``jq``) refuse.

NaN is written as ``null``. An infinity is too, unless the writer asks to keep it (``dumps_strict(...,
infinities=True)``): it is then written as the number :data:`INFINITY_TEXT` (or its negative), which strict readers
accept and which :func:`loads_strict` reads back as the infinity, so that an infinite value (a diverged model's MSE)
does not come back as "not measured".
"""

from __future__ import annotations

import json
import math
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

INFINITY_TEXT = "1e999"
"""How :func:`dumps_strict` writes an infinity it keeps (``-1e999`` for minus infinity): a JSON number beyond float64's
range. Python's ``json`` (hence :func:`loads_strict`) and JavaScript's ``JSON.parse`` read it as infinity; a reader
that clamps numbers to float64's range (``jq``) reads the largest finite double, 1.7976931348623157e308."""


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
    return _replace_non_finite(value, lambda number: None, set())


def nan_if_none(value: float | None) -> float:
    """A number read back from a file :func:`dumps_strict` wrote: ``None`` (its ``null``, written for a NaN, and for
    an infinity unless the writer kept infinities) as NaN, so that arithmetic and comparisons on it go on as they
    would on the value before writing; a kept infinity reads back as itself and is returned as it is."""
    return math.nan if value is None else value


def _replace_non_finite(value: Any, replace: Callable[[float], Any], open_containers: set[int]) -> Any:
    """``value`` with each NaN or infinite float ``f`` as ``replace(f)`` and tuples as lists (:func:`finite_or_none`);
    ``open_containers``: the ids of the containers being walked, enclosing ``value``."""
    if isinstance(value, float):
        return value if math.isfinite(value) else replace(value)
    if not isinstance(value, dict | list | tuple):
        return value
    if id(value) in open_containers:
        raise ValueError("Circular reference detected")
    open_containers.add(id(value))
    try:
        if isinstance(value, dict):
            return {key: _replace_non_finite(item, replace, open_containers) for key, item in value.items()}
        return [_replace_non_finite(item, replace, open_containers) for item in value]
    finally:
        open_containers.discard(id(value))


def dumps_strict(data: Any, infinities: bool = False, **kwargs: Any) -> str:
    """``json.dumps`` (``kwargs``: its options, e.g. ``indent``) of ``data`` as strict JSON, which :func:`loads_strict`
    and other strict readers accept: NaN is written as ``null``, and so are infinities (:func:`finite_or_none`),
    unless ``infinities``: then each is written as the number :data:`INFINITY_TEXT` (``-1e999`` for minus infinity),
    which :func:`loads_strict` reads back as that infinity. ``data`` is not modified.

    Raises:
        TypeError: a value JSON cannot hold (e.g. a set), from ``json.dumps``. ValueError: a circular reference, or
            a dict key that is a non-finite float.
    """
    if not infinities:
        return json.dumps(finite_or_none(data), allow_nan=False, **kwargs)
    # json writes floats itself: each infinity goes in as a string no data can hold (a fresh random marker), and its
    # quoted form is then replaced by the number
    marker = uuid.uuid4().hex
    text = json.dumps(_replace_non_finite(data, lambda number: marker + ("-" if number < 0 else "+")
                                          if math.isinf(number) else None, set()), allow_nan=False, **kwargs)
    return text.replace(f'"{marker}+"', INFINITY_TEXT).replace(f'"{marker}-"', f"-{INFINITY_TEXT}")
