#!/usr/bin/env python3
"""End-to-end ingest: plugin datagrams in, rows in the embedded store, against raw inserts of the same rows.

The collector's path runs in this process, as `stepline collect` wires it: a PluginReceiver polled by the
Runner decodes each datagram into rows; the Writers batch them per table (with a disk spool, the
collector's default) and insert them into an embedded store (chDB) through clickhouse-connect. A sender
process (spawned) replays prebuilt datagrams of realistic steps (64 running: one 8192-token prefill chunk
and 63 decodes, 63 ITL + 1 TTFT samples, 2 finished requests a step on average, 5 steps a datagram as a
100 steps/s engine's plugin sends them) through a blocking socket, so the collector sets the pace and
nothing is dropped. Each replay of the distinct steps comes from an engine of its own, so every row and
every request id is distinct (the writers deduplicate requests, the tables deduplicate identical blocks).

The reference, measured in the same run into the same store: clickhouse-connect inserts of the same rows,
batch by batch, with nothing else running. Targets: end-to-end >= 50% of the raw inserts' rows/s, and
>= 100,000 rows/s. A per-stage breakdown (each stage alone, us per row: decode = datagram to rows,
writer = Writers.write to stored in a sink that discards, insert = clickhouse-connect into the store)
shows where the time goes. The collector side is pinned to one core, the sender to another.

With `--rollup`, then the usage rollup (stepline.analysis.usage_rollup, the collector's per-minute job) over the
minutes the stored rows span, its CPU per row of the timeline against the write path's.

Prints figures; always exits 0.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence, Sized
from dataclasses import dataclass
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event as MpEvent
from typing import Any

from prometheus_client import CollectorRegistry
from realistic import build_steps

from stepline.analysis import usage_rollup
from stepline.analysis.usage_rollup import MINUTE_US
from stepline.core import gctune
from stepline.core.clock import SystemClock
from stepline.ingest.metrics import IngestMetrics
from stepline.ingest.runner import Runner, Scheduled
from stepline.ingest.writer import Writers
from stepline.model import schema
from stepline.model.rows import TABLE_OF, Row, Step, UsageMinute
from stepline.plugin import wire
from stepline.plugin.core import PluginCore
from stepline.sources.base import SourceContext
from stepline.sources.plugin_receiver import EMIT_BATCH_ROWS, PluginReceiver
from stepline.store import batches
from stepline.store.store import Store

HOST = "bench"
RUNNING = 64
FINISHED_CYCLE = (0, 1, 2, 3, 4)  # finished requests per step, in turn: 2 on average
STEPS_PER_DATAGRAM = 5  # a 100 steps/s engine's plugin seals a datagram every 50 ms
RATIO_TARGET = 0.5
RATE_TARGET = 100_000.0
TABLES = ("steps", "requests")


def _pin(cpu: int | None) -> None:
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu})


# -- the datagrams ----------------------------------------------------------------------------------------


def build_bodies(distinct_steps: int) -> tuple[list[bytes], int, int]:
    """Datagram bodies (records without the header) as the plugin seals them; and the steps and requests in them."""
    # Stamped now: the collector drops rows far from its clock (and the store's TTL would drop old ones).
    steps = build_steps(distinct_steps, lambda i: FINISHED_CYCLE[i % len(FINISHED_CYCLE)], seed=3, running=RUNNING,
                        base_ts=time.time() - 0.03 * distinct_steps)
    tmp = tempfile.mkdtemp(prefix="stepline-ingest-")
    path = os.path.join(tmp, "capture.sock")
    capture = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    capture.bind(path)
    capture.setblocking(False)
    ticks = [0]
    core = PluginCore("x", path, flush_interval_s=STEPS_PER_DATAGRAM - 0.5, monotonic=lambda: float(ticks[0]))
    header = wire.HEADER.size + len(b"x")
    bodies: list[bytes] = []
    requests = 0
    try:
        for sched, it in steps:
            ticks[0] += 1
            core.record(sched, it, 0)
            requests += len(it.finished_requests)
            while True:
                try:
                    bodies.append(capture.recv(wire.MAX_DATAGRAM + 1)[header:])
                except BlockingIOError:
                    break
        core.flush()
        bodies.extend(capture.recv(wire.MAX_DATAGRAM + 1)[header:] for _ in range(core.datagrams_sent - len(bodies)))
    finally:
        capture.close()
        shutil.rmtree(tmp, ignore_errors=True)
    if core.dropped_total or core.records_sent != len(steps) + requests:
        raise SystemExit(f"capturing the datagrams lost records: {core.dropped}")
    return bodies, len(steps), requests


def datagrams(bodies: Sequence[bytes], engines: Sequence[str]) -> Iterator[bytes]:
    """Each engine's replay of the bodies, with its own header and sequence, as one plugin would send them."""
    for number, engine in enumerate(engines):
        name = engine.encode()
        for sequence, body in enumerate(bodies):
            yield wire.encode_header(name, 1000 + number, number, sequence, 0) + body


