"""The Usage dashboard: `stepline usage` over time from the per-minute rollup, grouped by the `by` variable, with a
cost at the `gpu_price` variable's one price."""

from __future__ import annotations

from dataclasses import replace

import pytest

from stepline.analysis import usage_rollup
from stepline.analysis.usage_by import DIMENSIONS, IDLE, NONE
from stepline.dashboards import usage
from stepline.dashboards.macros import QueryContext
from stepline.model.rows import UsageMinute
from stepline.store.store import Store
from tests.dashboards.conftest import (
    GOLDEN,
    INTERVALS_MS,
    REQUESTS,
    answer,
    clickhouse_queries,
    context,
    panel_sql,
    panels,
    rendered,
    unknown_tables,
)
from tests.diagnosis.test_detectors import NOW, T0

MODEL = rendered(usage.dashboard)
PRICE = 2.49
FIRST_MINUTE = T0.timestamp() // 60 * 60  # the minute the timeline begins in, whole


def _context(interval_ms: int, **variables: str) -> QueryContext:
    """The timeline's range from the start of its first minute (a row stands for the minute it starts)."""
    return replace(context(interval_ms, **variables), from_ms=int(FIRST_MINUTE * 1000))


@pytest.fixture(scope="module")
def rolled(timeline: Store) -> Store:
    """The dashboard tests' timeline with its minutes rolled up, as the collector's job writes them."""
    rows = usage_rollup.roll(timeline, "h", FIRST_MINUTE, NOW.timestamp())
    timeline.insert("usage_minutes", rows, UsageMinute._fields)
    return timeline


def test_the_uid_is_stable_and_the_variables_choose_the_group_and_the_price() -> None:
    assert usage.UID == MODEL["uid"] == "stepline-usage"
    assert f'"uid": "{usage.UID}"' in (GOLDEN / "usage.json").read_text()
    variables = {v["name"]: v for v in MODEL["templating"]["list"]}
    assert variables["by"]["type"] == "custom" and variables["by"]["query"].split(",") == list(DIMENSIONS)
    assert variables["gpu_price"]["type"] == "textbox"


def test_it_has_usage_over_time_and_the_totals() -> None:
    assert list(panels(MODEL)) == ["GPU time by group", "Idle share of GPU time", "Energy by group",
                                   "Tokens by group", "Requests by group", "Totals by group"]


@pytest.mark.parametrize("by", DIMENSIONS)
def test_every_query_reads_the_rollup_and_answers_at_every_interval(rolled: Store, by: str) -> None:
    queries = clickhouse_queries(MODEL)
    assert not unknown_tables(queries)
    for interval_ms in INTERVALS_MS:
        for q in queries:
            assert answer(rolled, q.sql, _context(interval_ms, by=by, gpu_price=str(PRICE))), (q.where, interval_ms)


def test_the_totals_are_the_rollups_with_a_cost_at_the_price(rolled: Store) -> None:
    found = answer(rolled, panel_sql(MODEL, "Totals by group"), _context(60_000, by="team", gpu_price=str(PRICE)))
    rows = {r["group_name"]: r for r in found}
    stored = rolled.query("SELECT sum(gpu_seconds), sumIf(gpu_seconds, line = 'idle'), sum(requests) "
                          "FROM usage_minutes")
    total, idle, finished = stored.result_rows[0]
    assert rows[NONE]["requests"] == finished == len(REQUESTS)  # no gateway decision joins: no team
    assert sum(r["gpu_seconds"] for r in rows.values()) == pytest.approx(total)
    assert rows[IDLE]["gpu_seconds"] == pytest.approx(idle)
    for r in rows.values():
        assert r["cost"] == pytest.approx(r["gpu_seconds"] / 3600 * PRICE)
    unpriced = answer(rolled, panel_sql(MODEL, "Totals by group"), _context(60_000, by="team", gpu_price=""))
    assert all(r["cost"] is None for r in unpriced)
