"""End to end on loopback: a wedged engine pages through a real Prometheus and Alertmanager, and resolves after
recovery; a legitimately slow engine watched over the same span does not page."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from stepline.alerting.config import AlertConfig
from stepline.app.collector import Collector
from stepline.config.settings import Settings
from stepline.ingest.runner import Scheduled
from stepline.sim import vllm_server as sim_server
from stepline.sim.config import EngineConfig
from stepline.sim.gpu import GpuModel, SimulatedGpus, SimulatedGpuSource
from stepline.sim.telemetry import LateBound, Telemetry
from stepline.sim.workloads import chat_arrivals, compose, one_request
from stepline.sources.base import SourceContext
from stepline.sources.otlp import OtlpReceiver
from stepline.testing.alertstack import ALERTMANAGER, PROMETHEUS, AlertStack, Webhook, wait_for

pytestmark = pytest.mark.skipif(not (PROMETHEUS and ALERTMANAGER),
                                reason="needs Debian's prometheus and prometheus-alertmanager (.ci/run installs them)")


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[Webhook, AlertConfig, Path]]:
    hook = Webhook()
    cfg = replace(AlertConfig(), stalled_for="2s", wedged_for="2s", engine_down_for="2s", evaluation_interval="1s",
                  wedge_min_age_seconds=5.0, webhook_url=f"{hook.url}/stepline", heartbeat_url=f"{hook.url}/heartbeat")
    yield hook, cfg, tmp_path
    hook.close()


def test_a_wedged_engine_pages_and_resolves_a_slow_one_does_not(stack: tuple[Webhook, AlertConfig, Path],
                                                                 store_url: str, sock_dir: str) -> None:
    hook, cfg, tmp = stack
    # The wedge: every early request aborts and leaks its slot until all four are gone; later ones only queue.
    wedge_load = compose("wedge", 600, 0, chat_arrivals("leak", 0, 6, 4.0, output_median=8, abort_share=1.0),
                         chat_arrivals("chat", 6, 600, 2.0, output_median=30))
    gpus = SimulatedGpus(GpuModel(gpus=1, scenario="normal"), engine_pid=os.getpid())
    feeds = {"wedge": LateBound(gpus.model.on_step), "slow": LateBound(lambda step: None)}
    wedge = sim_server.serve(wedge_load, EngineConfig(max_num_seqs=4, leak_aborted_slots=True), port=0,
                             repeat=False, on_step=feeds["wedge"])
    # Legitimately slow: one 700k-token request, 90% cached, alone: multi-second steps that keep coming.
    slow = sim_server.serve(compose("slow", 600, 0, [one_request("long-700k", 0.2, 700_000, 3000, 0.9)]),
                            EngineConfig(num_gpu_blocks=60_000), port=0, repeat=False, on_step=feeds["slow"])

    def extra(ctx: SourceContext) -> list[Scheduled]:
        ctx.engine_processes.found("wedge", os.getpid())
        return [Scheduled(SimulatedGpuSource(gpus, ctx), 0.5)]

    settings = Settings.from_env({}, store=store_url, engines=(f"wedge={wedge.url}", f"slow={slow.url}"),
                                 metrics_port=0, query_port=0, otlp_port=0, plugin_socket=f"{sock_dir}/p.sock",
                                 scrape_interval_s=1.0, disabled_sources=frozenset({"gpu", "host"}))
    collector = Collector(settings, extra=extra)
    collector.start()
    alert_stack: AlertStack | None = None
    telemetry: list[Telemetry] = []
    try:
        otlp = next(s for s in collector.sources if isinstance(s, OtlpReceiver))
        for name, server in (("wedge", wedge), ("slow", slow)):
            t = Telemetry(name, server.simulation.config, plugin_socket=settings.plugin_socket,
                          otlp_endpoint=otlp.url)
            telemetry.append(t)
            feeds[name].attach(t.on_step)
        assert collector.metrics_server is not None
        alert_stack = AlertStack(cfg, hook, collector.metrics_server.port, tmp)

        page = wait_for(lambda: hook.find("EngineStalled", "wedge", "firing"), 120, "EngineStalled page")
        assert page["labels"]["severity"] == "critical"
        description = page["annotations"]["description"]
        # The page explains itself: engine, state, age against the budget, the top finding and what to run.
        assert "state stalled" in description and "budget of" in description, description
        assert "Top finding:" in description and "stepline diagnose --engine wedge" in description, description
        assert page["annotations"]["runbook_url"].endswith("#enginestalled")
        wait_for(lambda: hook.find("EngineWedgedWithQueue", "wedge", "firing"), 60, "EngineWedgedWithQueue page")

        assert wedge.release_leaked() == 4  # the operator restarts the lane
        wait_for(lambda: hook.find("EngineStalled", "wedge", "resolved"), 120, "EngineStalled resolve")
        # Over the same span, the legitimately slow engine made multi-second steps and never paged.
        store = collector.store
        assert store is not None

        def slow_steps() -> int:
            return int(store.query("SELECT count() FROM steps WHERE engine = 'slow' AND elapsed_ms > 1500"
                                   ).result_rows[0][0])

        wait_for(lambda: slow_steps() >= 8, 120, "eight multi-second steps of the slow engine")
        time.sleep(5)  # past the rules' `for` and Alertmanager's group wait
        assert not hook.names("slow") & {"EngineStalled", "EngineWedgedWithQueue", "EngineDown"}, hook.alerts
    finally:
        if alert_stack is not None:
            alert_stack.stop()
        for t in telemetry:
            t.close()
        wedge.stop()
        slow.stop()
        collector.stop()
