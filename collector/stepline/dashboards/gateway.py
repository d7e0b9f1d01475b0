"""Gateway lanes: what a router in front of the engines decided, beside what the engines then counted and held."""

from __future__ import annotations

import re

from grafana_foundation_sdk.builders import dashboard as db

from stepline.alerting.config import AlertConfig
from stepline.dashboards.buckets import GATE, per_interval
from stepline.dashboards.panels import (
    ENGINE,
    HOST,
    base,
    ch_variable,
    datasource_variables,
    events_annotation,
    grid,
    series,
)
from stepline.dashboards.query import ClickHouseQuery, Format
from stepline.diagnosis.gateway import IN_FLIGHT_METRICS
from stepline.queries.gateway import joined, size_in_unit
from stepline.queries.query import moment
from stepline.queries.window import EACH_ENGINE, IN_WINDOW

UID = "stepline-gateway-lanes"
LARGEST_PER_LANE = 20

GATEWAY = "$__conditionalAll(gateway IN (${gateway:singlequote}), $gateway)"
LANE = "$__conditionalAll(lane IN (${lane:singlequote}), $lane)"
# `host` is the collector that took a row in, gateway's and engine's alike; `engine` is the backend a gateway chose.
DECISIONS = f"$__timeFilter_ms(ts) AND {HOST} AND {GATEWAY} AND {ENGINE} AND {LANE}"
# Samples and steps carry no lane: with lanes chosen, only the backends those lanes' decisions went to.
LANE_BACKENDS = ("$__conditionalAll(engine GLOBAL IN (SELECT engine FROM gateway_decisions WHERE $__timeFilter_ms(ts) "
                 f"AND {LANE}), $lane)")
SAMPLES = f"$__timeFilter_ms(ts) AND {HOST} AND {GATEWAY} AND {ENGINE} AND {LANE_BACKENDS}"
# The engines' side shows only the backends the chosen gateways route to, not every engine collected.
BACKENDS = (f"engine GLOBAL IN (SELECT engine FROM gateway_decisions WHERE {DECISIONS} "
            f"UNION ALL SELECT engine FROM gateway_samples WHERE {SAMPLES})")

HOST_VARIABLE_SQL = (
    "SELECT DISTINCT host FROM (SELECT host FROM gateway_decisions WHERE $__timeFilter(ts) "
    "UNION ALL SELECT host FROM gateway_samples WHERE $__timeFilter(ts) "
    "UNION ALL SELECT host FROM engine_samples WHERE $__timeFilter(ts)) ORDER BY host")
GATEWAY_VARIABLE_SQL = (
    f"SELECT DISTINCT gateway FROM (SELECT gateway FROM gateway_decisions WHERE $__timeFilter(ts) AND {HOST} "
    f"UNION ALL SELECT gateway FROM gateway_samples WHERE $__timeFilter(ts) AND {HOST}) ORDER BY gateway")
BACKEND_VARIABLE_SQL = (
    f"SELECT DISTINCT engine FROM (SELECT engine FROM gateway_decisions WHERE $__timeFilter(ts) AND {HOST} AND "
    f"{GATEWAY} UNION ALL SELECT engine FROM gateway_samples WHERE $__timeFilter(ts) AND {HOST} AND {GATEWAY}) "
    "WHERE engine != '' ORDER BY engine")
LANE_VARIABLE_SQL = (f"SELECT DISTINCT lane FROM gateway_decisions WHERE $__timeFilter(ts) AND {HOST} AND {GATEWAY} "
                     f"AND {ENGINE} AND lane != '' ORDER BY lane")

# joined() binds its window and engine as query parameters, as the detectors run it; Grafana fills macros instead.
_BOUND = {IN_WINDOW: "$__timeFilter_ms(ts)", EACH_ENGINE: f"({HOST} AND {ENGINE})",
          moment("start"): "$__fromTime_ms", moment("end"): "$__toTime_ms"}
_PARAMETER = re.compile(r"(?<!\$)\{\w+:[^{}]+\}")  # ${var:format} is a Grafana variable

# The size the gateway compared with its bar, in the bar's unit; and that size per token the engine counted.
SIZE = size_in_unit("d")
SIZED = ("d.ts AS decided, d.gateway AS gateway, d.lane AS lane, d.engine AS engine, d.request_id AS request_id, "
         f"d.threshold_unit AS unit, {SIZE} AS size, d.threshold AS threshold, r.prompt_tokens AS prompt_tokens, "
         "size / r.prompt_tokens AS units_per_token")
