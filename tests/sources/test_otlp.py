"""The OTLP/HTTP trace receiver: the real OpenTelemetry SDK exporter as client, raw HTTP for the refusals."""

from __future__ import annotations

import gzip
import http.client
import json
import logging
import math
import socket
import threading
import time
import tracemalloc
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from email.message import Message
from typing import Any

import pytest
from google.protobuf import json_format  # type: ignore[import-untyped]
from google.rpc import status_pb2  # type: ignore[import-untyped]
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as ProtoSpan
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.trace import SpanKind

from stepline.core.clock import ManualClock
from stepline.model.rows import UNKNOWN_FINISH_REASON, Request, Row
from stepline.sources.base import Listener, Source, SourceContext
from stepline.sources.otlp import STATS_KEYS, OtlpReceiver
from stepline.sources.otlp_decode import (
    JSON,
    PROTOBUF,
)
from stepline.testing.sink import wait_until
from tests.core.test_listener import needs_ipv6

HOST = "h1"
ARRIVAL_NS = 1_714_564_800_123_456_789
FINISH_NS = ARRIVAL_NS + 2_500_000_000
TOKEN = "s3cret-token"

# What vLLM 0.33 puts on its llm_request span (vllm/v1/engine/output_processor.py:964-993, do_tracing): no model and
# no finish reason.
VLLM_ATTRIBUTES: dict[str, Any] = {
    "gen_ai.request.id": "chatcmpl-1",
    "gen_ai.request.top_p": 0.9,
    "gen_ai.request.max_tokens": 256,
    "gen_ai.request.temperature": 0.7,
    "gen_ai.request.n": 1,
    "gen_ai.usage.prompt_tokens": 3000,
    "gen_ai.usage.completion_tokens": 11,
    "gen_ai.latency.time_in_queue": 0.25,
    "gen_ai.latency.time_to_first_token": 1.75,
    "gen_ai.latency.e2e": 2.5,
    "gen_ai.latency.time_in_model_prefill": 1.5,
    "gen_ai.latency.time_in_model_decode": 0.5,
    "gen_ai.latency.time_in_model_inference": 2.0,
}

# The engine's model as the collector knows it (its plugin's engine_config, its /metrics): the spans name none.
MODELS = {"prod-a": "qwen3-8b"}

EXPECTED = Request(
    ts=1_714_564_802_623_457,  # 2.5 s after arrival, rounded to the nearest microsecond
    host=HOST, engine="prod-a", engine_index=0, model_name="qwen3-8b", request_id="chatcmpl-1", source="otlp",
    finish_reason=UNKNOWN_FINISH_REASON, arrival_ts=1_714_564_800_123_457, queue_seconds=0.25, prefill_seconds=1.5,
    decode_seconds=0.5,
    inference_seconds=2.0, e2e_seconds=2.5, ttft_seconds=1.75, mean_tpot_seconds=0.05, prompt_tokens=3000,
    cached_tokens=0, generation_tokens=11, max_tokens=256, preemptions=0,
)


@dataclass
class Http:
    """One raw HTTP exchange."""

    status: int
    headers: Message
    body: bytes


def context() -> SourceContext:
    """A collector's context that knows the engines' models (MODELS), as the plugin's engine_config told it."""
    ctx = SourceContext(HOST, ManualClock())
    for engine, model in MODELS.items():
        ctx.engine_models.announce(engine, model)
    return ctx


@pytest.fixture
def make_receiver() -> Iterator[Any]:
    """Builds started receivers on ephemeral ports, stopped after the test."""
    started: list[OtlpReceiver] = []

    def make(**kwargs: Any) -> OtlpReceiver:
        receiver = OtlpReceiver(context(), port=0, **kwargs)
        receiver.start()
        started.append(receiver)
        return receiver

    yield make
    for receiver in started:
        receiver.stop()


@pytest.fixture
def receiver(make_receiver: Any) -> OtlpReceiver:
    r: OtlpReceiver = make_receiver()
    return r


def drain(receiver: OtlpReceiver) -> list[Row]:
    rows: list[Row] = []
    receiver.poll(rows.extend)
    return rows


