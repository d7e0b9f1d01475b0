"""Fuzzing OTLP: export bodies (mutated protobuf and JSON, deep nesting, huge lengths, wrong types, bad UTF-8),
compression bombs, span timestamps through the clock rule, and the HTTP receiver's header and framing combinations.

The property is test_fuzz.py's: valid rows, or one clean line and exactly one counter; never an internal error.
"""

from __future__ import annotations

import contextlib
import copy
import gzip
import http.client
import json
import socket
import zlib
from collections.abc import Iterator
from typing import Any

import pytest
from google.protobuf import json_format  # type: ignore[import-untyped]
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepline.core.clock import ManualClock
from stepline.ingest.runner import MAX_AHEAD_S
from stepline.sources.base import Emit, SourceContext
from stepline.sources.otlp import STATS_KEYS, OtlpReceiver
from stepline.sources.otlp_decode import JSON, PROTOBUF, BodyTooLarge, OtlpDecodeError, decode, inflate
from tests.fuzz.test_sources import FAST, INT64, NOW, Bench, logged_errors, mutate, mutated, one_line
from tests.sources.test_otlp import ARRIVAL_NS, FINISH_NS, good_span, request_of

# ---- bodies, compression, timestamps --------------------------------------------------------------

BASE_MESSAGE = request_of(good_span("r1"), good_span("r2", gen_ai__usage__prompt_tokens={"int_value": 7}))
BASE_PROTOBUF = BASE_MESSAGE.SerializeToString()
BASE_JSON = json.loads(json_format.MessageToJson(BASE_MESSAGE))
ODD_JSON: st.SearchStrategy[Any] = st.sampled_from([
    None, -1, "-1", 1e30, "NaN", "Infinity", "-Infinity", "18446744073709551616", "9" * 30, [], {}, True, "x" * 300,
    "\ud800", {"intValue": "1e3"}, {"doubleValue": "NaN"},
    {"arrayValue": {"values": [{"kvlistValue": {"values": []}}]}},
])


@st.composite
def json_mutants(draw: st.DrawFn) -> bytes:
    message = json.loads(json.dumps(BASE_JSON))
    for _ in range(draw(st.integers(1, 3))):
        node: Any = message
        while isinstance(node, dict | list) and node and draw(st.booleans()):
            key = draw(st.sampled_from(sorted(node) if isinstance(node, dict) else range(len(node))))
            child = node[key]
            if not isinstance(child, dict | list) or not child or draw(st.booleans()):
                node[key] = copy.deepcopy(draw(ODD_JSON))  # the constants must stay as they are
                break
            node = child
    text = json.dumps(message, ensure_ascii=draw(st.booleans())).encode("utf-8", errors="surrogatepass")
    return mutate(text, draw, b'{}[]":,0123456789-eE.\\\xff\xc0') if draw(st.booleans()) else text


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        out.append((value & 0x7F) | (0x80 if value >> 7 else 0))
        value >>= 7
        if not value:
            return bytes(out)


def _deep(levels: int) -> bytes:
    """A span whose request id is an AnyValue array nested `levels` deep (protobuf parsers recurse on it)."""
    inner = b"\x0a\x01x"
    for _ in range(levels):
        value = b"\x0a" + _varint(len(inner)) + inner
        inner = b"\x2a" + _varint(len(value)) + value
    attribute = b"\x0a\x10gen_ai.request.id\x12" + _varint(len(inner)) + inner
    span = b"\x2a\x0bllm_request\x4a" + _varint(len(attribute)) + attribute
    scope = b"\x12" + _varint(len(span)) + span
    resource = b"\x12" + _varint(len(scope)) + scope
    return b"\x0a" + _varint(len(resource)) + resource


