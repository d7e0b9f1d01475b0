"""The gateway lanes dashboard: decisions per lane, the router's measured size against the engine's count, its slots
against what the engine holds, disconnects and swallowed exceptions, read from a store of one size router."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stepline.dashboards import gateway
from stepline.dashboards.macros import ALL, QueryContext
from stepline.diagnosis.common import utc
from stepline.model.rows import EngineSample, GatewayDecision, GatewaySample, Step
from stepline.queries.query import moment
from stepline.store.store import Store
from tests.dashboards.conftest import (
    GOLDEN,
    INTERVALS_MS,
    answer,
    clickhouse_queries,
    context,
    panel_sql,
    panels,
    rendered,
    unknown_tables,
)
from tests.diagnosis.test_detectors import _ts, request, step

MODEL = rendered(gateway.dashboard)
FAST, HEAVY = "fast-0:8000", "heavy-0:8000"
BAR_CHARS = 400_000  # 100k tokens at ~4 characters per token
DENSE = ("dense-json", 113_000)  # 3 chars per token: 339,000 chars, under the bar, onto the fast lane
LEAKED = 4  # clients that left the heavy lane; the router never gave their slots back
IDLE_FROM = 140.0  # the heavy engine's last step: after it the engine holds nothing


def _decision(at: float, rid: str, lane: str, engine: str, chars: int | None, *, router: str = "router",
              in_flight: int | None = None, status: int = 200, error: str = "", gone: bool = False,
              swallowed: str = "") -> GatewayDecision:
    bar, unit = (float(BAR_CHARS), "chars") if chars is not None and lane else (None, "")
    octets = None if chars is None else chars + 7  # a few multi-byte characters: bytes are not the bar's unit
    return GatewayDecision(_ts(at), "h", engine, router, rid, 1, lane, [FAST, HEAVY], chars, octets, None, bar, unit,
                           "healthy", in_flight, status, error, gone, _ts(at + 0.5), _ts(at + 3), swallowed)


def _routed() -> tuple[list[GatewayDecision], list[Any]]:
    """Prose to both lanes (4 chars per token), one dense-JSON monster under the bar, each served by its lane's
    engine under an id vLLM built from the forwarded one (bare, completions' or chat's); then clients leaving the
    heavy lane, a refusal once its slots are gone, a hook failing open and a lane-less gateway timing out."""
    sized = [(f"prose-{i}", 1_000 * (i + 1), 4) for i in range(6)] + [(DENSE[0], DENSE[1], 3)]
    sized += [(f"monster-{i}", 120_000, 4) for i in range(2)]
    decisions, requests = [], []
    for i, (rid, tokens, per_token) in enumerate(sized):
        at, chars = 10.0 + 5 * i, tokens * per_token
        lane, engine = ("heavy", HEAVY) if chars >= BAR_CHARS else ("fast", FAST)
        decisions.append(_decision(at, rid, lane, engine, chars, in_flight=1))
        served = (rid, f"cmpl-{rid}-0", f"chatcmpl-{rid}")[i % 3]
        requests.append(request(served, at + 0.01, 0.0, 0.4, 2.5, tokens)._replace(engine=engine))
    decisions += [_decision(100.0 + 10 * i, f"gone-{i}", "heavy", HEAVY, 500_000, in_flight=i + 1, status=499,
                            error="client_disconnected", gone=True) for i in range(LEAKED)]
    decisions.append(_decision(500.0, "refused", "heavy", HEAVY, 500_000, in_flight=LEAKED, status=429,
                               error="lane_saturated"))
    decisions += [_decision(200.0 + 10 * i, f"open-{i}", "fast", FAST, None, swallowed="KeyError: 'messages'")
                  for i in range(2)]
    decisions.append(_decision(300.0, "edge-0", "", FAST, None, router="edge", status=0, error="timeout"))
    return decisions, requests


def _scraped() -> tuple[list[GatewaySample], list[EngineSample]]:
    """The router's running requests per backend and the engines' gauges, every 5 s: the heavy lane's count climbs
    with each client that leaves and stays there after its engine went idle."""
    gauges, engines = [], []
    for i in range(120):
        t = 5.0 * i
        held = float(sum(1 for k in range(LEAKED) if t >= 100.0 + 10 * k))
        gauges += [GatewaySample(_ts(t), "h", HEAVY, "router", "vllm_router_running_requests", "gauge",
                                 {"worker": f"http://{HEAVY}"}, held, 0.0),
                   GatewaySample(_ts(t), "h", FAST, "router", "vllm_router_worker_load", "gauge",
                                 {"worker": f"http://{FAST}"}, 2.0, 0.0),
                   GatewaySample(_ts(t), "h", HEAVY, "router", "vllm_router_processed_requests_total", "counter",
                                 {"worker": f"http://{HEAVY}"}, 100.0 + i, 1.0)]
        for metric in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
            running = metric.endswith("running")
            engines += [EngineSample(_ts(t), "h", HEAVY, "0", "m", metric, "gauge", {},
                                     float(running and t < IDLE_FROM), 0.0),
                        EngineSample(_ts(t), "h", FAST, "0", "m", metric, "gauge", {}, 2.0 if running else 1.0, 0.0)]
    return gauges, engines


def _steps() -> list[Step]:
    fast = [step(float(i), n=i, waiting=i % 3)._replace(engine=FAST) for i in range(200)]
    heavy = [step(float(i), n=i, decoding=1)._replace(engine=HEAVY) for i in range(60, int(IDLE_FROM) + 1)]
    return fast + heavy


@pytest.fixture(scope="module")
def lanes(chdb_dir: Path) -> Iterator[Store]:
    """A store of its own for the module, holding the router above and its two engines."""
    store = Store.open(f"chdb://{chdb_dir}?database=gwdash_{uuid.uuid4().hex[:10]}")
    store.ensure_schema(30)
    decisions, requests = _routed()
    gauges, engines = _scraped()
    for table, rows in (("gateway_decisions", decisions), ("requests", requests), ("gateway_samples", gauges),
                        ("engine_samples", engines), ("steps", _steps())):
        store.insert(table, rows, rows[0]._fields)
    yield store
    store.client.command(f"DROP DATABASE IF EXISTS `{store.database}`")
    store.close()


def ctx(interval_ms: int = 1000, **variables: str | list[str]) -> QueryContext:
    """The timeline's range, every variable of this dashboard "All" unless given."""
    chosen: dict[str, str | list[str]] = {"gateway": ALL, "lane": ALL, **variables}
    return context(interval_ms, **chosen)


