"""The dashboards' targets: raw SQL for grafana-clickhouse-datasource, PromQL on `${prometheus}`, as Grafana's JSON."""

from __future__ import annotations

import json
from typing import Any

from grafana_foundation_sdk.cog.encoder import JSONEncoder

from stepline.dashboards.query import CLICKHOUSE, ClickHouseQuery, Format, promql, sql


def _json(built: object) -> dict[str, Any]:
    model: dict[str, Any] = json.loads(json.dumps(built, cls=JSONEncoder))
    return model


def test_sql_is_dedented_and_stripped() -> None:
    assert sql("""
        SELECT ts
        FROM steps
    """) == "SELECT ts\nFROM steps"


def test_a_clickhouse_target_is_raw_sql_on_the_datasource_variable() -> None:
    assert _json(ClickHouseQuery("\n    SELECT 1\n", Format.TABLE, "C").build()) == {
        "datasource": {"type": "grafana-clickhouse-datasource", "uid": "${datasource}"}, "editorType": "sql",
        "format": 1, "rawSql": "SELECT 1", "refId": "C"}
    assert _json(ClickHouseQuery("SELECT 1").build())["format"] == 0  # a time series unless told
    assert (CLICKHOUSE.type_val, CLICKHOUSE.uid) == ("grafana-clickhouse-datasource", "${datasource}")


def test_a_promql_target_is_a_range_query_unless_instant_which_is_a_table() -> None:
    assert _json(promql("up", "{{instance}}", "B").build()) == {
        "expr": "up", "datasource": {"type": "prometheus", "uid": "${prometheus}"}, "instant": False,
        "legendFormat": "{{instance}}", "range": True, "refId": "B"}
    instant = _json(promql("up", instant=True).build())
    assert (instant["instant"], instant["range"], instant["format"]) == (True, False, "table")
    assert "legendFormat" not in instant