OTLP_BODIES = st.one_of(
    mutated(BASE_PROTOBUF, bytes(range(256))).map(lambda data: (PROTOBUF, data)),
    st.builds(lambda cut, length: (PROTOBUF, BASE_PROTOBUF[:cut] + b"\x0a" + _varint(length)),
              st.integers(0, len(BASE_PROTOBUF)), st.sampled_from([1 << 31, 1 << 40, (1 << 64) - 1])),
    json_mutants().map(lambda data: (JSON, data)),
    st.sampled_from([(PROTOBUF, _deep(150)), (PROTOBUF, _deep(5000)), (JSON, b"[" * 50_000),
                     (JSON, b'{"resourceSpans":' * 5000), (JSON, b"\xff\xfe{}"), (JSON, b'"\\ud800"')]),
)


@settings(max_examples=250, deadline=20_000, suppress_health_check=[HealthCheck.too_slow])
@given(OTLP_BODIES)
def test_otlp_bodies_decode_to_storable_rows_or_one_clear_error(body: tuple[str, bytes]) -> None:
    media_type, data = body
    try:
        decoded = decode(data, media_type, "h")
    except OtlpDecodeError as exc:
        assert one_line(str(exc))
        return
    assert one_line(decoded.error_message) or not decoded.rejected
    for row in decoded.rows:
        assert 946_684_800_000_000 <= row.arrival_ts <= row.ts < INT64


BOMB = gzip.compress(b"\0" * (4 << 20), compresslevel=9)
RAW = zlib.compressobj(9, zlib.DEFLATED, -15)
RAW_BOMB = RAW.compress(b"\0" * (4 << 20)) + RAW.flush()


@settings(max_examples=150, deadline=10_000)
@given(st.one_of(st.builds(gzip.compress, st.binary(max_size=3000)), st.builds(zlib.compress, st.binary(max_size=300)),
                 st.sampled_from([BOMB, BOMB + BOMB, BOMB[:-8], RAW_BOMB, zlib.compress(b"\0" * (4 << 20))]),
                 st.binary(max_size=300)),
       st.sampled_from(["gzip", "x-gzip", "deflate", "identity", "", " GZIP "]), st.integers(1, 1 << 20))
def test_inflation_never_holds_more_than_the_limit(body: bytes, encoding: str, limit: int) -> None:
    try:
        out = inflate(body, encoding, limit)
    except (BodyTooLarge, OtlpDecodeError) as exc:
        assert one_line(str(exc))
    else:
        assert len(out) <= limit


NANOS = st.sampled_from([0, 1, ARRIVAL_NS, FINISH_NS, int(NOW * 1e9), int((NOW + 3600) * 1e9),
                         int((NOW - 90 * 86400) * 1e9), INT64 - 1, (1 << 64) - 1, 946_684_800 * 10**9])


@FAST
@given(st.lists(st.tuples(NANOS, NANOS), min_size=1, max_size=5))
def test_span_times_either_reject_the_span_or_obey_the_clock_rule(times: list[tuple[int, int]]) -> None:
    spans = [good_span(f"t{i}") for i in range(len(times))]
    for span, (start, end) in zip(spans, times, strict=True):
        span.start_time_unix_nano, span.end_time_unix_nano = start, end
    decoded = decode(request_of(*spans).SerializeToString(), PROTOBUF, "h")
    assert len(decoded.rows) + decoded.rejected == len(times)
    bench, rows = Bench(), list(decoded.rows)

    class Spans:
        name = "otlp"

        def poll(self, emit: Emit) -> None:
            emit(rows)

    with logged_errors() as errors:
        assert bench.runner.poll_once(Spans())
    assert errors == []
    in_range = [r for r in rows if (NOW - 30 * 86400) * 1e6 <= r.ts <= (NOW + MAX_AHEAD_S) * 1e6]
    assert bench.value("stepline_source_rows_total", source="otlp") == len(in_range)
    assert bench.value("stepline_writer_rows_dropped_total", table="requests",
                       reason="ts_out_of_range") == len(rows) - len(in_range)


# ---- the HTTP receiver end to end -----------------------------------------------------------------

@pytest.fixture(scope="module")
def otlp() -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver(SourceContext("h", ManualClock(NOW)), port=0, max_body_bytes=4096, token="t0ken")
    receiver.start()
    yield receiver
    receiver.stop()