def export(url: str, spans: Sequence[tuple[str, Mapping[str, Any]]], resource: Mapping[str, str] | None = None,
           compression: Compression = Compression.Gzip, headers: Mapping[str, str] | None = None, *,
           batched: bool = False) -> None:
    """Send spans through the SDK's own OTLP/HTTP exporter, as vLLM does (one SERVER span per request); one export
    per span, or all of them in one export when batched."""
    exporter = OTLPSpanExporter(endpoint=f"{url}/v1/traces", compression=compression, headers=headers, timeout=5)
    attributes = {"service.name": "prod-a"} if resource is None else dict(resource)
    provider = TracerProvider(resource=Resource.create(attributes))
    # A batch processor that waits a minute sends nothing before force_flush, which sends the spans as one export.
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=60_000) if batched
                                else SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("vllm.entrypoints.openai.api_server")
    for name, span_attributes in spans:
        span = tracer.start_span(name, kind=SpanKind.SERVER, start_time=ARRIVAL_NS, attributes=span_attributes)
        span.end(end_time=FINISH_NS)
    provider.force_flush()
    provider.shutdown()


def post(receiver: OtlpReceiver, body: bytes, headers: Mapping[str, str] | None = None, *, method: str = "POST",
         path: str = "/v1/traces") -> Http:
    """One raw request; Content-Length is set unless headers name their own framing."""
    hdrs = {"Content-Type": PROTOBUF, **(headers or {})}
    conn = http.client.HTTPConnection("127.0.0.1", receiver.port, timeout=10)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        for key, value in hdrs.items():
            conn.putheader(key, value)
        if "Content-Length" not in hdrs and "Transfer-Encoding" not in hdrs and "X-No-Length" not in hdrs:
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        response = conn.getresponse()
        return Http(response.status, response.headers, response.read())
    finally:
        conn.close()


def span(name: str = "llm_request", start: int = ARRIVAL_NS, end: int = FINISH_NS, **attributes: Any) -> ProtoSpan:
    """A protobuf span whose attributes are given as AnyValue field dicts, e.g. id={"string_value": "x"}."""
    kvs = [KeyValue(key=k.replace("__", "."), value=AnyValue(**v)) for k, v in attributes.items()]
    return ProtoSpan(name=name, start_time_unix_nano=start, end_time_unix_nano=end, attributes=kvs)


def request_of(*spans: ProtoSpan, resource: Mapping[str, str] | None = None) -> ExportTraceServiceRequest:
    message = ExportTraceServiceRequest()
    rs = message.resource_spans.add()
    for key, value in (resource or {"service.name": "raw"}).items():
        rs.resource.attributes.add(key=key, value=AnyValue(string_value=value))
    rs.scope_spans.add().spans.extend(spans)
    return message


def good_span(request_id: str = "r1", **overrides: Any) -> ProtoSpan:
    attrs: dict[str, Any] = {"gen_ai__request__id": {"string_value": request_id},
                             "gen_ai__usage__completion_tokens": {"int_value": 5},
                             "gen_ai__latency__time_in_model_decode": {"double_value": 0.4}}
    attrs.update(overrides)
    return span(**attrs)


def status_of(reply: Http) -> Any:
    status = status_pb2.Status()
    status.ParseFromString(reply.body)
    return status


def response_of(reply: Http) -> ExportTraceServiceResponse:
    response = ExportTraceServiceResponse()
    response.ParseFromString(reply.body)
    return response


# --- end to end, with the real exporter -------------------------------------------------------------------------

@pytest.mark.parametrize("compression", [Compression.Gzip, Compression.NoCompression, Compression.Deflate])
def test_exporter_spans_become_exact_request_rows(receiver: OtlpReceiver, compression: Compression) -> None:
    export(receiver.url, [("llm_request", VLLM_ATTRIBUTES)], compression=compression)
    assert drain(receiver) == [EXPECTED]
    assert drain(receiver) == []
    assert receiver.stats()["spans_accepted"] == 1
    assert receiver.stats()["requests_accepted"] == 1


def test_receiver_is_a_source_and_a_listener(receiver: OtlpReceiver) -> None:
    source: Source = receiver
    assert source.name == "otlp"
    assert isinstance(receiver, Listener)
    assert receiver.url == f"http://127.0.0.1:{receiver.port}" and receiver.port != 0
    assert set(receiver.stats()) == set(STATS_KEYS)


def test_other_spans_are_ignored_not_errors(receiver: OtlpReceiver) -> None:
    export(receiver.url, [("llm_request", VLLM_ATTRIBUTES), ("tokenize", {"x": 1}), ("POST /v1/chat", {})])
    assert drain(receiver) == [EXPECTED]
    stats = receiver.stats()
    assert (stats["spans_accepted"], stats["spans_ignored"], stats["spans_rejected"]) == (1, 2, 0)
    assert stats["requests_bad"] == 0


