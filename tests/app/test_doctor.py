"""`stepline doctor`'s checks, each passing and failing against real pieces: the simulator (its real plugin and OTLP
exporter) beside a collector in this process, the captured vLLM exposition served over HTTP, a ClickHouse endpoint
that refuses inserts, Debian's Prometheus and Alertmanager. NVML alone is a fake (stepline.testing's)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from stepline.app.collector import Collector
from stepline.app.doctor import (
    CHECKS,
    FAIL,
    OK,
    SKIP,
    Check,
    Doctor,
    Options,
    Reply,
    alertmanager_check,
    as_json,
    exit_code,
    fetch,
    prometheus_check,
)
from stepline.config.settings import Settings
from stepline.core.listener import HttpServer
from stepline.ingest.runner import Scheduled
from stepline.plugin.core import PluginCore
from stepline.sim.config import EngineConfig
from stepline.sim.records import StepRecord
from stepline.sim.telemetry import Telemetry, engine_config, iteration_stats, scheduler_stats
from stepline.sim.vllm_server import SimServer, idle_workload, serve
from stepline.sources.base import SourceContext
from stepline.sources.gpu.source import GpuSource
from stepline.sources.otlp import OtlpReceiver
from stepline.store.url import parse_store_url
from stepline.testing.alertstack import ALERTMANAGER, PROMETHEUS, free_port
from stepline.testing.fake_nvml import FakeNvml
from stepline.testing.sink import wait_until
from stepline.testing.storeserver import StoreServer
from tests.conftest import VLLM_METRICS_FIXTURE

MODEL = "test/model"
# What a wired engine gets: every check it was asked for holds, the two it was not given a URL for are skipped.
ALL_OK = {name: OK for name in CHECKS} | {"prometheus": SKIP, "alertmanager": SKIP}
Feed = Callable[[StepRecord], None]


@dataclass
class Wired:
    """A simulated engine scraped by a collector; what the engine sends (plugin, spans) is each test's `feed`."""

    sim: SimServer
    collector: Collector
    store: str
    run_dir: Path
    socket: str
    otlp_url: str
    feeds: list[Feed] = field(default_factory=list)

    def on_step(self, step: StepRecord) -> None:
        for feed in list(self.feeds):
            feed(step)

    def doctor(self, engine: str | None = None, **options: Any) -> dict[str, Check]:
        """The doctor's checks by name, in CHECKS order (asserted)."""
        settings = {"wait_s": 4.0} | options
        checks = Doctor(Options(engine=engine or f"sim={self.sim.url}", store=self.store, runtime_dir=self.run_dir,
                                **settings)).run()
        assert [c.name for c in checks] == list(CHECKS)
        return {c.name: c for c in checks}


def _families(exposition: str) -> int:
    """The vllm: families of an exposition (the text format gives each counter's `_created` a family of its own)."""
    return len({f.name for f in text_string_to_metric_families(exposition)
                if f.name.startswith("vllm:") and not f.name.endswith("_created")})


def statuses(checks: dict[str, Check]) -> dict[str, str]:
    return {name: c.status for name, c in checks.items()}


@pytest.fixture(scope="module")
def wired(chdb_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Wired]:
    sock_dir = tempfile.mkdtemp(prefix="stepline-")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # spans leave the simulator within 0.1 s, not vLLM's 5 s
        run_dir = tmp_path_factory.mktemp("doctor") / "run"
        holder: list[Wired] = []
        sim = serve(idle_workload(), EngineConfig(model=MODEL), port=0, on_step=lambda s: holder[0].on_step(s))
        store = f"chdb://{chdb_dir}?database=doctor_{uuid.uuid4().hex[:8]}"
        collector = Collector(_settings(store, sock_dir, engines=(f"sim={sim.url}",)), runtime_dir=run_dir)
        collector.start()
        otlp = next(s for s in collector.sources if isinstance(s, OtlpReceiver))
        holder.append(Wired(sim, collector, store, run_dir, collector.settings.plugin_socket, otlp.url))
        try:
            yield holder[0]
        finally:
            collector.stop()
            sim.stop()
            shutil.rmtree(sock_dir, ignore_errors=True)