def run_sender(socket_path: str, bodies: list[bytes], engines: list[str], cpu: int | None, ready: MpEvent,
               go: MpEvent, results: Queue[dict[str, float]]) -> None:
    """Send every datagram through a blocking socket: the receiver sets the pace, nothing is dropped."""
    _pin(cpu)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.connect(socket_path)
    ready.set()
    go.wait()
    started, cpu_started = time.perf_counter(), time.process_time()
    sent = 0
    for datagram in datagrams(bodies, engines):
        sock.send(datagram)
        sent += 1
    sock.close()
    results.put({"datagrams": sent, "seconds": time.perf_counter() - started,
                 "cpu_s": time.process_time() - cpu_started})


# -- stages, each alone ------------------------------------------------------------------------------------


class NullSink:
    """A sink that takes every batch and keeps nothing: the writer's own cost."""

    def __init__(self) -> None:
        self.rows = 0

    def insert_native(self, table: str, column_names: Sequence[str], data: bytes,
                      dedup_token: str | None = None) -> None:
        self.rows += batches.first_block_rows(data)


def decoded(bodies: Sequence[bytes], engines: Sequence[str]) -> Iterator[list[Row]]:
    """The rows of each datagram, decoded by a receiver that is not listening (no socket involved)."""
    receiver = PluginReceiver(SourceContext(HOST, SystemClock()), "/nonexistent/stepline-ingest.sock")
    for datagram in datagrams(bodies, engines):
        yield receiver.rows(datagram)


def decode_stage(bodies: Sequence[bytes], engines: Sequence[str]) -> tuple[float, int]:
    """Seconds to decode every datagram of `engines` into rows, and the rows."""
    receiver = PluginReceiver(SourceContext(HOST, SystemClock()), "/nonexistent/stepline-ingest.sock")
    data = list(datagrams(bodies, engines))
    started = time.perf_counter()
    rows = sum(len(receiver.rows(datagram)) for datagram in data)
    return time.perf_counter() - started, rows


def remember_as_collect_does(writers: Writers) -> None:
    """What `stepline collect` does before its writers take rows (app.collector): remember the store's requests
    of the memory's window, so that a report finished since then is placed from memory, not looked up in the store.
    Without it every report here (stamped before the writers start) would count as older than the memory. Each
    round replays from engines of its own, so the store holds none of their requests: there is nothing to read."""
    writers.placement.remember([], whole_window=True)


def writer_stage(bodies: Sequence[bytes], engines: Sequence[str], writer_options: dict[str, Any],
                 spool_dir: str) -> tuple[float, int]:
    """Seconds from the first Writers.write to Writers.stop's return with a sink that discards, and the rows."""
    chunks: list[list[Row]] = []
    pending: list[Row] = []
    for rows in decoded(bodies, engines):  # as the receiver emits them: EMIT_BATCH_ROWS at a time
        pending.extend(rows)
        if len(pending) >= EMIT_BATCH_ROWS:
            chunks.append(pending)
            pending = []
    chunks.append(pending)
    sink = NullSink()
    writers = Writers(sink, IngestMetrics(CollectorRegistry()), spool_dir=spool_dir, **writer_options)
    remember_as_collect_does(writers)
    writers.start()
    started = time.perf_counter()
    for chunk in chunks:
        writers.write(chunk)
    writers.stop()
    elapsed = time.perf_counter() - started
    total = sum(len(chunk) for chunk in chunks)
    if sink.rows != total:
        print(f"note: the writer stage stored {sink.rows} of {total} rows")
    return elapsed, total


@dataclass
class RawResult:
    """Raw clickhouse-connect inserts: seconds and rows per table."""

    seconds: dict[str, float]
    rows: dict[str, int]

    @property
    def rate(self) -> float:
        return sum(self.rows.values()) / max(1e-9, sum(self.seconds.values()))