def _target(title: str, ref_id: str) -> str:
    sql: str = next(t["rawSql"] for t in panels(MODEL)[title]["targets"] if t["refId"] == ref_id)
    return sql


IN_FLIGHT = "Gateway in flight vs engine running + waiting"


def test_the_uid_is_stable() -> None:
    assert gateway.UID == MODEL["uid"] == "stepline-gateway-lanes"
    assert f'"uid": "{gateway.UID}"' in (GOLDEN / "gateway-lanes.json").read_text()


def test_it_has_the_lanes_sizes_slots_and_failures_panels() -> None:
    shown = panels(MODEL)
    assert list(shown) == [
        "Decisions per lane", "Decisions by status class", IN_FLIGHT, "Client disconnects", "Units per token by lane",
        "Swallowed exceptions", "Largest requests per lane: measured vs counted", "Latest swallowed exceptions",
        "Health and status by backend"]
    assert [p["type"] for p in shown.values()] == ["timeseries"] * 4 + ["table", "timeseries"] + ["table"] * 3
    assert [t["refId"] for t in shown[IN_FLIGHT]["targets"]] == ["A", "B", "C", "D"]
    assert [v["name"] for v in MODEL["templating"]["list"]] == [
        "datasource", "prometheus", "host", "gateway", "engine", "lane"]


