"""Order statistics over plain lists of figures: the load generator's percentiles, whatif's quantiles and
nearest ranks."""

from __future__ import annotations

import math
from collections.abc import Sequence


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
