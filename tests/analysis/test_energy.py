"""A GPU's energy over time, from its counter or from its power."""

from __future__ import annotations

import math

import pytest

from stepline.analysis.energy import curve, method, used


def test_the_counter_rises_linearly_between_samples_and_a_reload_counts_nothing() -> None:
    c = curve([(0, 1_000, 50.0), (1_000_000, 1_500, 50.0), (2_000_000, 200, 50.0), (3_000_000, 900, 50.0)])
    assert c is not None and c.method == "counter"
    assert c.at(500_000) == pytest.approx(250.0)
    assert used([c], 0, 3_000_000) == pytest.approx(500 + 0 + 700)
    assert c.at(-5) == 0.0 and c.at(10**9) == pytest.approx(1_200.0)  # flat outside the samples


def test_failed_counter_reads_are_passed_over_and_too_few_leave_it_to_power() -> None:
    c = curve([(0, 1_000, 100.0), (1_000_000, None, math.nan), (2_000_000, 3_000, 100.0)])
    assert c is not None and c.method == "counter" and used([c], 0, 1_000_000) == pytest.approx(1_000.0)
    p = curve([(0, None, 100.0), (1_000_000, None, 300.0), (2_000_000, 5_000, math.nan)])
    assert p is not None and p.method == "power"
    # Trapezoids: 200 W over the first second, 300 W (the one known end) over the second, in mJ.
    assert used([p], 0, 2_000_000) == pytest.approx(200_000 + 300_000)
    assert curve([(0, None, math.nan), (1, None, math.nan)]) is None
    assert method([c, p]) == "counter+power" and method([]) == "none"