def as_lists(row: Row) -> Row:
    """The row with its samples as lists of floats, which clickhouse-connect writes 10-15% faster than the arrays of
    float32 the collector decodes them into (steps 8.4-9.4 against 10.1 us a row): the raw side gets its best form."""
    if type(row) is Step:
        return row._replace(ttft_seconds=list(row.ttft_seconds), itl_seconds=list(row.itl_seconds))
    return row


def raw_inserts(store: Store, bodies: Sequence[bytes], engines: Sequence[str], batch_rows: int) -> RawResult:
    """clickhouse-connect inserts of the decoded rows (samples as lists), `batch_rows` at a time per table; only the
    inserts are timed."""
    seconds = dict.fromkeys(TABLES, 0.0)
    counts = dict.fromkeys(TABLES, 0)
    pending: dict[str, list[Row]] = {table: [] for table in TABLES}

    def insert(table: str) -> None:
        batch, pending[table] = pending[table], []
        if not batch:
            return
        started = time.perf_counter()
        store.client.insert(f"`{store.database}`.`{table}`", batch,
                            column_names=list(schema.TABLE_BY_NAME[table].column_names))
        seconds[table] += time.perf_counter() - started
        counts[table] += len(batch)

    for rows in decoded(bodies, engines):
        for row in rows:
            pending[TABLE_OF[type(row)]].append(as_lists(row))
        for table in TABLES:
            if len(pending[table]) >= batch_rows:
                insert(table)
    for table in TABLES:
        insert(table)
    return RawResult(seconds, counts)


# -- end to end --------------------------------------------------------------------------------------------


@dataclass
class EndToEnd:
    """The collector path's figures for one round."""

    rows: int
    stored: int
    seconds: float  # from the first datagram sent to Writers.stop's return (everything in the store)
    received_s: float  # from the first datagram sent to the last row decoded
    cpu_s: float  # this process (receiver, writers, chDB), over `seconds`
    sender: dict[str, float]
    receiver: dict[str, int]
    dropped: float

    @property
    def rate(self) -> float:
        return self.stored / max(1e-9, self.seconds)


def _counter_total(registry: CollectorRegistry, name: str) -> float:
    return sum(sample.value for family in registry.collect() if family.name == name
               for sample in family.samples if sample.name.endswith("_total"))


def end_to_end(store: Store | None, tmp: str, bodies: list[bytes], engines: list[str], expected: tuple[int, int],
               writer_options: dict[str, Any], sender_cpu: int | None, *, writers_on: bool = True) -> EndToEnd:
    """The collector path: receiver, runner, writers (disk spool), store; a sender process replays the datagrams.

    With `store` None the writers hand their batches to a sink that discards them; with `writers_on` False too,
    this thread polls the receiver itself and counts the rows (receive and decode only).
    """
    metrics = IngestMetrics(CollectorRegistry())
    null_sink = NullSink()
    writers = Writers(store or null_sink, metrics, spool_dir=tempfile.mkdtemp(prefix="spool-", dir=tmp),
                      **writer_options)
    remember_as_collect_does(writers)
    receiver = PluginReceiver(SourceContext(HOST, SystemClock()), os.path.join(tmp, f"plugin-{engines[0]}.sock"))
    runner = Runner([Scheduled(receiver, 0.001)], writers, metrics, HOST)
    ctx = mp.get_context("spawn")
    ready, go = ctx.Event(), ctx.Event()
    results: Queue[dict[str, float]] = ctx.Queue()
    polled = 0

    def count(rows: Iterable[Row]) -> None:
        nonlocal polled
        polled += len(rows) if isinstance(rows, Sized) else sum(1 for _ in rows)

    if writers_on:
        writers.start()
        runner.start()  # binds the socket
    else:
        receiver.start()
    sender = ctx.Process(target=run_sender, args=(receiver.socket_path, bodies, engines, sender_cpu, ready, go,
                                                  results), daemon=True)
    sender.start()
    try:
        if not ready.wait(60):
            raise SystemExit("the sender process did not start")
        steps, requests = expected
        cpu_started, started = time.process_time(), time.perf_counter()
        go.set()
        deadline = started + 600
        while receiver.stats()["steps"] < steps or receiver.stats()["requests"] < requests:
            if time.perf_counter() > deadline or (not sender.is_alive() and sender.exitcode):
                print(f"note: the receiver decoded only {receiver.stats()} of {steps} steps, {requests} requests")
                break
            if writers_on:
                time.sleep(0.005)
            else:
                receiver.poll(count)
        received_s = time.perf_counter() - started
        if writers_on:
            runner.stop()
            writers.stop()
        else:
            receiver.stop()
        seconds, cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
        sent = results.get(timeout=60)
        sender.join(10)
    finally:
        sender.kill()
    if not writers_on:
        stored = polled
    elif store is None:
        stored = null_sink.rows
    else:
        like = f"{engines[0].rsplit('-', 1)[0]}-%"
        stored = sum(int(store.query(f"SELECT count() FROM `{table}` WHERE engine LIKE {{p:String}}",
                                     parameters={"p": like}).result_rows[0][0]) for table in TABLES)
    return EndToEnd(steps + requests, stored, seconds, received_s, cpu_s, sent, receiver.stats(),
                    _counter_total(metrics.registry, "stepline_writer_rows_dropped"))