PER_SECOND = "count() / ($__interval_ms / 1000)"
ENGINE_GAUGES = "('vllm:num_requests_running', 'vllm:num_requests_waiting')"


def with_macros(bound_sql: str) -> str:
    """A read written for bound parameters (stepline.queries.window), its window and engines as Grafana's macros."""
    text = bound_sql
    for parameter, macro in _BOUND.items():
        text = text.replace(parameter, macro)
    if left := _PARAMETER.search(text):
        raise ValueError(f"a bound parameter with no macro for it: {left.group()}")
    return text


def _sized() -> str:
    """Decisions made against a bar, beside the engine's prompt tokens for the request each became."""
    return with_macros(joined(SIZED, f"threshold IS NOT NULL AND {GATEWAY} AND {LANE}", ("prompt_tokens",),
                              "r.prompt_tokens > 0 AND size IS NOT NULL"))


def _in_flight() -> list[ClickHouseQuery]:
    """The gateway's slots per backend (scraped, and as each decision says), then what the engine held."""
    metrics = ", ".join(f"'{m}'" for m in IN_FLIGHT_METRICS)
    scraped = ClickHouseQuery(f"""
        SELECT $__timeInterval_ms(ts) AS time, engine, gateway, metric, max(v) AS gateway_in_flight
        FROM (SELECT ts, engine, gateway, metric, sum(value) AS v FROM gateway_samples
              WHERE {SAMPLES} AND engine != '' AND metric IN ({metrics}) GROUP BY ts, engine, gateway, metric)
        GROUP BY time, engine, gateway, metric ORDER BY time""")
    decided = ClickHouseQuery(f"""
        SELECT $__timeInterval_ms(ts) AS time, engine, gateway, max(in_flight) AS decision_in_flight
        FROM gateway_decisions WHERE {DECISIONS} AND engine != '' AND in_flight IS NOT NULL
        GROUP BY time, engine, gateway ORDER BY time""", ref_id="B")
    # The steps' per-second and per-minute projections hold the most running and the most waiting, not their sum.
    steps = ClickHouseQuery(per_interval(f"""
        SELECT $__timeInterval_ms(bucket) AS time, engine, max(running) + max(waiting) AS engine_running_waiting
        FROM steps WHERE {GATE} AND $__timeFilter_ms(bucket) AND {HOST} AND {ENGINE} AND {BACKENDS}
        GROUP BY time, engine"""), ref_id="C")
    # An idle engine does not step: its own gauges say it holds nothing.
    gauges = ClickHouseQuery(f"""
        SELECT $__timeInterval_ms(ts) AS time, engine, max(v) AS engine_running_waiting_scraped
        FROM (SELECT ts, engine, sum(value) AS v FROM engine_samples
              WHERE $__timeFilter_ms(ts) AND {HOST} AND {ENGINE} AND {BACKENDS} AND metric IN {ENGINE_GAUGES}
              GROUP BY ts, engine)
        GROUP BY time, engine ORDER BY time""", ref_id="D")
    return [scraped, decided, steps, gauges]


