"""The engine is never harmed: the plugin, in a process of its own as in vLLM, against a sidecar that is never
started, stops mid-run, freezes (SIGSTOP) or drowns (many senders, a reader that cannot keep up).

In every case each `record()` call stays short, never raises and never blocks; what cannot be sent is dropped
and counted by reason; and once the sidecar is back, data flows again and a `plugin_data_lost` event carries
exactly what the plugin dropped. The time bounds (no call over 50 ms, median under 1 ms) are not performance
targets: they catch a send that blocks, which would stall vLLM's output path for as long as the sidecar is away.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import statistics
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event as MpEvent
from pathlib import Path
from typing import Any

import pytest

from stepline.app.collector import Collector
from stepline.config.settings import Settings
from stepline.core.clock import SystemClock
from stepline.model.rows import Event, Request, Row, Step
from stepline.plugin.core import PluginCore
from stepline.sources.base import SourceContext
from stepline.sources.plugin_receiver import PluginReceiver
from stepline.store.store import Store
from stepline.testing import vllm_standins as standins

MAX_CALL_MS = 50.0
MEDIAN_CALL_MS = 1.0
STEP_PERIOD_S = 0.002  # 500 steps/s: five times a busy engine, so buffers fill within a test
RECONNECT_S = 0.3  # the plugin's default is 5 s; shorter keeps the file quick, the logic is the same
RUNNING = 64


# -- the engine: a PluginCore driven as vLLM drives it, in a spawned process ---------------------------------


@dataclass
class Report:
    """What the engine process saw: its record() timings and the plugin's counters."""

    calls: int
    max_ms: float
    median_ms: float
    raised: int  # exceptions that escaped record(): must stay 0
    made: int  # records handed to the plugin so far (steps, finished requests, the configuration)
    sent: int
    dropped: dict[str, int]
    held: int  # encoded, not yet sent nor dropped
    internal_errors: int

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())


def _stats(engine: str, i: int) -> tuple[standins.SchedulerStats, standins.IterationStats]:
    """Step `i`: 64 running (one prefill chunk, 63 decodes), one request finishing."""
    sched = standins.SchedulerStats(
        num_running_reqs=RUNNING, num_waiting_reqs=3, kv_cache_usage=0.6,
        iteration_details=standins.SchedulerIterationDetails(i, 1, 2048, RUNNING - 1, RUNNING - 1, 9.5),
        prefix_cache_stats=standins.PrefixCacheStats(requests=1, queries=2048, hits=1024),
    )
    it = standins.IterationStats(
        iteration_timestamp=time.time(), num_generation_tokens=RUNNING,
        time_to_first_tokens_iter=[0.25], inter_token_latencies_iter=[0.0095] * (RUNNING - 1),
        finished_requests=[standins.FinishedRequestStats(
            standins.FinishReason.STOP, f"{engine}-req-{i}", e2e_latency=3.0, num_prompt_tokens=2048,
            num_generation_tokens=37, queued_time=0.1, prefill_time=0.2, inference_time=2.9, decode_time=2.7,
            mean_time_per_output_token=0.075)],
    )
    return sched, it


def _engine_main(conn: Connection, socket_path: str, engine: str, options: dict[str, Any]) -> None:
    """Serve ("run", seconds) and ("close", drain_s) commands, answering each with a Report."""
    core = PluginCore(engine, socket_path, reconnect_interval_s=RECONNECT_S, **options)
    made, raised, step = 1, 0, 0
    core.engine_initialized({"model": "isolation-test"})
    while True:
        command, argument = conn.recv()
        durations: list[int] = []
        if command == "run":
            started = time.perf_counter()
            next_at = started
            while time.perf_counter() - started < argument:
                sched, it = _stats(engine, step)
                t0 = time.perf_counter_ns()
                try:
                    core.record(sched, it, 0)
                except Exception:
                    raised += 1
                durations.append(time.perf_counter_ns() - t0)
                step += 1
                made += 2
                next_at += STEP_PERIOD_S
                time.sleep(max(0.0, next_at - time.perf_counter()))
        else:
            core.close(drain_timeout_s=argument)
        sent, dropped, held = core.accounting()  # read together: the sender thread moves records meanwhile
        conn.send(Report(len(durations), max(durations, default=0) / 1e6,
                         statistics.median(durations) / 1e6 if durations else 0.0, raised, made, sent, dropped, held,
                         core.internal_errors))
        if command == "close":
            return


