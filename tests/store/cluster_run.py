"""ClickHouse clusters inside one chDB process, and every stepline read run on them beside a single-node store.

chDB serves no network, but it plans Distributed tables as a server does: a cluster whose replicas are this process
(the configured `tcp_port`, on 127.0.0.1 and on localhost) has every shard local, and its queries run through the
same distributed planner (GLOBAL, distributed_product_mode, two-stage aggregation) a fleet's servers use. There is
no Keeper, so `stepline schema --cluster` runs with ON CLUSTER dropped and its Replicated engines made plain
(`rewrite`), through the job's own code (stepline.store.cluster.ClusterSchema).

Two clusters over the same data, each in a database of its own, beside a single-node database holding it too:
- `one_shard`: its reads must equal the single node's, row for row;
- `two_shards`: both shards read the one set of local tables, so every row is there twice. Its reads must plan and
  run (a subquery over a Distributed table inside IN or JOIN is refused on two shards, unless GLOBAL), and what
  adds up must be exactly twice the single node's.

Run as `python -m tests.store.cluster_run OUT.json` from the repository: one engine per process, started with the
clusters' config, so tests/store/test_cluster.py runs it in a process of its own and reads the JSON it writes. It
lives with the tests, not in stepline.testing: it drives everything above the store (the CLI, the drills).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from stepline.core.oneline import one_line
from stepline.model import schema
from stepline.store import query_profile

SINGLE = "stepline_single"
CLUSTERS = {"one_shard": "stepline_one", "two_shards": "stepline_two"}
# 9000 is what ClickHouse's config.xml ships; chDB opens no port, it only compares each replica with it.
PORT = 9000
_REPLICATED = re.compile(r"ENGINE = Replicated(\w+)\('[^']*', '[^']*'\)")
_REPLICATED_SETTINGS = re.compile(
    r"\breplicated_deduplication_window = \d+(, replicated_deduplication_window\w* = \d+)*")


def engine_config() -> str:
    """The engine's remote_servers and tcp_port: two clusters whose every replica is this process."""
    def replica(host: str) -> str:
        return f"<replica><host>{host}</host><port>{PORT}</port></replica>"
    return (f"<tcp_port>{PORT}</tcp_port><remote_servers>"
            f"<one_shard><shard>{replica('127.0.0.1')}</shard></one_shard>"
            f"<two_shards><shard>{replica('127.0.0.1')}</shard><shard>{replica('localhost')}</shard></two_shards>"
            "</remote_servers>")


def rewrite(statement: str) -> str:
    """A cluster statement as one chDB process runs it: no ON CLUSTER (no Keeper to queue it), plain engines (no
    Keeper to replicate them) keeping their deduplication window as plain tables do."""
    statement = re.sub(r" ON CLUSTER `[^`]+`", "", statement)
    if _REPLICATED.search(statement):
        statement = _REPLICATED.sub(r"ENGINE = \1", statement)
        statement = _REPLICATED_SETTINGS.sub(f"non_replicated_deduplication_window = {schema.DEDUP_INSERTS}",
                                             statement)
    return statement


def store_url(path: str, database: str, cluster: str = "") -> str:
    return f"chdb://{path}?database={database}" + (f"&cluster={cluster}" if cluster else "")


# ---- the data: the seed's gateway story, two engines behind a router, ten minutes ----

def fill(path: str) -> tuple[datetime, datetime]:
    """The single-node database filled by a replay, then each cluster's schema applied and the same rows inserted
    through its Distributed tables; the data's time range."""
    from stepline.app.demo import roll_up_usage
    from stepline.drills.gateway import replay, seed_story
    from stepline.store.cluster import ClusterSchema
    from stepline.store.store import Store

    _, _, window = replay(seed_story(), store_url(path, SINGLE))
    # The collector's usage rollup, as the demo makes it (every host's engines, the replay's whole minutes).
    roll_up_usage(store_url(path, SINGLE), "", window.start.timestamp(), window.end.timestamp())
    store = Store.open(store_url(path, SINGLE))
    _gateway_samples(store)
    for cluster, database in CLUSTERS.items():
        ClusterSchema(store.client, database, cluster, rewrite).apply(30, store_url(path, database, cluster))
        for table in schema.TABLES:
            columns = ", ".join(f"`{c}`" for c in table.column_names)
            store.client.command(f"INSERT INTO `{database}`.`{table.name}` ({columns}) SELECT {columns} "
                                 f"FROM `{SINGLE}`.`{table.name}`", settings={"distributed_foreground_insert": 1})
    store.close()
    return window.start, window.end