@pytest.mark.parametrize(("resource", "engine"), [
    ({"service.name": "prod-a", "stepline.engine": "gpu7:8000"}, "gpu7:8000"),
    ({}, "vllm"),  # the SDK fills in service.name = unknown_service
    ({"service.name": "unknown_service:python3"}, "vllm"),
    ({"service.name": "prod-b"}, "prod-b"),
])
def test_engine_comes_from_the_resource(receiver: OtlpReceiver, resource: dict[str, str], engine: str) -> None:
    export(receiver.url, [("llm_request", VLLM_ATTRIBUTES)], resource=resource)
    assert drain(receiver) == [EXPECTED._replace(engine=engine, model_name=MODELS.get(engine, ""))]


def test_optional_attributes_missing(receiver: OtlpReceiver) -> None:
    attributes = {"gen_ai.request.id": "r2", "gen_ai.request.model": "m", "gen_ai.usage.completion_tokens": 1,
                  "gen_ai.response.finish_reasons": ("length", "stop")}
    export(receiver.url, [("llm_request", attributes)])
    [row] = drain(receiver)
    assert isinstance(row, Request)
    # The model its engine serves before the one the request asked for.
    assert (row.request_id, row.model_name, row.finish_reason, row.generation_tokens) == ("r2", "qwen3-8b", "length",
                                                                                          1)
    assert (row.prompt_tokens, row.max_tokens, row.cached_tokens, row.preemptions) == (0, 0, 0, 0)
    for value in (row.queue_seconds, row.prefill_seconds, row.decode_seconds, row.inference_seconds,
                  row.e2e_seconds, row.ttft_seconds, row.mean_tpot_seconds):
        assert math.isnan(value)


def test_a_span_as_vllm_sends_it_gets_its_engines_model_and_an_unknown_finish_reason(receiver: OtlpReceiver) -> None:
    # vLLM's span names neither (vllm/tracing/utils.py:28 defines gen_ai.response.model; nothing sets it): the
    # request takes the model the collector knows its engine serves, and says it does not know why it finished.
    export(receiver.url, [("llm_request", VLLM_ATTRIBUTES)])
    export(receiver.url, [("llm_request", VLLM_ATTRIBUTES)], resource={"service.name": "never-announced"})
    [known, unknown] = drain(receiver)
    assert isinstance(known, Request) and isinstance(unknown, Request)
    assert (known.engine, known.model_name, known.finish_reason) == ("prod-a", "qwen3-8b", UNKNOWN_FINISH_REASON)
    assert (unknown.engine, unknown.model_name, unknown.finish_reason) == ("never-announced", "",
                                                                          UNKNOWN_FINISH_REASON)


def test_what_a_span_says_comes_before_what_the_collector_knows(receiver: OtlpReceiver) -> None:
    said = {**VLLM_ATTRIBUTES, "gen_ai.response.model": "qwen3-8b-awq", "gen_ai.request.model": "asked",
            "gen_ai.response.finish_reasons": ("stop",)}
    asked = {**VLLM_ATTRIBUTES, "gen_ai.request.model": "asked"}
    export(receiver.url, [("llm_request", said), ("llm_request", asked)])
    export(receiver.url, [("llm_request", asked)], resource={"service.name": "never-announced"})
    assert [(r.model_name, r.finish_reason) for r in drain(receiver) if isinstance(r, Request)] == [
        ("qwen3-8b-awq", "stop"), ("qwen3-8b", UNKNOWN_FINISH_REASON), ("asked", UNKNOWN_FINISH_REASON)]


def test_exporter_bearer_token(make_receiver: Any) -> None:
    receiver = make_receiver(token=TOKEN)
    export(receiver.url, [("llm_request", VLLM_ATTRIBUTES)])  # no token: 401, and the exporter does not retry it
    assert drain(receiver) == []
    assert receiver.stats()["requests_unauthorized"] == 1
    export(receiver.url, [("llm_request", VLLM_ATTRIBUTES)], headers={"Authorization": f"Bearer {TOKEN}"})
    assert drain(receiver) == [EXPECTED]


