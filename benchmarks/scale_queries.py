"""Incident queries at scale: days of 8-GPU nodes in the store, then every dashboard query and `diagnose`.

    python benchmarks/scale_queries.py [--hours 24] [--hosts 1] [--engines 8] [--store URL] [--keep] [--rounds 3]

Synthesises the timeline inside ClickHouse (benchmarks/scale_data.py: 31M steps for 8 engines over 24 h,
requests, /metrics every 5 s, NVML at 10 Hz, psutil, events, three incidents near the end on the first node)
into an embedded store in a temporary directory, or into `--store`. An embedded `--store` that a finished fill
left is reused as it is (the fill writes `<dir>.scale.json` beside it: the shape, and what synthesis took), so
the rows are generated once and timed many times; one that holds steps but no such record (a fill cut short)
is refused. Then times every ClickHouse query of every generated dashboard (panels, variables, annotations;
macros expanded as Grafana's ClickHouse datasource does, with Grafana's default selection, All, for every
host, engine and GPU variable, at the interval Grafana picks for a 1,000-pixel-wide panel) over each
dashboard's default range, 24 h and, when the rows span it, 7 days; and `diagnose` (the Python API under
`stepline diagnose`), every detector and each on its own, over the last 30 minutes and 24 h. Each query runs
`--rounds` times (once more only while under 10 s: a query slower than that has missed by far, and its row
says how many rounds it ran); the best round is judged against the target (2 s), the median is shown beside it.
Prints a TARGET MISSED line for each miss; always exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import resource
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import chdb
from scale_data import Shape, synthesise

from stepline.core.oneline import one_line
from stepline.core.texttable import render_table
from stepline.dashboards.macros import ALL, QueryContext, expand
from stepline.dashboards.query import CLICKHOUSE_TYPE
from stepline.diagnosis.detectors import DETECTORS, diagnose
from stepline.diagnosis.findings import Window
from stepline.store.store import Store
from stepline.store.url import parse_store_url

TARGET_S = 2.0
DASHBOARDS = Path(__file__).resolve().parent.parent / "dashboards"
TABLES = ("steps", "requests", "engine_samples", "gpu_samples", "host_samples", "events", "gateway_decisions")
# Grafana's interval for a panel about 1,000 pixels wide: range / 1000, rounded as Grafana rounds it.
_NICE_MS = (10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10_000, 15_000, 20_000, 30_000, 60_000, 120_000,
            300_000, 600_000, 900_000, 1_200_000, 1_800_000, 3_600_000)


def grafana_interval_ms(range_ms: int, points: int = 1000) -> int:
    """The nice interval Grafana rounds range/points to (its `roundInterval`: the nearest step, roughly)."""
    raw = range_ms / points
    return min(_NICE_MS, key=lambda nice: abs(nice - raw) if nice >= raw * 0.65 else float("inf"))


@dataclass(frozen=True)
class Timed:
    name: str
    window: str
    rounds: list[float]
    rows: int
    error: str = ""

    @property
    def best(self) -> float:
        return min(self.rounds) if self.rounds else float("nan")

    @property
    def passed(self) -> bool:
        return not self.error and self.best < TARGET_S

    def show(self) -> Timed:
        """Print this result's line as soon as it is measured (a run cut short keeps what it had), and return it."""
        median = f"{statistics.median(self.rounds):.3f}" if self.rounds else "-"
        print(f"  {self.name} ({self.window}): best {self.best:.3f} s, median {median} s, {len(self.rounds)} "
              f"round(s), {self.rows} rows{' ' + self.error if self.error else ''}", flush=True)
        return self


DAY_S, WEEK_S = 86_400, 7 * 86_400


def _range_s(grafana_from: str) -> int:
    """Seconds in a dashboard's default range, `now-1h` style."""
    amount, unit = grafana_from.removeprefix("now-")[:-1], grafana_from[-1]
    return int(amount) * {"m": 60, "h": 3600, "d": DAY_S}[unit]


