"""Setting checks quote the value they refuse through :func:`unsparse.messages.quote`: a sparse file's metadata
reaches them (``quantization.weights.clusters`` through the quantizer's ``described``), and a megabyte value made a
megabyte message."""

from __future__ import annotations

import pytest

from unsparse.quant import KMeansQuantizer
from unsparse.settings import check_choice, check_flag, check_integer, check_number


@pytest.mark.parametrize("check", [
    lambda value: check_integer(value, "clusters", 2, 256),
    lambda value: check_number(value, "tol", lambda number: number >= 0, ">= 0"),
    lambda value: check_flag(value, "per_channel"),
    lambda value: check_choice(value, ("percentile", "kl"), "rule"),
    lambda value: KMeansQuantizer(clusters=value),
])
def test_a_huge_refused_value_gives_a_short_message(check) -> None:
    value = "7" * 1_000_000
    with pytest.raises(ValueError) as refused:
        check(value)
    message = str(refused.value)
    assert len(message) < 500 and "(1000002 characters)" in message