def test_exporter_retries_a_busy_receiver_and_nothing_is_lost(make_receiver: Any) -> None:
    receiver = make_receiver(max_pending_rows=1)
    assert post(receiver, request_of(good_span("first")).SerializeToString()).status == 200
    sender = threading.Thread(target=export, args=(receiver.url, [("llm_request", VLLM_ATTRIBUTES)]))
    sender.start()
    wait_until(lambda: receiver.stats()["requests_busy"] >= 1, timeout_s=5)
    first = drain(receiver)  # the exporter backs off about a second, then retries into the drained buffer
    sender.join(timeout=10)
    assert not sender.is_alive()
    assert [r.request_id for r in first if isinstance(r, Request)] == ["first"]
    assert drain(receiver) == [EXPECTED]


# --- raw HTTP: refusals and their status codes ----------------------------------------------------------------

def test_garbage_protobuf_is_400_with_a_google_rpc_status(receiver: OtlpReceiver,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    reply = post(receiver, b"\xff\xff\xff\xff not protobuf")
    assert reply.status == 400
    assert reply.headers["Content-Type"] == PROTOBUF
    status = status_of(reply)
    assert status.code == 3 and "ExportTraceServiceRequest" in status.message
    assert receiver.stats()["requests_bad"] == 1
    [record] = [r for r in caplog.records if r.name == "stepline.sources.otlp"]
    assert "(HTTP 400): not a valid protobuf ExportTraceServiceRequest" in record.getMessage()
    assert record.exc_info is None


@pytest.mark.parametrize("body", [b"\x1f\x8b\x08\x00garbage-garbage", gzip.compress(b"x" * 1000, mtime=0)[:-12]],
                         ids=["corrupt", "truncated"])
def test_corrupt_or_truncated_gzip_is_400(receiver: OtlpReceiver, body: bytes) -> None:
    reply = post(receiver, body, {"Content-Encoding": "gzip"})
    assert reply.status == 400
    assert "gzip" in status_of(reply).message
    assert receiver.stats()["requests_bad"] == 1


def test_oversized_content_length_is_413_without_reading_the_body(receiver: OtlpReceiver) -> None:
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", receiver.port), timeout=5) as sock:
        sock.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
                     b"Content-Length: 1000000000\r\n\r\nonly a few bytes")
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert time.monotonic() - started < 2.0
    assert reply.startswith(b"HTTP/1.1 413 ")
    assert b"Connection: close" in reply
    assert receiver.stats()["requests_too_large"] == 1


@pytest.mark.parametrize(("encoding", "wbits"), [("gzip", 16 + zlib.MAX_WBITS), ("deflate", zlib.MAX_WBITS)])
def test_a_bomb_costs_the_receiver_about_its_body_limit_in_memory(receiver: OtlpReceiver, encoding: str,
                                                                  wbits: int) -> None:
    deflater, zeros = zlib.compressobj(9, zlib.DEFLATED, wbits), bytes(1 << 20)
    bomb = b"".join(deflater.compress(zeros) for _ in range(200)) + deflater.flush()  # 200 KB inflating to 200 MiB
    tracemalloc.start()  # every thread's allocations: the handler's inflate included
    try:
        reply = post(receiver, bomb, {"Content-Encoding": encoding})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert reply.status == 413 and "inflates past" in status_of(reply).message
    assert peak < 4 * receiver.max_body_bytes  # the default 8 MiB limit and its buffers, not the 200 MiB


def test_gzip_bomb_is_413(make_receiver: Any) -> None:
    receiver = make_receiver(max_body_bytes=1 << 20)
    bomb = gzip.compress(b"\0" * (32 << 20), compresslevel=9)
    assert len(bomb) < 64 << 10
    reply = post(receiver, bomb, {"Content-Encoding": "gzip"})
    assert reply.status == 413
    assert "inflates past" in status_of(reply).message
    assert receiver.stats()["requests_too_large"] == 1


@pytest.mark.parametrize(("method", "path", "status"), [
    ("POST", "/v1/metrics", 404), ("POST", "/", 404), ("GET", "/v1/traces", 405), ("PUT", "/v1/traces", 405),
    ("GET", "/nothing", 404),
])
def test_wrong_path_or_method(receiver: OtlpReceiver, method: str, path: str, status: int) -> None:
    reply = post(receiver, b"", method=method, path=path)
    assert reply.status == status
    if status == 405:
        assert reply.headers["Allow"] == "POST"
    assert receiver.stats()["requests_unsupported"] == 1


