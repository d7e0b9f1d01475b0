"""Diagnosis scenarios: short simulated incidents with one known cause each, replayed into a store.

Each `Scenario` pairs a workload, an engine configuration and what the GPUs do with the finding
kind a correct diagnosis names first (None: nothing above info). `simulate` replays one on a
virtual clock; `run_scenario` does so through the real collector (plugin receiver, OTLP receiver,
/metrics ingestion, the GPU source over simulated GPUs), as `stepline demo --fast` does, and
`run_engines` replays several engines, each its own scenario, into one store through one collector.

A workload with no drain time ends the replay (and the window) while requests are still in flight.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from stepline.app.collector import Collector
from stepline.config.settings import Settings
from stepline.core.clock import ManualClock
from stepline.diagnosis.findings import Window
from stepline.gateway.record import DecisionRecorder
from stepline.sim.config import EngineConfig
from stepline.sim.costmodel import Throttle, ThrottledCostModel
from stepline.sim.engine import Admit, Simulation
from stepline.sim.gateway import SimGateway
from stepline.sim.gpu import (
    BOOST_MHZ,
    SW_POWER_CAP,
    TDP_W,
    GpuModel,
    GpuReading,
    SimulatedGpus,
    VirtualGpuSampler,
)
from stepline.sim.records import StepRecord
from stepline.sim.telemetry import Telemetry
from stepline.sim.workloads import Workload, chat_arrivals, compose, one_request
from stepline.sources.base import SourceContext
from stepline.sources.otlp import TRACES_PATH, OtlpReceiver
from stepline.sources.vllm_metrics import VllmMetricsSource

SCRAPE_INTERVAL_S = 5.0
GPU_INTERVAL_S = 0.5
# The power cap is applied, and the step slowdown re-read from the GPUs' clocks, this often.
TICK_S = 0.5


@dataclass(frozen=True)
class PowerCap:
    """Board power capped at `watts` from `start_s` to `end_s` (simulated seconds)."""

    start_s: float
    end_s: float
    watts: float


@dataclass(frozen=True)
class Scenario:
    """One simulated incident and the finding kind it should produce (None: nothing above info)."""

    name: str
    expected_kind: str | None
    workload: Workload
    config: EngineConfig = field(default_factory=EngineConfig)
    gpu_scenario: str = "normal"
    power_cap: PowerCap | None = None
    description: str = ""
    # One XID error this many simulated seconds after the first step (None: as gpu_scenario says).
    xid_at_s: float | None = None
    gpus: int = 2

    def gpu_model(self) -> GpuModel:
        """What this scenario's GPUs do; an XID on its own leaves board power uncapped."""
        if self.xid_at_s is not None and self.gpu_scenario == "normal":
            return GpuModel(self.gpus, "xid", power_cap_w=TDP_W, xid_at_s=self.xid_at_s)
        return GpuModel(self.gpus, self.gpu_scenario, xid_at_s=self.xid_at_s)


def _healthy() -> Scenario:
    return Scenario("healthy", None, compose("healthy", 150, 30, chat_arrivals("chat", 0, 150, 4.0, abort_share=0.01)),
                    description="steady cached chat at 4 req/s; nothing wrong")


def _monster_prefill() -> Scenario:
    # A fixed pool of long answers decodes throughout; nothing else arrives, so the queue stays empty.
    pool = [one_request(f"decode-{i:03d}", 0.1 * i, 2000, 3000, 0.9) for i in range(48)]
    monster = [one_request("monster-300k", 30.0, 300_000, 124)]
    return Scenario("monster_prefill", "prefill_interference", compose("monster_prefill", 120, 30, pool, monster),
                    description="48 requests decoding; one uncached 300k-token prompt prefills beside them")


def _head_of_line() -> Scenario:
    chat = chat_arrivals("chat", 0, 25, 1.0, output_median=30)
    monster = [one_request("monster-240k", 25.0, 240_000, 124)]
    shorts = chat_arrivals("short", 26, 36, 8.0, prompt_median=1500, output_median=40, cached=(0.4, 0.6))
    return Scenario("head_of_line", "head_of_line_blocking", compose("head_of_line", 90, 30, chat, monster, shorts),
                    description="a 240k-token prompt, then ~80 short requests that wait behind its prefill")


