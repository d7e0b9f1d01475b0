"""Usage and SLO at scale: `stepline usage`, the Usage dashboard and `stepline slo` over a scale store.

    python benchmarks/usage_scale.py --store chdb:///var/tmp/stepline-scale/node-7d [--roll-minutes 60] [--rounds 3]

The store is one `scale_queries.py` filled (its `<dir>.scale.json` says the shape). This adds what the usage readers
need, once, and records it in `<dir>.usage.json`:

- the gateway's decisions, where the fill predates them (scale_data.gateway_decisions_sql: one per request, key and
  team from a hash of its id);
- `usage_minutes`: the real rollup (stepline.analysis.usage_rollup.minute_rows, what the collector's UsageRollup
  runs each minute) over the last `--roll-minutes` whole minutes of every host, each minute timed (reading and
  attributing, then inserting its rows); then those rows copied back a block at a time to the span's first minute.
  The block ends where the collector's rollup would be at the store's end (LAG_S behind it), so a report's last
  minutes fall to the steps as they would. Rolling a week minute by minute costs what the collector spends on it
  over the week (about a CPU-second a minute of a node: hours here); the copies have the real minutes' rows and
  groups, so the readers read as many rows as they would.

Then times, best of `--rounds` (a round over 10 s is not run again), with the rows each reads (EXPLAIN ESTIMATE of
its queries, summed: the rows of the granules left after pruning by primary key and partition):
`stepline usage --by engine|team|model` (usage_rollup.report, as the CLI calls it) over 24 h and, where the store
spans it, 7 d, saying which source answered; `--exact` over the last hour (refused where it holds more steps than one
pass may walk, after counting them);
every query of the Usage dashboard (scale_queries.dashboard_queries, as Grafana expands it, `$by` at its default,
team) over 24 h and 7 d; and `stepline slo` (stepline.analysis.slo.statuses, the default objectives) since 24 h, 7 d
and 30 d. Target: 2 s each. Prints a TARGET MISSED line for each miss; always exits 0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from scale_data import Shape, gateway_decisions_sql
from scale_queries import DAY_S, WEEK_S, dashboard_queries, every_variable_all, grafana_interval_ms, record_path

from stepline.analysis import slo, usage_rollup
from stepline.analysis.usage_rollup import LAG_S, MINUTE_US, minute_rows
from stepline.config.slo import Slo
from stepline.core.texttable import render_table
from stepline.dashboards.macros import QueryContext, expand
from stepline.diagnosis.findings import Window
from stepline.model.rows import micros
from stepline.model.schema import TABLE_BY_NAME
from stepline.store.store import Store

TARGET_S = 2.0
GIVE_UP_S = 5 * TARGET_S
USAGE_COLUMNS = TABLE_BY_NAME["usage_minutes"].column_names


class Counting:
    """A reader that passes each query to the store's client; with `estimate`, it first asks the engine how many
    rows each query will read (EXPLAIN ESTIMATE: the rows of the granules left after pruning by the primary key and
    partitions, summed over its tables) and adds them up, and the time that took, to leave out of a timing. (The
    embedded engine reports no rows read per query: chDB's result counts the rows it returned.)"""

    def __init__(self, client: Any, estimate: bool = False) -> None:
        self._client = client
        self._estimate = estimate
        self.read_rows = 0
        self.estimating_s = 0.0

    def query(self, sql: str, parameters: dict[str, Any] | None = None) -> Any:
        if self._estimate:
            started = time.perf_counter()
            found = self._client.query(f"EXPLAIN ESTIMATE {sql}", parameters=parameters)
            names = list(found.column_names)
            self.read_rows += sum(int(r[names.index("rows")]) for r in found.result_rows)
            self.estimating_s += time.perf_counter() - started
        return self._client.query(sql, parameters=parameters)


@dataclass(frozen=True)
class Timed:
    query: str
    window: str
    rounds: list[float]
    read_rows: int
    note: str = ""
    error: str = ""

    @property
    def best(self) -> float:
        return min(self.rounds) if self.rounds else math.nan

    @property
    def passed(self) -> bool:
        return not self.error and self.best < TARGET_S


def timed(query: str, window: str, rounds: int, run: Callable[[Counting], str], client: Any) -> Timed:
    """Run `run` up to `rounds` times on a counting reader; its note is what the last run returned."""
    times: list[float] = []
    read = 0
    note = error = ""
    for _ in range(rounds):
        if times and times[-1] > GIVE_UP_S:
            break
        reader = Counting(client, estimate=not times)
        started = time.perf_counter()
        try:
            note = run(reader)
        except Exception as exc:  # a failing call is a result to print, not a reason to stop
            error = " ".join(str(exc).split())[:160]
            break
        times.append(time.perf_counter() - started - reader.estimating_s)
        read = read or reader.read_rows
    t = Timed(query, window, times, read, note, error)
    median = f"{statistics.median(times):.3f}" if times else "-"
    print(f"  {query} ({window}): best {t.best:.3f} s, median {median} s, {len(times)} round(s), {read:,} rows read"
          f"{' ' + note if note else ''}{' ERROR ' + error if error else ''}", flush=True)
    return t


def label(seconds: int) -> str:
    if seconds % DAY_S == 0 and seconds > DAY_S:
        return f"{seconds // DAY_S} d"
    return f"{seconds // 3600} h" if seconds % 3600 == 0 else f"{seconds // 60} min"


# -- what the store needs ----------------------------------------------------------------------------------------


def add_decisions(store: Store, shape: Shape) -> float | None:
    """The gateway's decisions for every host, where the store has none; seconds taken (None: there were some)."""
    if int(store.query("SELECT count() FROM gateway_decisions").result_rows[0][0]):
        return None
    started = time.monotonic()
    for h in range(shape.hosts):
        store.client.command(gateway_decisions_sql(shape, h))
    return time.monotonic() - started


def roll_up(store: Store, hosts: Sequence[str], first_us: int, end_us: int, minutes: int) -> dict[str, Any]:
    """The real rollup of the last `minutes` whole minutes before `end_us` of every host, each minute timed; then
    the rows copied back a block at a time to the minute of `first_us`. What it took, for the record."""
    last = (end_us - micros(LAG_S)) // MINUTE_US * MINUTE_US  # where the collector's rollup has got to by the end
    block_start = last - minutes * MINUTE_US
    roll_s: list[float] = []
    roll_cpu_s: list[float] = []
    insert_s = 0.0
    rows = 0
    for host in hosts:
        for m in range(block_start, last, MINUTE_US):
            started, cpu = time.perf_counter(), time.process_time()
            found = minute_rows(store.client, m, host)
            roll_s.append(time.perf_counter() - started)
            roll_cpu_s.append(time.process_time() - cpu)
            started = time.perf_counter()
            if found:
                store.insert("usage_minutes", [list(r) for r in found], USAGE_COLUMNS)
            insert_s += time.perf_counter() - started
            rows += len(found)
        print(f"  rolled {minutes} minutes of {host}: {sum(roll_s[-minutes:]):.0f} s", flush=True)
    start_minute = first_us // MINUTE_US * MINUTE_US
    copies = math.ceil((block_start - start_minute) / (minutes * MINUTE_US))
    started = time.monotonic()
    others = ", ".join(f"`{c}`" for c in USAGE_COLUMNS[1:])
    store.client.command(f"""
INSERT INTO usage_minutes ({', '.join(f'`{c}`' for c in USAGE_COLUMNS)})
SELECT ts - toIntervalMicrosecond(k * {minutes * MINUTE_US}) AS shifted, {others}
FROM usage_minutes ARRAY JOIN range(1, {copies + 1}) AS k
WHERE shifted >= fromUnixTimestamp64Micro({start_minute}, 'UTC')""")
    store.client.command("OPTIMIZE TABLE usage_minutes FINAL")
    copied_s = time.monotonic() - started
    total = int(store.query("SELECT count() FROM usage_minutes").result_rows[0][0])
    per_minute = statistics.median(roll_s)
    print(f"  rollup: {len(roll_s)} host-minutes rolled, {rows:,} rows; per host-minute median {per_minute:.2f} s "
          f"({statistics.median(roll_cpu_s):.2f} CPU-s), inserting {1e6 * insert_s / max(1, rows):.1f} us/row; "
          f"copied back to {total:,} rows in {copied_s:.0f} s", flush=True)
    return {"host_minutes": len(roll_s), "rows": rows, "roll_s_median": per_minute,
            "roll_s_p90": sorted(roll_s)[int(0.9 * (len(roll_s) - 1))], "roll_s_mean": statistics.fmean(roll_s),
            "roll_cpu_s_median": statistics.median(roll_cpu_s), "insert_s": insert_s,
            "insert_rows_per_s": rows / insert_s if insert_s else None, "copied_s": copied_s, "rows_after_copy": total}


# -- what is timed -----------------------------------------------------------------------------------------------


def time_usage(store: Store, end: datetime, spans: Sequence[int], rounds: int, exact: bool = True) -> list[Timed]:
    out = []
    for seconds in spans:
        window = Window(end - timedelta(seconds=seconds), end)
        for by in ("engine", "team", "model"):
            def run(reader: Counting, window: Window = window, by: str = by) -> str:
                r = usage_rollup.report(reader, window, by)
                return f"[{r.source}, {len(r.groups)} groups]"
            out.append(timed(f"stepline usage --since {label(seconds)} --by {by}", label(seconds), rounds, run,
                             store.client))
    if not exact:
        return out
    hour = Window(end - timedelta(hours=1), end)

    def one_pass(reader: Counting) -> str:
        try:
            r = usage_rollup.report(reader, hour, "team", exact=True)
        except ValueError as exc:  # more steps than one pass may walk: refused, after counting them
            return f"[refused: {exc}]"
        return f"[{r.source}, {len(r.groups)} groups]"
    out.append(timed("stepline usage --since 1h --by team --exact", "1 h", min(rounds, 2), one_pass, store.client))
    return out


def time_dashboard(store: Store, end: datetime, spans: Sequence[int], rounds: int) -> list[Timed]:
    out = []
    chosen = every_variable_all()
    end_ms = int(end.timestamp() * 1000)
    for seconds in spans:
        ctx = QueryContext(end_ms - seconds * 1000, end_ms, grafana_interval_ms(seconds * 1000), chosen)
        for name, _, raw in dashboard_queries():
            if not name.startswith("usage / "):
                continue
            sql = expand(raw, ctx)

            def run(reader: Counting, sql: str = sql) -> str:
                return f"[{len(reader.query(sql).result_rows)} rows out]"
            out.append(timed(name, label(seconds), rounds, run, store.client))
    return out


def time_slo(store: Store, end: datetime, spans: Sequence[int], rounds: int) -> list[Timed]:
    out = []
    for seconds in spans:
        since = end.timestamp() - seconds

        def run(reader: Counting, since: float = since) -> str:
            return f"[{len(slo.statuses(reader, Slo(), since=since))} objective-scopes]"
        out.append(timed(f"stepline slo --since {label(seconds)}", label(seconds), rounds, run, store.client))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--store", required=True, help="an embedded store scale_queries.py filled")
    parser.add_argument("--roll-minutes", type=int, default=60,
                        help="whole minutes of each host the real rollup rolls before the copies (default 60)")
    parser.add_argument("--rounds", type=int, default=3, help="runs per query (default 3)")
    parser.add_argument("--only", choices=("usage", "dashboard", "slo"), help="time only these")
    parser.add_argument("--no-exact", action="store_true", help="leave out `--exact` over the last hour")
    parser.add_argument("--windows", help="hours of each window, comma-separated (default 24, and 168 where the "
                                          "store spans a week)")
    args = parser.parse_args(argv)
    record = record_path(args.store)
    if record is None or not record.exists():
        print(f"{args.store}: no scale record beside it; fill it with scale_queries.py --store {args.store} first")
        return 1
    filled = json.loads(record.read_text())
    shape = Shape(**filled["shape"])
    usage_record = Path(str(record).removesuffix(".scale.json") + ".usage.json")
    print(f"{os.cpu_count()} CPUs; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; shape "
          f"{shape.hours:g} h x {shape.hosts} host(s) x {shape.engines} engines")
    store = Store.open(args.store)
    try:
        store.ensure_schema(max(30, math.ceil(shape.hours / 24) + 7))
        # The span is the shape's (a store filled with --steps-hours has steps over its last hours only).
        first_us = shape.start_s * 1_000_000
        end_us = int(store.query("SELECT toUnixTimestamp64Micro(max(ts)) FROM steps").result_rows[0][0])
        made: dict[str, Any] = json.loads(usage_record.read_text()) if usage_record.exists() else {}
        if "decisions_s" not in made:
            decided = add_decisions(store, shape)
            made["decisions_s"] = decided
            print(f"gateway decisions: {'added in ' + format(decided, '.0f') + ' s' if decided else 'already there'}")
        if "rollup" not in made:
            if int(store.query("SELECT count() FROM usage_minutes").result_rows[0][0]):
                print("usage_minutes holds rows but no record of them: a rollup cut short? truncate it and run again")
                return 1
            hosts = [shape.host(h) for h in range(shape.hosts)]
            made["rollup"] = roll_up(store, hosts, first_us, end_us, args.roll_minutes)
        usage_record.write_text(json.dumps(made, indent=1))
        print(f"what the store holds for usage ({usage_record}): {json.dumps(made)}")
        for table in ("requests", "gateway_decisions", "usage_minutes"):
            print(f"  {table}: {int(store.query(f'SELECT count() FROM {table}').result_rows[0][0]):,} rows")
        end = datetime.fromtimestamp(end_us / 1e6 + 1, UTC).replace(microsecond=0)
        held_s = (end_us - first_us) / 1e6
        spans = ([round(float(h) * 3600) for h in args.windows.split(",")] if args.windows
                 else [DAY_S] + ([WEEK_S] if held_s >= WEEK_S - 3600 else []))
        results: list[Timed] = []
        if args.only in (None, "usage"):
            print("timing stepline usage ...", flush=True)
            results += time_usage(store, end, spans, args.rounds, not args.no_exact)
        if args.only in (None, "dashboard"):
            print("timing the Usage dashboard's queries ...", flush=True)
            results += time_dashboard(store, end, spans, args.rounds)
        if args.only in (None, "slo"):
            print("timing stepline slo ...", flush=True)
            results += time_slo(store, end, [*spans, 30 * DAY_S], args.rounds)
    finally:
        store.close()
    print()
    print(render_table(["query", "window", "best s", "median s", "rounds", "rows read", "result"],
                       [[r.query, r.window, f"{r.best:.3f}",
                         f"{statistics.median(r.rounds):.3f}" if r.rounds else "-", len(r.rounds),
                         f"{r.read_rows:,}", "PASS" if r.passed else "TARGET MISSED"] for r in results],
                       max_width=60))
    for r in results:
        if not r.passed:
            print(f"TARGET MISSED {r.query} ({r.window}): {r.error or f'{r.best:.2f} s >= {TARGET_S:g} s'}")
    print(f"\n{sum(r.passed for r in results)}/{len(results)} under {TARGET_S:g} s (best of {args.rounds}); "
          f"load average after {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
