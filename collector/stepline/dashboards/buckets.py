"""Per-interval queries that read every row only when Grafana asks for less than a bucket.

Steps (per second and per minute) and GPU samples (per minute) keep projections: aggregates per bucket
inside each part (schema.py). A query reads one when it filters and groups on the bucket expression, so a
panel is written once over `bucket` and rendered once per level, each behind a filter on Grafana's
interval: only the coarsest level whose bucket divides the interval reads (every row below a second), the
others' filters are constant false and read nothing.
A day of steps at a minute per point then reads 11.5k rows instead of 30M.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

GATE = "$__bucket_gate"
"""Where a query's filter begins: replaced by the level's condition on the interval."""

RAW = ("ts", 0)
SECOND = ("toStartOfSecond(ts)", 1000)
MINUTE = ("toStartOfMinute(ts)", 60_000)
Level = tuple[str, int]


def per_interval(select: str, *, order_by: str = "time", levels: Sequence[Level] = (RAW, SECOND, MINUTE)) -> str:
    """`select` (reading `bucket` for the time, `GATE` first in its filter) once per level, ordered by `order_by`."""
    if GATE not in select or "bucket" not in select:
        raise ValueError(f"a per-interval query reads `bucket` and starts its filter with {GATE}: {select}")
    branches = []
    for i, (expression, size) in enumerate(levels):
        gate = [f"$__interval_ms % {size} = 0"] if size else []
        if i + 1 < len(levels):
            gate.append(f"$__interval_ms % {levels[i + 1][1]} != 0")
        body = textwrap.dedent(select).strip().replace(GATE, " AND ".join(gate))
        branches.append(f"WITH {expression} AS bucket\n{body}")
    return "SELECT * FROM (\n" + "\nUNION ALL\n".join(branches) + f"\n)\nORDER BY {order_by}"
