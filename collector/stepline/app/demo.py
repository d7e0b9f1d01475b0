"""`stepline demo`: a simulated engine under the burst workload, collected into the embedded store."""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Collection
from datetime import timedelta
from typing import Any

from stepline.analysis import perrequest, summary, timeline, usage_rollup
from stepline.app.collector import Collector
from stepline.config.settings import Settings
from stepline.core.clock import ManualClock
from stepline.diagnosis.detectors import summary_for_demo
from stepline.ingest.runner import Scheduled
from stepline.model.rows import UsageMinute, micros
from stepline.queries.requests import merged
from stepline.queries.window import ENGINE, SINCE
from stepline.sim import vllm_server as sim_server
from stepline.sim.config import EngineConfig
from stepline.sim.gpu import GpuModel, SimulatedGpus, SimulatedGpuSource, VirtualGpuSampler
from stepline.sim.records import StepRecord
from stepline.sim.replay import replay
from stepline.sim.telemetry import LateBound, Telemetry
from stepline.sim.workloads import Workload, make_workload
from stepline.sources.base import SourceContext
from stepline.sources.otlp import OtlpReceiver
from stepline.sources.vllm_metrics import VllmMetricsSource
from stepline.store.reads import scalar
from stepline.store.store import Store

log = logging.getLogger(__name__)

# In real time the demo drives the short burst (the burst's first monster, while chat decodes, in ~75 s); with
# --fast it replays the whole 10-minute burst. Rescaling the burst to a minute loses its story (sim/workloads.py).
REALTIME_WORKLOAD = "short-burst"
FAST_WORKLOAD = "burst"
DEFAULT_GPU_SCENARIO = "power-cap"  # the clocks drop during prefill: the GPU panels have a story too


def workload_for(name: str | None = None, *, fast: bool = False, duration_s: float | None = None) -> Workload:
    """The workload the demo drives: `name`, else the whole burst with `fast` and the short burst in real time."""
    return make_workload(name or (FAST_WORKLOAD if fast else REALTIME_WORKLOAD), duration_s=duration_s)


def run_demo(store_url: str, workload: Workload, *, fast: bool = False, scrape_interval_s: float | None = None,
             gpu_scenario: str = DEFAULT_GPU_SCENARIO) -> None:
    """Drive `workload` into a collector that writes `store_url`, then print the summary and the diagnosis.

    With `fast` it is replayed on a virtual clock (scraped every 5 s unless told), else served in real time (1 s)."""
    since = time.time()
    # Each run is an engine of its own: a fast replay is stamped into the recent past, where an
    # earlier run may already lie, and the two must not blur into one engine's counters.
    engine = time.strftime("sim-%H%M%S")
    config = EngineConfig()
    gpus = SimulatedGpus(GpuModel(scenario=gpu_scenario), engine_pid=os.getpid())
    with tempfile.TemporaryDirectory(prefix="stepline-demo-") as sockets:
        # The real GPU source would find no NVML here: the demo's GPUs are simulated, sampled by the same code.
        base: dict[str, Any] = {"store": store_url, "metrics_port": 0, "query_port": 0, "otlp_port": 0,
                                "plugin_socket": os.path.join(sockets, "plugin.sock"),
                                "disabled_sources": frozenset({"gpu"}),
                                # Rolled up below, once every report is in: a fast replay lies in the past.
                                "usage_rollup": False}
        if fast:
            interval = scrape_interval_s or 5.0
            collector = Collector(Settings.from_env(engines=(), scrape_interval_s=interval, **base))
            collector.start()
            telemetry = _telemetry(collector, engine, config)
            since = _replay(collector, workload, config, interval, engine, telemetry, gpus)
        else:
            interval = scrape_interval_s or 1.0
            forward = LateBound(gpus.model.on_step)
            server = sim_server.serve(workload, config, host="127.0.0.1", port=0, repeat=False, on_step=forward)
            try:
                settings = Settings.from_env(engines=(f"{engine}={server.url}",), scrape_interval_s=interval, **base)
                collector = Collector(settings, extra=lambda ctx: _gpu_sources(gpus, ctx, engine, settings))
                collector.start()
                telemetry = _telemetry(collector, engine, config)
                forward.attach(telemetry.on_step)
                _watch(collector, server, workload.duration_s + workload.drain_s, interval)
            finally:
                server.stop()
        telemetry.close()
        collector.stop()
    roll_up_usage(collector.settings.store, collector.settings.host_name, since, time.time())
    _print_summary(collector.settings.store, engine, since)


def roll_up_usage(store_url: str, host: str, start_s: float, end_s: float, engines: Collection[str] = ()) -> int:
    """Roll the whole minutes of [start_s, end_s) into usage_minutes, as the collector's job does minute by minute
    (the Usage dashboard reads them), for `host`'s engines (every host's where '', only `engines` where given);
    how many rows."""
    store = Store.open(store_url)
    try:
        rows = [r for r in usage_rollup.roll(store, host, start_s, end_s) if not engines or r.engine in engines]
        if rows:
            store.insert("usage_minutes", rows, UsageMinute._fields)
    finally:
        store.close()
    return len(rows)


def _gpu_sources(gpus: SimulatedGpus, ctx: SourceContext, engine: str, settings: Settings) -> list[Scheduled]:
    # The simulator runs inside this process: its GPUs' process is ours, and it serves `engine`.
    ctx.engine_processes.found(engine, os.getpid())
    return [Scheduled(SimulatedGpuSource(gpus, ctx), settings.gpu_interval_s)]


