"""Generated dashboards: no drift, every SQL query runs on a demo store, every PromQL parses, every panel whole."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from stepline.alerting.config import AlertConfig
from stepline.cli import dashboards as dashboards_cli
from stepline.config.slo import Slo
from stepline.dashboards.generate import DASHBOARDS, build, render
from stepline.dashboards.macros import ALL, QueryContext, expand
from stepline.dashboards.query import CLICKHOUSE_TYPE

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "dashboards"
# The demo's engine drafts nothing, and the gateway story's hook swallows nothing.
ALLOWED_EMPTY = {"Spec-decode acceptance", "Swallowed exceptions", "Latest swallowed exceptions"}
TIMELINE_VARIABLES = {"datasource", "prometheus", "host", "engine"}

# chDB holds one store path per process and this session already holds one: query the demo's store elsewhere.
RUN_QUERIES = """
import json, math, sys
from stepline.store.store import Store
job = json.load(sys.stdin)
store = Store.open(job["url"])
out = []
for q in job["queries"]:
    try:
        r = store.query(q)
        first = [v if isinstance(v, (int, float, str)) and not (isinstance(v, float) and not math.isfinite(v))
                 else str(v) for v in (r.result_rows[0] if r.result_rows else [])]
        out.append({"columns": list(r.column_names), "types": [t.name for t in r.column_types],
                    "rows": len(r.result_rows), "first": first, "error": None,
                    "lines": [str(row[0]) for row in r.result_rows] if q.startswith("EXPLAIN") else []})
    except Exception as exc:
        out.append({"error": str(exc)[:2000]})
print(json.dumps(out))
"""


@dataclass(frozen=True)
class SqlQuery:
    """One ClickHouse query found in a dashboard, and what reads its result."""

    dashboard: str
    title: str
    kind: str  # a panel type, "annotation" or "variable"
    fmt: int
    sql: str


def _dashboards() -> dict[str, dict[str, Any]]:
    return {name: json.loads((GOLDEN / name).read_text()) for name in DASHBOARDS}


def _sql_queries() -> list[SqlQuery]:
    found = []
    for name, d in _dashboards().items():
        for panel in d["panels"]:
            for t in panel["targets"]:
                if t["datasource"]["type"] == CLICKHOUSE_TYPE:
                    found.append(SqlQuery(name, panel["title"], panel["type"], t["format"], t["rawSql"]))
        for a in d.get("annotations", {}).get("list", []):
            found.append(SqlQuery(name, a["name"], "annotation", a["target"]["format"], a["target"]["rawSql"]))
        for v in d["templating"]["list"]:
            if v["type"] == "query":
                found.append(SqlQuery(name, v["name"], "variable", 1, v["query"]))
    return found


def _prom_exprs() -> list[str]:
    return [t["expr"] for d in _dashboards().values() for p in d["panels"] for t in p["targets"]
            if t["datasource"]["type"] == "prometheus"]


def _run(url: str, queries: list[str]) -> list[dict[str, Any]]:
    proc = subprocess.run([sys.executable, "-c", RUN_QUERIES], input=json.dumps({"url": url, "queries": queries}),
                          capture_output=True, text=True, timeout=60, check=True)
    result: list[dict[str, Any]] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


@dataclass(frozen=True)
class Demo:
    url: str
    host: str
    engine: str
    lane_engine: str  # the gateway story's heavy-lane engine: the backend the gateway dashboard shows
    from_ms: int
    to_ms: int


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Demo]:
    """A simulated burst (with an XID), then the gateway story, collected into an embedded store of its own."""
    tmp = tmp_path_factory.mktemp("dash-demo")
    url = f"chdb://{tmp}/store"
    subprocess.run([sys.executable, "-m", "stepline", "demo", "--fast", "--duration", "120",
                    "--gpu-scenario", "xid", "--store", url], cwd=tmp, capture_output=True, timeout=120, check=True)
    subprocess.run([sys.executable, "-m", "stepline", "demo", "--fast", "--gateway", "--store", url], cwd=tmp,
                   capture_output=True, timeout=180, check=True)
    [meta, lane] = _run(url, ["SELECT any(host), anyIf(engine, engine LIKE 'sim-%'), "
                              "toUnixTimestamp64Milli(min(ts)), toUnixTimestamp64Milli(max(ts)) FROM steps",
                              "SELECT any(engine) FROM gateway_decisions WHERE lane = 'heavy'"])
    assert meta["error"] is None and lane["error"] is None, (meta, lane)
    host, engine, lo, hi = meta["first"]
    yield Demo(url, host, engine, lane["first"][0], int(lo) - 5000, int(hi) + 5000)
    shutil.rmtree(tmp, ignore_errors=True)


def test_generated_dashboards_match_the_committed_files(tmp_path: Path) -> None:
    written = build(tmp_path)
    assert sorted(p.name for p in written) == sorted(p.name for p in GOLDEN.glob("*.json"))
    for path in written:
        assert path.read_bytes() == (GOLDEN / path.name).read_bytes(), (
            f"{path.name} drifted: run `stepline dashboards build --out dashboards`")


def test_cli_builds_into_the_given_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    dashboards_cli.add_arguments(parser)
    args = parser.parse_args(["build", "--out", str(tmp_path / "out")])
    assert dashboards_cli.run(args) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(DASHBOARDS)
    assert capsys.readouterr().out.count("\n") == len(DASHBOARDS)


# Grafana's interval picks what a per-interval query reads: every row, whole seconds or whole minutes.
INTERVALS_MS = (200, 1000, 60_000)


@pytest.mark.parametrize("interval_ms", INTERVALS_MS)
@pytest.mark.parametrize("scope", ["one engine", "all engines"])
def test_every_sql_query_runs_on_a_demo_store(demo: Demo, scope: str, interval_ms: int) -> None:
    variables: dict[str, str | list[str]] = (
        {"host": ALL, "engine": [demo.engine], "gpu": ALL} if scope == "one engine"
        else {"host": [demo.host], "engine": ALL, "gpu": ["0", "1"]})
    variables.update(gateway=ALL, lane=ALL, by="team" if scope == "one engine" else "tenant", gpu_price="2.49")
    ctx = QueryContext(demo.from_ms, demo.to_ms, interval_ms, variables)
    # The gateway dashboard's engine is a backend behind the gateway: one engine is the story's heavy lane.
    lanes = QueryContext(demo.from_ms, demo.to_ms, interval_ms,
                         {**variables, "engine": [demo.lane_engine]} if scope == "one engine" else variables)
    queries = _sql_queries()
    results = _run(demo.url, [expand(q.sql, lanes if q.dashboard == "gateway-lanes.json" else ctx) for q in queries])
    # A panel of several queries shows what any of them finds (the gateway's /metrics beside its decisions: the
    # story's router has no /metrics to scrape).
    answered = {(q.dashboard, q.title) for q, r in zip(queries, results, strict=True) if r.get("rows")}
    problems = [problem for q, r in zip(queries, results, strict=True) if (problem := _check(q, r))
                and not (problem.endswith(": no rows") and (q.dashboard, q.title) in answered)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(("interval_ms", "bucket"), [(1000, "toStartOfSecond(ts)"), (60_000, "toStartOfMinute(ts)")])
def test_long_ranges_read_the_projections(demo: Demo, interval_ms: int, bucket: str) -> None:
    """Every per-interval query has a per-minute level (steps also per-second), and at its interval it reads that
    level's projection rather than the rows."""
    per_interval = [q for q in _sql_queries() if "AS bucket" in q.sql]
    assert all("WITH toStartOfMinute(ts) AS bucket" in q.sql for q in per_interval)
    queries = [q for q in per_interval if f"WITH {bucket} AS bucket" in q.sql]
    assert len(queries) == (9 if interval_ms == 1000 else 21)
    ctx = QueryContext(demo.from_ms, demo.to_ms, interval_ms,
                       {"host": ALL, "engine": ALL, "gpu": ALL, "gateway": ALL, "lane": ALL})
    plans = _run(demo.url, ["EXPLAIN projections=1 " + expand(q.sql, ctx) for q in queries])
    problems = []
    for q, plan in zip(queries, plans, strict=True):
        reads = " ".join(line.strip() for line in plan.get("lines", []) if "ReadFromMergeTree" in line)
        if plan["error"] or not any(name in reads for name in ("steps_per_", "gpu_samples_per_")):
            problems.append(f"{q.dashboard} / {q.title}: {plan['error'] or reads}")
    assert not problems, "\n".join(problems)


