#!/usr/bin/env python3
"""The collector's footprint: its RSS with an embedded store and with a remote store, and its CPU per 1k steps/s.

Each case runs `stepline collect` in a process of its own (default sources, the GPU source off: no GPU
here) and measures that process only: RSS once started and idle, then under load (peak of 1 s samples, and
at the end), and CPU (user + system, all threads) over the loaded window, after a short ramp. The load is a
spawned process driving 8 plugins (PluginCore, Unix datagrams) with realistic steps (64 running: one prefill
chunk and 63 decodes, 63 ITL + 1 TTFT samples, a finished request every ~2.7 steps, as the soak's steady
chat) at `--rate` steps/s in all, each stamped when sent and each request with an id of its own.

    embedded  --store chdb://DIR: the collector hosts ClickHouse (chDB) in its own process
    remote    --store http://127.0.0.1:PORT/stepline: a ClickHouse HTTP endpoint (stepline.testing.storeserver's
              StoreServer over an embedded store, run by this script, so not counted) takes the inserts

Afterwards every case checks that nothing was dropped and that the store holds every step sent.
Prints figures; always exits 0.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.queues import Queue
from typing import Any

import psutil  # type: ignore[import-untyped]
from realistic import build_steps
from soak import Memory, free_port, high_water_mib, snapshot

from stepline.plugin.core import PluginCore
from stepline.store.store import Store

ENGINES = 8
RUNNING = 64
FINISHED_CYCLE = (0, 0, 1, 0, 1, 0, 0, 1)  # 3 finished requests in 8 steps, as the soak's steady chat
DATABASE = "remote"  # the remote case's database (the embedded case uses the default, stepline)


# -- the load ------------------------------------------------------------------------------------------------


def run_load(socket_path: str, rate: float, seconds: float, results: Queue[dict[str, Any]]) -> None:
    """`rate` steps/s in all, round robin over ENGINES plugins, for `seconds`; then a clean close."""
    steps = build_steps(400, lambda i: FINISHED_CYCLE[i % len(FINISHED_CYCLE)], seed=5, running=RUNNING)
    cores = [PluginCore(f"footprint-{e}", socket_path) for e in range(ENGINES)]
    for e, core in enumerate(cores):
        core.engine_initialized({"model": "footprint", "engine_index": e})
    period = 1.0 / rate
    started = time.perf_counter()
    n = requests = 0
    while time.perf_counter() - started < seconds:
        due = started + n * period
        now = time.perf_counter()
        if due > now:
            time.sleep(due - now)
        sched, it = steps[n % len(steps)]
        core = cores[n % ENGINES]
        it.iteration_timestamp = time.time()
        for f in it.finished_requests:
            f.request_id = f"req-{n}-{requests}"
            requests += 1
        core.record(sched, it, 0)
        n += 1
    elapsed = time.perf_counter() - started
    for core in cores:
        core.close(drain_timeout_s=5.0)
    results.put({"steps": n, "requests": requests, "elapsed_s": elapsed,
                 "sent": sum(c.records_sent for c in cores), "dropped": sum(c.dropped_total for c in cores)})


# -- the collector ---------------------------------------------------------------------------------------------


@dataclass
class Footprint:
    """One case's figures."""

    store: str
    idle_rss_mib: float
    peak_rss_mib: float
    end_rss_mib: float
    high_water_mib: float
    cpu_s: float
    window_s: float
    steps_per_s: float
    steps_sent: int
    steps_stored: int
    drops: float
    notes: list[str] = field(default_factory=list)

    @property
    def cores(self) -> float:
        return self.cpu_s / max(1e-9, self.window_s)


def _rss(process: psutil.Process) -> float:
    return float(process.memory_info().rss) / 2**20


def measure(label: str, store_url: str, tmp: str, rate: float, seconds: float, idle_s: float, ramp_s: float,
            count_steps: Callable[[], int]) -> Footprint:
    """Start a collector on `store_url`, let it idle, load it, stop it cleanly; its figures."""
    plugin_socket = os.path.join(tmp, f"{label}.sock")
    metrics_port = free_port()
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    command = [sys.executable, "-m", "stepline", "collect", "--store", store_url, "--plugin-socket", plugin_socket,
               "--metrics-port", str(metrics_port), "--query-port", "0", "--otlp-port", "0", "--host-name",
               "footprint", "--disable-source", "gpu", "--spool-dir", os.path.join(tmp, f"{label}-spool")]
    log_path = os.path.join(tmp, f"{label}.log")
    with open(log_path, "wb") as log_file:
        collector = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT)
    ctx = mp.get_context("spawn")
    results: Queue[dict[str, Any]] = ctx.Queue()
    load = ctx.Process(target=run_load, args=(plugin_socket, rate, seconds + ramp_s, results), daemon=True)
    memory = Memory()
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(plugin_socket) or not _answers(metrics_url):
            if time.monotonic() > deadline or collector.poll() is not None:
                with open(log_path) as fh:
                    raise SystemExit(f"the {label} collector did not start:\n{fh.read()[-3000:]}")
            time.sleep(0.1)
        process = psutil.Process(collector.pid)
        time.sleep(idle_s)
        idle = _rss(process)
        threading.Thread(target=memory.sample_every_second, args=(process,), daemon=True).start()
        load.start()
        time.sleep(ramp_s)
        # Steps received (the writers' counts move in 1 s batches; the receiver's do not).
        steps = {"source": "plugin", "counter": "steps"}
        before = snapshot(process, metrics_url)
        sent = results.get(timeout=seconds + 120)
        after = snapshot(process, metrics_url)
        cpu_s, window_s = after.cpu_s - before.cpu_s, after.at - before.at
        received = (after.total("stepline_source_counts_total", **steps)
                    - before.total("stepline_source_counts_total", **steps))
        end = _rss(process)
        memory.stop.set()
        high_water = high_water_mib(collector.pid)
        time.sleep(1.5)  # the receiver's last polls
        final = snapshot(process, metrics_url)
        collector.send_signal(signal.SIGTERM)
        collector.wait(120)
        load.join(10)
    finally:
        memory.stop.set()
        if collector.poll() is None:
            collector.kill()
        if load.is_alive():
            load.kill()
    drops = (final.total("stepline_writer_rows_dropped_total") + float(sent["dropped"])
             + sum(final.total("stepline_source_counts_total", source="plugin", counter=c)
                   for c in ("malformed", "unauthorized", "lost_datagrams", "plugin_dropped_records")))
    return Footprint(label, idle, max(memory.samples, default=end), end, high_water, cpu_s, window_s,
                     received / max(1e-9, window_s), int(sent["steps"]), count_steps(), drops)