class EngineProcess:
    """A spawned process standing in for vLLM's API server, with the plugin inside."""

    def __init__(self, socket_path: str, engine: str, **options: Any) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_engine_main, args=(child, socket_path, engine, options), daemon=True)
        self._process.start()
        self.engine = engine

    def run(self, seconds: float) -> Report:
        """Record steps at STEP_PERIOD_S for `seconds`; the report comes back, or the engine was blocked."""
        self._conn.send(("run", seconds))
        return self._answer(seconds + 20)

    def close(self, drain_s: float = 5.0) -> Report:
        """Send what the plugin still holds (the sidecar is up by then), as a clean shutdown does."""
        self._conn.send(("close", drain_s))
        return self._answer(drain_s + 20)

    def _answer(self, timeout_s: float) -> Report:
        if not self._conn.poll(timeout_s):
            raise AssertionError(f"the engine process did not answer within {timeout_s:.0f} s: record() blocked")
        report: Report = self._conn.recv()
        return report

    def kill(self) -> None:
        if self._process.is_alive():
            self._process.kill()
        self._process.join(5)


@pytest.fixture
def engines() -> Iterator[list[EngineProcess]]:
    started: list[EngineProcess] = []
    yield started
    for engine in started:
        engine.kill()


def assert_harmless(report: Report, *reasons: str) -> None:
    """The engine's calls stayed short and quiet; drops, if any, are counted with one of `reasons`."""
    assert report.calls > 0
    assert report.max_ms < MAX_CALL_MS, f"a record() call took {report.max_ms:.1f} ms"
    assert report.median_ms < MEDIAN_CALL_MS, f"median record() call {report.median_ms:.3f} ms"
    assert report.raised == 0 and report.internal_errors == 0
    assert set(report.dropped) <= set(reasons), report.dropped
    assert report.made == report.sent + report.dropped_total + report.held  # every record accounted for


# -- a sidecar of its own: a PluginReceiver in a spawned process -----------------------------------------------


@dataclass
class Seen:
    """What a sidecar received, per engine."""

    steps: Counter[str] = field(default_factory=Counter)
    requests: Counter[str] = field(default_factory=Counter)
    configs: Counter[str] = field(default_factory=Counter)
    lost: Counter[str] = field(default_factory=Counter)  # records dropped, as plugin_data_lost events tell
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, rows: Iterable[Row]) -> None:
        for row in rows:
            if isinstance(row, Step):
                self.steps[row.engine] += 1
            elif isinstance(row, Request):
                self.requests[row.engine] += 1
            elif isinstance(row, Event) and row.kind == "engine_config":
                self.configs[row.engine] += 1
            elif isinstance(row, Event) and row.kind == "plugin_data_lost":
                self.lost[row.engine] += int(row.attributes["dropped_records"])

    def records(self, engine: str) -> int:
        return self.steps[engine] + self.requests[engine] + self.configs[engine]


def _sidecar_main(socket_path: str, ready: MpEvent, slow: MpEvent, stop: MpEvent, results: Queue[Seen]) -> None:
    """Poll a PluginReceiver until told to stop; while `slow` is set, read for 2 ms in every 50 ms."""
    receiver = PluginReceiver(SourceContext("node-1", SystemClock()), socket_path, window_s=0.002)
    receiver.start()
    seen = Seen()
    ready.set()
    while not stop.is_set():
        receiver.poll(seen.add)
        if slow.is_set():
            time.sleep(0.05)
    receiver.stop()
    receiver.poll(seen.add)
    seen.counts = receiver.stats()
    results.put(seen)