def _settings(store: str, sock_dir: str, **overrides: Any) -> Settings:
    return Settings.from_env({}, store=store, metrics_port=0, query_port=0, otlp_port=0, scrape_interval_s=0.5,
                             flush_interval_s=0.2, plugin_socket=f"{sock_dir}/{uuid.uuid4().hex[:8]}.sock",
                             **overrides)


@contextmanager
def feeding(wired: Wired, *telemetry: Telemetry | Feed) -> Iterator[None]:
    """The engine sends through these while the block runs; each Telemetry is flushed and closed after it."""
    wired.feeds[:] = [t.on_step if isinstance(t, Telemetry) else t for t in telemetry]
    try:
        yield
    finally:
        wired.feeds.clear()
        for t in telemetry:
            if isinstance(t, Telemetry):
                t.close()


def telemetry(wired: Wired, engine: str = "sim", *, plugin: bool = True, otlp: bool = True) -> Telemetry:
    return Telemetry(engine, wired.sim.simulation.config, plugin_socket=wired.socket if plugin else None,
                     otlp_endpoint=wired.otlp_url if otlp else None)


@pytest.fixture
def wired_fully(wired: Wired) -> Iterator[Wired]:
    """The engine sends steps (with iteration details) and spans, both as engine `sim`."""
    with feeding(wired, telemetry(wired)):
        yield wired


@contextmanager
def traffic(url: str) -> Iterator[None]:
    """Clients' completions to the engine every 0.3 s while the block runs (for a doctor that sends none)."""
    stop = threading.Event()

    def send() -> None:
        body = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 2}).encode()
        while not stop.is_set():
            request = urllib.request.Request(f"{url}/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=10) as response:
                response.read()
            stop.wait(0.3)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)


@contextmanager
def exposition(date_offset_s: float = 0.0) -> Iterator[str]:
    """The /metrics vLLM 0.33.0 rendered (tests/fixtures), served with a Date `date_offset_s` off this clock."""
    body = VLLM_METRICS_FIXTURE.read_bytes()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path != "/metrics":
                self.send_error(404)
                return
            self.send_response_only(200)
            self.send_header("Date", formatdate(time.time() + date_offset_s, usegmt=True))
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            return

    server = HttpServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


# ---- all wired ------------------------------------------------------------------------------------------------


def test_the_plugin_line_says_a_batch_queued_core_steps_by_its_cadence(wired: Wired) -> None:
    # vLLM 0.33 schedules asynchronously by default on GPUs: its elapsed_ms is then a wait, and stepline's step time
    # the cadence of step ends (model.schema, steps.step_time): the doctor says which the engine's steps are.
    config = dataclasses.replace(wired.sim.simulation.config, async_scheduling=True)
    with feeding(wired, Telemetry("sim", config, plugin_socket=wired.socket)):
        checks = wired.doctor()
    assert checks["plugin"].status == OK, checks["plugin"].line()
    assert "its core steps through a batch queue" in checks["plugin"].message


def test_a_wired_engine_passes_every_check(wired_fully: Wired) -> None:
    checks = wired_fully.doctor()
    assert statuses(checks) == ALL_OK, [c.line() for c in checks.values()]
    families = _families(VLLM_METRICS_FIXTURE.read_text())  # the simulator exposes fewer, all of them vLLM's
    assert "vllm: families, model test/model; probe sent" in checks["engine"].message
    assert 0 < int(checks["engine"].message.split(": ")[1].split()[0]) <= families
    assert checks["collector"].message.startswith(f"pid {os.getpid()} scrapes sim; SQL at http://127.0.0.1:")
    assert "from sim, iteration details on; its core steps synchronously" in checks["plugin"].message
    assert checks["otlp"].message.split()[1:3] in (["span", "accepted"], ["spans", "accepted"])
    assert checks["model"].message.startswith("test/model (/metrics, /v1/models, the plugin")
    assert checks["gpu"].message.endswith("none expected (STEPLINE_EXPECT_GPUS unset)")
    assert checks["store"].message.startswith(f"chdb://{wired_fully.store.split('://')[1].split('?')[0]} writable")
    assert checks["store"].message.endswith(("spool empty", "draining"))  # a segment waits until its insert returns
    assert checks["clock"].message.startswith("engine and collector agree (HTTP Date, ")
    assert checks["prometheus"].message == "give --prometheus URL to check that it scrapes the collector"
    listed = list(checks.values())
    assert exit_code(listed) == 0 and json.loads(as_json(listed))["ok"] is True