def _gateway_samples(store: Any) -> None:
    """A scraped router's in-flight gauge per backend every 5 s, from its decisions (the replay scrapes no router)."""
    from stepline.diagnosis.gateway import IN_FLIGHT_METRICS

    store.client.command(
        f"INSERT INTO `{SINGLE}`.gateway_samples (ts, host, engine, gateway, metric, kind, labels, value, delta) "
        f"SELECT toStartOfInterval(ts, INTERVAL 5 SECOND) AS t, any(host), engine, gateway, '{IN_FLIGHT_METRICS[0]}', "
        "'gauge', map('server', engine), toFloat64(max(coalesce(in_flight, 0))), 0 "
        f"FROM `{SINGLE}`.gateway_decisions WHERE engine != '' GROUP BY t, engine, gateway")


# ---- the reads ----

Read = Callable[[str, str, datetime, datetime], Any]  # (store URL, database, start, end) -> comparable value


def reads(dashboards: Path) -> dict[str, Read]:
    """Every read of stepline, by name: dashboard queries (as Grafana sends them, through the query endpoint),
    detectors, the CLI's read commands, the gateway analysis and the collector's own lookups."""
    from stepline.diagnosis.detectors import DETECTORS

    found: dict[str, Read] = {}
    for name, raw in dashboard_queries(dashboards):
        found[f"dashboard {name}"] = _dashboard(raw, chosen(dashboards / f"{name.split(' / ')[0]}.json"))
    for name, detector in DETECTORS:
        found[f"detector {name}"] = _detector(name, detector)
    found["cli timeline"] = lambda url, db, start, end: _cli(
        ["timeline", "--around", (start + (end - start) / 2).isoformat(), "--window", "60", "--store", url])
    found["cli requests"] = lambda url, db, start, end: _cli(["requests", "--slowest", "30", "--since", "2h",
                                                              "--store", url])
    found["cli diagnose"] = lambda url, db, start, end: _cli(["diagnose", *_between(start, end), "--json",
                                                              "--store", url])
    found["cli whatif"] = lambda url, db, start, end: _cli(  # its last two minutes: the replays take seconds each
        ["whatif", *_between(end - timedelta(seconds=120), end), "--json", "--jobs", "1", "--replays", "2",
         "--store", url])
    found["cli report"] = _report
    found["cli doctor"] = lambda url, db, start, end: _cli(["doctor", "--no-probe", "--json", "--store", url])
    found["gateway lanes"] = _analysis("lanes")
    found["gateway largest"] = _analysis("largest")
    found["gateway slots"] = _analysis("slots")
    found["store recent_requests"] = _lookup("recent")
    found["store requests_of"] = _lookup("of")
    found["store engine_models"] = _lookup("models")
    return found


def dashboard_queries(dashboards: Path) -> list[tuple[str, str]]:
    """(dashboard / panel, raw SQL) of every ClickHouse query of the committed dashboards, variables included."""
    from stepline.dashboards.query import CLICKHOUSE_TYPE

    found: list[tuple[str, str]] = []
    for path in sorted(dashboards.glob("*.json")):
        d = json.loads(path.read_text())
        for panel in d["panels"]:
            for i, t in enumerate(panel["targets"]):
                if t["datasource"]["type"] == CLICKHOUSE_TYPE:
                    found.append((f"{path.stem} / {panel['title']} [{i}]", t["rawSql"]))
        for a in d.get("annotations", {}).get("list", []):
            found.append((f"{path.stem} / annotation {a['name']}", a["target"]["rawSql"]))
        for v in d["templating"]["list"]:
            if v["type"] == "query":
                found.append((f"{path.stem} / variable ${v['name']}", v["query"]))
    return found


def chosen(dashboard: Path) -> dict[str, str]:
    """What a dashboard's variables that are no query hold when it opens (a custom variable's current value, a
    textbox's text): Grafana's default for them, as All is for the others."""
    found = {}
    for v in json.loads(dashboard.read_text())["templating"]["list"]:
        if v["type"] in ("custom", "textbox", "constant"):
            found[v["name"]] = str((v.get("current") or {}).get("value", v.get("query", "")) or "")
    return found


def _between(start: datetime, end: datetime) -> list[str]:
    return ["--from", start.isoformat(), "--to", end.isoformat()]