@pytest.mark.parametrize("chosen", [{}, {"gateway": ["router"], "lane": ["heavy"], "engine": [HEAVY], "host": ["h"]}])
def test_every_query_reads_schema_tables_and_runs_at_every_interval(lanes: Store, chosen: dict[str, Any]) -> None:
    queries = clickhouse_queries(MODEL)
    found = unknown_tables(queries)
    for interval_ms in INTERVALS_MS:
        for q in queries:
            try:
                answer(lanes, q.sql, ctx(interval_ms, **chosen))
            except Exception as exc:  # the message is the finding: collected, then asserted empty
                found.append(f"{q.where} @ {interval_ms} ms: {str(exc)[:300]}")
    assert not found


def test_the_dense_monster_shows_three_chars_per_token_under_the_bar(lanes: Store) -> None:
    rows = answer(lanes, panel_sql(MODEL, "Largest requests per lane: measured vs counted"), ctx())
    fast = [r for r in rows if r["lane"] == "fast"]
    # Every sized decision joined its engine request, whichever id vLLM built from the forwarded one.
    assert len(fast) == 7 and [r["lane"] for r in rows if r["lane"] != "fast"] == ["heavy"] * 2
    dense = fast[0]  # the engine counted it largest of its lane
    assert (dense["request_id"], dense["engine"], dense["unit"]) == (DENSE[0], FAST, "chars")
    assert (dense["size"], dense["threshold"], dense["prompt_tokens"]) == (3 * DENSE[1], BAR_CHARS, DENSE[1])
    assert dense["under_bar"] and dense["units_per_token"] == pytest.approx(3.0)
    assert [r["units_per_token"] for r in rows if r["request_id"] != DENSE[0]] == [pytest.approx(4.0)] * 8
    assert not any(r["under_bar"] for r in rows if r["lane"] == "heavy")


def test_units_per_token_by_lane(lanes: Store) -> None:
    by_lane = {r["lane"]: r for r in answer(lanes, panel_sql(MODEL, "Units per token by lane"), ctx())}
    fast, heavy = by_lane["fast"], by_lane["heavy"]
    assert (fast["unit"], fast["requests"], fast["threshold"]) == ("chars", 7, BAR_CHARS)
    assert (fast["per_token_min"], fast["per_token_p50"]) == pytest.approx((3.0, 4.0))
    assert (heavy["requests"], heavy["per_token_min"], heavy["per_token_max"]) == (2, 4.0, 4.0)
    assert set(by_lane) == {"fast", "heavy"}  # the lane-less gateway measured against no bar


def _last(rows: list[dict[str, Any]], value: str, engine: str) -> float:
    mine = sorted((r for r in rows if r["engine"] == engine), key=lambda r: r["time"])
    return float(mine[-1][value])


def test_the_gateway_holds_the_leaked_slots_the_engine_does_not(lanes: Store) -> None:
    scraped = answer(lanes, _target(IN_FLIGHT, "A"), ctx())
    assert {(r["engine"], r["metric"]) for r in scraped} == {
        (HEAVY, "vllm_router_running_requests"), (FAST, "vllm_router_worker_load")}  # in-flight metrics only
    decided = answer(lanes, _target(IN_FLIGHT, "B"), ctx())
    stepped = answer(lanes, _target(IN_FLIGHT, "C"), ctx())
    gauges = answer(lanes, _target(IN_FLIGHT, "D"), ctx())
    gateway_held = _last(scraped, "gateway_in_flight", HEAVY)
    engine_held = _last(gauges, "engine_running_waiting_scraped", HEAVY)
    assert (gateway_held, _last(decided, "decision_in_flight", HEAVY), engine_held) == (LEAKED, LEAKED, 0)
    assert gateway_held - engine_held == LEAKED
    heavy_steps = [r for r in stepped if r["engine"] == HEAVY]
    assert {r["engine_running_waiting"] for r in heavy_steps} == {1}  # one running, none waiting, while it stepped
    assert utc(max(r["time"] for r in heavy_steps)).timestamp() == pytest.approx(_ts(IDLE_FROM) / 1e6)
    # Beside the fast lane's engine, which holds what its gateway says.
    assert _last(gauges, "engine_running_waiting_scraped", FAST) == 3.0
    assert max(r["engine_running_waiting"] for r in stepped if r["engine"] == FAST) == 4  # two running, two waiting


