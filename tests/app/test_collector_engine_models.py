"""An engine announces its model once, at its start: a collector restarted beside it still names its rows, and the
requests only its spans reported (vLLM's spans name no model)."""

from __future__ import annotations

import os
import time

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import SpanKind

from stepline.app.collector import Collector
from stepline.config.settings import Settings
from stepline.model.rows import UNKNOWN_FINISH_REASON
from stepline.plugin.core import PluginCore
from stepline.sim.config import DEFAULT_MODEL
from stepline.sim.vllm_server import SimServer
from stepline.sources.otlp import OtlpReceiver
from stepline.sources.registry import REGISTRY
from stepline.store.store import Store
from stepline.testing.sink import wait_until
from stepline.testing.vllm_standins import SchedulerIterationDetails, SchedulerStats

HOST = "node-m"


def _collector(store_url: str, socket_path: str, *sources: str, engines: tuple[str, ...] = ()) -> Collector:
    enabled = {"plugin", *sources}
    settings = Settings.from_env({}, store=store_url, engines=engines, metrics_port=0, query_port=0, otlp_port=0,
                                 host_name=HOST, flush_interval_s=0.05, plugin_socket=socket_path,
                                 scrape_interval_s=0.2,
                                 disabled_sources=frozenset(s.name for s in REGISTRY if s.name not in enabled))
    collector = Collector(settings)
    collector.start()
    return collector


def _span(collector: Collector, engine: str, request_id: str) -> None:
    """One request's span as vLLM 0.33 sends it (vllm/v1/engine/output_processor.py:964-1000, do_tracing: no model,
    no finish reason), from an engine started with OTEL_SERVICE_NAME=`engine`, to the collector's OTLP receiver."""
    otlp = next(s for s in collector.sources if isinstance(s, OtlpReceiver))
    provider = TracerProvider(resource=Resource.create({"service.name": engine}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"{otlp.url}/v1/traces", timeout=5)))
    now = time.time()
    span = provider.get_tracer("vllm.v1.engine.output_processor").start_span(
        "llm_request", kind=SpanKind.SERVER, start_time=round((now - 1.5) * 1e9), attributes={
            "gen_ai.latency.time_to_first_token": 0.5, "gen_ai.latency.e2e": 1.5, "gen_ai.latency.time_in_queue": 0.1,
            "gen_ai.usage.prompt_tokens": 900, "gen_ai.usage.completion_tokens": 12,
            "gen_ai.latency.time_in_model_prefill": 0.4, "gen_ai.latency.time_in_model_decode": 1.0,
            "gen_ai.latency.time_in_model_inference": 1.4, "gen_ai.request.id": request_id,
            "gen_ai.request.max_tokens": 12, "gen_ai.request.n": 1})
    span.end(end_time=round(now * 1e9))
    provider.shutdown()


def _requests(store: Store, count: int) -> list[tuple[str, str, str, str]]:
    sql = "SELECT request_id, model_name, finish_reason, source FROM requests FINAL ORDER BY request_id"
    wait_until(lambda: len(store.query(sql).result_rows) >= count, timeout_s=10)
    return [tuple(r) for r in store.query(sql).result_rows]


def _steps(core: PluginCore, first: int, count: int) -> None:
    for i in range(first, first + count):
        details = SchedulerIterationDetails(i, 0, 0, 1, 1, 3.0)
        core.record(SchedulerStats(num_running_reqs=1, iteration_details=details), None)
    core.close()


def _wait_for_steps(store: Store, count: int) -> None:
    deadline = time.monotonic() + 10
    while store.query("SELECT count() FROM steps").result_rows[0][0] < count and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_restarted_collector_names_the_rows_of_an_engine_that_started_before_it(store: Store, store_url: str,
                                                                                  sock_dir: str) -> None:
    socket_path = os.path.join(sock_dir, "p.sock")
    first = _collector(store_url, socket_path)
    try:
        core = PluginCore("e1", socket_path)
        core.engine_initialized({"model": "/models/tiny", "served_model_name": "tiny"})
        _steps(core, 0, 3)
        _wait_for_steps(store, 3)
    finally:
        first.stop()
    second = _collector(store_url, socket_path)
    try:
        _steps(PluginCore("e1", socket_path), 3, 3)  # the same engine, still running: no new engine_config
        _wait_for_steps(store, 6)
    finally:
        second.stop()
    rows = store.query("SELECT step, model_name FROM steps ORDER BY step").result_rows
    assert rows == [(i, "tiny") for i in range(6)]


def test_a_request_only_its_span_reported_carries_its_engines_model(store: Store, store_url: str,
                                                                     sock_dir: str) -> None:
    socket_path = os.path.join(sock_dir, "p.sock")
    first = _collector(store_url, socket_path, "otlp")
    try:
        core = PluginCore("e1", socket_path)  # STEPLINE_ENGINE (else OTEL_SERVICE_NAME) names the engine for both
        core.engine_initialized({"model": "/models/tiny", "served_model_name": "tiny"})
        _steps(core, 0, 3)
        _wait_for_steps(store, 3)
        _span(first, "e1", "span-only-1")  # a request the plugin never reported (its report was dropped)
        _requests(store, 1)
    finally:
        first.stop()
    second = _collector(store_url, socket_path, "otlp")  # the engine runs on: its model comes back from the store
    try:
        _span(second, "e1", "span-only-2")
        rows = _requests(store, 2)
    finally:
        second.stop()
    assert rows == [("span-only-1", "tiny", UNKNOWN_FINISH_REASON, "otlp"),
                    ("span-only-2", "tiny", UNKNOWN_FINISH_REASON, "otlp")]


def test_an_engine_without_the_plugin_is_named_from_its_metrics(store: Store, store_url: str, sock_dir: str,
                                                                 steady_engine: SimServer) -> None:
    collector = _collector(store_url, os.path.join(sock_dir, "p.sock"), "otlp", "vllm_metrics",
                           engines=(f"sim-a={steady_engine.url}",))
    try:
        wait_until(lambda: collector.wait_for_rows("engine_samples", 1, 0.1) >= 1, timeout_s=10)
        _span(collector, "sim-a", "from-metrics")
        rows = _requests(store, 1)
    finally:
        collector.stop()
    assert rows == [("from-metrics", DEFAULT_MODEL, UNKNOWN_FINISH_REASON, "otlp")]