# ---- the engine -----------------------------------------------------------------------------------------------


def test_a_dead_engine_url_fails_the_engine_line_and_the_others_hold(wired_fully: Wired) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with traffic(wired_fully.sim.url):
        checks = wired_fully.doctor(f"sim={dead}", probe=False, wait_s=6.0)
    assert statuses(checks) == ALL_OK | {"engine": FAIL}, [c.line() for c in checks.values()]
    assert checks["engine"].message.startswith(f"{dead}/metrics unreachable: ")
    assert checks["engine"].message.endswith(f"is vLLM serving there? check --engine (the collector scrapes sim at "
                                             f"{wired_fully.sim.url}/metrics)")
    assert checks["collector"].message.startswith(f"pid {os.getpid()} scrapes sim at {wired_fully.sim.url}/metrics")
    assert exit_code(list(checks.values())) == 1


def test_what_is_no_vllm_fails_the_engine_line(wired_fully: Wired) -> None:
    assert wired_fully.collector.metrics_server is not None
    stepline_metrics = wired_fully.collector.metrics_server.url.removesuffix("/metrics")
    checks = wired_fully.doctor(f"sim={stepline_metrics}", probe=False, wait_s=0.5)
    assert checks["engine"].status == FAIL
    assert "no vllm: metrics among" in checks["engine"].message
    assert "is this a vLLM server's /metrics? — point --engine at vLLM's HTTP port" in checks["engine"].message


def test_the_captured_vllm_exposition_passes_and_another_model_fails_the_model_line(wired_fully: Wired) -> None:
    with exposition() as url, traffic(wired_fully.sim.url):
        checks = wired_fully.doctor(f"sim={url}", probe=False, wait_s=6.0)
    families = _families(VLLM_METRICS_FIXTURE.read_text())
    assert checks["engine"] == Check("engine", OK, f"{url}/metrics answers: {families} vllm: families, model "
                                                   "Qwen/Qwen3-8B")
    # The steps of engine `sim` name another model than the /metrics the doctor was pointed at.
    assert statuses(checks) == ALL_OK | {"model": FAIL}, [c.line() for c in checks.values()]
    assert checks["model"].message == ("/metrics says 'Qwen/Qwen3-8B', the plugin 'test/model' — these steps come "
                                       "from another vLLM: give each its own STEPLINE_ENGINE, and --engine NAME=URL")


def test_an_engine_clock_off_by_90_s_fails_the_clock_line(wired_fully: Wired) -> None:
    with exposition(date_offset_s=90.0) as url:
        checks = wired_fully.doctor(f"sim={url}", probe=False, wait_s=0.5)
    assert checks["engine"].status == OK
    assert checks["clock"].status == FAIL
    offset = int(checks["clock"].message.split()[4])
    assert 89 <= offset <= 91, checks["clock"].message
    assert checks["clock"].message.endswith("s off the collector's (HTTP Date) — sync both hosts with NTP (chrony)")


# ---- the collector --------------------------------------------------------------------------------------------


def test_without_a_collector_its_line_fails_and_what_needs_it_is_skipped(wired_fully: Wired, tmp_path: Path) -> None:
    store = f"chdb://{tmp_path / 'nowhere'}"
    checks = Doctor(Options(engine=f"sim={wired_fully.sim.url}", store=store, runtime_dir=tmp_path / "run",
                            wait_s=2.0)).run()
    by_name = {c.name: c for c in checks}
    assert statuses(by_name) == {"engine": OK, "collector": FAIL, "plugin": SKIP, "otlp": SKIP, "model": OK,
                                 "gpu": SKIP, "store": SKIP, "clock": OK, "prometheus": SKIP, "alertmanager": SKIP}
    assert by_name["collector"].message == (f"none running for {store} (no runtime file in {tmp_path / 'run'}) — "
                                            f"start `stepline collect --engine sim={wired_fully.sim.url}`")
    assert by_name["plugin"].message == "needs the collector (see collector)"
    assert by_name["model"].message == "test/model (/metrics, /v1/models agree)"
    assert exit_code(checks) == 1