@dataclass(frozen=True)
class RollupCost:
    """The usage rollup over the minutes the stored rows span (stepline.analysis.usage_rollup: what the collector's
    UsageRollup runs once a minute, LAG_S after each minute closes)."""

    minutes: int
    rows_read: int  # steps and requests of those minutes: what it reads and attributes
    rows_written: int  # usage_minutes rows
    cpu_s: float  # this process (the attribution in Python, chDB's reads), rolling and inserting
    seconds: float


def rollup_cost(store: Store) -> RollupCost:
    """Roll up every whole minute the stored rows of HOST touch, and insert the rows, as the collector would."""
    lo, hi = (int(v) for v in store.query(
        "SELECT toUnixTimestamp64Micro(min(ts)), toUnixTimestamp64Micro(max(ts)) FROM steps WHERE host = {h:String}",
        parameters={"h": HOST}).result_rows[0])
    first, end = lo // MINUTE_US * MINUTE_US, (hi // MINUTE_US + 1) * MINUTE_US
    read = sum(int(store.query(
        f"SELECT count() FROM `{t}` WHERE host = {{h:String}} AND ts >= fromUnixTimestamp64Micro({{lo:Int64}}, 'UTC') "
        "AND ts < fromUnixTimestamp64Micro({hi:Int64}, 'UTC')",
        parameters={"h": HOST, "lo": first, "hi": end}).result_rows[0][0]) for t in TABLES)
    collect_the_last_round()
    cpu_started, started = time.process_time(), time.perf_counter()
    rows = usage_rollup.roll(store.client, HOST, first / 1e6, end / 1e6)
    store.insert("usage_minutes", [list(r) for r in rows], UsageMinute._fields)
    return RollupCost((end - first) // MINUTE_US, read, len(rows), time.process_time() - cpu_started,
                      time.perf_counter() - started)


def collect_the_last_round() -> None:
    """Free what the round before left, before the next is timed. A collector keeps one set of writers, and one
    memory of requests, for its life; each round here makes its own, and the last round's are garbage in cycles
    (writers and their threads). Left to the collection on gctune's timer, freeing them (600,000 objects, most of
    them the memory's) fell inside the next round's timing: 0.4-0.5 s of a 3-4 s round, that round's alone."""
    gc.collect()


