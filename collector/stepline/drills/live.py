"""A scenario served live, on the wall clock: the simulated vLLM server, its GPUs (power cap and XID on the
scenario's schedule), its plugin datagrams and spans sent to a running collector, which scrapes its /metrics and
samples its GPUs with the real GPU source. What a collector beside a real engine meets, as it happens."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import replace

from stepline.app.collector import Collector
from stepline.drills.scenarios import GPU_INTERVAL_S, TICK_S, Scenario, power_cap_factor
from stepline.ingest.runner import Scheduled
from stepline.sim import vllm_server as sim_server
from stepline.sim.costmodel import Throttle, ThrottledCostModel
from stepline.sim.gpu import SimulatedGpus, SimulatedGpuSource
from stepline.sim.telemetry import LateBound, Telemetry
from stepline.sources.base import SourceContext
from stepline.sources.otlp import OtlpReceiver


class LiveEngine:
    """`scenario` served at real speed from now on; `attach` it to a collector, `stop` it when done."""

    def __init__(self, name: str, scenario: Scenario, *, first_gpu: int = 0) -> None:
        self.name = name
        self.scenario = scenario
        self._throttle = Throttle()
        self.config = replace(scenario.config, cost=ThrottledCostModel.wrap(scenario.config.cost, self._throttle))
        self.gpus = SimulatedGpus(scenario.gpu_model(), engine_pid=os.getpid(), first_index=first_gpu)
        self._feed = LateBound(self.gpus.model.on_step)
        self._telemetry: Telemetry | None = None
        self._stop = threading.Event()
        self.started = time.time()  # the scenario's second 0: its arrivals are timed from here
        self.server = sim_server.serve(scenario.workload, self.config, port=0, repeat=False, on_step=self._feed)
        self._ticker = threading.Thread(target=self._tick, name=f"live-{name}", daemon=True)
        self._ticker.start()

    @property
    def url(self) -> str:
        return self.server.url

    def at(self, scenario_s: float) -> float:
        """The wall-clock time of the scenario's second `scenario_s`."""
        return self.started + scenario_s

    def gpu_source(self, ctx: SourceContext) -> Scheduled:
        """The real GPU source over this engine's simulated GPUs, for a collector's `extra` sources."""
        ctx.engine_processes.found(self.name, os.getpid())  # the simulator runs in this process
        return Scheduled(SimulatedGpuSource(self.gpus, ctx), GPU_INTERVAL_S)

    def attach(self, collector: Collector) -> None:
        """Send the engine's plugin datagrams and spans to `collector` (the steps so far replayed first)."""
        otlp = next(s for s in collector.sources if isinstance(s, OtlpReceiver))
        self._telemetry = Telemetry(self.name, self.config, plugin_socket=collector.settings.plugin_socket,
                                    otlp_endpoint=otlp.url)
        self._feed.attach(self._telemetry.on_step)

    def done(self) -> bool:
        return self.server.simulation.is_done()

    def in_flight(self) -> int:
        scheduler = self.server.simulation.scheduler
        return len(scheduler.running) + len(scheduler.waiting)

    def _tick(self) -> None:
        # The cap for the coming tick, from the clocks the GPUs showed at its start (as the replay does), from the
        # scenario's second 0 on: a cap in force from the start holds before this thread first wakes, however late.
        model = self.gpus.model
        while True:
            now = time.time()
            self._throttle.factor = power_cap_factor(self.scenario.power_cap, model, model.reading(now),
                                                     now - self.started)
            if self._stop.wait(TICK_S):
                return

    def stop(self) -> None:
        self._stop.set()
        self._ticker.join(5)
        self.server.stop()
        if self._telemetry is not None:
            self._telemetry.close()
