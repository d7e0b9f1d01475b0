"""The vLLM /metrics source: exact parsing of a real exposition, deltas, resets, up/down, bad pages."""

from __future__ import annotations

import http.client
import socket
import threading
import urllib.error
from collections.abc import Iterator
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from stepline.core.clock import ManualClock
from stepline.model.rows import EngineSample, Event, Row
from stepline.sources.base import SourceContext, SourceError
from stepline.sources.vllm_metrics import VllmMetricsSource, build, parse_exposition
from tests.conftest import VLLM_METRICS_FIXTURE

FIXTURE = VLLM_METRICS_FIXTURE.read_bytes()


class FakeEngine:
    """Answers fetches with whatever exposition (or failure) the test sets."""

    def __init__(self, body: bytes = FIXTURE, content_type: str = "text/plain; version=0.0.4") -> None:
        self.body = body
        self.content_type = content_type
        self.failure: OSError | None = None

    def __call__(self, url: str, timeout_s: float) -> tuple[str, bytes]:
        if self.failure is not None:
            raise self.failure
        return self.content_type, self.body


def _source(engine: FakeEngine, clock: ManualClock | None = None) -> VllmMetricsSource:
    return VllmMetricsSource("http://10.0.0.7:8000", SourceContext("gpu-node-1", clock or ManualClock()),
                             fetch=engine)


def _poll(source: VllmMetricsSource) -> list[Row]:
    rows: list[Row] = []
    source.poll(rows.extend)
    return rows


def _samples(rows: list[Row]) -> dict[tuple[str, tuple[tuple[str, str], ...]], EngineSample]:
    return {(r.metric, tuple(sorted(r.labels.items()))): r for r in rows if isinstance(r, EngineSample)}


def test_fixture_parses_to_exact_values() -> None:
    samples, start_time = parse_exposition(FIXTURE.decode())
    by_key = {(s.metric, tuple(sorted(s.labels.items()))): s for s in samples}
    ident = (("engine", "0"), ("model_name", "Qwen/Qwen3-8B"))
    assert by_key[("vllm:num_requests_running", ident)].value == 32.0
    assert by_key[("vllm:num_requests_waiting", ident)].kind == "gauge"
    assert by_key[("vllm:kv_cache_usage_perc", ident)].value == pytest.approx(0.5175491448626377)
    assert by_key[("vllm:prefix_cache_queries_total", ident)].value == 3_076_229
    assert by_key[("vllm:prefix_cache_hits_total", ident)].kind == "counter"
    stop = tuple(sorted((*ident, ("finished_reason", "stop"))))
    assert by_key[("vllm:request_success_total", stop)].value == 37.0
    assert by_key[("vllm:time_to_first_token_seconds_count", ident)].value == 102.0
    assert by_key[("vllm:time_to_first_token_seconds_sum", ident)].kind == "sum"
    buckets = [s for s in samples if s.metric == "vllm:time_to_first_token_seconds_bucket"]
    assert buckets and all(s.kind == "bucket" for s in buckets)
    assert max(buckets, key=lambda s: float(s.labels["le"])).value == 102.0  # +Inf bucket equals count
    info = [s for s in samples if s.metric == "vllm:cache_config_info"]
    assert len(info) == 1 and info[0].kind == "info" and info[0].labels["num_gpu_blocks"] == "48213"
    # The histogram whose name ends in _total keeps its name and its kinds.
    iteration = {s.kind for s in samples if s.metric.startswith("vllm:iteration_tokens_total_")}
    assert iteration == {"bucket", "sum", "count"}
    assert not any(s.metric.endswith("_created") for s in samples)
    assert not any(not s.metric.startswith("vllm:") for s in samples)
    assert len(samples) == 399 - 44  # every vllm: line but the _created ones
    assert start_time is not None and start_time > 1.6e9


def test_rows_carry_engine_identity_in_columns_and_other_labels_in_the_map() -> None:
    rows = _poll(_source(FakeEngine()))
    samples = [r for r in rows if isinstance(r, EngineSample)]
    assert {(r.host, r.engine, r.model_name) for r in samples} == {("gpu-node-1", "10.0.0.7:8000", "Qwen/Qwen3-8B")}
    # vLLM itself leaves `engine` off the admission counters, which belong to the API server.
    assert {r.metric for r in samples if r.engine_index != "0"} == {"vllm:admission_rejections_total"}
    reasons = {r.labels["finished_reason"] for r in samples if r.metric == "vllm:request_success_total"}
    assert reasons == {"stop", "length", "abort", "error", "repetition"}
    assert all("model_name" not in r.labels and "engine" not in r.labels for r in samples)


def test_counters_become_deltas_and_a_restart_never_goes_negative() -> None:
    clock = ManualClock()
    engine = FakeEngine()
    source = _source(engine, clock)
    first = _samples(_poll(source))
    key = ("vllm:generation_tokens_total", ())
    assert first[key].value == 4800.0 and first[key].delta == 0.0  # nothing known of the past

    clock.advance(5)
    engine.body = FIXTURE.replace(b"vllm:generation_tokens_total{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"} 4800.0",
                                  b"vllm:generation_tokens_total{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"} 5000.0")
    second = _samples(_poll(source))
    assert second[key].delta == 200.0
    assert second[("vllm:num_requests_running", ())].delta == 0.0  # gauges carry no delta

    clock.advance(5)  # the engine restarts: every counter starts again
    engine.body = FIXTURE.replace(b"vllm:generation_tokens_total{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"} 4800.0",
                                  b"vllm:generation_tokens_total{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"} 12.0")
    engine.body = engine.body.replace(b"process_start_time_seconds 1", b"process_start_time_seconds 2")
    rows = _poll(source)
    third = _samples(rows)
    assert third[key].delta == 12.0
    assert all(r.delta >= 0 for r in third.values())
    assert [e.kind for e in rows if isinstance(e, Event)] == ["engine_restart"]


