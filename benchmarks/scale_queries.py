"""Incident queries at scale: a day of an 8-GPU node in the store, then every dashboard query and `diagnose`.

    python benchmarks/scale_queries.py [--hours 24] [--engines 8] [--store URL] [--keep] [--rounds 3]

Synthesises the timeline inside ClickHouse (benchmarks/scale_data.py: >= 30M steps for 8 engines over
24 h, requests, /metrics every 5 s, NVML at 10 Hz, psutil, events, three incidents near the end) into an
embedded store in a temporary directory, or into `--store` (reused as it is when it already holds steps).
Then times, over the last 30 minutes and the last `--hours`: every ClickHouse query of every generated
dashboard (panels, variables, annotations; macros expanded as Grafana's ClickHouse datasource does, for
all hosts, engines and GPUs, at the interval Grafana picks for a 1,000-pixel-wide panel), and
`diagnose` (the Python API under `stepline diagnose`) with each detector on its own. Each query runs
`--rounds` times; the best round is judged against the target (2 s), the median is shown beside it.
Prints a TARGET MISSED line for each miss; always exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
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

from stepline.core.texttable import render_table
from stepline.dashboards.macros import ALL, QueryContext, expand
from stepline.dashboards.query import CLICKHOUSE_TYPE
from stepline.diagnosis.detectors import DETECTORS, diagnose
from stepline.diagnosis.findings import Window
from stepline.store.store import Store

TARGET_S = 2.0
DASHBOARDS = Path(__file__).resolve().parent.parent / "dashboards"
TABLES = ("steps", "requests", "engine_samples", "gpu_samples", "host_samples", "events")
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


def dashboard_queries() -> list[tuple[str, str]]:
    """(dashboard / panel-or-variable, raw SQL) for every ClickHouse query of the committed dashboards."""
    found: list[tuple[str, str]] = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        d = json.loads(path.read_text())
        short = path.stem
        for panel in d["panels"]:
            for t in panel["targets"]:
                if t["datasource"]["type"] == CLICKHOUSE_TYPE:
                    found.append((f"{short} / {panel['title']}", t["rawSql"]))
        for a in d.get("annotations", {}).get("list", []):
            found.append((f"{short} / annotation {a['name']}", a["target"]["rawSql"]))
        for v in d["templating"]["list"]:
            if v["type"] == "query":
                found.append((f"{short} / variable ${v['name']}", v["query"]))
    return found


def _time(rounds: int, run: Callable[[], int]) -> tuple[list[float], int, str]:
    times: list[float] = []
    rows = 0
    for _ in range(rounds):
        started = time.perf_counter()
        try:
            rows = run()
        except Exception as exc:  # a failing query is a result to print, not a reason to stop
            return times, rows, " ".join(str(exc).split())[:200]
        times.append(time.perf_counter() - started)
    return times, rows, ""


def time_dashboards(store: Store, end_ms: int, span_s: int, label: str, rounds: int) -> list[Timed]:
    span_ms = span_s * 1000
    ctx = QueryContext(end_ms - span_ms, end_ms, grafana_interval_ms(span_ms),
                       {"host": ALL, "engine": ALL, "gpu": ALL})
    out = []
    for name, raw in dashboard_queries():
        sql = expand(raw, ctx)
        times, rows, error = _time(rounds, lambda sql=sql: len(store.query(sql).result_rows))  # type: ignore[misc]
        out.append(Timed(name, label, times, rows, error))
    return out


def time_diagnosis(store: Store, end: datetime, span_s: int, label: str, rounds: int) -> list[Timed]:
    window = Window(end - timedelta(seconds=span_s), end)
    out = []
    for name, detector in DETECTORS:
        one = ((name, detector),)
        times, rows, error = _time(rounds, lambda one=one: len(diagnose(store.client, window, one)))  # type: ignore[misc]
        out.append(Timed(f"diagnose / {name}", label, times, rows, error))
    times, rows, error = _time(rounds, lambda: len(diagnose(store.client, window)))
    out.append(Timed("diagnose (every detector, as the CLI)", label, times, rows, error))
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


def counts(store: Store) -> dict[str, int]:
    return {t: int(store.query(f"SELECT count() FROM `{t}`").result_rows[0][0]) for t in TABLES}


def span_label(seconds: int) -> str:
    return f"{seconds // 3600} h" if seconds % 3600 == 0 else f"{seconds // 60} min"


def fill(store: Store, shape: Shape) -> None:
    """Synthesise the timeline, then merge every table's parts as a day of background merges would."""
    print(f"synthesising {shape.hours:g} h of {shape.engines} engines at {shape.step_rate:g} steps/s ...", flush=True)
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
    parser.add_argument("--engines", type=int, default=8, help="engines, one per GPU (default 8)")
    parser.add_argument("--step-rate", type=float, default=45.0, help="steps per second per engine (default 45)")
    parser.add_argument("--store", help="store URL to fill (or reuse when it holds steps); default: a temp dir")
    parser.add_argument("--keep", action="store_true", help="keep the temporary store and print its URL")
    parser.add_argument("--rounds", type=int, default=3, help="runs per query (default 3)")
    parser.add_argument("--only", choices=("dashboards", "diagnose"), help="time only these")
    args = parser.parse_args(argv)
    print(f"{os.cpu_count()} CPUs; chDB {chdb.__version__}")
    with opened(args.store, args.keep) as store:
        store.ensure_schema(30)
        if counts(store)["steps"] == 0:
            fill(store, Shape(end_s=int(time.time()), hours=args.hours, engines=args.engines,
                              step_rate=args.step_rate))
        else:
            print("reusing the store's rows")
        print_rows(store)
        end_us = int(store.query("SELECT toUnixTimestamp64Micro(max(ts)) FROM steps").result_rows[0][0])
        end = datetime.fromtimestamp(end_us / 1e6 + 1, UTC).replace(microsecond=0)
        spans = (1800, round(args.hours * 3600))
        results: list[Timed] = []
        for seconds in spans:
            label = span_label(seconds)
            print(f"timing {label} (dashboards at a {grafana_interval_ms(seconds * 1000) / 1000:g} s interval) ...",
                  flush=True)
            if args.only != "diagnose":
                results += time_dashboards(store, int(end.timestamp() * 1000), seconds, label, args.rounds)
            if args.only != "dashboards":
                results += time_diagnosis(store, end, seconds, label, args.rounds)
        if args.only != "dashboards":
            print_findings(store, end, spans)
        print()
        print(render_table(["query", "window", "best s", "median s", "rows", "result"],
                           [[r.name, r.window, f"{r.best:.3f}", f"{statistics.median(r.rounds):.3f}" if r.rounds
                             else "-", r.rows, "PASS" if r.passed else "TARGET MISSED"] for r in results],
                           max_width=70))
        for r in results:
            if not r.passed:
                why = r.error or f"{r.best:.2f} s >= {TARGET_S:g} s"
                print(f"TARGET MISSED {r.name} ({r.window}): {why}")
        print(f"\n{sum(r.passed for r in results)}/{len(results)} under {TARGET_S:g} s (best of {args.rounds}; "
              "rows: rows returned, or findings for diagnose)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
