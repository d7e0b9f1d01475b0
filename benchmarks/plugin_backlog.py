#!/usr/bin/env python3
"""How soon the stepline plugin's backlog is empty once the engine goes idle, over the real socket.

A burst of `--steps` realistic steps (64 running: one prefill chunk and 63 decodes, 63 ITL samples and one
TTFT, 0-6 finished requests) is recorded back to back by a PluginCore in this process, as vLLM's output
handler calls `record()` at its fastest. The sidecar is a PluginReceiver in a spawned process that polls
as the collector does (0.2 s windows, every row decoded and counted). The burst's last step reports 0
running and 0 waiting: the engine has gone idle, and from then on makes no call at all (not even vLLM's
`log()`, due only every 10 s). Measured from that moment: until the plugin holds nothing, and until the
sidecar has decoded every record. The kernel's own limits apply (net.unix.max_dgram_qlen, printed).

Cases: the sidecar reading throughout; and the sidecar stalled (SIGSTOP) through the whole burst and
resumed the moment the engine goes idle, as a sidecar starved of CPU by a busy engine would be: then the
plugin holds the whole burst. Target: the backlog is empty within 1 s of the engine going idle, with no
drop. Prints figures; always exits 0. Missed targets are printed as "TARGET MISSED" lines.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence, Sized
from dataclasses import dataclass
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Event as MpEvent

from realistic import Step, build_steps

from stepline.core.clock import SystemClock
from stepline.model.rows import Row
from stepline.plugin.core import PluginCore
from stepline.sources.base import SourceContext
from stepline.sources.plugin_receiver import PluginReceiver

RUNNING = 64
FINISHED_CYCLE = (0, 1, 2, 3, 4, 5, 6)
TARGET_S = 1.0
COLLECTOR_WINDOW_S = 0.2  # PluginReceiver's default, as the collector polls it


def _pin(cpu: int | None) -> None:
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu})


def run_sidecar(socket_path: str, cpu: int | None, ready: MpEvent, stop: MpEvent, rows: Synchronized[int],
                lost: Synchronized[int]) -> None:
    """A PluginReceiver polled in a loop, as the collector's runner does; rows counted, then discarded."""
    _pin(cpu)
    receiver = PluginReceiver(SourceContext("bench", SystemClock()), socket_path, window_s=COLLECTOR_WINDOW_S)
    receiver.start()
    ready.set()

    def emit(batch: Iterable[Row]) -> None:
        n = len(batch) if isinstance(batch, Sized) else sum(1 for _ in batch)
        if n:
            with rows.get_lock():
                rows.value += n

    while not stop.is_set():
        receiver.poll(emit)
        lost.value = receiver.counts["lost_datagrams"] + receiver.counts["malformed"]
    receiver.stop()


@dataclass
class Figures:
    case: str
    steps: int
    records: int
    burst_s: float
    held_at_idle: int
    empty_after_s: float  # from the idle step until the plugin held nothing (inf: not within the timeout)
    decoded_after_s: float  # from the idle step until the sidecar had decoded every record (inf: not within)
    datagrams: int
    dropped: dict[str, int]
    lost: int


def _idle(step: Step) -> Step:
    """The burst's last step: the last requests finished, nothing running or waiting."""
    sched, it = step
    sched.num_running_reqs = 0
    sched.num_waiting_reqs = 0
    return sched, it


