"""The break-even table's bounds never state more than was measured: a sweep whose highest sparsity is 0.999 read
``> 1.00`` (no sparsity at all breaks even), and one whose lowest is 0.125 read ``<= 0.12``."""

from __future__ import annotations

import pytest

from unsparse.report.break_even import break_even, describe


@pytest.mark.parametrize(("curve", "text"), [
    ([(0.9, 0.5), (0.999, 0.8)], "> 0.999"),
    ([(0.9, 0.5), (0.995, 0.8)], "> 0.995"),
    ([(0.125, 1.2), (0.5, 2.0)], "<= 0.125"),
    ([(0.5, 1.2), (0.9, 2.0)], "<= 0.50"),  # two decimals where they are exact, as the committed pages read
    ([(0.7, 0.5), (0.98, 0.9)], "> 0.98"),
])
def test_a_bound_is_the_measured_sparsity_not_a_rounding_of_it(curve, text) -> None:
    assert describe(break_even(curve)) == text