def test_a_counter_decrease_alone_is_a_restart() -> None:
    engine = FakeEngine()
    source = _source(engine)
    _poll(source)
    engine.body = FIXTURE.replace(b"vllm:num_preemptions_total{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"} 7.0",
                                  b"vllm:num_preemptions_total{engine=\"0\",model_name=\"Qwen/Qwen3-8B\"} 1.0")
    rows = _poll(source)
    assert [e.kind for e in rows if isinstance(e, Event)] == ["engine_restart"]
    assert _samples(rows)[("vllm:num_preemptions_total", ())].delta == 1.0


def test_a_series_born_between_scrapes_counts_from_zero() -> None:
    engine = FakeEngine()
    source = _source(engine)
    _poll(source)
    engine.body = FIXTURE + (b'# TYPE vllm:num_preemptions_total counter\n'
                             b'vllm:num_preemptions_total{engine="1",model_name="Qwen/Qwen3-8B"} 3.0\n')
    rows = [r for r in _poll(source) if isinstance(r, EngineSample) and r.engine_index == "1"]
    assert [(r.metric, r.delta) for r in rows] == [("vllm:num_preemptions_total", 3.0)]


def test_unreachable_engine_is_one_event_per_transition() -> None:
    engine = FakeEngine()
    source = _source(engine)
    engine.failure = ConnectionRefusedError(111, "Connection refused")
    events: list[Row] = []
    for _ in range(3):
        with pytest.raises(SourceError, match=r"engine 10\.0\.0\.7:8000 unreachable at http://10\.0\.0\.7:8000/metrics"):
            source.poll(events.extend)
    engine.failure = None
    source.poll(events.extend)
    engine.failure = TimeoutError("timed out")
    with pytest.raises(SourceError):
        source.poll(events.extend)
    kinds = [e.kind for e in events if isinstance(e, Event)]
    assert kinds == ["engine_down", "engine_up", "engine_down"]


@pytest.mark.parametrize(("failure", "kind"), [
    (urllib.error.URLError(ConnectionRefusedError(111, "Connection refused")), "refused"),
    (http.client.RemoteDisconnected("Remote end closed connection without response"), "gone"),
    (ConnectionResetError(104, "Connection reset by peer"), "gone"),
    (urllib.error.URLError(TimeoutError("timed out")), "timeout"),
    (TimeoutError("timed out"), "timeout"),
    (urllib.error.URLError(socket.gaierror(-2, "Name or service not known")), "unreachable"),
    (urllib.error.HTTPError("http://10.0.0.7:8000/metrics", 503, "Service Unavailable", Message(), None), "http"),
])
def test_a_failed_scrape_says_its_kind(failure: OSError, kind: str) -> None:
    # urllib wraps what fails while connecting in URLError and raises what fails while reading as it is.
    engine = FakeEngine()
    engine.failure = failure
    with pytest.raises(SourceError) as info:
        _poll(_source(engine))
    assert info.value.reason == kind


def test_a_closed_port_is_refused_and_a_silent_listener_times_out() -> None:
    # Nothing listens: refused at once. A socket that listens and never answers: the scrape's timeout.
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    refused = VllmMetricsSource(f"http://127.0.0.1:{port}", SourceContext("h", ManualClock()), timeout_s=0.3)
    with pytest.raises(SourceError) as info:
        _poll(refused)
    assert info.value.reason == "refused"
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        hung = VllmMetricsSource(f"http://127.0.0.1:{silent.getsockname()[1]}", SourceContext("h", ManualClock()),
                                 timeout_s=0.3)
        with pytest.raises(SourceError) as info:
            _poll(hung)
    assert info.value.reason == "timeout"


@pytest.mark.parametrize(
    ("body", "content_type", "fragment"),
    [
        (b"<html><body>Welcome to nginx</body></html>", "text/html", "with text/html, not Prometheus text"),
        (b"<html><body>Welcome</body></html>", "text/plain", "not a Prometheus exposition"),
        (b"# TYPE http_requests_total counter\nhttp_requests_total 3\n", "text/plain", "no vllm: metrics"),
        (b"", "text/plain", "no vllm: metrics among 0 families"),
        (b"vllm:num_requests_running{engine=\"0\" 3\n", "text/plain", "not a Prometheus exposition"),
    ],
)
def test_a_page_that_is_not_a_vllm_exposition_is_one_clear_line(body: bytes, content_type: str,
                                                                  fragment: str) -> None:
    source = _source(FakeEngine(body, content_type))
    with pytest.raises(SourceError) as info:
        _poll(source)
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)
    assert info.value.reason == "invalid"


def test_unknown_families_are_ignored() -> None:
    extra = b"# HELP http_requests_total Total.\n# TYPE http_requests_total counter\nhttp_requests_total{h=\"x\"} 9\n"
    rows = _poll(_source(FakeEngine(extra + FIXTURE)))
    assert len([r for r in rows if isinstance(r, EngineSample)]) == 399 - 44


@pytest.fixture
def http_engine() -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = FIXTURE if self.path == "/metrics" else b"not found"
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def test_scrapes_a_real_http_endpoint(http_engine: str) -> None:
    (source,) = build(SourceContext("h", ManualClock()), (f"prod-a={http_engine}",), 2.0)
    assert source.engine == "prod-a" and source.url == f"{http_engine}/metrics"
    rows = _poll(source)
    assert len([r for r in rows if isinstance(r, EngineSample)]) == 399 - 44
    (missing,) = build(SourceContext("h", ManualClock()), (f"{http_engine}/nope",), 2.0)
    with pytest.raises(SourceError, match="HTTP 404"):
        _poll(missing)