def _telemetry(collector: Collector, engine: str, config: EngineConfig) -> Telemetry:
    """The simulated engine's plugin and span exporter, pointed at this collector's receivers."""
    otlp = next(s for s in collector.sources if isinstance(s, OtlpReceiver))
    return Telemetry(engine, config, plugin_socket=collector.settings.plugin_socket, otlp_endpoint=otlp.url)


def _replay(collector: Collector, workload: Workload, config: EngineConfig, interval: float, engine: str,
            telemetry: Telemetry, gpus: SimulatedGpus) -> float:
    """Replay the workload into the collector on a virtual clock; returns when (in stamped time) it began."""
    assert collector.writers is not None
    writers = collector.writers
    host = collector.settings.host_name
    scraper = VllmMetricsSource(f"http://{engine}.invalid/metrics", SourceContext(host, collector.clock),
                                engine=engine)
    sampler = VirtualGpuSampler(gpus, SourceContext(host, ManualClock(0.0)), engine,
                                 collector.settings.gpu_interval_s, writers.write)

    def on_step(step: StepRecord) -> None:
        sampler.until(step.ts - step.elapsed_ms / 1000)  # the GPUs before this step began
        gpus.model.on_step(step)
        sampler.until(step.ts)
        telemetry.on_step(step)

    started = time.monotonic()
    result = replay(workload, config, interval, lambda ts, body: scraper.ingest(body, ts, writers.write),
                    on_step=on_step, keep_records=False)
    sampler.until(result.end_ts)
    print(f"replayed {result.scrapes} scrapes ({result.end_ts - result.start_ts:.0f} s of simulated time) "
          f"in {time.monotonic() - started:.1f} s; drained={result.drained}")
    return result.start_ts


def _watch(collector: Collector, server: sim_server.SimServer, seconds: float, interval: float) -> None:
    print(f"simulated vLLM engine at {server.url}/metrics; collecting for about {seconds:.0f} s "
          f"(Ctrl-C stops early, keeping what was collected)")
    if collector.query_endpoint is not None:
        print(f"while it runs, `stepline query` goes through the collector at {collector.query_endpoint.url}")
    deadline = time.monotonic() + seconds + 2 * interval
    next_report = time.monotonic() + 10
    try:
        while time.monotonic() < deadline:
            time.sleep(0.5)
            if server.simulation.is_done() and time.monotonic() > deadline - seconds:
                time.sleep(2 * interval)  # one more scrape sees the final counters
                break
            if time.monotonic() >= next_report:
                next_report += 10
                sched = server.simulation.scheduler
                print(f"  t+{seconds - (deadline - time.monotonic() - 2 * interval):4.0f}s  "
                      f"running {len(sched.running):3d}  waiting {len(sched.waiting):3d}  "
                      f"steps {server.simulation.iteration_index}")
    except KeyboardInterrupt:
        print("stopping early")


def _print_summary(store_url: str, engine: str, since: float) -> None:
    store = Store.open(store_url)
    params = {"since": micros(since), "engine": engine}
    window = f"{ENGINE} AND {SINCE}"
    try:
        print(f"\nengine {engine}, per minute (from vLLM's own counters and histograms):")
        print(summary.render(summary.trim_idle(summary.per_minute(store, engine, since))))
        print("\nper request, by prompt size (from the plugin's finished requests):")
        print(perrequest.by_prompt_band(store, engine, since))
        print()
        print(perrequest.around_largest_prefill(store, engine, since))
        moment = perrequest.largest_prefill_start(store, engine, since)
        if moment is not None:
            print(f"\nthe GPUs meanwhile (stepline timeline --around {moment:%H:%M:%S} --window 30 --bucket 5):")
            print(timeline.around(store, store.database, moment + timedelta(seconds=20), window_s=30,
                                  engine=engine, bucket_s=5))
        counts = store.query(f"SELECT kind, count() FROM events WHERE {window} GROUP BY kind ORDER BY kind",
                             parameters=params).result_rows
        # A request's reports merge into one row (the merged read): count requests, not reports.
        tables = {table: scalar(store.query(f"SELECT count() FROM {merged(table) if table == 'requests' else table} "
                                            f"WHERE {window}", parameters=params))
                  for table in ("engine_samples", "steps", "requests", "gpu_samples")}
        # The host is sampled in real time, also while a fast replay runs: its rows are the collector's own.
        tables["host_samples"] = scalar(store.query(f"SELECT count() FROM host_samples WHERE {SINCE}",
                                                    parameters=params))
        print(f"\n{engine} on the timeline: " + ", ".join(f"{n} rows in {t}" for t, n in tables.items())
              + "; events: " + ", ".join(f"{k} {n}" for k, n in counts))
        print(f"\nwhat stepline diagnose says about {engine}:")
        print(summary_for_demo(store, engine, since))
    finally:
        store.close()
    print("\nlook further:\n"
          "  stepline status\n"
          "  stepline diagnose --since 1h\n"
          "  stepline report --since 1h --out incident.html\n"
          "  stepline requests --slowest 10\n"
          "  stepline query \"SELECT ts, value FROM engine_samples WHERE metric = 'vllm:num_requests_waiting' "
          "ORDER BY ts DESC LIMIT 10\"\n"
          "  stepline query \"SELECT ts, kind, message FROM events ORDER BY ts\"\n"
          "  stepline query \"SELECT ts, elapsed_ms, num_ctx_tokens, num_generation_requests FROM steps "
          "ORDER BY elapsed_ms DESC LIMIT 10\"")