def test_an_engine_the_collector_does_not_scrape_fails_the_collector_line(wired_fully: Wired) -> None:
    checks = wired_fully.doctor(f"other={wired_fully.sim.url}", wait_s=2.0)
    assert checks["engine"].status == OK
    assert checks["collector"] == Check("collector", FAIL, f"pid {os.getpid()} does not scrape engine other (it "
                                        f"scrapes sim) — give it --engine other={wired_fully.sim.url}")
    # The plugin names the engine `sim`, as the collector does: the doctor says which name to change.
    assert checks["plugin"].status == FAIL
    assert "; steps arrive as engine 'sim' — set STEPLINE_ENGINE=other in vLLM's" in checks["plugin"].message


# ---- the plugin -----------------------------------------------------------------------------------------------


def test_steps_without_iteration_details_fail_the_plugin_line_alone(wired: Wired) -> None:
    plugin = PluginCore("sim", wired.socket, iteration_details=False)
    plugin.engine_initialized({**engine_config(wired.sim.simulation.config),
                               "enable_logging_iteration_details": False})

    def without_details(step: StepRecord) -> None:
        plugin.record(replace(scheduler_stats(step), iteration_details=None), iteration_stats(step))

    try:
        with feeding(wired, telemetry(wired, plugin=False), without_details):
            checks = wired.doctor()
    finally:
        plugin.close()
    assert statuses(checks) == ALL_OK | {"plugin": FAIL}, [c.line() for c in checks.values()]
    assert checks["plugin"].message.endswith("from sim, none with iteration details — start vLLM with "
                                             "--enable-logging-iteration-details")


def waited(message: str, wait_s: int = 3) -> str:
    """`message` with the seconds the doctor says it waited put back to `wait_s`, once they are `wait_s` or up to 10 s
    more: it reports the seconds it actually waited, which a busy machine stretches (4 s seen for 3)."""
    found = re.search(r" in (\d+) s[;,: —]", message)
    assert found is not None and wait_s <= int(found.group(1)) <= wait_s + 10, message
    return message[:found.start(1)] + str(wait_s) + message[found.end(1):]


def test_no_plugin_fails_the_plugin_line_alone(wired: Wired) -> None:
    # The probe makes the engine step: its /metrics counters move, and no step arrives. The plugin is silent.
    with feeding(wired, telemetry(wired, plugin=False)):
        checks = wired.doctor(wait_s=3.0)
    assert statuses(checks) == ALL_OK | {"plugin": FAIL}, [c.line() for c in checks.values()]
    message = waited(checks["plugin"].message)
    assert re.fullmatch(r"no steps from engine sim in 3 s while its /metrics counters moved by \d+: its plugin is "
                        r"silent — install stepline's plugin \(pip install stepline\) in vLLM's environment, named in "
                        r"VLLM_PLUGINS if that is set, its STEPLINE_PLUGIN_SOCKET the collector's; a vLLM that scaled "
                        r"up with elastic EP has dropped it: restart vLLM", message), message
    assert checks["model"].message == "test/model (/metrics, /v1/models, spans agree)"  # spans alone reported


def test_a_plugin_the_collector_saw_fall_silent_fails_the_plugin_line_saying_so(wired: Wired) -> None:
    # The collector's watchdog has seen the engine's counters move without a step for 95 s (a plugin dropped by an
    # elastic EP scale-up); the doctor, sending no probe to an idle engine, sees no counter move of its own.
    assert wired.collector.metrics_server is not None
    collector_metrics = wired.collector.metrics_server.url
    line = 'stepline_engine_plugin_silent_seconds{engine="sim"} 95.0\n'

    def silent_for_95_s(url: str, timeout_s: float, body: bytes | None = None,
                        headers: dict[str, str] | None = None) -> Reply:
        reply = fetch(url, timeout_s, body, headers)
        if url != collector_metrics:
            return reply
        text = re.sub(r'^stepline_engine_plugin_silent_seconds\{engine="sim"\} .*\n', "", reply.body.decode(),
                      flags=re.M)
        return replace(reply, body=(text + line).encode())

    with feeding(wired, telemetry(wired, plugin=False)):
        checks = {c.name: c for c in Doctor(Options(engine=f"sim={wired.sim.url}", store=wired.store,
                                                    runtime_dir=wired.run_dir, wait_s=3.0, probe=False),
                                            fetch=silent_for_95_s).run()}
    assert checks["plugin"].status == FAIL
    assert waited(checks["plugin"].message).startswith(
        "no steps from engine sim in 3 s: its plugin is silent (the collector has seen it so for 95 s: a "
        "plugin_silent event) — install stepline's plugin"), checks["plugin"].message