def _prefix_cache_collapse() -> Scenario:
    quiet = chat_arrivals("quiet", 0, 75, 3.0, prompt_median=3000, output_median=40, cached=(0.96, 1.0),
                          max_prompt=16_384)
    fresh = chat_arrivals("fresh", 75, 150, 5.0, prompt_median=3000, output_median=40, cached=(0.0, 0.08),
                          max_prompt=16_384)
    return Scenario("prefix_cache_collapse", "prefix_cache_collapse",
                    compose("prefix_cache_collapse", 150, 30, quiet, fresh),
                    description="prefix-cache hit rate ~98% then ~4%: fresh documents, no monsters")


def _leaked_slot_wedge() -> Scenario:
    chat = chat_arrivals("chat", 0, 180, 2.0, output_median=60, abort_share=0.2)
    return Scenario("leaked_slot_wedge", "wedged_engine", compose("leaked_slot_wedge", 180, 0, chat),
                    EngineConfig(max_num_seqs=16, leak_aborted_slots=True),
                    description="aborted requests keep their slot until max_num_seqs=16 is used up; then no steps")


def _gpu_power_cap() -> Scenario:
    # Two requests decode alone first (what this GPU does unhindered), then long-context chat keeps
    # ~40% of the GPU busy, until a deep power cap holds the clocks near half for a minute.
    alone = [one_request(f"alone-{i}", 0.5 + i, 4000, 1200, 0.95) for i in range(2)]
    chat = chat_arrivals("chat", 15, 180, 4.0, prompt_median=4000, output_median=300, cached=(0.93, 0.97),
                          max_prompt=16_384)
    return Scenario("gpu_power_cap", "gpu_throttling", compose("gpu_power_cap", 180, 0, alone, chat),
                    power_cap=PowerCap(70.0, 130.0, 130.0),
                    description="steady decode load; a 130 W power cap from t=70 s to t=130 s holds clocks down")


def _config_not_in_effect() -> Scenario:
    # Chat pauses while the document prefills: its 8192-token chunks slow nobody, so the unapplied
    # setting is the only thing wrong (no interference to blame).
    before, after = chat_arrivals("chat", 0, 55, 3.0), chat_arrivals("later", 65, 150, 3.0)
    # Partly cached, so its hit rate stays well above half the chat's: no cache collapse either.
    document = [one_request("document-40k", 60.0, 40_960, 100, 0.6)]
    return Scenario("config_not_in_effect", "config_not_in_effect",
                    compose("config_not_in_effect", 150, 30, before, document, after),
                    EngineConfig(long_prefill_token_threshold=2048, ignore_long_prefill_token_threshold=True),
                    description="long_prefill_token_threshold=2048 reported at start-up, 8192-token chunks run")


def _legitimately_slow() -> Scenario:
    work = [one_request("long-700k", 0.5, 700_000, 3000, 0.9)]
    return Scenario("legitimately_slow", None, compose("legitimately_slow", 150, 30, work),
                    description="one 700k-token request alone: a 70k-token prefill, then a slow, steady decode")


_BUILDERS: dict[str, Callable[[], Scenario]] = {
    "healthy": _healthy,
    "monster_prefill": _monster_prefill,
    "head_of_line": _head_of_line,
    "prefix_cache_collapse": _prefix_cache_collapse,
    "leaked_slot_wedge": _leaked_slot_wedge,
    "gpu_power_cap": _gpu_power_cap,
    "config_not_in_effect": _config_not_in_effect,
    "legitimately_slow": _legitimately_slow,
}
SCENARIO_NAMES = tuple(_BUILDERS)


def make_scenario(name: str) -> Scenario:
    """The scenario called `name`."""
    try:
        return _BUILDERS[name]()
    except KeyError:
        raise ValueError(f"unknown scenario {name!r}; choose one of {', '.join(SCENARIO_NAMES)}") from None


@dataclass
class ScenarioRun:
    """What a replay produced: its stamped span, steps, and the GPUs' reading after each step."""

    scenario: Scenario
    start_ts: float
    end_ts: float
    steps: list[StepRecord] = field(default_factory=list)
    readings: list[tuple[float, GpuReading]] = field(default_factory=list)
    scrapes: int = 0
    drained: bool = False
    # Requests still waiting or running when the replay stopped.
    in_flight: int = 0


