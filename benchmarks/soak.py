#!/usr/bin/env python3
"""Soak: simulated engines at a steady step rate into a real collector, for minutes; what the collector costs.

By default 8 engines x 100 steps/s x ~64 running requests for 5 minutes (`--engines`, `--rate`, `--running`,
`--seconds`). Each engine is the simulator (stepline.sim: the scheduler, a cost model tuned so that a step
with `--running` requests takes 1/`--rate` s, steady chat arrivals sized to keep that many running) served in
real time by a SimServer, whose steps go through the real plugin (PluginCore, Unix datagrams) and whose
finished requests go out as OTLP `llm_request` spans (the opentelemetry-sdk exporter, OTLP/HTTP); the collector
also scrapes every SimServer's /metrics (`--scrape-interval`, 5 s as deployed). `--no-otlp` and `--no-scrape`
leave those out. The engines run in two spawned processes (half each); the collector is `stepline collect` in
a process of its own, with its default sources (the GPU source off: no GPU here), so its CPU and memory are
measured apart from the load: RSS sampled every second (peak and end, and the kernel's high-water mark) and
CPU (user + system, all threads) over the measured window, which starts after `--warmup` seconds.

Printed: rows/s per table, every drop counter (the plugins', the receiver's, the OTLP receiver's, the
exporters', the writers'; all must be 0), the rows in the store after a clean stop against what the engines
made, collector RSS and CPU (% of one core, and CPU seconds per second per 1,000 steps/s). Targets: no drops,
and every step and request made is in the store. Prints figures; always exits 0.
"""

from __future__ import annotations

import argparse
import logging
import math
import multiprocessing as mp
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event as MpEvent
from typing import Any

import psutil  # type: ignore[import-untyped]
from prometheus_client.parser import text_string_to_metric_families

from stepline.sim.config import EngineConfig
from stepline.sim.costmodel import CostModel
from stepline.sim.records import StepRecord
from stepline.sim.telemetry import Telemetry
from stepline.sim.vllm_server import serve
from stepline.sim.workloads import Workload, chat_arrivals, compose
from stepline.store.discovery import read_beside_store
from stepline.store.store import Store

OUTPUT_MEDIAN = 150  # tokens: steady chat (the simulator's `steady` workload)
MEAN_OUTPUT = OUTPUT_MEDIAN * math.exp(0.5**2 / 2)  # lognormal, sigma 0.5
WORKLOAD_S = 600.0  # one cycle of arrivals; the server repeats it with fresh request ids


# -- the engines ----------------------------------------------------------------------------------------------


def engine_config(rate: float, running: int) -> EngineConfig:
    """A cost model whose step with `running` decodes and a few prefill tokens takes about 1/rate s."""
    step_s = 1.0 / rate
    return EngineConfig(cost=CostModel(
        step_overhead_s=0.40 * step_s,
        prefill_token_s=27e-6 * step_s / 0.010,  # ~55 uncached prompt tokens a step: ~15% of it
        prefill_attention_pair_s=0.0,
        decode_request_s=0.45 * step_s / running,
        decode_context_token_s=0.0,
    ))


def workload(index: int, rate: float, running: int) -> Workload:
    """Steady chat sized by Little's law: `running` requests in flight at `rate` steps/s (one token a step)."""
    arrivals_per_s = running * rate / MEAN_OUTPUT
    return compose(f"soak-{index}", WORKLOAD_S, 0.0,
                   chat_arrivals(f"soak{index}", 0.0, WORKLOAD_S, arrivals_per_s, seed=index,
                                 output_median=OUTPUT_MEDIAN))


class Gate:
    """The step callback of one SimServer: nothing leaves until the collector is up, then all of it, counted."""

    def __init__(self) -> None:
        self.target: Telemetry | None = None
        self.steps = 0
        self.requests = 0
        self.running = 0

    def __call__(self, step: StepRecord) -> None:
        target = self.target
        if target is None:
            return
        target.on_step(step)
        self.steps += 1
        self.requests += len(step.finished_requests)
        self.running += step.num_running_reqs


