"""What the dashboard tests share: a dashboard as Grafana reads it, its ClickHouse queries expanded as the datasource
expands them, and a store holding a short timeline of one engine to run them on."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from grafana_foundation_sdk.builders import dashboard as db

from stepline.alerting.config import AlertConfig
from stepline.dashboards.generate import render
from stepline.dashboards.macros import ALL, QueryContext, expand
from stepline.dashboards.query import CLICKHOUSE_TYPE
from stepline.model.rows import EngineSample, Event, micros
from stepline.model.schema import TABLE_BY_NAME
from stepline.store.store import Store
from tests.diagnosis.test_detectors import ENGINE, NOW, T0, _ts, config, gpu, insert, request, step

GOLDEN = Path(__file__).resolve().parents[2] / "dashboards"
# Grafana's interval decides what a per-interval query reads: every row, whole seconds or whole minutes.
INTERVALS_MS = (200, 1000, 60_000)
_TABLE = re.compile(r"\b(?:FROM|(?<!ARRAY )JOIN)\s+([A-Za-z_]\w*)")  # ARRAY JOIN names a column


@dataclass(frozen=True)
class Query:
    """One ClickHouse query of a dashboard: where it is (a panel's, annotation's or variable's name) and its SQL."""

    where: str
    sql: str


def rendered(make: Callable[[AlertConfig], db.Dashboard], config: AlertConfig | None = None) -> dict[str, Any]:
    """The dashboard's JSON model, as written to dashboards/ (ids and grid positions assigned)."""
    model: dict[str, Any] = json.loads(render(make, config or AlertConfig()))
    return model


def panels(model: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """title -> panel."""
    return {p["title"]: p for p in model["panels"]}


def clickhouse_queries(model: dict[str, Any]) -> list[Query]:
    """Every ClickHouse query the dashboard runs: its panels', its annotations' and its variables'."""
    found = [Query(p["title"], t["rawSql"]) for p in model["panels"] for t in p["targets"]
             if t["datasource"]["type"] == CLICKHOUSE_TYPE]
    found += [Query(a["name"], a["target"]["rawSql"]) for a in model.get("annotations", {}).get("list", [])
              if "target" in a]
    return found + [Query(v["name"], v["query"]) for v in model["templating"]["list"] if v["type"] == "query"]


def promql(model: dict[str, Any]) -> list[str]:
    """Every PromQL expression of its panels."""
    return [t["expr"] for p in model["panels"] for t in p["targets"] if t["datasource"]["type"] == "prometheus"]


def unknown_tables(queries: list[Query]) -> list[str]:
    """'where: table' for every table a query reads that the schema does not define."""
    return [f"{q.where}: {name}" for q in queries for name in _TABLE.findall(q.sql) if name not in TABLE_BY_NAME]


def context(interval_ms: int, **variables: str | list[str]) -> QueryContext:
    """The timeline's range at `interval_ms`, every variable "All" unless given."""
    chosen: dict[str, str | list[str]] = {"host": ALL, "engine": ALL, "gpu": ALL, **variables}
    return QueryContext(micros(T0.timestamp() - 5) // 1000, micros(NOW.timestamp()) // 1000, interval_ms, chosen)


def answer(store: Store, sql: str, ctx: QueryContext) -> list[dict[str, Any]]:
    """The rows the datasource would get for `sql`, as column -> value."""
    result = store.query(expand(sql, ctx))
    return [dict(zip(result.column_names, row, strict=True)) for row in result.result_rows]


def problems(store: Store, model: dict[str, Any]) -> list[str]:
    """What is wrong with the dashboard's ClickHouse queries: a table the schema does not define ('where: table'),
    or a query that does not run on the store at one of the intervals ('where @ interval: error')."""
    queries = clickhouse_queries(model)
    found = unknown_tables(queries)
    for interval_ms in INTERVALS_MS:
        for q in queries:
            try:
                answer(store, q.sql, context(interval_ms))
            except Exception as exc:  # the message is the finding: collected, then asserted empty
                found.append(f"{q.where} @ {interval_ms} ms: {str(exc)[:300]}")
    return found


def panel_sql(model: dict[str, Any], title: str) -> str:
    """The SQL of the panel's one target."""
    [target] = panels(model)[title]["targets"]
    sql: str = target["rawSql"]
    return sql


# The timeline: two minutes of one engine (ENGINE on host "h") stepping once a second with a queue of 0..4, a
# 2,048-token prefill at 60 s, its GPU sampled every second (throttled from 90 s), three finished requests of
# known sizes, its configuration, an XID, and the waiting gauge scraped every 5 s.
STEPS = 120
SLOWEST = ("slow", 10.0, 1.0, 2.0, 30.0, 50_000)  # request id, arrival, queue, ttft, decode seconds, prompt tokens
REQUESTS = (SLOWEST, ("fast", 20.0, 0.0, 0.1, 1.0, 500), ("mid", 30.0, 0.5, 1.0, 5.0, 5_000))


def _waiting(t: float, value: float) -> EngineSample:
    return EngineSample(_ts(t), "h", ENGINE, "0", "m", "vllm:num_requests_waiting", "gauge", {}, value, 0.0)


@pytest.fixture(scope="module")
def timeline(chdb_dir: Path) -> Iterator[Store]:
    """A store of its own for the module, holding the timeline above."""
    store = Store.open(f"chdb://{chdb_dir}?database=dash_{uuid.uuid4().hex[:10]}")
    store.ensure_schema(30)
    rows: list[Any] = [config(), Event(_ts(45), "h", ENGINE, "nvml", "gpu_xid", "critical", "XID 79 on GPU 0",
                                       {"xid": "79", "gpu": "0"})]
    rows += [step(float(i), n=i, waiting=i % 5) for i in range(STEPS)]
    rows.append(step(60.5, 250.0, prefill=2048, n=STEPS))
    rows += [gpu(float(i), flags=("hw_slowdown",) if i >= 90 else ()) for i in range(STEPS)]
    rows += [request(*r) for r in REQUESTS]
    insert(store, rows)
    samples = [_waiting(5.0 * i, float(i % 3)) for i in range(STEPS // 5)]
    store.insert("engine_samples", samples, EngineSample._fields)
    yield store
    store.client.command(f"DROP DATABASE IF EXISTS `{store.database}`")
    store.close()