class SidecarProcess:
    def __init__(self, socket_path: str, *, slow: bool = False) -> None:
        ctx = mp.get_context("spawn")
        self._ready, self.slow, self._stop = ctx.Event(), ctx.Event(), ctx.Event()
        if slow:
            self.slow.set()
        self._results: Queue[Seen] = ctx.Queue()
        self.process = ctx.Process(target=_sidecar_main, args=(socket_path, self._ready, self.slow, self._stop,
                                                               self._results), daemon=True)
        self.process.start()
        assert self._ready.wait(30), "the sidecar process did not start"

    def signal(self, signum: signal.Signals) -> None:
        assert self.process.pid is not None
        os.kill(self.process.pid, signum)

    def stop(self) -> Seen:
        self._stop.set()
        seen = self._results.get(timeout=30)
        self.process.join(10)
        return seen

    def kill(self) -> None:
        if self.process.pid is not None and self.process.is_alive():
            os.kill(self.process.pid, signal.SIGCONT)
            self.process.kill()
        self.process.join(5)


def _flood_main(socket_path: str, seconds: float, senders: int) -> None:
    """Many plugins at once, each sealing a datagram per record, as fast as the socket takes them."""
    steps = [_stats("flood", i) for i in range(8)]
    cores = [PluginCore(f"flood-{n}", socket_path, flush_interval_s=0.0) for n in range(senders)]
    deadline = time.monotonic() + seconds
    i = 0
    while time.monotonic() < deadline:
        for core in cores:
            core.record(*steps[i % len(steps)])
        i += 1
        if i % 16 == 0:
            time.sleep(0.0005)  # leave the other core's processes some air on a small machine


# -- a whole collector, in this process ------------------------------------------------------------------------


def _collector(store_url: str, socket_path: str, spool_dir: Path) -> Collector:
    settings = Settings(store=store_url, metrics_port=0, query_port=0, otlp_port=0, plugin_socket=socket_path,
                        flush_interval_s=0.2, spool_dir=str(spool_dir),
                        disabled_sources=frozenset({"vllm_metrics", "gpu", "host", "otlp"}))
    collector = Collector(settings)
    collector.start()
    return collector


def _stored(store: Store, engine: str) -> tuple[int, int]:
    """(steps, requests and configuration events) and the records plugin_data_lost events say were dropped."""
    records, lost = store.query(
        "SELECT (SELECT count() FROM steps WHERE engine = {e:String}) "
        "+ (SELECT count() FROM requests WHERE engine = {e:String}) "
        "+ (SELECT count() FROM events WHERE engine = {e:String} AND kind = 'engine_config'), "
        "(SELECT sum(toUInt64OrZero(attributes['dropped_records'])) FROM events "
        " WHERE engine = {e:String} AND kind = 'plugin_data_lost')", parameters={"e": engine}).result_rows[0]
    return int(records), int(lost)


# -- the cases -------------------------------------------------------------------------------------------------


def test_a_sidecar_never_started_costs_the_engine_nothing(store: Store, store_url: str, sock_dir: str,
                                                          tmp_path: Path, engines: list[EngineProcess]) -> None:
    path = os.path.join(sock_dir, "never.sock")
    engine = EngineProcess(path, "never-started")
    engines.append(engine)
    alone = engine.run(1.0)
    assert_harmless(alone, "no_sidecar")
    assert alone.sent == 0 and alone.dropped["no_sidecar"] == alone.made - alone.held  # everything, counted
    collector = _collector(store_url, path, tmp_path / "spool")
    try:
        joined = engine.run(1.0)  # the plugin finds the socket at its next reconnect attempt
        assert_harmless(joined, "no_sidecar")
        done = engine.close()
    finally:
        collector.stop()
    assert done.dropped == joined.dropped and done.sent > 0 and done.held == 0
    records, lost = _stored(store, engine.engine)
    assert records == done.sent  # data flows once the sidecar is there
    assert lost == done.dropped_total >= alone.made  # and the timeline says what the engine could not send