def test_a_plugin_named_otherwise_fails_the_plugin_line_with_the_name_to_give(wired: Wired) -> None:
    with feeding(wired, telemetry(wired, "vllm", otlp=False), telemetry(wired, plugin=False)):
        checks = wired.doctor(wait_s=3.0)
    assert statuses(checks) == ALL_OK | {"plugin": FAIL}, [c.line() for c in checks.values()]
    assert waited(checks["plugin"].message) == ("no steps from engine sim in 3 s; steps arrive as engine 'vllm' — set "
                                        "STEPLINE_ENGINE=sim in vLLM's environment (or name it vllm in the "
                                        "collector: --engine vllm=URL)")


# ---- OTLP -----------------------------------------------------------------------------------------------------


def test_no_spans_fail_the_otlp_line_alone(wired: Wired) -> None:
    with feeding(wired, telemetry(wired, otlp=False)):
        checks = wired.doctor(wait_s=3.0)
    assert statuses(checks) == ALL_OK | {"otlp": FAIL}, [c.line() for c in checks.values()]
    assert waited(checks["otlp"].message) == ("no spans in 3 s — start vLLM with --otlp-traces-endpoint "
                                      "http://127.0.0.1:4318/v1/traces and OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="
                                      "http/protobuf, opentelemetry-exporter-otlp in its environment")


def test_spans_named_otherwise_fail_the_otlp_line_with_the_name_to_give(wired: Wired) -> None:
    with feeding(wired, telemetry(wired, otlp=False), telemetry(wired, "vllm", plugin=False)):
        checks = wired.doctor()
    assert statuses(checks) == ALL_OK | {"otlp": FAIL}, [c.line() for c in checks.values()]
    assert checks["otlp"].message == ("spans arrive as engine 'vllm', not 'sim' — set OTEL_SERVICE_NAME=sim in "
                                      "vLLM's environment")


# ---- GPUs -----------------------------------------------------------------------------------------------------


@contextmanager
def another_collector(wired: Wired, chdb_dir: Path, run_dir: Path, *, extra: Callable[[SourceContext],
                      list[Scheduled]] | None = None, **overrides: Any) -> Iterator[Collector]:
    """A collector of its own (store database, sockets, ports) scraping the same engine."""
    sock_dir = tempfile.mkdtemp(prefix="stepline-")
    store = f"chdb://{chdb_dir}?database=doctor_{uuid.uuid4().hex[:8]}"
    collector = Collector(_settings(store, sock_dir, engines=(f"sim={wired.sim.url}",), **overrides), extra=extra,
                          runtime_dir=run_dir)
    collector.start()
    try:
        yield collector
    finally:
        collector.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)


def _gpu_check(collector: Collector, run_dir: Path) -> Check:
    checks = Doctor(Options(engine=f"sim={collector.settings.engines[0].partition('=')[2]}",
                            store=collector.settings.store, runtime_dir=run_dir, wait_s=0.5, probe=False)).run()
    return next(c for c in checks if c.name == "gpu")