def dashboard_queries() -> list[tuple[str, int, str]]:
    """(dashboard / panel-or-variable, the dashboard's default range in seconds, raw SQL) for every ClickHouse
    query of the committed dashboards (a dashboard of Prometheus queries only, collector-health, has none)."""
    found: list[tuple[str, int, str]] = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        d = json.loads(path.read_text())
        short, default_s = path.stem, _range_s(d["time"]["from"])
        for panel in d["panels"]:
            for t in panel["targets"]:
                if t["datasource"]["type"] == CLICKHOUSE_TYPE:
                    found.append((f"{short} / {panel['title']}", default_s, t["rawSql"]))
        for a in d.get("annotations", {}).get("list", []):
            found.append((f"{short} / annotation {a['name']}", default_s, a["target"]["rawSql"]))
        for v in d["templating"]["list"]:
            if v["type"] == "query":
                found.append((f"{short} / variable ${v['name']}", default_s, v["query"]))
    return found


def every_variable_all() -> dict[str, str]:
    """Grafana's default selection for every variable of the committed dashboards: All for the query variables
    ($host, $engine, $gpu, $gateway, $lane, ...), a custom or text box variable's default value ($by, $gpu_price
    of the Usage dashboard: team, and no price)."""
    chosen: dict[str, str] = {}
    for path in sorted(DASHBOARDS.glob("*.json")):
        for v in json.loads(path.read_text())["templating"]["list"]:
            current = v.get("current") or {}
            chosen[v["name"]] = str(current.get("value", "")) if v["type"] in ("custom", "textbox") else ALL
    return chosen


# A query whose round takes this long has missed by far: it is not run again (its row shows fewer rounds).
GIVE_UP_S = 5 * TARGET_S


def _time(rounds: int, run: Callable[[], int]) -> tuple[list[float], int, str]:
    times: list[float] = []
    rows = 0
    for _ in range(rounds):
        if times and times[-1] > GIVE_UP_S:
            break
        started = time.perf_counter()
        try:
            rows = run()
        except Exception as exc:  # a failing query is a result to print, not a reason to stop
            return times, rows, one_line(exc, 200)
        times.append(time.perf_counter() - started)
    return times, rows, ""


