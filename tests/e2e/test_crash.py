"""kill -9 of the collector mid-outage, then a restart: nothing duplicated, loss bounded by the flush interval."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import clickhouse_connect

from stepline.model.rows import micros
from stepline.plugin.core import PluginCore
from stepline.testing import vllm_standins as standins
from stepline.testing.sink import wait_until
from stepline.testing.storeserver import StoreServer

FLUSH_S = 0.2
RECEIVER_WINDOW_S = 0.2  # the plugin receiver hands rows on every 0.2 s
PLUGIN_FLUSH_S = 0.05
# The stated bound (flush interval + receiver window), plus the plugin's own batching and room for a busy machine.
LOSS_BOUND_S = FLUSH_S + RECEIVER_WINDOW_S + PLUGIN_FLUSH_S + 1.0


class Collector:
    """`stepline collect` in a process of its own, ready once it says it is collecting."""

    def __init__(self, store_url: str, spool_dir: str, socket_path: str) -> None:
        args = [sys.executable, "-m", "stepline", "collect", "--store", store_url, "--spool-dir", spool_dir,
                "--flush-interval", str(FLUSH_S), "--plugin-socket", socket_path, "--metrics-port", "0",
                "--query-port", "0", "--otlp-port", "0"]
        for source in ("gpu", "host", "otlp"):
            args += ["--disable-source", source]
        self.lines: list[str] = []
        self.proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "STEPLINE_HOST_NAME": "crash-host"})
        threading.Thread(target=self._read, daemon=True).start()
        wait_until(lambda: any("collecting from" in line for line in self.lines) or self.proc.poll() is not None,
                   timeout_s=60)
        assert self.proc.poll() is None, "".join(self.lines)

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)


class Sender:
    """An engine's plugin sending one step every 5 ms, each stamped with the time it was sent."""

    def __init__(self, socket_path: str) -> None:
        self.plugin = PluginCore("crash", socket_path, flush_interval_s=PLUGIN_FLUSH_S, reconnect_interval_s=0.2)
        self.sent: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        details = standins.SchedulerIterationDetails(0, 0, 0, 64, 64, 5.0)
        while not self._stop.wait(0.005):
            now = time.time()
            stats = standins.SchedulerStats(num_running_reqs=64, iteration_details=details)
            self.plugin.record(stats, standins.IterationStats(iteration_timestamp=now))
            self.sent.append(micros(now))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.plugin.close()


def test_kill_9_during_an_outage_then_restart_duplicates_nothing_and_loses_at_most_the_flush_interval(
        store_server: StoreServer, sock_dir: str, tmp_path: Path) -> None:
    database = f"k_{uuid.uuid4().hex[:12]}"
    spool_dir = str(tmp_path / "spool")
    socket_path = f"{sock_dir}/p.sock"
    first = Collector(store_server.store_url(database), spool_dir, socket_path)
    sender = Sender(socket_path)
    try:
        time.sleep(1.5)
        store_server.refuse_inserts = True  # the store refuses: segments pile up in the spool
        refused_from = time.time()
        time.sleep(2.0)
        assert [n for n in os.listdir(spool_dir) if n.endswith(".steps.seg")]
        first.proc.send_signal(signal.SIGKILL)
        killed_at = micros(time.time())
        first.proc.wait()
        store_server.refuse_inserts = False
        second = Collector(store_server.store_url(database), spool_dir, socket_path)
        restarted_at = micros(time.time())
        time.sleep(1.5)
    finally:
        sender.stop()
    time.sleep(1.0)
    second.proc.send_signal(signal.SIGTERM)
    assert second.proc.wait(timeout=60) == 0, "".join(second.lines)

    client = clickhouse_connect.get_client(dsn=f"chdb://{store_server.path}", database=database)
    try:
        stored = [int(ts) for (ts,) in client.query(
            "SELECT toUnixTimestamp64Micro(ts) FROM steps WHERE engine = 'crash'").result_rows]
    finally:
        client.close()
    assert len(stored) == len(set(stored)), "a step was written twice"
    present = set(stored)
    before_kill = [ts for ts in sender.sent if ts < killed_at - micros(LOSS_BOUND_S)]
    assert [ts for ts in before_kill if ts not in present] == []
    assert any(ts >= micros(refused_from) for ts in before_kill)  # some of those only ever were in the spool
    after_restart = [ts for ts in sender.sent if ts > restarted_at + micros(0.5)]
    assert after_restart and [ts for ts in after_restart if ts not in present] == []
    lost = [ts for ts in sender.sent if killed_at - micros(LOSS_BOUND_S) <= ts < killed_at and ts not in present]
    assert len(lost) <= LOSS_BOUND_S / 0.005