_ENDPOINTS: dict[str, Any] = {}


def _endpoint_client(url: str, database: str) -> Any:
    """A clickhouse-connect client of a query endpoint over `database`, as Grafana's datasource reaches it."""
    import clickhouse_connect

    from stepline.endpoints.query import QueryEndpoint
    from stepline.store.store import Store

    if database not in _ENDPOINTS:
        store = Store.open(url)
        endpoint = QueryEndpoint(store.reader(), port=0, database=database)
        endpoint.start()
        port = int(endpoint.url.rsplit(":", 1)[1].strip("/"))
        _ENDPOINTS[database] = clickhouse_connect.get_client(host="127.0.0.1", port=port,
                                                             database=database, autogenerate_session_id=False)
    return _ENDPOINTS[database]


def _dashboard(raw: str, defaults: dict[str, str]) -> Read:
    def run(url: str, database: str, start: datetime, end: datetime) -> Any:
        from stepline.dashboards.macros import ALL, QueryContext, expand

        from_ms, to_ms = int(start.timestamp() * 1000), int(end.timestamp() * 1000) + 60_000
        ctx = QueryContext(from_ms - 60_000, to_ms, 10_000, _AllVariables(ALL, defaults))
        rows = _endpoint_client(url, database).query(expand(raw, ctx)).result_rows
        limit = _SAMPLE.search(raw)
        if limit and "ORDER BY" not in raw and len(rows) == int(limit.group(1)):
            return {"sampled rows": len(rows)}  # any LIMIT rows of more: which ones is the plan's choice
        return _rows(rows)
    return run


_SAMPLE = re.compile(r"\bLIMIT (\d+)\s*$")


class _AllVariables(dict[str, str]):
    """Grafana's default selection, All, for any variable a dashboard names, except those `defaults` holds (a
    custom variable's or a textbox's value when the dashboard opens)."""

    def __init__(self, value: str, defaults: dict[str, str]) -> None:
        super().__init__(defaults)
        self.value = value

    def __missing__(self, key: str) -> str:
        return self.value

    def __contains__(self, key: object) -> bool:
        return True

    def get(self, key: str, default: Any = None) -> Any:
        return self[key]


def _detector(name: str, detector: Any) -> Read:
    def run(url: str, database: str, start: datetime, end: datetime) -> Any:
        from stepline.diagnosis.detectors import diagnose
        from stepline.diagnosis.findings import Window
        from stepline.store.reader import open_reader

        reader = open_reader(url)
        try:
            findings = diagnose(reader.client, Window(start, end + timedelta(seconds=60)), ((name, detector),))
        finally:
            reader.close()
        failed = [f.title for f in findings if f.kind == "detector_failed"]
        if failed:
            raise RuntimeError(failed[0])
        return [_normal(f.as_json()) for f in findings]
    return run


def _analysis(what: str) -> Read:
    def run(url: str, database: str, start: datetime, end: datetime) -> Any:
        from stepline.analysis import gateway
        from stepline.diagnosis.findings import Window
        from stepline.store.reader import open_reader

        reader = open_reader(url)
        window = Window(start, end + timedelta(seconds=60))
        try:
            if what == "lanes":
                return gateway.lanes(reader.client, window)
            if what == "largest":
                return gateway.largest(reader.client, window, 1000)
            engine = reader.client.query("SELECT engine FROM gateway_decisions WHERE engine != '' "
                                         "ORDER BY engine DESC LIMIT 1").result_rows[0][0]
            return gateway.slots(reader.client, window, engine)
        finally:
            reader.close()
    return run


def _lookup(what: str) -> Read:
    def run(url: str, database: str, start: datetime, end: datetime) -> Any:
        from stepline.store.store import Store

        store = Store.open(url)
        try:
            host = store.query("SELECT any(host) FROM requests").result_rows[0][0]
            if what == "models":
                return sorted(store.engine_models(host).items())
            if what == "recent":
                found = store.recent_requests(host, 7200.0)
            else:
                keys = [(str(e), str(r)) for e, r in store.query(
                    "SELECT DISTINCT engine, request_id FROM requests ORDER BY engine, request_id LIMIT 50"
                ).result_rows]
                found = store.requests_of(host, keys)
            return sorted(_normal(list(r)) for r in found)
        finally:
            store.close()
    return run


