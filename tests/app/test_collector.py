"""The collector end to end: a live engine endpoint in, the embedded store out, SQL while it runs."""

from __future__ import annotations

import os
import time
import urllib.parse
import urllib.request
from pathlib import Path

import clickhouse_connect

from stepline.analysis.usage_rollup import UsageRollup
from stepline.app.collector import Collector
from stepline.config.settings import Settings
from stepline.endpoints.events import post_events
from stepline.model.rows import Event, micros
from stepline.sim.vllm_server import SimServer
from stepline.sim.workloads import make_workload
from stepline.sources.otlp import OtlpReceiver
from stepline.store.discovery import read_beside_store, running
from stepline.store.reader import open_reader, table_status
from stepline.store.url import parse_store_url
from stepline.testing.sink import wait_until
from tests.core.test_listener import needs_ipv6


def test_collects_a_live_engine_and_answers_sql_while_running(store_url: str, steady_engine: SimServer,
                                                               sock_dir: str, tmp_path: Path) -> None:
    settings = Settings.from_env({}, store=store_url, engines=(f"sim={steady_engine.url}", "dead=http://127.0.0.1:9"),
                                 metrics_port=0, query_port=0, scrape_interval_s=0.2, flush_interval_s=0.1,
                                 otlp_port=0, plugin_socket=f"{sock_dir}/p.sock")
    collector = Collector(settings, runtime_dir=tmp_path / "run")
    collector.start()
    try:
        assert collector.store is not None and collector.query_endpoint is not None
        # The runtime file, by which the CLI finds this collector from any directory.
        ((path, announced),), _ = running(tmp_path / "run")
        assert path == collector.runtime_file and announced.pid == os.getpid()
        assert announced.store == store_url and announced.query_url == collector.query_endpoint.url
        assert collector.metrics_server is not None and announced.metrics_url.endswith(
            f":{collector.metrics_server.port}/metrics")
        wait_until(lambda: collector.wait_for_rows("engine_samples", 1000, 0.1) >= 1000)
        # The usage rollup runs beside the sources: at its start it rolls the last closed minute.
        [rollup] = [s for s in collector.sources if isinstance(s, UsageRollup)]
        wait_until(lambda: rollup.stats()["minutes_rolled"] == 1)
        # The collector announces its endpoint next to the store; a client reads through it.
        info = read_beside_store(parse_store_url(store_url).path)
        assert info is not None and info.query_url == collector.query_endpoint.url
        client = clickhouse_connect.get_client(host="127.0.0.1", port=collector.query_endpoint.port,
                                               database=collector.store.database)
        kinds = {kind: n for kind, n in client.query("SELECT kind, count() FROM events GROUP BY kind").result_rows}
        assert kinds["engine_up"] == 1 and kinds["engine_down"] == 1 and kinds["collector_started"] == 1
        assert client.query("SELECT count() FROM engine_samples WHERE engine = 'sim' "
                            "AND metric = 'vllm:num_requests_running'").result_rows[0][0] >= 2
        client.close()
        # The self-metrics say what was written and which source is down.
        assert collector.metrics_server is not None
        text = urllib.request.urlopen(f"http://127.0.0.1:{collector.metrics_server.port}/metrics").read().decode()
        assert 'stepline_source_up{source="vllm_metrics:sim"} 1.0' in text
        assert 'stepline_source_up{source="vllm_metrics:dead"} 0.0' in text
        assert ('stepline_source_last_error_info{error="engine dead unreachable at http://127.0.0.1:9/metrics: '
                '[Errno 111] Connection refused",source="vllm_metrics:dead"} 1.0') in text
        assert 'source="vllm_metrics:sim"} 1.0' not in text.split("stepline_source_last_error_info{", 1)[1]
        assert 'stepline_writer_rows_written_total{table="engine_samples"}' in text
        # Every HTTP listener says what it closed or refused (none here): query, OTLP, events, /metrics.
        for listener in ("query", "otlp", "events", "metrics"):
            for reason in ("slow_heads", "busy_refused"):
                line = f'stepline_listener_connections_refused_total{{listener="{listener}",reason="{reason}"}} 0.0'
                assert line in text, line
    finally:
        collector.stop()
    # After a clean stop everything accepted is in the store, and the store opens directly.
    assert read_beside_store(parse_store_url(store_url).path) is None
    assert running(tmp_path / "run") == ([], [])
    written = collector.metrics.registry.get_sample_value("stepline_writer_rows_written_total",
                                                          {"table": "engine_samples"})
    reader = open_reader(store_url)
    try:
        status = {t.table: t for t in table_status(reader.client)}
        assert status["engine_samples"].rows == written
        assert status["events"].rows >= 4  # started, up, down, stopped
        seen = {r[0] for r in reader.client.query("SELECT kind FROM events").result_rows}
        assert "collector_stopped" in seen
    finally:
        reader.close()


def _with_otlp(store_url: str, sock_dir: str) -> tuple[Collector, OtlpReceiver]:
    """A started collector with a plugin socket and an OTLP receiver, no engines to scrape; and its receiver."""
    settings = Settings.from_env({}, store=store_url, engines=(), metrics_port=0, query_port=0, otlp_port=0,
                                 plugin_socket=f"{sock_dir}/p.sock", flush_interval_s=0.1)
    collector = Collector(settings)
    collector.start()
    return collector, next(s for s in collector.sources if isinstance(s, OtlpReceiver))


