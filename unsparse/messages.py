"""Error-message text for values that may come from untrusted input (a sparse file's metadata holds up to 4 MiB).

Every message that quotes such a value goes through :func:`quote` (or :func:`shorten` for text), so that a refusal
stays one readable line however large the value was.
"""

from __future__ import annotations

QUOTE_MAX_CHARACTERS = 200
"""Characters of an untrusted value (a file's metadata holds up to 4 MiB) that an error message quotes
(:func:`shorten`)."""


def shorten(text: str, limit: int = QUOTE_MAX_CHARACTERS) -> str:
    """``text`` for an error message: as it is up to ``limit`` characters, else its first ``limit`` characters, an
    ellipsis and its length (``'abc...' (5000 characters)``), so that a message quoting untrusted input stays short."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def quote(value: object, limit: int = QUOTE_MAX_CHARACTERS) -> str:
    """``repr(value)`` cut by :func:`shorten`: how error messages quote an untrusted value."""
    return shorten(repr(value), limit)