def run_case(name: str, steps: Sequence[Step], stall: bool, socket_path: str, sidecar_cpu: int | None,
             timeout_s: float) -> Figures:
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    rows, lost = ctx.Value("q", 0), ctx.Value("q", 0)
    sidecar = ctx.Process(target=run_sidecar, args=(socket_path, sidecar_cpu, ready, stop, rows, lost), daemon=True)
    sidecar.start()
    try:
        if not ready.wait(30):
            raise SystemExit("the sidecar process did not start")
        assert sidecar.pid is not None
        core = PluginCore("bench", socket_path)
        core.engine_initialized({"model": "bench", "served_model_name": "bench"})
        records = 1 + len(steps) + sum(len(it.finished_requests) for _, it in steps)
        time.sleep(0.3)  # the configuration is read; the sidecar is in its polling loop
        if stall:
            os.kill(sidecar.pid, signal.SIGSTOP)
        started = time.perf_counter()
        for sched, it in steps:
            core.record(sched, it, 0)
        idle_at = time.perf_counter()  # the idle step was the last call: from here the engine makes none
        if stall:
            os.kill(sidecar.pid, signal.SIGCONT)
        held_at_idle = core.records_held
        empty_after: float | None = None
        decoded_after: float | None = None
        while decoded_after is None and time.perf_counter() - idle_at < timeout_s:
            now = time.perf_counter()
            if empty_after is None and core.records_held == 0:
                empty_after = now - idle_at
            if rows.value >= records:
                decoded_after = now - idle_at
            time.sleep(0.001)
        if empty_after is None and core.records_held == 0:
            empty_after = time.perf_counter() - idle_at
        figures = Figures(name, len(steps), records, idle_at - started, held_at_idle,
                          math.inf if empty_after is None else empty_after,
                          math.inf if decoded_after is None else decoded_after,
                          core.datagrams_sent, dict(core.dropped), int(lost.value))
        core.close(drain_timeout_s=0.0)
        return figures
    finally:
        stop.set()
        if sidecar.pid is not None and sidecar.is_alive():
            os.kill(sidecar.pid, signal.SIGCONT)
        sidecar.join(10)
        if sidecar.is_alive():
            sidecar.kill()


def _qlen() -> str:
    try:
        with open("/proc/sys/net/unix/max_dgram_qlen") as f:
            return f.read().strip()
    except OSError:
        return "?"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=5_000, help="steps in the burst (default 5000)")
    parser.add_argument("--timeout", type=float, default=30.0, help="give up waiting after this long (default 30 s)")
    args = parser.parse_args(argv)

    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    main_cpu = cpus[0] if len(cpus) >= 2 else None
    sidecar_cpu = cpus[1] if len(cpus) >= 2 else None
    _pin(main_cpu)
    print(f"machine: {platform.platform()}; python {platform.python_version()}; usable cpus {len(cpus) or '?'}; "
          f"engine on cpu {main_cpu}, sidecar on cpu {sidecar_cpu}")
    print(f"kernel: net.unix.max_dgram_qlen={_qlen()} (the sidecar's queue, in datagrams)")
    print(f"burst: {args.steps} steps back to back, {RUNNING} running, "
          f"{sum(FINISHED_CYCLE) / len(FINISHED_CYCLE):g} finished requests per step on average; the last step "
          f"reports 0 running, 0 waiting; sidecar polls in {COLLECTOR_WINDOW_S * 1000:g} ms windows")

    tmp = tempfile.mkdtemp(prefix="stepline-backlog-")
    results: list[Figures] = []
    try:
        for name, stall in (("sidecar reading", False), ("sidecar stalled, resumed at idle", True)):
            steps = build_steps(args.steps, lambda i: FINISHED_CYCLE[i % len(FINISHED_CYCLE)], seed=4,
                                running=RUNNING)
            steps[-1] = _idle(steps[-1])
            path = os.path.join(tmp, f"{len(results)}.sock")
            results.append(run_case(name, steps, stall, path, sidecar_cpu, args.timeout))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print()
    print(f"{'case':<34} {'records':>8} {'burst s':>8} {'held at idle':>13} {'empty after':>12} "
          f"{'decoded after':>14} {'datagrams':>10}  dropped / lost")
    for f in results:
        dropped = ", ".join(f"{n} {reason}" for reason, n in sorted(f.dropped.items())) or "0"
        print(f"{f.case:<34} {f.records:>8} {f.burst_s:>8.2f} {f.held_at_idle:>13} "
              f"{f.empty_after_s * 1000:>10.0f}ms {f.decoded_after_s * 1000:>12.0f}ms {f.datagrams:>10}  "
              f"{dropped} / {f.lost}")
    print()
    for f in results:
        ok = f.empty_after_s <= TARGET_S and not f.dropped and f.lost == 0 and math.isfinite(f.decoded_after_s)
        print(f"{'ok           ' if ok else 'TARGET MISSED'}  {f.case}: backlog of {f.held_at_idle} records empty "
              f"{f.empty_after_s * 1000:.0f} ms after the engine went idle, all {f.records} records decoded after "
              f"{f.decoded_after_s * 1000:.0f} ms (target: empty within {TARGET_S:g} s, no drop)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
