"""End to end on loopback: a wedged engine pages through a real Prometheus and Alertmanager, and resolves after
recovery; a legitimately slow engine watched over the same span does not page. With the timings as deployed, a
killed engine pages within 30 s while one whose scrapes time out keeps EngineDown's patience."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
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
from stepline.testing.alertstack import ALERTMANAGER, PROMETHEUS, AlertStack, Webhook, free_port, wait_for
from tests.conftest import VLLM_METRICS_FIXTURE

CRASH_PAGE_S = 30.0  # a refused engine pages within this of its process being gone

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


class HangingEngine:
    """vLLM's captured /metrics, answered until `hang()`; from then on every scrape is held until `stop()`: a hung
    engine whose process is still there, its port accepting."""

    def __init__(self) -> None:
        self._hung = threading.Event()
        self._stopped = threading.Event()
        body = VLLM_METRICS_FIXTURE.read_bytes()
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if engine._hung.is_set():
                    engine._stopped.wait()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def hang(self) -> None:
        self._hung.set()

    def stop(self) -> None:
        self._stopped.set()
        self.server.shutdown()
        self.server.server_close()


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def test_a_killed_engine_pages_within_30_s_and_a_hung_one_keeps_its_patience(tmp_path: Path, store_url: str,
                                                                               sock_dir: str) -> None:
    # As deployed: the generated rules and Alertmanager waits, the collector scraping every 5 s (3 s timeout), and
    # Prometheus scraping it every 5 s (deploy/prometheus/prometheus.yml).
    hook = Webhook()
    cfg = replace(AlertConfig(), webhook_url=f"{hook.url}/stepline", heartbeat_url=f"{hook.url}/heartbeat")
    socket_path = f"{sock_dir}/p.sock"
    port = free_port()
    crashed = subprocess.Popen([sys.executable, "-m", "stepline", "sim", "--port", str(port), "--engine-name",
                                "crashed", "--plugin-socket", socket_path], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    crashed_url = f"http://127.0.0.1:{port}"
    hung = HangingEngine()
    settings = Settings.from_env({}, store=store_url, engines=(f"crashed={crashed_url}", f"hung={hung.url}"),
                                 metrics_port=0, query_port=0, otlp_port=0, plugin_socket=socket_path,
                                 disabled_sources=frozenset({"gpu", "host"}))
    assert (settings.scrape_interval_s, settings.scrape_timeout) == (5.0, 3.0)
    collector = Collector(settings)
    stack: AlertStack | None = None
    try:
        wait_for(lambda: _answers(crashed_url) or crashed.poll() is not None, 60, "the simulated engine")
        assert crashed.poll() is None
        collector.start()
        assert collector.metrics_server is not None
        stack = AlertStack(cfg, hook, collector.metrics_server.port, tmp_path, scrape_s=5.0, generated_waits=True)
        # The whole path is live (Prometheus evaluates, Alertmanager delivers) and both engines are scraped.
        # Readiness, not a measured figure: Prometheus's first evaluations and Alertmanager's first group take longer
        # on a loaded machine (over 60 s with the suite and a benchmark beside it).
        wait_for(lambda: [a for a in hook.snapshot() if a["labels"]["alertname"] == "Watchdog"], 120, "the heartbeat")
        for engine in ("crashed", "hung"):
            assert collector.metrics.registry.get_sample_value(
                "stepline_source_up", {"source": f"vllm_metrics:{engine}"}) == 1

        crashed.send_signal(signal.SIGKILL)
        hung.hang()
        gone_at = time.time()
        crashed.wait(10)
        page = wait_for(lambda: hook.find("EngineGone", "crashed", "firing"), CRASH_PAGE_S + 30, "EngineGone page")
        paged_s = page["received"] - gone_at
        print(f"EngineGone paged {paged_s:.1f} s after the kill")
        assert paged_s <= CRASH_PAGE_S, paged_s
        assert page["labels"]["reason"] == "refused" and page["labels"]["severity"] == "critical"
        assert "crashed" in page["annotations"]["summary"] and "refused" in page["annotations"]["description"]

        # The hung engine's scrapes time out all along; through the same 30 s (and 5 s more) nothing pages for it.
        time.sleep(max(0.0, gone_at + CRASH_PAGE_S + 5 - time.time()))
        failure = collector.metrics.registry.get_sample_value(
            "stepline_source_failure_info", {"source": "vllm_metrics:hung", "reason": "timeout"})
        assert failure == 1
        assert not hook.names("hung") & {"EngineGone", "EngineDown"}, hook.snapshot()
        assert "EngineDown" not in hook.names("crashed")  # EngineGone inhibits it, and its minute has not passed
    finally:
        if stack is not None:
            stack.stop()
        if crashed.poll() is None:
            crashed.kill()
            crashed.wait()
        hung.stop()
        collector.stop()
        hook.close()