def simulate(
    scenario: Scenario,
    *,
    end_at: float | None = None,
    before_step: Callable[[StepRecord], None] | None = None,
    on_step: Callable[[StepRecord], None] | None = None,
    on_scrape: Callable[[float, bytes], None] | None = None,
    gpus: SimulatedGpus | None = None,
    admit: Admit | None = None,
) -> ScenarioRun:
    """Replay `scenario` on a virtual clock, stamped as if it had ended at `end_at` (default: now).

    `before_step` sees each step before the GPU model does, `on_step` after; `on_scrape(ts, body)`
    gets the engine's /metrics every SCRAPE_INTERVAL_S simulated seconds; `admit` is a gateway's gate in front.
    """
    workload = scenario.workload
    scrapes = math.ceil((workload.duration_s + workload.drain_s) / SCRAPE_INTERVAL_S - 1e-9)
    end = end_at if end_at is not None else time.time()
    start = end - scrapes * SCRAPE_INTERVAL_S
    model = gpus.model if gpus is not None else scenario.gpu_model()
    throttle = Throttle()
    config = replace(scenario.config, cost=ThrottledCostModel.wrap(scenario.config.cost, throttle))
    run = ScenarioRun(scenario, start, end)

    def record(step: StepRecord) -> None:
        if before_step is not None:
            before_step(step)
        model.on_step(step)
        run.steps.append(step)
        run.readings.append((step.ts, model.reading(step.ts)))
        if on_step is not None:
            on_step(step)

    sim = Simulation(workload, config, ManualClock(start), on_step=record, admit=admit)
    now = 0.0
    for k in range(scrapes + 1):
        target = k * SCRAPE_INTERVAL_S
        while now < target:
            # The tick's starting second decides the cap for the steps that end within it.
            last = run.readings[-1][1] if run.readings else None
            throttle.factor = power_cap_factor(scenario.power_cap, model, last, now)
            now = min(now + TICK_S, target)
            sim.advance_to(now)
        if on_scrape is not None:
            on_scrape(start + target, sim.render_metrics())
        run.scrapes += 1
    run.drained = sim.is_done()
    run.in_flight = len(sim.scheduler.running) + len(sim.scheduler.waiting)
    return run


def power_cap_factor(cap: PowerCap | None, model: GpuModel, last: GpuReading | None, now: float) -> float:
    """Apply the cap for simulated second `now`; returns how much slower steps run at the clocks it leaves."""
    if cap is None or not cap.start_s <= now < cap.end_s:
        model.set_power_cap(None)
        return 1.0
    model.set_power_cap(cap.watts)
    # Steps slow in proportion to the SM clock the cap left on the latest step.
    return BOOST_MHZ / last.sm_clock_mhz if last is not None and last.reasons & SW_POWER_CAP else 1.0


def run_scenario(scenario: Scenario, store_url: str, *, end_at: float | None = None,
                 engine: str | None = None) -> tuple[str, Window]:
    """Replay `scenario` through a collector into `store_url`; returns the engine name and the window to diagnose.

    The window runs from the replay's first scrape to when the run finished (at least `end_at`):
    the plugin's engine_config event is stamped on receipt, in real time, so it must fall inside.
    """
    engine = engine or scenario.name
    _, window = run_engines([(engine, scenario)], store_url, end_at=end_at)
    return engine, window


