"""The plugin delivers what it holds on its own: a backlog drains after the engine stops calling, an engine going
idle is flushed at once, and at process exit what is held is sent, or counted and logged (real sockets, the
kernel's own queue length)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from stepline.core.clock import ManualClock
from stepline.model.rows import Row, Step
from stepline.plugin.core import PluginCore
from stepline.sim.config import EngineConfig
from stepline.sim.telemetry import Telemetry
from stepline.sources.base import SourceContext
from stepline.sources.plugin_receiver import PluginReceiver
from stepline.testing import vllm_standins as standins

NOW = 1_790_000_000.25
COLLECTOR_DIR = str(Path(__file__).resolve().parents[2] / "collector")


def _stats(i: int, running: int = 64, waiting: int = 3, deferred: int = 0
           ) -> tuple[standins.SchedulerStats, standins.IterationStats]:
    """Step `i` of a busy engine: 64 ITL samples and a finished request, about 450 bytes on the wire; `deferred`
    waiting requests besides the `waiting` ones, as vLLM 0.33 counts them apart."""
    sched = standins.SchedulerStats(
        num_running_reqs=running, num_waiting_reqs=waiting, num_skipped_waiting_reqs=deferred, kv_cache_usage=0.5,
        iteration_details=standins.SchedulerIterationDetails(i, 1, 512, max(0, running - 1), max(0, running - 1), 9.5),
    )
    it = standins.IterationStats(
        iteration_timestamp=NOW + i * 0.01, num_generation_tokens=running,
        inter_token_latencies_iter=[0.0095] * running,
        finished_requests=[standins.FinishedRequestStats(standins.FinishReason.STOP, f"req-{i}", e2e_latency=1.0)],
    )
    return sched, it


class Reading:
    """A receiver read in a loop on a thread of its own (a sidecar), from `start()` on."""

    def __init__(self, path: str) -> None:
        self.receiver = PluginReceiver(SourceContext("node-1", ManualClock(NOW)), path, window_s=0.02)
        self.receiver.start()
        self.rows: list[Row] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.receiver.poll(self.rows.extend)

    def start(self) -> Reading:
        self._thread.start()
        return self

    def steps(self) -> list[int]:
        return [r.step for r in list(self.rows) if isinstance(r, Step)]

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        self.receiver.stop()
        self.receiver.poll(self.rows.extend)


@pytest.fixture
def sidecar(sock_dir: str) -> Iterator[Reading]:
    reading = Reading(os.path.join(sock_dir, "plugin.sock"))
    yield reading
    reading.stop()


def _until(condition: Callable[[], bool], timeout_s: float) -> float:
    """Seconds until `condition` held, or raise after `timeout_s`."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"not within {timeout_s} s")
        time.sleep(0.005)
    return time.monotonic() - started


def test_a_backlog_drains_after_the_engine_stops_calling(sidecar: Reading) -> None:
    core = PluginCore("burst", sidecar.receiver.socket_path, flush_interval_s=0.0)
    burst = 4_000  # about 1.8 MB: far more than the sidecar's queue holds (10 datagrams here)
    for i in range(burst):
        core.record(*_stats(i))  # nobody reads yet: the kernel queue fills and the plugin holds the rest
    assert core.records_held > 0
    sidecar.start()  # the sidecar reads again; the engine makes no further call, not even log()
    _until(lambda: core.records_held == 0, timeout_s=5.0)
    _until(lambda: len(sidecar.steps()) == burst, timeout_s=5.0)
    assert core.dropped == {} and core.records_sent == 2 * burst
    assert sidecar.steps() == list(range(burst))


def test_an_engine_going_idle_is_flushed_at_once(sidecar: Reading) -> None:
    core = PluginCore("idle", sidecar.receiver.socket_path, flush_interval_s=60.0)  # no timer would send soon
    sidecar.start()
    core.record(*_stats(0, running=4))
    core.record(*_stats(1, running=0, waiting=0))  # the last request finished: the engine is idle now
    _until(lambda: sidecar.steps() == [0, 1], timeout_s=2.0)


def test_an_engine_holding_only_deferred_requests_is_not_flushed_as_idle(sidecar: Reading) -> None:
    # vLLM 0.33 leaves deferred waiters (a grammar compiling, KVs on their way, a LoRA over budget) out of
    # num_waiting_reqs and counts them in num_skipped_waiting_reqs: 0 running, 0 waiting, 2 deferred is work queued.
    core = PluginCore("deferred", sidecar.receiver.socket_path, flush_interval_s=60.0)  # no timer would send soon
    sidecar.start()
    core.record(*_stats(0, running=4))
    core.record(*_stats(1, running=0, waiting=0, deferred=2))
    core.record(*_stats(2, running=0, waiting=0))  # idle now: the three steps go out at once, in one datagram
    _until(lambda: sidecar.steps() == [0, 1, 2], timeout_s=2.0)
    assert core.datagrams_sent == 1  # step 1 sealed no batch of its own