def test_expected_gpus_without_nvml_fail_the_gpu_line(wired: Wired, chdb_dir: Path, tmp_path: Path) -> None:
    with another_collector(wired, chdb_dir, tmp_path, expect_gpus=True,
                           disabled_sources=frozenset({"host"})) as collector:
        wait_until(lambda: collector.metrics.registry.get_sample_value("stepline_source_up", {"source": "gpu"})
                   is not None, timeout_s=10)
        check = _gpu_check(collector, tmp_path)
    assert check.status == FAIL
    assert check.message.startswith("no NVML: ")  # this machine has no NVIDIA driver
    assert check.message.endswith(", though GPUs are expected (STEPLINE_EXPECT_GPUS) — give the collector the GPUs "
                                  "and libnvidia-ml (NVIDIA container runtime, nvidia.com/gpu)")


@pytest.mark.parametrize("tied", [True, False])
def test_gpus_tied_to_the_engine_pass_the_gpu_line_and_untied_ones_fail_it(wired: Wired, chdb_dir: Path,
                                                                           tmp_path: Path, tied: bool) -> None:
    nvml = FakeNvml(2)
    owners = {gpu.uuid: "sim" for gpu in nvml.devices} if tied else {}

    def fake_gpus(ctx: SourceContext) -> list[Scheduled]:
        return [Scheduled(GpuSource(ctx, nvml, configured_gpus=owners), 0.1)]

    with another_collector(wired, chdb_dir, tmp_path, extra=fake_gpus,
                           disabled_sources=frozenset({"gpu", "host"})) as collector:
        wait_until(lambda: collector.wait_for_rows("gpu_samples", 2, 0.1) >= 2, timeout_s=10)
        check = _gpu_check(collector, tmp_path)
    if tied:
        assert check == Check("gpu", OK, "2 GPUs sampled, 2 tied to sim")
    else:
        assert check == Check("gpu", FAIL, "2 GPUs sampled, none tied to sim (no engine) — give the collector "
                                           "--engine-process sim=PID, or STEPLINE_ENGINE_GPUS='sim=GPU-uuid,...'")


# ---- the store ------------------------------------------------------------------------------------------------


def test_a_store_refusing_inserts_fails_the_store_line_and_passes_it_once_drained(
        wired: Wired, store_server: StoreServer, tmp_path: Path) -> None:
    store = store_server.store_url(f"doctor_{uuid.uuid4().hex[:8]}")
    sock_dir = tempfile.mkdtemp(prefix="stepline-")
    collector = Collector(_settings(store, sock_dir, spool_dir=str(tmp_path / "spool"),
                                    disabled_sources=frozenset({"gpu", "vllm_metrics", "plugin", "otlp"})),
                          runtime_dir=tmp_path / "run")
    collector.start()

    def spooled() -> float:
        return collector.metrics.registry.get_sample_value("stepline_spool_bytes") or 0.0

    def store_check() -> Check:
        checks = Doctor(Options(engine=f"sim={wired.sim.url}", store=store, runtime_dir=tmp_path / "run",
                                wait_s=1.0, probe=False)).run()
        return next(c for c in checks if c.name == "store")

    try:
        store_server.refuse_inserts = True
        wait_until(lambda: spooled() > 0, timeout_s=15)
        refused = store_check()
        store_server.refuse_inserts = False
        wait_until(lambda: spooled() == 0, timeout_s=30)
        accepted = store_check()
    finally:
        collector.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)
    redacted = parse_store_url(store).redacted()
    assert refused.status == FAIL and " MiB wait in the spool, " in refused.message, refused
    assert refused.message.endswith(f"— check the store {redacted}: reachable, disk, parts")
    assert accepted.status == OK and accepted.message.startswith(f"{redacted} writable ("), accepted


# ---- Prometheus and Alertmanager ------------------------------------------------------------------------------

needs_prometheus = pytest.mark.skipif(not (PROMETHEUS and ALERTMANAGER),
                                      reason="needs Debian's prometheus and prometheus-alertmanager")


@contextmanager
def started(command: list[str], ready_url: str, log: Path) -> Iterator[None]:
    """A Prometheus or Alertmanager, from when `ready_url` answers to the end of the block."""
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: process.poll() is not None or _answer(ready_url) is not None, timeout_s=30, poll_s=0.2)
        assert process.poll() is None, log.read_text()
        yield
    finally:
        process.terminate()
        process.wait(20)