def dashboard(config: AlertConfig) -> db.Dashboard:
    """The gateway lanes dashboard."""
    d = base("stepline / Gateway lanes", UID,
             "What the gateway decided per lane, what it measured against what the engine counted, and the slots it "
             "holds against what the engine holds.", ["gateway"])
    for variable in datasource_variables():
        d = d.with_variable(variable)
    for name, label, text in (("host", "Host", HOST_VARIABLE_SQL), ("gateway", "Gateway", GATEWAY_VARIABLE_SQL),
                              ("engine", "Backend", BACKEND_VARIABLE_SQL), ("lane", "Lane", LANE_VARIABLE_SQL)):
        d = d.with_variable(ch_variable(name, label, text))
    d = d.annotation(events_annotation())
    d = d.with_panel(series(
        "Decisions per lane", "How many routing attempts per second each gateway put in each lane.", "reqps",
        ClickHouseQuery(f"""
            SELECT $__timeInterval_ms(ts) AS time, gateway, lane, {PER_SECOND} AS decisions
            FROM gateway_decisions WHERE {DECISIONS}
            GROUP BY time, gateway, lane ORDER BY time"""), stacked=True))
    d = d.with_panel(series(
        "Decisions by status class", "What the gateway answered each lane's clients: 2xx, 4xx (499: the client "
        "left, 429: refused), 5xx, or nothing.", "reqps",
        ClickHouseQuery(f"""
            SELECT $__timeInterval_ms(ts) AS time, lane,
                   if(status = 0, 'no answer', concat(toString(intDiv(status, 100)), 'xx')) AS status_class,
                   {PER_SECOND} AS decisions
            FROM gateway_decisions WHERE {DECISIONS}
            GROUP BY time, lane, status_class ORDER BY time"""), stacked=True))
    d = d.with_panel(series(
        "Gateway in flight vs engine running + waiting",
        "Requests the gateway holds in flight to each backend (from its /metrics, and as each decision says) "
        "against the most the engine ran plus the most it queued (from steps, and its own gauges when idle): a "
        "gateway count above the engine's is slots leaked.", "short", *_in_flight()))
    d = d.with_panel(series(
        "Client disconnects", "How many clients left before their response ended, per backend (each one a slot a "
        "leaky gateway never gives back).", "short",
        ClickHouseQuery(f"""
            SELECT $__timeInterval_ms(ts) AS time, engine, countIf(client_disconnected) AS disconnects
            FROM gateway_decisions WHERE {DECISIONS}
            GROUP BY time, engine HAVING disconnects > 0 ORDER BY time"""), bars=True))
    d = d.with_panel(grid(
        "Units per token by lane",
        "What the gateway's unit (the bar's: chars, bytes or tokens) is worth in the engine's tokens, per lane: "
        "prose runs ~4 chars per token, dense code and JSON ~3, so a bar set in chars lets dense monsters under it.",
        ClickHouseQuery(f"""
            SELECT gateway, lane, unit, count() AS requests, min(units_per_token) AS per_token_min,
                   quantile(0.5)(units_per_token) AS per_token_p50, max(units_per_token) AS per_token_max,
                   any(threshold) AS threshold
            FROM ({_sized()})
            GROUP BY gateway, lane, unit ORDER BY gateway, lane, unit""", Format.TABLE),
        units=[("per_token_.*", "none")], w=12, h=8))
    d = d.with_panel(series(
        "Swallowed exceptions", "How many decisions a routing hook caught an exception in and routed anyway (failed "
        "open), and how many it measured no size for.", "short",
        ClickHouseQuery(f"""
            SELECT $__timeInterval_ms(ts) AS time, gateway, lane, countIf(swallowed_exception != '') AS swallowed,
                   countIf(size_chars IS NULL AND size_bytes IS NULL AND size_tokens IS NULL) AS unmeasured
            FROM gateway_decisions WHERE {DECISIONS}
            GROUP BY time, gateway, lane HAVING swallowed + unmeasured > 0 ORDER BY time"""), bars=True))
    d = d.with_panel(grid(
        "Largest requests per lane: measured vs counted",
        f"The {LARGEST_PER_LANE} requests per lane the engine counted most prompt tokens for: the size the gateway "
        "measured in its bar's unit, the bar, and that size per token (a request under the bar with more tokens "
        "than the bar stands for went to the wrong lane).",
        ClickHouseQuery(f"""
            SELECT decided, gateway, lane, engine, request_id, unit, size, threshold, size < threshold AS under_bar,
                   prompt_tokens, units_per_token
            FROM ({_sized()})
            ORDER BY gateway, lane, prompt_tokens DESC LIMIT {LARGEST_PER_LANE} BY gateway, lane""", Format.TABLE),
        units=[("units_per_token", "none"), ("under_bar", "bool_yes_no")], h=12))
    d = d.with_panel(grid(
        "Latest swallowed exceptions", "What the routing hook caught and went on past, latest first.",
        ClickHouseQuery(f"""
            SELECT ts, gateway, lane, engine, request_id, status, swallowed_exception
            FROM gateway_decisions WHERE {DECISIONS} AND swallowed_exception != ''
            ORDER BY ts DESC LIMIT 100""", Format.TABLE), h=8))
    return d.with_panel(grid(
        "Health and status by backend", "How each gateway saw each backend when it chose it (its health cache) and "
        "how those attempts ended.",
        ClickHouseQuery(f"""
            SELECT gateway, engine, lane, health, status, error_type, count() AS decisions,
                   countIf(client_disconnected) AS disconnected, max(ts) AS last_decided
            FROM gateway_decisions WHERE {DECISIONS}
            GROUP BY gateway, engine, lane, health, status, error_type
            ORDER BY gateway, engine, lane, decisions DESC""", Format.TABLE), h=8))