def test_the_last_steps_of_an_engine_that_stops_calling_go_out_after_one_interval(sidecar: Reading) -> None:
    core = PluginCore("stopped", sidecar.receiver.socket_path, flush_interval_s=0.05)
    core.engine_initialized({"model": "m"})
    sidecar.start()
    core.record(*_stats(0, running=8))  # still busy, then no further call (a wedged engine's last step)
    assert _until(lambda: sidecar.steps() == [0], timeout_s=2.0) < 1.0


def test_the_simulator_calls_the_periodic_path_as_vllm_calls_log(sidecar: Reading) -> None:
    telemetry = Telemetry("sim", EngineConfig(), plugin_socket=sidecar.receiver.socket_path, log_interval_s=0.02)
    assert telemetry.plugin is not None
    calls: list[float] = []
    flush = telemetry.plugin.flush

    def counted() -> None:
        calls.append(time.monotonic())
        flush()

    telemetry.plugin.flush = counted  # type: ignore[method-assign]  # this instance only: its periodic caller
    try:
        _until(lambda: len(calls) >= 3, timeout_s=2.0)  # idle: no step at all, and log() still comes
    finally:
        telemetry.close()
    stopped = len(calls)
    time.sleep(0.1)
    assert len(calls) == stopped  # and it stops with the telemetry


_EXITING_ENGINE = textwrap.dedent("""
    import logging, sys
    sys.path.insert(0, {collector!r})
    from stepline.testing import vllm_standins as standins
    from stepline.plugin.core import PluginCore
    logging.basicConfig(level=logging.WARNING, format="%(message)s")

    def step(i):
        return (standins.SchedulerStats(num_running_reqs=64, num_waiting_reqs=3,
                    iteration_details=standins.SchedulerIterationDetails(i, 1, 512, 63, 63, 9.5)),
                standins.IterationStats(iteration_timestamp=1.79e9 + i, inter_token_latencies_iter=[0.01] * 64))

    core = PluginCore("exiting", {path!r}, flush_interval_s={interval!r})
    core.engine_initialized({{"model": "m"}})
    for i in range({steps}):
        core.record(*step(i))
    print(core.records_held, flush=True)
    # No close(): the process just ends, as vLLM's API server does (vLLM gives stat loggers no shutdown call).
""")


def _exit_engine(path: str, steps: int, interval: float) -> tuple[subprocess.CompletedProcess[str], float]:
    script = _EXITING_ENGINE.format(collector=COLLECTOR_DIR, path=path, steps=steps, interval=interval)
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    return result, time.monotonic() - started


def test_what_is_held_at_exit_is_sent(sidecar: Reading) -> None:
    sidecar.start()
    result, _ = _exit_engine(sidecar.receiver.socket_path, steps=50, interval=3600.0)  # every step still held
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) == 50
    _until(lambda: len(sidecar.steps()) == 50, timeout_s=2.0)
    assert "dropped" not in result.stderr


def test_what_cannot_be_sent_at_exit_is_counted_and_logged_within_a_bound(sidecar: Reading) -> None:
    # The sidecar is bound but never reads (frozen): at exit the plugin tries for its exit timeout, then counts.
    result, elapsed = _exit_engine(sidecar.receiver.socket_path, steps=5_000, interval=0.0)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) > 0
    assert "closing; dropped" in result.stderr and "(closed)" in result.stderr, result.stderr
    assert elapsed < 15  # interpreter start and 5,000 steps, plus at most the 1 s exit timeout


def test_record_and_the_periodic_flush_on_two_threads_lose_nothing_and_keep_the_sequence(sidecar: Reading) -> None:
    # The simulator (and any host that calls log() off the output thread) flushes from another thread.
    core = PluginCore("two-threads", sidecar.receiver.socket_path, flush_interval_s=0.001)
    sidecar.start()
    done = threading.Event()

    def log_periodically() -> None:
        while not done.is_set():
            core.flush()

    flusher = threading.Thread(target=log_periodically, daemon=True)
    flusher.start()
    try:
        for i in range(3_000):
            core.record(*_stats(i))
    finally:
        done.set()
        flusher.join(5)
    core.flush()
    _until(lambda: len(sidecar.steps()) == 3_000, timeout_s=5.0)
    assert sidecar.steps() == list(range(3_000))
    assert core.accounting() == (6_000, {}, 0)
    assert sidecar.receiver.stats()["lost_datagrams"] == 0  # datagrams left in sequence order, none skipped
