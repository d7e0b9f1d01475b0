"""Order statistics over plain lists of figures: the load generator's percentiles, whatif's quantiles and
nearest ranks; and the mean of a few repeated runs with its confidence interval."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), interpolating linearly between ranks; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def nearest_rank(ordered: Sequence[float], q: float) -> float:
    """The value at rank q * n of sorted `ordered` (no interpolation); NaN when empty."""
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else math.nan


# Student's t distribution's 97.5th percentile by degrees of freedom (1-30), for a two-sided 95% interval of a mean
# from a few runs; past 30 the normal's 1.96 is within 4%. Standard table values (e.g. NIST/SEMATECH e-Handbook of
# Statistical Methods, 1.3.6.7.2, "Critical values of the Student's t distribution").
_T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
          2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
MEAN_CONFIDENCE = 0.95


def t_975(degrees_of_freedom: int) -> float:
    """Student's t 97.5th percentile: the half-width of a 95% interval of a mean, in standard errors."""
    if degrees_of_freedom < 1:
        raise ValueError(f"degrees of freedom must be at least 1, got {degrees_of_freedom}")
    return _T_975[degrees_of_freedom - 1] if degrees_of_freedom <= len(_T_975) else 1.96


@dataclass(frozen=True, slots=True)
class MeanInterval:
    """The mean of `n` runs' values and its 95% confidence interval (Student's t; NaN bounds for one run)."""

    mean: float
    low: float
    high: float
    n: int


def mean_interval(values: Sequence[float], floor: float | None = None) -> MeanInterval:
    """The mean of `values` (NaN ones left out) with its 95% interval: mean -/+ t(n-1) * sd / sqrt(n), its low end
    no lower than `floor` where one is given (a latency's interval from two runs can otherwise reach below 0)."""
    seen = [v for v in values if not math.isnan(v)]
    if not seen:
        return MeanInterval(math.nan, math.nan, math.nan, 0)
    mean = sum(seen) / len(seen)
    if len(seen) == 1:
        return MeanInterval(mean, math.nan, math.nan, 1)
    sd = math.sqrt(sum((v - mean) ** 2 for v in seen) / (len(seen) - 1))
    half = t_975(len(seen) - 1) * sd / math.sqrt(len(seen))
    low = mean - half if floor is None else max(floor, mean - half)
    return MeanInterval(mean, low, mean + half, len(seen))