def test_framing_errors(receiver: OtlpReceiver) -> None:
    assert post(receiver, b"", {"X-No-Length": "1"}).status == 411
    assert post(receiver, b"0\r\n\r\n", {"Transfer-Encoding": "chunked"}).status == 411
    assert post(receiver, b"", {"Content-Length": "-1"}).status == 400
    assert post(receiver, b"", {"Content-Length": "ten"}).status == 400
    assert post(receiver, b"", {"Content-Length": "\u00b2"}).status == 400  # a digit to str.isdigit(), not to int()
    assert post(receiver, b"", {"Content-Length": "9" * 5000}).status == 413
    assert post(receiver, b"", {"Content-Length": "0", "content-length": "5"}).status == 400
    assert post(receiver, b"", {"Content-Length": "00"}).status == 200
    stats = receiver.stats()
    assert (stats["requests_unsupported"], stats["requests_bad"], stats["requests_too_large"]) == (2, 4, 1)


def test_unsupported_media_type_and_encoding_are_415(receiver: OtlpReceiver) -> None:
    body = request_of(good_span()).SerializeToString()
    reply = post(receiver, body, {"Content-Type": "text/plain"})
    assert reply.status == 415 and "application/x-protobuf" in status_of(reply).message
    assert post(receiver, body, {"Content-Encoding": "br"}).status == 415
    assert receiver.stats()["requests_unsupported"] == 2
    assert drain(receiver) == []


def test_otlp_json_is_accepted_and_answered_in_json(receiver: OtlpReceiver) -> None:
    message = request_of(good_span("j1"), good_span("j2", gen_ai__latency__e2e={"string_value": "abc"}))
    body = json_format.MessageToJson(message).encode()
    # OTLP/JSON carries ids in hex and int64 as strings: both must parse.
    body = body.replace(b'"name": "llm_request"',
                        b'"name": "llm_request", "traceId": "5b8efff798038103d269b633813fc60c", '
                        b'"spanId": "eee19b7ec3c1b174", "kind": 2', 1)
    reply = post(receiver, body, {"Content-Type": "application/json; charset=utf-8"})
    assert reply.status == 200
    assert reply.headers["Content-Type"] == JSON
    answer = json.loads(reply.body)
    assert answer["partialSuccess"]["rejectedSpans"] == "1"
    assert [r.request_id for r in drain(receiver) if isinstance(r, Request)] == ["j1"]
    bad = post(receiver, b"{not json", {"Content-Type": JSON})
    assert bad.status == 400 and json.loads(bad.body)["code"] == 3


def test_bearer_token_is_required_and_never_logged(make_receiver: Any, caplog: pytest.LogCaptureFixture) -> None:
    receiver = make_receiver(token=TOKEN)
    body = request_of(good_span()).SerializeToString()
    caplog.set_level(logging.DEBUG)
    missing = post(receiver, body)
    assert missing.status == 401 and missing.headers["WWW-Authenticate"].startswith("Bearer")
    assert post(receiver, body, {"Authorization": "Bearer wrong"}).status == 401
    assert post(receiver, body, {"Authorization": f"Basic {TOKEN}"}).status == 401
    assert post(receiver, body, {"Authorization": f"Bearer {TOKEN}"}).status == 200
    assert receiver.stats()["requests_unauthorized"] == 3
    assert len(drain(receiver)) == 1
    assert TOKEN not in caplog.text


def test_without_a_token_no_authorization_is_needed(receiver: OtlpReceiver) -> None:
    assert post(receiver, request_of(good_span()).SerializeToString()).status == 200


def test_full_buffer_is_503_until_polled(make_receiver: Any) -> None:
    receiver = make_receiver(max_pending_rows=2)
    assert post(receiver, request_of(good_span("a"), good_span("b")).SerializeToString()).status == 200
    busy = post(receiver, request_of(good_span("c")).SerializeToString())
    assert busy.status == 503 and status_of(busy).code == 14
    assert receiver.stats()["requests_busy"] == 1
    assert [r.request_id for r in drain(receiver) if isinstance(r, Request)] == ["a", "b"]
    assert post(receiver, request_of(good_span("c")).SerializeToString()).status == 200
    # All or nothing: one row waits, so a batch of two would overflow; an empty buffer takes any batch.
    assert post(receiver, request_of(good_span("d"), good_span("e")).SerializeToString()).status == 503
    drain(receiver)
    big = request_of(good_span("f"), good_span("g"), good_span("h"))
    assert post(receiver, big.SerializeToString()).status == 200
    assert len(drain(receiver)) == 3