# -- main ------------------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rows", type=int, default=300_000, help="rows per end-to-end round (default 300000)")
    parser.add_argument("--distinct-steps", type=int, default=1_000,
                        help="distinct steps, replayed by one engine after another (default 1000)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of raw + end-to-end; medians are reported")
    parser.add_argument("--batch-rows", type=int, default=20_000,
                        help="rows per insert, the writers' batch (default 20000, the collector's)")
    parser.add_argument("--flush-interval", type=float, default=1.0,
                        help="the writers' flush interval, seconds (default 1, the collector's)")
    parser.add_argument("--pin", action="store_true",
                        help="pin the collector side to one core and the sender to another (default: both share "
                             "every core, as a sidecar and an engine do; the sender needs little)")
    parser.add_argument("--rollup", action="store_true",
                        help="then roll the stored rows up into usage_minutes as the collector's usage rollup does, "
                             "and compare its CPU per row with the write path's")
    args = parser.parse_args(argv)
    rounds = max(1, args.rounds)
    gctune.tune()  # as `stepline collect` does once it has started

    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    collector_cpu = cpus[0] if len(cpus) >= 2 and args.pin else None
    sender_cpu = cpus[1] if len(cpus) >= 2 and args.pin else None
    _pin(collector_cpu)
    where = (f"collector side on cpu {collector_cpu}, sender on cpu {sender_cpu}" if args.pin
             else f"collector and sender share the {len(cpus) or '?'} usable cores")
    print(f"machine: {platform.platform()}; {platform.processor() or platform.machine()}; "
          f"python {platform.python_version()} ({sys.implementation.name}); cpu_count={os.cpu_count()}, "
          f"usable={len(cpus) or '?'}; {where}")

    bodies, steps_per_replay, requests_per_replay = build_bodies(max(STEPS_PER_DATAGRAM, args.distinct_steps))
    rows_per_replay = steps_per_replay + requests_per_replay
    replays = max(1, round(args.rows / rows_per_replay))
    expected = (steps_per_replay * replays, requests_per_replay * replays)
    body_bytes = sum(len(b) for b in bodies)
    print(f"rows: {RUNNING} running a step (1 prefill chunk, {RUNNING - 1} decodes: {RUNNING - 1} ITL + 1 TTFT "
          f"samples), {sum(FINISHED_CYCLE) / len(FINISHED_CYCLE):g} finished requests a step; {steps_per_replay} "
          f"steps + {requests_per_replay} requests in {len(bodies)} datagrams of {body_bytes / len(bodies) / 1024:.1f}"
          f" KiB on average, replayed by {replays} engines: {sum(expected):,} rows a round; batches of "
          f"{args.batch_rows:,} rows, flush every {args.flush_interval:g} s; {rounds} round(s)")
    writer_options: dict[str, Any] = {"batch_rows": args.batch_rows, "max_rows": max(200_000, args.batch_rows),
                                      "flush_interval_s": args.flush_interval}

    tmp = tempfile.mkdtemp(prefix="stepline-ingest-")
    store = Store.open(f"chdb://{tmp}/store")
    raws: list[RawResult] = []
    ends: list[EndToEnd] = []
    try:
        store.ensure_schema(30)
        # Stages, each alone on this thread, over a few replays (the writer's threads run beside it).
        stage_engines = [f"stage-{i}" for i in range(max(1, min(replays, round(60_000 / rows_per_replay))))]
        decode_s, decode_rows = decode_stage(bodies, stage_engines)
        writer_s, writer_rows = writer_stage(bodies, stage_engines, writer_options,
                                             tempfile.mkdtemp(prefix="spool-", dir=tmp))
        for r in range(rounds):
            collect_the_last_round()
            raws.append(raw_inserts(store, bodies, [f"raw{r}-{i}" for i in range(replays)], args.batch_rows))
            collect_the_last_round()
            ends.append(end_to_end(store, tmp, bodies, [f"e2e{r}-{i}" for i in range(replays)], expected,
                                   writer_options, sender_cpu))
        # The same path cut short, to see where the time goes: without the store, and without the writers.
        collect_the_last_round()
        no_store = end_to_end(None, tmp, bodies, [f"nostore-{i}" for i in range(replays)], expected, writer_options,
                              sender_cpu)
        collect_the_last_round()
        receive_only = end_to_end(None, tmp, bodies, [f"recv-{i}" for i in range(replays)], expected,
                                  writer_options, sender_cpu, writers_on=False)
        rollup = rollup_cost(store) if args.rollup else None
    finally:
        store.close()
        shutil.rmtree(tmp, ignore_errors=True)

    decode_us = 1e6 * decode_s / max(1, decode_rows)
    writer_us = 1e6 * writer_s / max(1, writer_rows)
    insert_seconds = {t: sum(r.seconds[t] for r in raws) for t in TABLES}
    insert_rows = {t: sum(r.rows[t] for r in raws) for t in TABLES}
    insert_us = 1e6 * sum(insert_seconds.values()) / max(1, sum(insert_rows.values()))
    raw_rate = statistics.median(r.rate for r in raws)
    end_rate = statistics.median(e.rate for e in ends)

    print()
    print(f"{'round':<6} {'raw rows/s':>11} {'e2e rows/s':>11} {'e2e/raw':>8} {'stored':>9} {'e2e s':>7} "
          f"{'decoded by s':>13} {'CPU s':>6} {'CPU %':>6} {'sender CPU s':>13} {'drops':>6}")
    for r, (raw, end) in enumerate(zip(raws, ends, strict=True)):
        drops = (end.dropped + end.receiver["malformed"] + end.receiver["lost_datagrams"]
                 + end.receiver["plugin_dropped_records"])
        print(f"{r:<6} {raw.rate:>11,.0f} {end.rate:>11,.0f} {end.rate / raw.rate:>7.2f}x {end.stored:>9,} "
              f"{end.seconds:>7.2f} {end.received_s:>13.2f} {end.cpu_s:>6.2f} "
              f"{100 * end.cpu_s / max(1e-9, end.seconds):>5.0f}% {end.sender['cpu_s']:>13.2f} {drops:>6.0f}")
    print()
    print("the collector path cut short (same datagrams, same sender; rows/s from the first datagram to the last row):")
    for label, cut in (("receive + decode only (this thread polls the receiver)", receive_only),
                       ("+ runner + writers (disk spool), a sink that discards", no_store),
                       (f"+ inserts into the embedded store (round {len(ends) // 2} above)", ends[len(ends) // 2])):
        print(f"  {label:<58} {cut.rate:>9,.0f} rows/s  CPU {1e6 * cut.cpu_s / max(1, cut.rows):5.1f} us/row  "
              f"({cut.stored:,}/{cut.rows:,} rows)")
    print()
    print("per-stage cost, each stage alone on one thread (us per row; rows of both tables):")
    print(f"  decode  (datagram -> rows, PluginReceiver.rows)         {decode_us:6.2f} us/row  ({decode_rows:,} rows)")
    print(f"  writer  (Writers.write -> batch handed to the sink)    {writer_us:6.2f} us/row  ({writer_rows:,} rows, "
          "disk spool, sink discards)")
    print(f"  insert  (clickhouse-connect into the embedded store)   {insert_us:6.2f} us/row  ("
          + ", ".join(f"{t} {1e6 * insert_seconds[t] / max(1, insert_rows[t]):.2f}" for t in TABLES) + ")")
    total_us = decode_us + writer_us + insert_us
    print(f"  sum                                                   {total_us:6.2f} us/row  -> "
          f"{1e6 / total_us:,.0f} rows/s if the stages ran one after another on one core")
    shares = sorted(((decode_us, "decode"), (writer_us, "writer"), (insert_us, "insert")), reverse=True)
    print(f"  largest share: {shares[0][1]} ({100 * shares[0][0] / total_us:.0f}% of the sum)")
    if rollup:
        e2e_cpu_us = 1e6 * statistics.median(e.cpu_s / max(1, e.rows) for e in ends)
        rollup_cpu_us = 1e6 * rollup.cpu_s / max(1, rollup.rows_read)
        print()
        print(f"the usage rollup beside it (usage_rollup.roll over the {rollup.minutes} minute(s) the stored rows "
              "span, then its rows inserted; the rows of every round and the raw inserts):")
        print(f"  {rollup.rows_read:,} steps and requests read, {rollup.rows_written:,} usage_minutes rows written in "
              f"{rollup.seconds:.2f} s, CPU {rollup.cpu_s:.2f} s: {rollup_cpu_us:.1f} us/row read")
        print(f"  against the collector's write path, end to end (median round): {e2e_cpu_us:.1f} us/row written -> "
              f"the rollup costs {rollup_cpu_us / e2e_cpu_us:.2f}x the collector's CPU per row of the timeline")
    print()
    ratio = end_rate / raw_rate
    missed = 0
    for ok, what in ((end_rate >= RATE_TARGET, f"end-to-end {end_rate:,.0f} rows/s (target >= {RATE_TARGET:,.0f})"),
                     (ratio >= RATIO_TARGET, f"end-to-end / raw = {end_rate:,.0f} / {raw_rate:,.0f} = {ratio:.2f}x "
                                             f"(target >= {RATIO_TARGET})"),
                     (all(e.stored == e.rows for e in ends), "every row sent reached the store: "
                      + ", ".join(f"{e.stored:,}/{e.rows:,}" for e in ends))):
        missed += not ok
        print(f"{'ok           ' if ok else 'TARGET MISSED'}  {what}")
    print(f"{'all targets met' if not missed else f'{missed} target(s) missed'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