def _report(url: str, database: str, start: datetime, end: datetime) -> Any:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "report.html"
        _cli(["report", *_between(start, end), "--no-whatif", "--out", str(out), "--store", url])
        # The page says when it was made: everything else is the store's.
        return re.sub(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(\.\d+)?(\+00:00| UTC)?", "T", out.read_text())


def _cli(argv: list[str], *, errors: bool = False) -> Any:
    from stepline.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    found = {"exit": code, "stdout": out.getvalue()}
    return found | {"stderr": err.getvalue()} if errors else found


def _rows(rows: list[Any]) -> list[Any]:
    """Rows in an order and a precision two plans of one query agree on (ties ordered any way; float sums in any
    order)."""
    return sorted((_normal(list(r)) for r in rows), key=repr)


def _normal(value: Any) -> Any:
    if isinstance(value, float):
        return None if math.isnan(value) else float(f"{value:.9g}")
    if isinstance(value, dict):
        return {k: _normal(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_normal(v) for v in value]
    if isinstance(value, datetime):
        return value.isoformat()
    return value if isinstance(value, (int, str, bool, type(None))) else repr(value)


# ---- what adds up, for the two-shard cluster: every table's rows and the sums of its numbers ----

def additive(database: str, path: str) -> dict[str, Any]:
    """Per table: its row count and the sum of each numeric column (steps' tokens, samples' values, ...)."""
    from stepline.store.store import Store

    store = Store.open(store_url(path, database))
    try:
        figures: dict[str, Any] = {}
        for table in schema.TABLES:
            numeric = [c for c, t in table.columns if re.match(r"(Nullable\()?(U?Int|Float)", t)]
            sums = ", ".join(f"toFloat64(sum(`{c}`))" for c in numeric)
            row = store.query(f"SELECT count(){', ' + sums if sums else ''} FROM `{table.name}`").result_rows[0]
            figures[table.name] = dict(zip(["count()", *numeric], _normal(list(row)), strict=True))
        return figures
    finally:
        store.close()


# ---- retries: a spool segment stored, its acknowledgement lost, the segment inserted again ----

class _LostAcknowledgement:
    """A store whose first answer to each insert never arrives, after the insert went in: what a connection that
    breaks while the server writes looks like to a writer."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.tokens: list[str | None] = []

    def insert_native(self, table: str, column_names: Any, data: bytes, dedup_token: str | None = None) -> None:
        self.store.insert_native(table, column_names, data, dedup_token)
        self.tokens.append(dedup_token)
        if len(self.tokens) == 1:
            raise TimeoutError("the answer to the insert never came")


def retried(path: str, database: str, cluster: str) -> dict[str, Any]:
    """A writer's segment of steps rows, inserted through the cluster's Distributed table, its acknowledgement lost
    and the segment retried from the spool; then the same rows again as a new segment. Rows in the shard-local
    table after each, and the tokens the inserts carried."""
    import time as clock

    from prometheus_client import CollectorRegistry

    from stepline.ingest.metrics import IngestMetrics
    from stepline.ingest.spool import Spool
    from stepline.ingest.writer import TableWriter
    from stepline.store.store import Store

    store = Store.open(store_url(path, database, cluster))
    store.ensure_schema(30)  # the cluster check: the insert settings a collector uses on this cluster
    rows = store.query(f"SELECT * FROM `{SINGLE}`.steps ORDER BY ts LIMIT 300").result_rows
    local = f"SELECT count() FROM `{schema.local_name('steps')}`"
    before = int(store.query(local).result_rows[0][0])
    counts = []
    sink = _LostAcknowledgement(store)
    for _ in range(2):
        metrics = IngestMetrics(CollectorRegistry())
        writer = TableWriter("steps", sink, metrics.writer, Spool(metrics.drops, max_bytes=1 << 26),
                             flush_interval_s=0.05, retry_max_s=0.5)
        writer.start()
        writer.put(rows)
        deadline = clock.monotonic() + 30
        while writer.depth() and clock.monotonic() < deadline:
            clock.sleep(0.05)
        writer.stop(5.0)
        counts.append(int(store.query(local).result_rows[0][0]) - before)
    settings = dict(store._insert_settings)
    store.close()
    return {"rows": len(rows), "after_retry": counts[0], "after_new_segment": counts[1], "tokens": sink.tokens,
            "settings": settings}


# ---- the schema's one owner: the job applies and migrates, collectors only check ----

def schema_job(path: str) -> dict[str, Any]:
    """What a collector and `stepline schema --cluster --apply` do to a cluster database: before the job ran, after
    it, after a version older and one newer than this stepline's, and after the job met tables an older stepline
    made (a column and a projection missing)."""
    from unittest import mock

    from stepline.store.cluster import ClusterSchema
    from stepline.store.errors import StoreError
    from stepline.store.store import Store

    database, cluster = "stepline_job", "one_shard"
    url = store_url(path, database, cluster)
    admin = Store.open(store_url(path, SINGLE))
    found: dict[str, Any] = {}

    def collector_opens() -> str:
        store = Store.open(url)
        try:
            store.ensure_schema(30)
            return "ok"
        except StoreError as exc:
            return str(exc)
        finally:
            store.close()

    def tables() -> list[str]:
        return sorted(str(r[0]) for r in admin.query("SELECT name FROM system.tables WHERE database = {db:String}",
                                                      parameters={"db": database}).result_rows)

    admin.client.command(f"CREATE DATABASE `{database}`")
    found["before the job"] = collector_opens()
    found["tables a collector left"] = tables()
    with mock.patch.object(ClusterSchema, "as_written", staticmethod(rewrite)):
        found["job exit"] = _cli(["schema", "--cluster", cluster, "--retention", "30", "--apply", url])
        found["after the job"] = collector_opens()
        found["tables after the job"] = tables()
        version = f"`{database}`.`schema_version`"
        for label, delta in (("older", -1), ("newer", 1)):
            admin.client.command(f"TRUNCATE TABLE {version}")
            admin.client.command(f"INSERT INTO {version} VALUES ({schema.SCHEMA_VERSION + delta}, now64(6))")
            found[f"{label} schema"] = collector_opens()
        found["job on newer"] = _cli(["schema", "--cluster", cluster, "--apply", url], errors=True)
        admin.client.command(f"TRUNCATE TABLE {version}")
        admin.client.command(f"INSERT INTO {version} VALUES ({schema.SCHEMA_VERSION - 1}, now64(6))")
        for name in (schema.local_name("events"), "events"):
            admin.client.command(f"ALTER TABLE `{database}`.`{name}` DROP COLUMN attributes")
        admin.client.command(f"ALTER TABLE `{database}`.`{schema.local_name('steps')}` "
                             "DROP PROJECTION steps_per_minute")
        found["job on older"] = _cli(["schema", "--cluster", cluster, "--apply", url])
    found["after migrating"] = collector_opens()
    found["events columns"] = [str(r[0]) for r in admin.query(
        "SELECT table, name FROM system.columns WHERE database = {db:String} AND name = 'attributes' ORDER BY table",
        parameters={"db": database}).result_rows]
    found["steps_local projections"] = sorted(str(r[0]) for r in admin.query(
        "SELECT name FROM system.projections WHERE database = {db:String} AND table = 'steps_local'",
        parameters={"db": database}).result_rows)
    admin.close()
    return found


def run_all(dashboards: Path, folder: str) -> dict[str, Any]:
    """Fill the databases, run every read on each: {"reads": {name: {database: {"value" | "error"}}}, ...}."""
    query_profile.add_engine_config(engine_config())
    path = str(Path(folder) / "store")
    start, end = fill(path)
    targets = {SINGLE: store_url(path, SINGLE)}
    targets |= {database: store_url(path, database, cluster) for cluster, database in CLUSTERS.items()}
    results: dict[str, dict[str, Any]] = {}
    for name, read in reads(dashboards).items():
        results[name] = {}
        for database, url in targets.items():
            started = time.perf_counter()
            try:
                value = read(url, database, start, end)
            except Exception as exc:  # a read that fails is the result the test reports
                results[name][database] = {"error": one_line(exc, 600)}
            else:
                text = (json.dumps(value, default=str).replace(url, "URL").replace(f"chdb://{path}", "URL")
                        .replace(path, "PATH").replace(database, "DATABASE"))
                results[name][database] = {"value": json.loads(text)}
            results[name][database]["seconds"] = round(time.perf_counter() - started, 3)
    return {"reads": results, "additive": {db: additive(db, path) for db in targets},
            "retries": {db: retried(path, db, cluster) for cluster, db in CLUSTERS.items()},
            "schema job": schema_job(path),
            "window": [start.isoformat(), end.isoformat()]}


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    dashboards = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parents[2] / "dashboards"
    with tempfile.TemporaryDirectory(prefix="stepline-cluster-") as folder:
        result = run_all(dashboards, folder)
    out.write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
