"""The panel and variable helpers every dashboard is built from: one look, units and legends set on purpose, and
variables and annotations that answer from the store."""

from __future__ import annotations

import json
from typing import Any

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog.encoder import JSONEncoder

from stepline.dashboards import panels as p
from stepline.dashboards.query import CLICKHOUSE_TYPE, PROMETHEUS, ClickHouseQuery, Format, promql
from stepline.store.store import Store
from tests.dashboards.conftest import answer, context
from tests.diagnosis.test_detectors import ENGINE


def _json(built: cogbuilder.Builder[Any]) -> dict[str, Any]:
    model: dict[str, Any] = json.loads(json.dumps(built.build(), cls=JSONEncoder))
    return model


def test_a_series_has_a_table_legend_and_draws_slo_lines() -> None:
    panel = _json(p.series("Step", "How long.", "ms", ClickHouseQuery("SELECT 1"), lines=[(0.1, "orange")]))
    assert (panel["type"], panel["fieldConfig"]["defaults"]["unit"]) == ("timeseries", "ms")
    assert panel["options"]["legend"] == {"displayMode": "table", "placement": "bottom", "showLegend": True,
                                          "calcs": ["mean", "max", "lastNotNull"]}
    custom = panel["fieldConfig"]["defaults"]["custom"]
    assert (custom["fillOpacity"], custom["thresholdsStyle"]) == (10, {"mode": "dashed"})
    assert panel["fieldConfig"]["defaults"]["thresholds"]["steps"] == [{"value": None, "color": "transparent"},
                                                                       {"value": 0.1, "color": "orange"}]
    stacked = _json(p.series("Tokens", "What.", "short", ClickHouseQuery("SELECT 1"), stacked=True, bars=True))
    custom = stacked["fieldConfig"]["defaults"]["custom"]
    assert (custom["stacking"], custom["drawStyle"], custom["fillOpacity"]) == ({"mode": "normal"}, "bars", 60)
    assert "thresholdsStyle" not in custom


def test_right_axis_moves_matching_fields_with_their_unit() -> None:
    panel = _json(p.right_axis(p.series("KV", "How full.", "percentunit", ClickHouseQuery("SELECT 1")),
                               "preempted.*", "short"))
    assert panel["fieldConfig"]["overrides"] == [{"matcher": {"id": "byRegexp", "options": "preempted.*"},
                                                  "properties": [{"id": "custom.axisPlacement", "value": "right"},
                                                                 {"id": "unit", "value": "short"}]}]


def test_a_grid_sets_units_hides_link_columns_and_links() -> None:
    link = db.DashboardLink("there").url("/d/x")
    panel = _json(p.grid("Slowest", "Which.", ClickHouseQuery("SELECT 1", Format.TABLE),
                         units=[(".*_seconds", "s")], hidden=["from_ms"], links=[link]))
    assert panel["type"] == "table"
    assert panel["fieldConfig"]["defaults"]["custom"]["filterable"] is True
    assert [o["matcher"] for o in panel["fieldConfig"]["overrides"]] == [
        {"id": "byRegexp", "options": ".*_seconds"}, {"id": "byName", "options": "from_ms"}]
    assert [lk["url"] for lk in panel["fieldConfig"]["defaults"]["links"]] == ["/d/x"]
    assert panel["gridPos"]["w"] == 24


def test_a_single_stat_reads_prometheus_and_colours_by_thresholds() -> None:
    panel = _json(p.single("Up", "How many.", "none", promql("up"), [(None, "red"), (1, "green")]))
    assert (panel["type"], panel["datasource"]) == ("stat", {"type": "prometheus", "uid": PROMETHEUS.uid})
    assert panel["options"]["reduceOptions"]["calcs"] == ["lastNotNull"]
    assert panel["options"]["colorMode"] == "background"


def test_a_distribution_is_a_histogram_of_a_table_query() -> None:
    panel = _json(p.distribution("TTFT", "How spread.", "s", "SELECT ttft_seconds FROM requests"))
    assert panel["type"] == "histogram"
    assert [(t["format"], t["rawSql"]) for t in panel["targets"]] == [(1, "SELECT ttft_seconds FROM requests")]


def test_variables_are_multi_value_with_all_and_narrow_each_other() -> None:
    variables = [_json(v) for v in p.timeline_variables(gpu=True)]
    assert [(v["type"], v["name"]) for v in variables] == [
        ("datasource", "datasource"), ("datasource", "prometheus"), ("query", "host"), ("query", "engine"),
        ("query", "gpu")]
    host = variables[2]
    assert host["query"] == host["definition"] == p.HOST_VARIABLE_SQL  # one line: Grafana shows it as typed
    assert (host["multi"], host["includeAll"], host["current"]["value"]) == (True, True, [p.ALL_VALUE])
    assert variables[0]["query"] == CLICKHOUSE_TYPE
    assert "$host" in variables[3]["query"] and "$engine" in variables[4]["query"]  # each narrows the next
    assert [v["name"] for v in (_json(v) for v in p.timeline_variables())] == [
        "datasource", "prometheus", "host", "engine"]


def test_variables_answer_from_the_store(timeline: Store) -> None:
    ctx = context(1000)
    assert [r["host"] for r in answer(timeline, p.HOST_VARIABLE_SQL, ctx)] == ["h"]
    assert [r["engine"] for r in answer(timeline, p.ENGINE_VARIABLE_SQL, ctx)] == [ENGINE]
    assert not answer(timeline, p.ENGINE_VARIABLE_SQL, context(1000, host=["elsewhere"]))
    assert [r["gpu"] for r in answer(timeline, p.GPU_VARIABLE_SQL, ctx)] == ["0"]


def test_the_events_annotation_tells_what_happened(timeline: Store) -> None:
    annotation = _json(p.events_annotation())
    assert (annotation["name"], annotation["enable"]) == ("Engine events", True)
    events = answer(timeline, annotation["target"]["rawSql"], context(1000))
    assert [(e["title"], e["text"], e["tags"]) for e in events] == [
        ("engine_config (info)", "configured", ["engine_config", ENGINE]),
        ("gpu_xid (critical)", "XID 79 on GPU 0", ["gpu_xid", ENGINE])]


def test_every_dashboard_gets_the_house_settings() -> None:
    d = _json(p.timeline_base("stepline / X", "stepline-x", "What X shows.", ["x"], gpu=True))
    assert (d["uid"], d["timezone"], d["time"], d["refresh"]) == ("stepline-x", "utc", {"from": "now-1h", "to": "now"},
                                                                 "30s")
    assert d["tags"] == ["stepline", "x"] and d["editable"] is True
    assert [v["name"] for v in d["templating"]["list"]][-1] == "gpu"
    assert [a["name"] for a in d["annotations"]["list"]] == ["Engine events"]