def _answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=2).read()
    except OSError:
        return False
    return True


def _count_embedded(path: str) -> Callable[[], int]:
    def count() -> int:
        store = Store.open(f"chdb://{path}")
        try:
            return int(store.query(f"SELECT count() FROM `{store.database}`.steps").result_rows[0][0])
        finally:
            store.close()
    return count


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rate", type=float, default=1000.0, help="steps/s in all (default 1000)")
    parser.add_argument("--seconds", type=float, default=30.0, help="loaded window per case (default 30)")
    parser.add_argument("--idle", type=float, default=5.0, help="seconds idle before the load (default 5)")
    parser.add_argument("--ramp", type=float, default=3.0, help="seconds of load before the window (default 3)")
    parser.add_argument("--only", choices=("embedded", "remote"), help="run one case")
    args = parser.parse_args(argv)

    print(f"machine: {platform.platform()}; python {platform.python_version()}; cpu_count={os.cpu_count()}; "
          f"load average before " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    print(f"load: {args.rate:g} steps/s over {ENGINES} plugins ({RUNNING} running a step, "
          f"{sum(FINISHED_CYCLE)}/{len(FINISHED_CYCLE)} finished requests a step); idle {args.idle:g} s, ramp "
          f"{args.ramp:g} s, window {args.seconds:g} s per case")
    tmp = tempfile.mkdtemp(prefix="stepline-footprint-")
    # One chDB path for both cases: this process hosts at most one (it counts the embedded case's rows once that
    # collector has exited, then serves the same path, another database, to the remote case's collector).
    path = os.path.join(tmp, "store")
    results: list[Footprint] = []
    try:
        if args.only in (None, "embedded"):
            results.append(measure("embedded", f"chdb://{path}", tmp, args.rate, args.seconds, args.idle,
                                   args.ramp, _count_embedded(path)))
        if args.only in (None, "remote"):
            results.append(remote(path, tmp, args))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print()
    print(f"{'store':<10} {'idle RSS':>9} {'peak RSS':>9} {'end RSS':>8} {'high-water':>11} {'steps/s':>8} "
          f"{'CPU %':>6} {'CPU-s/s per 1k steps/s':>23} {'stored/sent':>17} {'drops':>6}")
    for r in results:
        print(f"{r.store:<10} {r.idle_rss_mib:>7.0f}Mi {r.peak_rss_mib:>7.0f}Mi {r.end_rss_mib:>6.0f}Mi "
              f"{r.high_water_mib:>9.0f}Mi {r.steps_per_s:>8.0f} {100 * r.cores:>5.1f}% "
              f"{r.cores / max(1e-9, r.steps_per_s / 1000):>23.3f} {r.steps_stored:>8,}/{r.steps_sent:<8,} "
              f"{r.drops:>6.0f}")
        for note in r.notes:
            print(f"  {r.store}: {note}")
    print("(RSS of the collector process only; with a remote store the ClickHouse endpoint's memory is elsewhere. "
          "2 shared cores: CPU figures are noisy)")
    print()
    for r in results:
        ok = r.drops == 0 and r.steps_stored == r.steps_sent
        print(f"{'ok           ' if ok else 'TARGET MISSED'}  {r.store}: {r.steps_stored:,} of {r.steps_sent:,} steps "
              f"stored, {r.drops:.0f} dropped")
    return 0


def remote(path: str, tmp: str, args: argparse.Namespace) -> Footprint:
    """The remote case: a StoreServer over the embedded store at `path`, in this process, is the collector's store."""
    try:
        from stepline.testing.storeserver import StoreServer
    except ImportError:
        return Footprint("remote", math.nan, math.nan, math.nan, math.nan, 0.0, 1.0, 0.0, 0, 0, 0.0,
                         ["skipped: stepline.testing.storeserver is not available"])
    server = StoreServer(path)
    server.start()
    try:
        def count() -> int:
            store = Store.open(server.store_url(DATABASE))
            try:
                return int(store.query(f"SELECT count() FROM `{store.database}`.steps").result_rows[0][0])
            finally:
                store.close()

        return measure("remote", server.store_url(DATABASE), tmp, args.rate, args.seconds, args.idle, args.ramp,
                       count)
    finally:
        server.close()


if __name__ == "__main__":
    sys.exit(main())