def _check(q: SqlQuery, r: dict[str, Any]) -> str:
    """What is wrong with one query's result for the panel reading it ('' when nothing)."""
    where = f"{q.dashboard} / {q.title}"
    if r["error"] is not None:
        return f"{where}: {r['error']}"
    if r["rows"] == 0:
        return "" if q.title in ALLOWED_EMPTY else f"{where}: no rows"
    columns, types = r["columns"], r["types"]
    if q.fmt == 0 and not (columns[0] == "time" and types[0].startswith("DateTime") and len(columns) >= 2):
        return f"{where}: a time series needs a time column first, then values: {columns} {types}"
    if q.fmt == 1 and not all(re.fullmatch(r"[a-z][a-z0-9_]*", c) for c in columns):
        return f"{where}: unnamed column in {columns}"
    if q.kind == "annotation" and not {"time", "title", "text"} <= set(columns):
        return f"{where}: an annotation needs time, title and text: {columns}"
    if q.kind in ("variable", "histogram") and len(columns) != 1:
        return f"{where}: expected one column: {columns}"
    return ""


def test_every_promql_expression_passes_promtool(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed")
    exprs = _prom_exprs()
    assert exprs
    rules = [{"record": f"stepline:dashboard_check_{i}", "expr": e.replace("$__rate_interval", "5m")}
             for i, e in enumerate(exprs)]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    proc = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_panel_is_complete() -> None:
    uids = set()
    for name, d in _dashboards().items():
        uids.add(d["uid"])
        variables = {v["name"] for v in d["templating"]["list"]}
        assert {"datasource", "prometheus"} <= variables, name
        has_sql = any(t["datasource"]["type"] == CLICKHOUSE_TYPE for p in d["panels"] for t in p["targets"])
        if has_sql:
            assert variables >= TIMELINE_VARIABLES, name
        ids = [p["id"] for p in d["panels"]]
        assert len(set(ids)) == len(ids), name
        for p in d["panels"]:
            where = f"{name} / {p.get('title')}"
            assert p["title"] and p["description"], where
            assert p["datasource"]["uid"] in ("${datasource}", "${prometheus}"), where
            assert p["targets"], where
            for t in p["targets"]:
                assert t["datasource"] == p["datasource"], where
            assert p["fieldConfig"]["defaults"].get("unit"), f"{where}: no unit"
            assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, where
    assert "stepline-gpu" in uids and len(uids) == len(DASHBOARDS)


def test_slo_lines_come_from_the_shared_config() -> None:
    config = AlertConfig(slo=Slo(itl_p99_seconds=0.123))
    text = render(DASHBOARDS["engine-timeline.json"], config)
    assert '"value": 0.123' in text