def _answer(url: str) -> Any:
    """The JSON (or True for another body) `url` answers with 200; None while it does not."""
    try:
        reply = fetch(url, 1.0)
    except OSError:
        return None
    if reply.status != 200:
        return None
    try:
        return json.loads(reply.body)
    except ValueError:
        return True


@pytest.fixture(scope="module")
def prometheus(wired: Wired, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    """Prometheus scraping the collector as job stepline, and a port where nothing listens as job dead."""
    assert PROMETHEUS is not None and wired.collector.metrics_server is not None
    work, port, dead = tmp_path_factory.mktemp("prometheus"), free_port(), free_port()
    config = {"global": {"scrape_interval": "1s"}, "scrape_configs": [
        {"job_name": "stepline", "static_configs": [{"targets": [f"127.0.0.1:{wired.collector.metrics_server.port}"]}]},
        {"job_name": "dead", "static_configs": [{"targets": [f"127.0.0.1:{dead}"]}]}]}
    (work / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    url = f"http://127.0.0.1:{port}"
    with started([PROMETHEUS, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'tsdb'}",
                  f"--web.listen-address=127.0.0.1:{port}"], f"{url}/-/ready", work / "log"):
        def scraped_both() -> bool:
            answer = _answer(f"{url}/api/v1/query?query=count(up)")
            return bool(answer and answer["data"]["result"] and answer["data"]["result"][0]["value"][1] == "2")

        wait_until(scraped_both, timeout_s=30, poll_s=0.3)
        yield url, dead


@needs_prometheus
def test_prometheus_scraping_the_collector_passes_the_prometheus_line(wired_fully: Wired,
                                                                      prometheus: tuple[str, int]) -> None:
    url, dead = prometheus
    assert wired_fully.collector.metrics_server is not None
    ours = wired_fully.collector.metrics_server.url
    target = ours.split("//")[1].split("/")[0]

    def get(u: str) -> Any:
        return fetch(u, 5.0)

    assert prometheus_check(get, url, 'job="stepline"', ours) == Check(
        "prometheus", OK, f"scrapes the collector: up{{job=\"stepline\", instance='{target}'}} = 1")
    assert prometheus_check(get, url, 'job="dead"', ours) == Check(
        "prometheus", FAIL, f'up{{job="dead"}} is of 127.0.0.1:{dead}, not this collector ({target}) — add it to '
                            "the job's targets")
    assert prometheus_check(get, url, 'job="dead"', "") == Check(
        "prometheus", FAIL, f'up{{job="dead"}} is 0 for 127.0.0.1:{dead}: Prometheus cannot scrape the collector — '
                            "its --listen and --metrics-port must be reachable from Prometheus")
    assert prometheus_check(get, url, 'job="nothing"', ours) == Check(
        "prometheus", FAIL, f'no target has up{{job="nothing"}} — scrape the collector\'s /metrics ({target}) in that '
                            "job (deploy/prometheus/prometheus.yml)")
    gone = f"http://127.0.0.1:{free_port()}"
    assert prometheus_check(get, gone, 'job="stepline"', ours).message.startswith(f"{gone} unreachable: ")


@needs_prometheus
def test_a_ready_alertmanager_passes_the_alertmanager_line(wired_fully: Wired, tmp_path: Path) -> None:
    assert ALERTMANAGER is not None
    port = free_port()
    (tmp_path / "am.yml").write_text(json.dumps({"route": {"receiver": "none"}, "receivers": [{"name": "none"}]}))
    url = f"http://127.0.0.1:{port}"
    with started([ALERTMANAGER, f"--config.file={tmp_path / 'am.yml'}", f"--storage.path={tmp_path / 'am'}",
                  f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="], f"{url}/-/ready",
                 tmp_path / "log"):
        checks = wired_fully.doctor(alertmanager=url, prometheus="", wait_s=4.0)
    assert checks["alertmanager"].status == OK, checks["alertmanager"]
    assert checks["alertmanager"].message.startswith(f"{url} ready (version ")
    assert statuses(checks) == ALL_OK | {"alertmanager": OK}
    gone = f"http://127.0.0.1:{free_port()}"
    failed = alertmanager_check(lambda u: fetch(u, 2.0), gone)
    assert failed.status == FAIL and failed.message.endswith("— check --alertmanager")
