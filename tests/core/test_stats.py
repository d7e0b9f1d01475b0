"""Percentiles interpolate between ranks; nearest ranks do not."""

import math

import pytest

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