def test_the_engine_side_shows_only_the_chosen_lanes_backends(lanes: Store) -> None:
    for ref_id in "ACD":
        rows = answer(lanes, _target(IN_FLIGHT, ref_id), ctx(lane=["fast"]))
        assert rows and {r["engine"] for r in rows} == {FAST}, ref_id


def test_engine_minutes_read_the_same_most_held(lanes: Store) -> None:
    minutes = answer(lanes, _target(IN_FLIGHT, "C"), ctx(60_000))
    assert {r["engine"] for r in minutes} == {FAST, HEAVY}
    assert max(r["engine_running_waiting"] for r in minutes if r["engine"] == FAST) == 4


def test_disconnects_and_statuses(lanes: Store) -> None:
    gone = answer(lanes, panel_sql(MODEL, "Client disconnects"), ctx())
    assert {r["engine"] for r in gone} == {HEAVY} and sum(r["disconnects"] for r in gone) == LEAKED
    classes: dict[str, float] = {}
    for r in answer(lanes, panel_sql(MODEL, "Decisions by status class"), ctx()):  # per second, 1-s intervals
        classes[r["status_class"]] = classes.get(r["status_class"], 0) + r["decisions"]
    assert classes == {"2xx": 11, "4xx": LEAKED + 1, "no answer": 1}
    health = answer(lanes, panel_sql(MODEL, "Health and status by backend"), ctx(gateway=["router"]))
    assert [(r["engine"], r["lane"], r["status"], r["decisions"], r["disconnected"]) for r in health] == [
        (FAST, "fast", 200, 9, 0), (HEAVY, "heavy", 499, LEAKED, LEAKED), (HEAVY, "heavy", 200, 2, 0),
        (HEAVY, "heavy", 429, 1, 0)]


def test_swallowed_exceptions_are_counted_and_shown_latest_first(lanes: Store) -> None:
    counted = answer(lanes, panel_sql(MODEL, "Swallowed exceptions"), ctx())
    assert sum(r["swallowed"] for r in counted) == 2
    assert sum(r["unmeasured"] for r in counted) == 3  # the lane-less gateway measured nothing either
    latest = answer(lanes, panel_sql(MODEL, "Latest swallowed exceptions"), ctx())
    assert [(r["request_id"], r["swallowed_exception"]) for r in latest] == [
        ("open-1", "KeyError: 'messages'"), ("open-0", "KeyError: 'messages'")]


def test_the_variables_narrow_by_gateway_and_lane(lanes: Store) -> None:
    per_lane = answer(lanes, panel_sql(MODEL, "Decisions per lane"), ctx(gateway=["edge"]))
    assert {(r["gateway"], r["lane"]) for r in per_lane} == {("edge", "")}
    assert {r["lane"] for r in answer(lanes, panel_sql(MODEL, "Decisions per lane"), ctx(lane=["heavy"]))} == {
        "heavy"}
    variables = {v["name"]: v["query"] for v in MODEL["templating"]["list"] if v["type"] == "query"}
    assert [r["lane"] for r in answer(lanes, variables["lane"], ctx())] == ["fast", "heavy"]  # '' is no lane
    assert [r["engine"] for r in answer(lanes, variables["engine"], ctx(gateway=["edge"]))] == [FAST]
    assert [r["gateway"] for r in answer(lanes, variables["gateway"], ctx())] == ["edge", "router"]


def test_a_read_with_a_parameter_no_macro_fills_is_refused() -> None:
    with pytest.raises(ValueError, match="since:Int64"):
        gateway.with_macros("SELECT 1 FROM steps WHERE ts >= fromUnixTimestamp64Micro({since:Int64}, 'UTC')")
    assert gateway.with_macros(f"ts >= {moment('start')} AND ${{lane:singlequote}}") == (
        "ts >= $__fromTime_ms AND ${lane:singlequote}")
