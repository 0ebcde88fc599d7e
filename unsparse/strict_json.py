"""Strict JSON for files read as untrusted input (sparse model files, plans, benchmark results).

Python's ``json`` accepts the literals ``NaN``, ``Infinity`` and ``-Infinity`` and keeps the last of duplicate object
keys; in a file that is checked field by field, either lets two readers see different content (a duplicate layer
entry with other counts, a NaN that compares false everywhere).
"""

from __future__ import annotations

import json
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
