"""Percentiles interpolate between ranks; nearest ranks do not; a few runs' mean gets Student's t interval."""

import math

import pytest

from stepline.core import stats
from stepline.core.stats import nearest_rank, percentile


def test_percentile_interpolates_linearly_between_ranks() -> None:
    assert percentile([], 99) == 0.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert percentile([0.0, 10.0], 95) == pytest.approx(9.5)
    assert percentile([5.0, 1.0, 3.0], 0) == 1.0 and percentile([5.0, 1.0, 3.0], 100) == 5.0


def test_nearest_rank_takes_a_recorded_value_and_is_nan_for_none() -> None:
    ordered = [1.0, 2.0, 3.0, 4.0]
    assert nearest_rank(ordered, 0.5) == 3.0
    assert nearest_rank(ordered, 0.99) == 4.0 and nearest_rank(ordered, 1.0) == 4.0
    assert math.isnan(nearest_rank([], 0.5))


def test_the_mean_of_a_few_runs_has_students_t_interval() -> None:
    m = stats.mean_interval([1.0, 2.0, 3.0])  # sd 1: the half-width is t(2) / sqrt(3)
    assert (m.mean, m.n) == (2.0, 3)
    assert m.high - m.mean == pytest.approx(4.303 / math.sqrt(3)) and m.mean - m.low == pytest.approx(m.high - m.mean)
    two = stats.mean_interval([10.0, 12.0, math.nan])  # NaN is no run: sd sqrt(2), t(1) 12.706
    assert (two.mean, two.n) == (11.0, 2) and two.high == pytest.approx(11.0 + 12.706 * math.sqrt(2) / math.sqrt(2))
    one = stats.mean_interval([5.0])
    assert one.mean == 5.0 and math.isnan(one.low) and math.isnan(one.high)
    assert stats.mean_interval([]).n == 0
    assert stats.t_975(1) == 12.706 and stats.t_975(30) == 2.042 and stats.t_975(31) == 1.96
    with pytest.raises(ValueError, match="at least 1"):
        stats.t_975(0)