def run_engines(engines: Sequence[tuple[str, Scenario]], store_url: str, *, end_at: float | None = None,
                gateway: SimGateway | None = None) -> tuple[list[ScenarioRun], Window]:
    """Replay several engines, each (name, scenario) with its own workload, configuration and GPUs, into
    `store_url` through one collector; all end at `end_at` (default: now). Returns each engine's run and the
    window to diagnose: every engine's span, over all engines ("") when there are several.

    Each engine has GPUs of its own on the one host (the second engine's numbered after the first's). With a
    `gateway`, the engines of its lanes replay behind its gates, and its decisions reach the collector as a
    home-made router's would: DecisionRecorder's spans to the OTLP receiver.
    """
    if not engines:
        raise ValueError("run_engines needs at least one engine")
    names = [name for name, _ in engines]
    if len(set(names)) != len(names):
        raise ValueError(f"engine names must differ, got {names}")
    end = end_at if end_at is not None else time.time()
    runs: list[ScenarioRun] = []
    with tempfile.TemporaryDirectory(prefix="stepline-scenario-") as sockets:
        # The GPUs are simulated and sampled on the virtual clock below; the real GPU source would find no NVML.
        base: dict[str, Any] = {"store": store_url, "metrics_port": 0, "query_port": 0, "otlp_port": 0,
                                "plugin_socket": os.path.join(sockets, "plugin.sock"),
                                "disabled_sources": frozenset({"gpu"}), "scrape_interval_s": SCRAPE_INTERVAL_S,
                                # A replay lies in the past: the job would roll its minutes before their reports.
                                "usage_rollup": False}
        collector = Collector(Settings.from_env(engines=(), **base))
        collector.start()
        try:
            first_gpu = 0
            for engine, scenario in engines:
                runs.append(_replay(collector, engine, scenario, end, first_gpu, gateway))
                first_gpu += scenario.gpus
            if gateway is not None:
                started = {name: run.start_ts for name, run in zip(names, runs, strict=True)}
                _report_decisions(collector, gateway, started)
        finally:
            collector.stop()
    window_end = max(max(r.end_ts for r in runs), time.time())
    window_start = min(r.start_ts for r in runs)
    return runs, Window(datetime.fromtimestamp(window_start, UTC), datetime.fromtimestamp(window_end, UTC),
                        names[0] if len(names) == 1 else "")


def _report_decisions(collector: Collector, gateway: SimGateway, start_ts: dict[str, float]) -> None:
    otlp = next(s for s in collector.sources if isinstance(s, OtlpReceiver))
    # A replay's decisions arrive all at once, on a machine busy replaying: the receiver is given its time.
    recorder = DecisionRecorder(f"{otlp.url.rstrip('/')}{TRACES_PATH}", gateway.config.name, timeout_s=60.0)
    try:
        for record in gateway.records(start_ts):
            recorder.record(**record)
    finally:
        recorder.close(timeout_s=30.0)
    stats = recorder.stats()
    if stats["sent"] != stats["recorded"]:
        raise RuntimeError(f"the simulated gateway's decisions did not all reach the collector: {stats}")


def _replay(collector: Collector, engine: str, scenario: Scenario, end_at: float, first_gpu: int,
            gateway: SimGateway | None = None) -> ScenarioRun:
    """One engine's replay through `collector`'s receivers and /metrics ingestion, its GPUs sampled beside it."""
    assert collector.writers is not None
    write = collector.writers.write
    otlp = next(s for s in collector.sources if isinstance(s, OtlpReceiver))
    gpus = SimulatedGpus(scenario.gpu_model(), engine_pid=os.getpid(), first_index=first_gpu)
    telemetry = Telemetry(engine, scenario.config, plugin_socket=collector.settings.plugin_socket,
                          otlp_endpoint=otlp.url)
    host = collector.settings.host_name
    scraper = VllmMetricsSource(f"http://{engine}.invalid/metrics", SourceContext(host, collector.clock),
                                engine=engine)
    sampler = VirtualGpuSampler(gpus, SourceContext(host, ManualClock(0.0)), engine, GPU_INTERVAL_S, write)

    gate = gateway.gate(engine) if gateway is not None else None

    def on_step(step: StepRecord) -> None:
        sampler.until(step.ts)
        telemetry.on_step(step)
        if gate is not None:
            gate.on_step(step)

    try:
        # The GPUs read the previous step's figures until this one began.
        run = simulate(scenario, end_at=end_at, gpus=gpus, on_step=on_step,
                       admit=gate.admit if gate is not None else None,
                       before_step=lambda step: sampler.until(step.ts - step.elapsed_ms / 1000),
                       on_scrape=lambda ts, body: scraper.ingest(body, ts, write))
        sampler.until(run.end_ts)
    finally:
        telemetry.close()
    return run