def time_dashboards(store: Store, end_ms: int, span_s: int | None, rounds: int) -> list[Timed]:
    """Every dashboard query over the last `span_s`, or each over its dashboard's default range (None)."""
    out = []
    for name, default_s, raw in dashboard_queries():
        span_ms = (span_s or default_s) * 1000
        ctx = QueryContext(end_ms - span_ms, end_ms, grafana_interval_ms(span_ms), every_variable_all())
        label = span_label(span_ms // 1000) + ("" if span_s else " (default)")
        sql = expand(raw, ctx)
        times, rows, error = _time(rounds, lambda sql=sql: len(store.query(sql).result_rows))  # type: ignore[misc]
        out.append(Timed(name, label, times, rows, error).show())
    return out


def time_diagnosis(store: Store, end: datetime, span_s: int, label: str, rounds: int) -> list[Timed]:
    window = Window(end - timedelta(seconds=span_s), end)
    out = []
    for name, detector in DETECTORS:
        one = ((name, detector),)
        times, rows, error = _time(rounds, lambda one=one: len(diagnose(store.client, window, one)))  # type: ignore[misc]
        out.append(Timed(f"diagnose / {name}", label, times, rows, error).show())
    times, rows, error = _time(rounds, lambda: len(diagnose(store.client, window)))
    out.append(Timed("diagnose (every detector, as the CLI)", label, times, rows, error).show())
    return out


@contextmanager
def opened(url: str | None, keep: bool) -> Iterator[Store]:
    tmp = None if url else tempfile.mkdtemp(prefix="stepline-scale-")
    store = Store.open(url or f"chdb://{tmp}/store")
    try:
        yield store
    finally:
        store.close()
        if tmp and not keep:
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp:
            print(f"\nstore kept: chdb://{tmp}/store")


def wait_for_mutations(store: Store) -> float | None:
    """Wait until the store's background mutations are done (a projection ensure_schema added is built for the
    rows already there), so that none runs beside the queries timed; seconds waited, None when none ran."""
    started = time.monotonic()
    waited = False
    while store.query("SELECT count() FROM system.mutations WHERE database = currentDatabase() AND NOT is_done"
                      ).result_rows[0][0]:
        waited = True
        time.sleep(1)
    return time.monotonic() - started if waited else None


def counts(store: Store) -> dict[str, int]:
    return {t: int(store.query(f"SELECT count() FROM `{t}`").result_rows[0][0]) for t in TABLES}


def span_label(seconds: int) -> str:
    if seconds % DAY_S == 0 and seconds > DAY_S:
        return f"{seconds // DAY_S} d"
    return f"{seconds // 3600} h" if seconds % 3600 == 0 else f"{seconds // 60} min"


def record_path(url: str) -> Path | None:
    """Where a fill of an embedded store records itself: `<dir>.scale.json` beside the store's directory."""
    parsed = parse_store_url(url)
    return Path(parsed.path.rstrip("/") + ".scale.json") if parsed.embedded else None


def peak_rss_mib() -> float:
    """This process's peak RSS (chDB runs inside it), MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def disk_mib(url: str) -> float | None:
    parsed = parse_store_url(url)
    if not parsed.embedded:
        return None
    return sum(f.stat().st_size for f in Path(parsed.path).rglob("*") if f.is_file()) / 2**20


def fill(store: Store, shape: Shape) -> dict[str, float]:
    """Synthesise the timeline, then merge every table's parts as days of background merges would; returns what
    each table's synthesis took, and the merge, in seconds."""
    print(f"synthesising {shape.hours:g} h of {shape.hosts} host(s) x {shape.engines} engines at "
          f"{shape.step_rate:g} steps/s ...", flush=True)
    per_table: dict[str, float] = {}

    def run(label: str, sql: str) -> None:
        started = time.monotonic()
        store.client.command(sql)
        table = label.split()[0] if label.split()[0] in TABLES else "steps"
        per_table[table] = per_table.get(table, 0.0) + time.monotonic() - started

    started = time.monotonic()
    synthesise(run, shape)
    made = time.monotonic() - started
    print("synthesis: " + ", ".join(f"{t} {s:.0f} s" for t, s in per_table.items()) + f"; {made:.0f} s in all")
    started = time.monotonic()
    for (name,) in store.query("SELECT name FROM system.tables WHERE database = currentDatabase() "
                               "AND engine LIKE '%MergeTree'").result_rows:
        store.client.command(f"OPTIMIZE TABLE `{name}` FINAL")
    merged = time.monotonic() - started
    print(f"merging parts: {merged:.0f} s (synthesis and merge: {made + merged:.0f} s)")
    return {**per_table, "synthesis": made, "merge": merged}


def print_rows(store: Store) -> None:
    disk = {str(t): int(b) for t, b in store.query(
        "SELECT table, sum(bytes_on_disk) FROM system.parts WHERE active AND database = currentDatabase() "
        "GROUP BY table").result_rows}
    projections = {str(t): int(b) for t, b in store.query(
        "SELECT table, sum(bytes_on_disk) FROM system.projection_parts WHERE active AND "
        "database = currentDatabase() GROUP BY table").result_rows}
    print(render_table(["table", "rows", "on disk MiB", "of which projections MiB"],
                       [[t, f"{n:,}", f"{disk.get(t, 0) / 2**20:,.0f}", f"{projections.get(t, 0) / 2**20:,.0f}"]
                        for t, n in counts(store).items()]))


def print_findings(store: Store, end: datetime, spans: Sequence[int]) -> None:
    """What diagnose finds in each window: the injected incidents should be among it."""
    for seconds in spans:
        findings = diagnose(store.client, Window(end - timedelta(seconds=seconds), end))
        print(f"\nfindings over the last {span_label(seconds)}:")
        for f in findings[:8]:
            print(f"  {f.severity:8s} {f.kind:28s} {f.engine or '(all)':14s} {f.title}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--hours", type=float, default=24.0, help="hours of timeline to synthesise (default 24)")
    parser.add_argument("--engines", type=int, default=8, help="engines per host, one per GPU (default 8)")
    parser.add_argument("--hosts", type=int, default=1, help="hosts (8 x 8 GPUs: a fleet of 64 engines; default 1)")
    parser.add_argument("--step-rate", type=float, default=45.0, help="steps per second per engine (default 45)")
    parser.add_argument("--steps-hours", type=float,
                        help="steps over the last this many hours only (every other table over all of them): a "
                             "store for usage_scale.py, not for timing the dashboards or diagnose")
    parser.add_argument("--store", help="store URL to fill (or reuse when it holds steps); default: a temp dir")
    parser.add_argument("--keep", action="store_true", help="keep the temporary store and print its URL")
    parser.add_argument("--rounds", type=int, default=3, help="runs per query (default 3)")
    parser.add_argument("--only", choices=("dashboards", "diagnose", "fill"),
                        help="time only these (fill: fill the store, or show what it holds, and time nothing)")
    args = parser.parse_args(argv)
    print(f"{os.cpu_count()} CPUs; chDB {chdb.__version__}")
    record = record_path(args.store) if args.store else None
    with opened(args.store, args.keep) as store:
        # Retention well past the rows' span: a week of rows must not expire while it is timed.
        store.ensure_schema(max(30, math.ceil(args.hours / 24) + 7))
        built_in = wait_for_mutations(store)
        if built_in is not None:
            print(f"the store's schema brought up to date (projections built for the rows there): {built_in:.0f} s")
        if counts(store)["steps"] == 0:
            shape = Shape(end_s=int(time.time()), hours=args.hours, engines=args.engines, hosts=args.hosts,
                          step_rate=args.step_rate, steps_hours=args.steps_hours)
            took = fill(store, shape)
            if record:
                record.write_text(json.dumps({"shape": dataclasses.asdict(shape), "seconds": took,
                                              "peak_rss_mib": peak_rss_mib(), "rows": counts(store)}, indent=1))
        elif record and not record.exists():
            print(f"{args.store} holds steps but no {record.name}: a fill cut short? delete it and run again")
            return 1
        else:
            print("reusing the store's rows" + (f" ({record}: {record.read_text()})" if record else ""))
        print_rows(store)
        disk = disk_mib(args.store) if args.store else None
        print(f"peak RSS so far {peak_rss_mib():,.0f} MiB" + (f"; store on disk {disk:,.0f} MiB" if disk else ""))
        end_us, start_us = (int(v) for v in store.query("SELECT toUnixTimestamp64Micro(max(ts)), "
                                                        "toUnixTimestamp64Micro(min(ts)) FROM steps").result_rows[0])
        end = datetime.fromtimestamp(end_us / 1e6 + 1, UTC).replace(microsecond=0)
        held_s = (end_us - start_us) / 1e6
        if args.only == "fill":
            return 0
        dash_spans: list[int | None] = [None, DAY_S] + ([WEEK_S] if held_s >= WEEK_S - 3600 else [])
        diag_spans = (1800, DAY_S)
        results: list[Timed] = []
        if args.only != "diagnose":
            for span in dash_spans:
                print(f"timing dashboards over {span_label(span) if span else 'their default range'} "
                      f"(at a {grafana_interval_ms((span or 3600) * 1000) / 1000:g} s interval) ...", flush=True)
                results += time_dashboards(store, int(end.timestamp() * 1000), span, args.rounds)
        if args.only != "dashboards":
            for seconds in diag_spans:
                print(f"timing diagnose over {span_label(seconds)} ...", flush=True)
                results += time_diagnosis(store, end, seconds, span_label(seconds), args.rounds)
            print_findings(store, end, diag_spans)
        print()
        print(render_table(["query", "window", "best s", "median s", "rounds", "rows", "result"],
                           [[r.name, r.window, f"{r.best:.3f}", f"{statistics.median(r.rounds):.3f}" if r.rounds
                             else "-", len(r.rounds), r.rows, "PASS" if r.passed else "TARGET MISSED"]
                            for r in results],
                           max_width=70))
        for r in results:
            if not r.passed:
                why = r.error or f"{r.best:.2f} s >= {TARGET_S:g} s"
                print(f"TARGET MISSED {r.name} ({r.window}): {why}")
        print(f"\n{sum(r.passed for r in results)}/{len(results)} under {TARGET_S:g} s (best of {args.rounds}; "
              "rows: rows returned, or findings for diagnose)")
        print(f"peak RSS {peak_rss_mib():,.0f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