def test_partial_success_for_rejected_spans(receiver: OtlpReceiver) -> None:
    message = request_of(
        good_span("ok-1"),
        span(gen_ai__usage__prompt_tokens={"int_value": 3}),  # no gen_ai.request.id
        good_span("bad-latency", gen_ai__latency__time_in_queue={"string_value": "abc"}),
        good_span("negative", gen_ai__latency__e2e={"double_value": -1.0}),
        good_span("nan", gen_ai__latency__e2e={"double_value": math.nan}),
        good_span("fraction", gen_ai__usage__prompt_tokens={"double_value": 12.5}),
        good_span("bool", gen_ai__usage__prompt_tokens={"bool_value": True}),
        span(name="other"),
    )
    reply = post(receiver, message.SerializeToString())
    assert reply.status == 200
    response = response_of(reply)
    assert response.partial_success.rejected_spans == 6
    assert "gen_ai.request.id" in response.partial_success.error_message
    assert "'abc'" in response.partial_success.error_message
    assert [r.request_id for r in drain(receiver) if isinstance(r, Request)] == ["ok-1"]
    stats = receiver.stats()
    assert (stats["spans_accepted"], stats["spans_rejected"], stats["spans_ignored"]) == (1, 6, 1)
    clean = response_of(post(receiver, request_of(good_span()).SerializeToString()))
    assert not clean.HasField("partial_success")


def test_a_7mb_request_id_is_rejected_not_stored(receiver: OtlpReceiver, caplog: pytest.LogCaptureFixture) -> None:
    huge = {**VLLM_ATTRIBUTES, "gen_ai.request.id": "r" * 7_000_000}
    export(receiver.url, [("llm_request", huge), ("llm_request", VLLM_ATTRIBUTES)], batched=True)
    assert drain(receiver) == [EXPECTED]
    stats = receiver.stats()
    assert (stats["spans_accepted"], stats["spans_rejected"], stats["requests_accepted"]) == (1, 1, 1)
    [line] = [r.getMessage() for r in caplog.records if r.name == "stepline.sources.otlp"]
    assert line.endswith("gen_ai.request.id is over the 1024-byte limit for ids and names (7000000 characters)")
    assert len(line) < 200


def test_stop_releases_the_port_and_keeps_received_rows(make_receiver: Any) -> None:
    receiver: OtlpReceiver = make_receiver()
    port = receiver.port
    assert post(receiver, request_of(good_span("kept")).SerializeToString()).status == 200
    receiver.stop()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    assert [r.request_id for r in drain(receiver) if isinstance(r, Request)] == ["kept"]
    again = OtlpReceiver(SourceContext(HOST, ManualClock()), port=port)
    again.start()
    again.stop()
    receiver.stop()  # idempotent


@needs_ipv6
def test_listens_on_ipv6_loopback_when_given_it() -> None:
    receiver = OtlpReceiver(context(), "::1", 0, token=TOKEN)
    receiver.start()
    try:
        assert receiver.url == f"http://[::1]:{receiver.port}"
        export(receiver.url, [("llm_request", VLLM_ATTRIBUTES)], headers={"Authorization": f"Bearer {TOKEN}"})
        assert drain(receiver) == [EXPECTED]
        conn = http.client.HTTPConnection("::1", receiver.port, timeout=10)
        conn.request("POST", "/v1/traces", b"", {"Content-Type": PROTOBUF, "Authorization": "Bearer wrong"})
        refused = conn.getresponse()
        assert (refused.status, refused.headers["WWW-Authenticate"]) == (401, 'Bearer realm="stepline"')
        conn.close()
    finally:
        receiver.stop()


def test_taken_port_is_a_clear_oserror(receiver: OtlpReceiver) -> None:
    other = OtlpReceiver(SourceContext(HOST, ManualClock()), port=receiver.port)
    with pytest.raises(OSError, match=r"cannot listen on 127\.0\.0\.1"):
        other.start()


@pytest.mark.parametrize("kwargs", [{"port": 70000}, {"max_body_bytes": 0}, {"max_pending_rows": 0}, {"token": ""}])
def test_bad_settings_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="otlp receiver"):
        OtlpReceiver(SourceContext(HOST, ManualClock()), **kwargs)
