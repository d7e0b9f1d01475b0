"""Per-interval queries: one branch per level, and Grafana's interval picks the one that reads (every row, whole
seconds or whole minutes), so a panel's points are the level's buckets."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from stepline.dashboards.buckets import GATE, MINUTE, RAW, SECOND, per_interval
from stepline.dashboards.macros import QueryContext, expand
from stepline.store.store import Store

# Steps at 0.2 s, 0.7 s, 1.3 s and 61 s past a whole minute (a recent one: older rows are past the store's TTL).
BASE = datetime.now(UTC).replace(second=0, microsecond=0) - timedelta(minutes=5)
OFFSETS_S = (0.2, 0.7, 1.3, 61.0)
COUNT_PER_BUCKET = f"SELECT bucket AS time, count() AS n FROM steps WHERE {GATE} GROUP BY time"


@pytest.mark.parametrize(("interval_ms", "counts"), [
    (200, [1, 1, 1, 1]),  # below a second: every row
    (1500, [1, 1, 1, 1]),  # not whole seconds: every row
    (1000, [2, 1, 1]),  # whole seconds: per second
    (30_000, [2, 1, 1]),  # whole seconds, not whole minutes: per second
    (60_000, [3, 1]),  # whole minutes: per minute
    (120_000, [3, 1]),
])
def test_the_interval_picks_the_level_that_reads(store: Store, interval_ms: int, counts: list[int]) -> None:
    values = ", ".join(f"(fromUnixTimestamp64Micro({round((BASE.timestamp() + s) * 1e6)}, 'UTC'), 'e')"
                       for s in OFFSETS_S)
    store.client.command(f"INSERT INTO steps (ts, engine) VALUES {values}")
    sql = expand(per_interval(COUNT_PER_BUCKET), QueryContext(0, 0, interval_ms))
    assert [row[1] for row in store.query(sql).result_rows] == counts


def test_one_branch_per_level_each_gated_on_the_interval() -> None:
    sql = per_interval(COUNT_PER_BUCKET, order_by="n", levels=(RAW, SECOND, MINUTE))
    assert sql.count("UNION ALL") == 2 and sql.endswith("ORDER BY n")
    assert "WITH ts AS bucket\nSELECT bucket AS time, count() AS n FROM steps WHERE $__interval_ms % 1000 != 0" in sql
    assert "WITH toStartOfSecond(ts) AS bucket" in sql and "$__interval_ms % 1000 = 0 AND $__interval_ms % 60000 != 0" \
        in sql
    assert "WITH toStartOfMinute(ts) AS bucket\nSELECT bucket AS time, count() AS n FROM steps WHERE " \
           "$__interval_ms % 60000 = 0 GROUP BY time" in sql
    two = per_interval(COUNT_PER_BUCKET, levels=(RAW, MINUTE))
    assert two.count("UNION ALL") == 1 and "toStartOfSecond" not in two


def test_a_query_without_the_gate_is_refused() -> None:
    with pytest.raises(ValueError, match="per-interval query"):
        per_interval("SELECT bucket FROM steps WHERE 1")