def test_steps_and_requests_arrive_through_the_plugin_and_otlp(store_url: str, sock_dir: str) -> None:
    from stepline.sim.config import EngineConfig
    from stepline.sim.replay import replay
    from stepline.sim.telemetry import Telemetry

    collector, otlp = _with_otlp(store_url, sock_dir)
    try:
        telemetry = Telemetry("sim-a", EngineConfig(), plugin_socket=collector.settings.plugin_socket,
                              otlp_endpoint=otlp.url)
        result = replay(make_workload("steady", duration_s=20), None, 5.0, lambda ts, body: None,
                        on_step=telemetry.on_step, keep_records=False)
        telemetry.close()
        assert result.drained
    finally:
        collector.stop()
    assert collector.store is not None
    store = open_reader(store_url)
    try:
        steps, requests = store.client.query(
            "SELECT (SELECT count() FROM steps WHERE engine = 'sim-a'), "
            "(SELECT count() FROM requests WHERE engine = 'sim-a')").result_rows[0]
    finally:
        store.close()
    value = collector.metrics.registry.get_sample_value
    assert steps > 100 and steps == value("stepline_source_counts_total", {"source": "plugin", "counter": "steps"})
    assert requests > 10
    assert requests == value("stepline_source_counts_total", {"source": "plugin", "counter": "requests"})
    # Every request came twice (plugin, then its span): one row each, the spans counted as duplicates.
    assert value("stepline_source_counts_total", {"source": "otlp", "counter": "spans_accepted"}) == requests
    assert value("stepline_requests_deduplicated_total", {"source": "otlp"}) == requests
    assert value("stepline_source_counts_total", {"source": "plugin", "counter": "malformed"}) is None


def test_a_routers_decisions_reach_the_store_through_the_collector(store_url: str, sock_dir: str) -> None:
    from stepline.gateway.record import DecisionRecorder

    collector, otlp = _with_otlp(store_url, sock_dir)
    try:
        recorder = DecisionRecorder(f"{otlp.url}/v1/traces", gateway="edge")
        now = time.time()
        for i in range(30):
            recorder.record(request_id=f"r{i}", lane="heavy" if i % 3 == 0 else "fast", start_s=now + i * 0.01,
                            end_s=now + i * 0.01 + 1, backend="http://10.1.0.7:8000/v1", size_chars=1000 * i,
                            threshold=15_000, threshold_unit="chars", status=200)
        recorder.close()
        assert recorder.stats()["sent"] == 30
        wait_until(lambda: collector.wait_for_rows("gateway_decisions", 30, 0.1) >= 30)
    finally:
        collector.stop()
    reader = open_reader(store_url)
    try:
        rows = reader.client.query("SELECT lane, count(), uniqExact(request_id), any(engine), any(threshold_unit) "
                                   "FROM gateway_decisions WHERE gateway = 'edge' GROUP BY lane ORDER BY lane")
        assert [tuple(r) for r in rows.result_rows] == [("fast", 20, 20, "10.1.0.7:8000", "chars"),
                                                        ("heavy", 10, 10, "10.1.0.7:8000", "chars")]
    finally:
        reader.close()


@needs_ipv6
def test_on_ipv6_loopback_every_listener_is_announced_in_brackets_and_answers(store_url: str, sock_dir: str,
                                                                              tmp_path: Path) -> None:
    settings = Settings.from_env({}, store=store_url, listen="::1", metrics_port=0, query_port=0, events_port=0,
                                 otlp_port=0, plugin_socket=f"{sock_dir}/p.sock", flush_interval_s=0.1,
                                 disabled_sources=frozenset({"vllm_metrics", "gpu", "host"}))
    collector = Collector(settings, runtime_dir=tmp_path / "run")
    collector.start()
    try:
        assert collector.metrics_server and collector.query_endpoint and collector.events_ingest
        ((_, announced),), _ = running(tmp_path / "run")
        assert announced.metrics_url == f"http://[::1]:{collector.metrics_server.port}/metrics"
        assert announced.query_url == f"http://[::1]:{collector.query_endpoint.port}"
        assert announced.events_url == f"http://[::1]:{collector.events_ingest.port}/v1/events"
        beside = read_beside_store(parse_store_url(store_url).path)
        assert beside is not None and (beside.query_url, beside.metrics_url) == (announced.query_url,
                                                                                 announced.metrics_url)
        with urllib.request.urlopen(announced.metrics_url, timeout=10) as response:
            assert b"stepline_source_up" in response.read()
        query = urllib.parse.urlsplit(announced.query_url)
        client = clickhouse_connect.get_client(host=query.hostname, port=query.port,
                                               database=parse_store_url(store_url).database)
        assert post_events(announced.events_url, announced.events_token,
                           [Event(micros(time.time()), "h", "", "matrix", "matrix_run", "info", "over IPv6", {})]) == 1
        wait_until(lambda: client.command("SELECT count() FROM events WHERE message = 'over IPv6'") == 1)
        client.close()
        otlp = next(s for s in collector.sources if isinstance(s, OtlpReceiver))
        assert otlp.url == f"http://[::1]:{otlp.port}"
    finally:
        collector.stop()