def test_a_sidecar_stopped_mid_run_costs_the_engine_nothing(store: Store, store_url: str, sock_dir: str,
                                                            tmp_path: Path, engines: list[EngineProcess]) -> None:
    path = os.path.join(sock_dir, "restart.sock")
    collector = _collector(store_url, path, tmp_path / "spool-first")
    engine = EngineProcess(path, "restarted-under-it")
    engines.append(engine)
    try:
        flowing = engine.run(0.8)
        assert_harmless(flowing)
        assert flowing.dropped == {}
    finally:
        collector.stop()
    gone = engine.run(1.0)
    assert_harmless(gone, "no_sidecar")
    assert gone.dropped["no_sidecar"] > 0
    collector = _collector(store_url, path, tmp_path / "spool-second")
    try:
        back = engine.run(1.0)
        assert_harmless(back, "no_sidecar")
        done = engine.close()
    finally:
        collector.stop()
    assert done.held == 0 and set(done.dropped) == {"no_sidecar"}
    assert done.sent >= back.sent > gone.sent  # it flows again after the restart
    records, lost = _stored(store, engine.engine)
    assert records == done.sent
    assert lost == done.dropped_total


def test_a_frozen_sidecar_costs_the_engine_nothing(sock_dir: str, engines: list[EngineProcess]) -> None:
    path = os.path.join(sock_dir, "frozen.sock")
    sidecar = SidecarProcess(path)
    try:
        engine = EngineProcess(path, "frozen-under-it", max_buffer_bytes=64 << 10)
        engines.append(engine)
        flowing = engine.run(0.5)
        assert_harmless(flowing)
        sidecar.signal(signal.SIGSTOP)
        try:
            frozen = engine.run(2.0)  # the kernel queue fills, sends hit EAGAIN, then the buffer overflows
        finally:
            sidecar.signal(signal.SIGCONT)
        assert_harmless(frozen, "buffer_full")
        assert frozen.dropped["buffer_full"] > 0
        thawed = engine.run(0.5)  # the backlog drains (the oldest batches may still overflow at first)
        assert_harmless(thawed, "buffer_full")
        steady = engine.run(0.5)
        assert_harmless(steady, "buffer_full")
        done = engine.close()
        seen = sidecar.stop()
    finally:
        sidecar.kill()
    assert steady.dropped == thawed.dropped == done.dropped  # caught up: nothing more is lost
    assert done.held == 0 and done.sent >= steady.sent > thawed.sent > frozen.sent
    assert seen.records(engine.engine) == done.sent
    assert seen.lost[engine.engine] == done.dropped_total
    assert seen.counts["lost_datagrams"] == 0 and seen.counts["malformed"] == 0


def test_a_flooded_sidecar_costs_the_engine_nothing(sock_dir: str, engines: list[EngineProcess]) -> None:
    path = os.path.join(sock_dir, "flood.sock")
    sidecar = SidecarProcess(path, slow=True)
    flood = mp.get_context("spawn").Process(target=_flood_main, args=(path, 2.5, 4), daemon=True)
    try:
        engine = EngineProcess(path, "flooded", max_buffer_bytes=32 << 10)
        engines.append(engine)
        flood.start()
        time.sleep(0.5)  # the flood has started and the reader is behind
        flooded = engine.run(1.5)
        # The outbox waits for room and packs a backlog into 60 KB datagrams, so it may keep up even here, where
        # each flooding plugin spends a datagram on every record; whatever it could not keep is counted.
        assert_harmless(flooded, "buffer_full")
        flood.join(10)
        sidecar.slow.clear()
        recovered = engine.run(1.0)
        assert_harmless(recovered, "buffer_full")
        done = engine.close()
        seen = sidecar.stop()
    finally:
        if flood.is_alive():
            flood.kill()
        sidecar.kill()
    assert done.held == 0 and done.sent >= recovered.sent > flooded.sent
    assert seen.records(engine.engine) == done.sent  # every datagram the engine got out arrived, undamaged
    assert seen.lost[engine.engine] == done.dropped_total
    assert seen.counts["malformed"] == 0
    assert sum(n for name, n in seen.steps.items() if name.startswith("flood-")) > 0  # the flood was real