VALID = BASE_PROTOBUF
HEADER_SETS = st.fixed_dictionaries({}, optional={
    "Content-Type": st.sampled_from([PROTOBUF, JSON, "application/x-protobuf; charset=utf-8", "APPLICATION/JSON",
                                     "text/plain", "", "multipart/form-data; boundary=x", "é"]),
    "Content-Encoding": st.sampled_from(["gzip", "deflate", "identity", "br", "gzip, gzip", "x-gzip", " ", "zstd"]),
    "Content-Length": st.sampled_from(["0", "-1", "+5", "5_0", "0x10", "1" * 30, "²", "", "4097"]),
    "Transfer-Encoding": st.sampled_from(["chunked", "gzip, chunked", "identity"]),
    "Expect": st.sampled_from(["100-continue", "nonsense"]),
})
AUTHORIZATIONS = st.sampled_from(["Bearer t0ken"] * 4 + ["Bearer wrong", "bearer  t0ken ", "Basic dDBrZW4=", "Bearer",
                                                        "Bearer t0ken\x00", ""])
BODIES = st.sampled_from([b"", VALID, gzip.compress(VALID), zlib.compress(VALID), BOMB[:4000], b"\x00" * 5000,
                          json_format.MessageToJson(BASE_MESSAGE).encode(), b"garbage"])
TARGETS = st.sampled_from(["/v1/traces", "/v1/traces?x=1", "/v1/metrics", "//[x", "*", "/v1/traces#f", "/%zz",
                           "http://h/v1/traces", "/" + "a" * 70_000])
METHODS = st.sampled_from(["POST", "POST", "GET", "PUT", "BREW", "post", ""])


def exchange(port: int, request: bytes, timeout_s: float = 10.0) -> tuple[int | None, bytes]:
    """Send raw bytes, half-close, read one response: (status, body), or (None, b"") if closed without one."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        with contextlib.suppress(OSError):  # the server may answer and close before reading everything
            sock.sendall(request)
            sock.shutdown(socket.SHUT_WR)
        response = http.client.HTTPResponse(sock)
        try:
            response.begin()
        except (http.client.RemoteDisconnected, ConnectionResetError):
            return None, b""
        except http.client.BadStatusLine:  # a request line of two words is HTTP/0.9: its reply has no status line
            return 0, b""
        try:
            return response.status, response.read()
        except (http.client.IncompleteRead, ConnectionResetError):
            return response.status, b""


@settings(max_examples=120, deadline=20_000, suppress_health_check=[HealthCheck.too_slow])
@given(METHODS, TARGETS, HEADER_SETS, AUTHORIZATIONS, BODIES)
def test_the_receiver_answers_every_request_and_counts_it_once(otlp: OtlpReceiver, method: str, target: str,
                                                              headers: dict[str, str], authorization: str,
                                                              body: bytes) -> None:
    headers = {"Content-Length": str(len(body)), **headers} if "Transfer-Encoding" not in headers else headers
    headers["Authorization"] = authorization
    head = f"{method} {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n".encode("latin-1", errors="replace")
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode("utf-8")
    before = otlp.stats()
    status, reply = exchange(otlp.port, head + b"\r\n" + body)
    after = otlp.stats()
    grew = {key: after[key] - before[key] for key in STATS_KEYS if key.startswith("requests_")}
    assert sum(grew.values()) == 1, (status, grew)
    if status in (None, 0):  # a body cut short (nobody left to answer), a reset after the reply, or HTTP/0.9
        pass
    elif status == 200:
        assert grew["requests_accepted"] == 1
        otlp.poll(lambda rows: None)
    else:
        assert 400 <= status < 600 and status != 500, (status, reply[:200])
        assert grew["requests_accepted"] == 0


def test_a_request_cut_short_is_counted(otlp: OtlpReceiver) -> None:
    before = otlp.stats()["requests_bad"]
    status, _ = exchange(otlp.port, b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
                                    b"Authorization: Bearer t0ken\r\nContent-Length: 100\r\n\r\nshort")
    assert status is None and otlp.stats()["requests_bad"] == before + 1