class _CountingHandler(logging.Handler):
    """Counts warnings and errors of the OpenTelemetry SDK (a full span queue, a failed export)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1


def run_engines(indexes: list[int], rate: float, running: int, plugin_socket: str, otlp_url: str | None,
                urls: Queue[list[tuple[str, str]]], go: MpEvent, stop: MpEvent,
                results: Queue[dict[str, Any]]) -> None:
    """Serve some simulated engines in real time; once `go` is set, their steps and spans go to the collector."""
    otel_problems = _CountingHandler()
    logging.getLogger("opentelemetry").addHandler(otel_problems)
    config = engine_config(rate, running)
    gates = [Gate() for _ in indexes]
    servers = [serve(workload(i, rate, running), config, port=0, speed=1.0, repeat=True, on_step=gate)
               for i, gate in zip(indexes, gates, strict=True)]
    names = [f"soak-{i}" for i in indexes]
    urls.put([(name, server.url) for name, server in zip(names, servers, strict=True)])
    go.wait()
    cpu_started = time.process_time()
    telemetries = [Telemetry(name, config, plugin_socket=plugin_socket, otlp_endpoint=otlp_url) for name in names]
    for gate, telemetry in zip(gates, telemetries, strict=True):
        gate.target = telemetry
    stop.wait()
    for gate in gates:
        gate.target = None
    for server in servers:
        server.stop()
    for telemetry in telemetries:
        telemetry.close()
    cpu_s = time.process_time() - cpu_started
    engines = {}
    for name, gate, telemetry in zip(names, gates, telemetries, strict=True):
        plugin = telemetry.plugin
        assert plugin is not None
        engines[name] = {"steps": gate.steps, "requests": gate.requests,
                         "mean_running": gate.running / max(1, gate.steps), "records_sent": plugin.records_sent,
                         "dropped": dict(plugin.dropped), "internal_errors": plugin.internal_errors}
    results.put({"engines": engines, "cpu_s": cpu_s, "otel_problems": otel_problems.count})


# -- the collector, in its own process ----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@dataclass
class Snapshot:
    """The collector's counters and CPU at one moment."""

    at: float
    cpu_s: float
    metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float]

    def total(self, name: str, **labels: str) -> float:
        wanted = set(labels.items())
        return sum(v for (n, lbls), v in self.metrics.items() if n == name and wanted <= set(lbls))

    def by(self, name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for (n, lbls), v in self.metrics.items():
            if n == name:
                key = dict(lbls).get(label, "")
                out[key] = out.get(key, 0.0) + v
        return out

    def nonzero(self, name: str, **labels: str) -> dict[str, float]:
        wanted = set(labels.items())
        return {",".join(f"{k}={v}" for k, v in lbls): value for (n, lbls), value in self.metrics.items()
                if n == name and wanted <= set(lbls) and value}


def snapshot(process: psutil.Process, metrics_url: str) -> Snapshot:
    times = process.cpu_times()
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    metrics = {(sample.name, tuple(sorted(sample.labels.items()))): float(sample.value)
               for family in text_string_to_metric_families(text) for sample in family.samples}
    return Snapshot(time.monotonic(), times.user + times.system, metrics)


@dataclass
class Memory:
    """RSS samples of the collector, MiB."""

    samples: list[float] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def sample_every_second(self, process: psutil.Process) -> None:
        while not self.stop.wait(1.0):
            try:
                self.samples.append(process.memory_info().rss / 2**20)
            except psutil.Error:
                return


def high_water_mib(pid: int) -> float:
    """The kernel's peak RSS of the process (VmHWM), MiB; NaN when unavailable."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return math.nan


def wait_for(predicate: Any, timeout_s: float, what: str, log_path: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    with open(log_path) as fh:
        tail = fh.read()[-3000:]
    raise SystemExit(f"{what} did not happen within {timeout_s:.0f} s; collector log:\n{tail}")


# -- main ----------------------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=300.0, help="measured window (default 300)")
    parser.add_argument("--warmup", type=float, default=20.0, help="seconds before the window (default 20)")
    parser.add_argument("--engines", type=int, default=8, help="simulated engines (default 8)")
    parser.add_argument("--rate", type=float, default=100.0, help="steps/s per engine (default 100)")
    parser.add_argument("--running", type=int, default=64, help="running requests per engine (default 64)")
    parser.add_argument("--scrape-interval", type=float, default=5.0, help="the collector's /metrics scrape interval")
    parser.add_argument("--no-otlp", action="store_true", help="send no OTLP spans")
    parser.add_argument("--no-scrape", action="store_true", help="do not scrape the engines' /metrics")
    args = parser.parse_args(argv)
    n = max(1, args.engines)

    print(f"machine: {platform.platform()}; {platform.processor() or platform.machine()}; python "
          f"{platform.python_version()}; cpu_count={os.cpu_count()}; memory "
          f"{psutil.virtual_memory().total / 2**30:.1f} GiB; load average before "
          + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    print(f"load: {n} engines x {args.rate:g} steps/s x ~{args.running} running (steady chat, output median "
          f"{OUTPUT_MEDIAN} tokens); plugin datagrams, "
          + ("no OTLP" if args.no_otlp else "OTLP/HTTP spans") + ", "
          + ("no scrapes" if args.no_scrape else f"/metrics scraped every {args.scrape_interval:g} s")
          + f"; warm-up {args.warmup:g} s, measured {args.seconds:g} s")

    tmp = tempfile.mkdtemp(prefix="stepline-soak-")
    store_dir = os.path.join(tmp, "store")
    plugin_socket = os.path.join(tmp, "plugin.sock")
    otlp_port = free_port()
    ctx = mp.get_context("spawn")
    urls: Queue[list[tuple[str, str]]] = ctx.Queue()
    results: Queue[dict[str, Any]] = ctx.Queue()
    go, stop = ctx.Event(), ctx.Event()
    halves = [list(range(0, (n + 1) // 2)), list(range((n + 1) // 2, n))]
    generators = [ctx.Process(target=run_engines, args=(
        half, args.rate, args.running, plugin_socket, None if args.no_otlp else f"http://127.0.0.1:{otlp_port}",
        urls, go, stop, results), daemon=True) for half in halves if half]
    collector: subprocess.Popen[bytes] | None = None
    log_path = os.path.join(tmp, "collector.log")
    memory = Memory()
    try:
        for generator in generators:
            generator.start()
        engines = [pair for _ in generators for pair in urls.get(timeout=120)]
        command = [sys.executable, "-m", "stepline", "collect", "--store", f"chdb://{store_dir}",
                   "--plugin-socket", plugin_socket, "--otlp-port", str(otlp_port), "--metrics-port", "0",
                   "--query-port", "0", "--host-name", "soak", "--scrape-interval", str(args.scrape_interval),
                   "--disable-source", "gpu"]  # no GPU here: NVML is absent
        if not args.no_scrape:
            for name, url in engines:
                command += ["--engine", f"{name}={url}"]
        with open(log_path, "wb") as log_file:
            collector = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT)
        wait_for(lambda: read_beside_store(store_dir) is not None and os.path.exists(plugin_socket), 120,
                 "the collector's start", log_path)
        info = read_beside_store(store_dir)
        assert info is not None
        process = psutil.Process(collector.pid)
        sampler = threading.Thread(target=memory.sample_every_second, args=(process,), daemon=True)
        sampler.start()
        go.set()
        time.sleep(args.warmup)
        first = snapshot(process, info.metrics_url)
        rss_at_start = process.memory_info().rss / 2**20
        time.sleep(args.seconds)
        last = snapshot(process, info.metrics_url)
        rss_at_end = process.memory_info().rss / 2**20
        peak = high_water_mib(process.pid)
        window = memory.samples[int(args.warmup):] or [rss_at_end]
        stop.set()
        made = [results.get(timeout=120) for _ in generators]
        for generator in generators:
            generator.join(30)
        time.sleep(1.5)  # the receivers' last polls
        drained = snapshot(process, info.metrics_url)
        memory.stop.set()
        collector.send_signal(signal.SIGTERM)
        collector.wait(120)
        exit_code = collector.returncode
    finally:
        memory.stop.set()
        stop.set()
        for generator in generators:
            if generator.is_alive():
                generator.kill()
        if collector is not None and collector.poll() is None:
            collector.kill()

    store = Store.open(f"chdb://{store_dir}")
    try:
        stored = {table: int(store.query(f"SELECT count() FROM `{table}` WHERE engine LIKE 'soak-%'")
                             .result_rows[0][0]) for table in ("steps", "requests", "engine_samples")}
        all_rows = {str(t): int(c) for t, c in store.query(
            "SELECT table, sum(rows) FROM system.parts WHERE database = currentDatabase() AND active "
            "GROUP BY table ORDER BY table").result_rows}
    finally:
        store.close()
    with open(log_path) as fh:
        warnings = [line.rstrip() for line in fh if " WARNING " in line or " ERROR " in line]
    shutil.rmtree(tmp, ignore_errors=True)

    per_engine = {name: e for m in made for name, e in m["engines"].items()}
    steps_made = sum(e["steps"] for e in per_engine.values())
    requests_made = sum(e["requests"] for e in per_engine.values())
    window_s = last.at - first.at
    written_first, written_last = first.by("stepline_writer_rows_written_total", "table"), \
        last.by("stepline_writer_rows_written_total", "table")
    steps_per_s = (written_last.get("steps", 0) - written_first.get("steps", 0)) / window_s
    cpu_s = last.cpu_s - first.cpu_s
    cores = cpu_s / window_s

    print()
    print(f"engines: {len(per_engine)}; steps made {steps_made:,} ({steps_made / len(per_engine):,.0f} each), "
          f"requests finished {requests_made:,}; mean running "
          f"{statistics.mean(e['mean_running'] for e in per_engine.values()):.1f}; engine processes' CPU "
          + ", ".join(f"{m['cpu_s']:.0f} s" for m in made))
    print(f"rows/s per table over the {window_s:.0f} s window (written to the store):")
    for table in sorted(set(written_last) | set(written_first)):
        rate = (written_last.get(table, 0) - written_first.get(table, 0)) / window_s
        print(f"  {table:<16} {rate:>10,.1f}")
    rows_in_window = sum(written_last.values()) - sum(written_first.values())
    print(f"  {'all':<16} {rows_in_window / window_s:>10,.1f}  ({rows_in_window:,.0f} rows)")

    print()
    print("drops (all must be 0):")
    plugin_drops: dict[str, int] = {}
    for e in per_engine.values():
        for reason, count in e["dropped"].items():
            plugin_drops[reason] = plugin_drops.get(reason, 0) + count
    internal = sum(e["internal_errors"] for e in per_engine.values())
    receiver = {c: drained.total("stepline_source_counts_total", source="plugin", counter=c)
                for c in ("malformed", "unauthorized", "lost_datagrams", "plugin_dropped_records")}
    otlp_bad = {c: drained.total("stepline_source_counts_total", source="otlp", counter=c)
                for c in ("spans_rejected", "requests_bad", "requests_too_large", "requests_unauthorized",
                          "requests_busy", "requests_unsupported")}
    spans_accepted = drained.total("stepline_source_counts_total", source="otlp", counter="spans_accepted")
    spans_missing = 0 if args.no_otlp else max(0, requests_made - int(spans_accepted))
    otel_problems = sum(int(m["otel_problems"]) for m in made)
    writer_drops = drained.nonzero("stepline_writer_rows_dropped_total")
    source_errors = drained.nonzero("stepline_source_errors_total")
    lines = [
        ("plugins (PluginCore.dropped, all engines)", sum(plugin_drops.values()),
         ", ".join(f"{k} {v}" for k, v in sorted(plugin_drops.items())) + (f"; internal errors {internal}"
                                                                            if internal else "")),
        ("plugin receiver", sum(receiver.values()), ", ".join(f"{k} {v:.0f}" for k, v in receiver.items())),
        ("OTLP receiver", sum(otlp_bad.values()), ", ".join(f"{k} {v:.0f}" for k, v in otlp_bad.items())),
        ("OTLP exporters (spans not accepted; SDK warnings)", spans_missing + otel_problems,
         f"{spans_missing} of {requests_made:,} spans missing, {otel_problems} SDK warnings"),
        ("writers (rows dropped, every reason)", sum(writer_drops.values()),
         ", ".join(f"{k}: {v:.0f}" for k, v in writer_drops.items()) or "none"),
    ]
    for what, count, detail in lines:
        print(f"  {what:<52} {count:>8.0f}  ({detail})")
    print(f"  (source poll errors, for information: {source_errors or 'none'}; collector log warnings/errors: "
          f"{len(warnings)})")
    for line in warnings[:5]:
        print(f"    {line[:200]}")

    print()
    print(f"store after a clean stop (exit code {exit_code}): steps {stored['steps']:,} of {steps_made:,} made, "
          f"requests {stored['requests']:,} of {requests_made:,} finished, engine_samples "
          f"{stored['engine_samples']:,}; rows by table: " + ", ".join(f"{t} {c:,}" for t, c in all_rows.items()))
    print()
    print(f"collector RSS: at window start {rss_at_start:.0f} MiB, peak in window {max(window):.0f} MiB, end "
          f"{rss_at_end:.0f} MiB, kernel high-water mark (whole life) {peak:.0f} MiB")
    fifths = [window[min(len(window) - 1, round(k * (len(window) - 1) / 5))] for k in range(6)]
    print("collector RSS across the window, every fifth of it: " + ", ".join(f"{m:.0f}" for m in fifths) + " MiB")
    print(f"collector CPU: {cpu_s:.1f} s over {window_s:.0f} s = {100 * cores:.1f}% of one core, at "
          f"{steps_per_s:,.0f} steps/s: {cores / max(1e-9, steps_per_s / 1000):.3f} CPU-seconds per second per "
          "1k steps/s")
    print("note: 2 shared cores; the engines' processes, the collector and other work contend for them")

    print()
    drops_total = sum(count for _, count, _ in lines)
    checks = [
        (drops_total == 0, f"no drops anywhere ({drops_total:.0f})"),
        (stored["steps"] == steps_made and stored["requests"] == requests_made,
         f"every step and request made is in the store ({stored['steps']:,}/{steps_made:,}, "
         f"{stored['requests']:,}/{requests_made:,})"),
        (steps_per_s >= 0.95 * n * args.rate, f"{steps_per_s:,.0f} steps/s written (offered {n * args.rate:,.0f})"),
    ]
    for ok, what in checks:
        print(f"{'ok           ' if ok else 'TARGET MISSED'}  {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
