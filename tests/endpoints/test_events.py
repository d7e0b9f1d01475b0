"""The collector's events endpoint: a token, a bounded JSON body, whole requests written or refused whole."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from stepline.endpoints.events import MAX_BODY_BYTES, EventsIngest, EventsRefused, post_events
from stepline.model.rows import Event
from tests.core.test_listener import needs_ipv6

NOW = 1_750_000_000.0


def event(**changes: Any) -> Event:
    fields = {"ts": int(NOW * 1e6), "host": "h", "engine": "sim", "source": "matrix", "kind": "matrix_run",
              "severity": "info", "message": "a run", "attributes": {"run": "a", "itl_p99_ms": "7.000"}}
    return Event(**{**fields, **changes})


class Sink:
    def __init__(self, room: int = 1_000_000) -> None:
        self.rows: list[Event] = []
        self.room = room

    def write(self, rows: Sequence[Event]) -> int:
        taken = list(rows)[: self.room - len(self.rows)]
        self.rows.extend(taken)
        return len(taken)


@pytest.fixture
def sink() -> Sink:
    return Sink()


@pytest.fixture
def ingest(sink: Sink) -> Iterator[EventsIngest]:
    endpoint = EventsIngest(sink.write, port=0, extra_token="configured", clock=lambda: NOW)
    endpoint.start()
    yield endpoint
    endpoint.stop()


def send(ingest: EventsIngest, body: bytes, *, token: str | None = None, method: str = "POST",
         path: str = "/v1/events", content_type: str = "application/json") -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", ingest.port, timeout=10)
    headers = {"Content-Type": content_type}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    try:
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def body(*events: Event | dict[str, Any]) -> bytes:
    return json.dumps({"events": [e._asdict() if isinstance(e, Event) else e for e in events]}).encode()


def test_events_with_the_token_are_written_whole(ingest: EventsIngest, sink: Sink) -> None:
    assert ingest.url == f"http://127.0.0.1:{ingest.port}/v1/events" and len(ingest.token) >= 32
    assert send(ingest, body(event(), event(kind="other_kind")), token=ingest.token) == (200, {"accepted": 2})
    assert send(ingest, body(event()), token="configured") == (200, {"accepted": 1})
    assert sink.rows == [event(), event(kind="other_kind"), event()]
    assert post_events(ingest.url, ingest.token, [event(message="via the client")]) == 1
    assert sink.rows[-1].message == "via the client"


@pytest.mark.parametrize(
    ("raw", "token", "status", "reason"),
    [
        (body(event()), None, 401, "a valid 'Authorization: Bearer <token>' header is required"),
        (body(event()), "wrong", 401, "a valid 'Authorization: Bearer <token>' header is required"),
        (b"\x00garbage{", "TOKEN", 400, "the body is not JSON"),
        (b'{"rows": []}', "TOKEN", 400, 'the body must be {"events": [...]}'),
        (body(), "TOKEN", 400, "no events in the body"),
        (body(event(), {**event()._asdict(), "ts": 1_700_000_000}), "TOKEN", 400,
         "event 1: ts must be wall-clock microseconds"),
        (body({**event()._asdict(), "ts": int((NOW + 7 * 86400) * 1e6)}), "TOKEN", 400, "not in the future"),
        (body({**event()._asdict(), "table": "steps"}), "TOKEN", 400, "event 0: unknown field(s) table"),
        (body({"ts": int(NOW * 1e6), "host": "h"}), "TOKEN", 400, "event 0: missing kind, severity, source"),
        (body(event(source="watchdog", kind="wedged_engine")), "TOKEN", 400, "'watchdog' is the collector's own"),
        (body(event(severity="fatal")), "TOKEN", 400, "severity 'fatal' must be one of info, warning, critical"),
        (body(event(kind="Drop Table")), "TOKEN", 400, "must be lower_snake_case"),
        (body(event(attributes={"a": 1})), "TOKEN", 400, "attribute 'a' must be a string"),
        (body(event(message="x" * 20000)), "TOKEN", 400, "message is over 16384 characters"),
        (body(*[event()] * 1001), "TOKEN", 413, "1001 events in one request; at most 1000"),
        (b"{" + b" " * MAX_BODY_BYTES + b"}", "TOKEN", 413, f"is over the {MAX_BODY_BYTES}-byte limit"),
    ],
)
def test_a_bad_token_or_body_is_refused_in_one_line_and_nothing_is_written(
    ingest: EventsIngest, sink: Sink, raw: bytes, token: str | None, status: int, reason: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    got, answer = send(ingest, raw, token=ingest.token if token == "TOKEN" else token)
    assert got == status and reason in answer["error"] and "\n" not in answer["error"]
    assert sink.rows == []
    assert f"events endpoint: refused a request (HTTP {status})" in caplog.text
    assert ingest.token not in caplog.text


@pytest.mark.parametrize(("raw", "reason"), [
    (b"[" * 100_000 + b"]" * 100_000, "the body is JSON nested too deeply to decode"),
    (b'{"events": [{"ts": ' + b"1" * 5000 + b"}]}", "the body is not JSON: Exceeds the limit (4300 digits)"),
], ids=["deep", "long-integer"])
def test_a_body_the_decoder_cannot_take_is_400_in_one_line(ingest: EventsIngest, sink: Sink, raw: bytes,
                                                           reason: str) -> None:
    got, answer = send(ingest, raw, token=ingest.token)
    assert got == 400 and answer["error"].startswith(reason) and "\n" not in answer["error"]
    assert sink.rows == []


@pytest.mark.parametrize("source", [
    "Watchdog", "watchdog ", " WATCHDOG\t", "otlp\u00a0",  # case and spacing, a no-break space included
    "\uff57\uff41\uff54\uff43\uff48\uff44\uff4f\uff47", "\uff27\uff30\uff35", "\u1d34ost",  # fullwidth, modifier
    "watch\u200bdog", "plug\u00adin",  # a zero-width space, a soft hyphen
])
def test_a_reserved_source_spelled_another_way_is_refused(ingest: EventsIngest, sink: Sink, source: str) -> None:
    """Case, surrounding space, fullwidth or modifier letters and invisible characters do not make it another name."""
    got, answer = send(ingest, body(event(source=source)), token=ingest.token)
    assert (got, answer["error"]) == (400, f"event 0: source {source!r} is the collector's own")
    assert sink.rows == []


def test_a_request_target_that_is_no_url_is_400(ingest: EventsIngest, sink: Sink) -> None:
    raw = body(event())
    conn = http.client.HTTPConnection("127.0.0.1", ingest.port, timeout=10)
    try:
        conn.putrequest("POST", "http://[x/v1/events", skip_host=True)  # an unclosed IPv6 bracket in absolute form
        for key, value in (("Host", "127.0.0.1"), ("Content-Type", "application/json"),
                           ("Authorization", f"Bearer {ingest.token}"), ("Content-Length", str(len(raw)))):
            conn.putheader(key, value)
        conn.endheaders(raw)
        response = conn.getresponse()
        assert (response.status, json.loads(response.read())) == (
            400, {"error": "cannot parse the request target 'http://[x/v1/events'"})
    finally:
        conn.close()
    assert sink.rows == []


def test_only_post_to_the_events_path(ingest: EventsIngest, sink: Sink) -> None:
    assert send(ingest, b"", method="GET", token=ingest.token)[0] == 405
    assert send(ingest, body(event()), path="/v1/traces", token=ingest.token)[0] == 404
    assert send(ingest, body(event()), token=ingest.token, content_type="text/plain")[0] == 415
    assert sink.rows == []


def test_a_full_queue_is_503_and_the_client_says_so_in_one_line() -> None:
    sink = Sink(room=1)
    endpoint = EventsIngest(sink.write, port=0)
    endpoint.start()
    try:
        with pytest.raises(EventsRefused) as refused:
            post_events(endpoint.url, endpoint.token, [event(), event()])
        assert str(refused.value) == (f"the collector at {endpoint.url} refused the events: HTTP 503: the "
                                      "collector's events queue took 1 of 2 events (the rest are dropped and "
                                      "counted): retry later")
        with pytest.raises(EventsRefused, match="refused the events: HTTP 401"):
            post_events(endpoint.url, "wrong", [event()])
    finally:
        endpoint.stop()
    with pytest.raises(EventsRefused, match=r"^cannot reach the collector at http://127\.0\.0\.1:"):
        post_events(endpoint.url, endpoint.token, [event()], timeout_s=2)


def test_a_new_collector_makes_a_new_token() -> None:
    tokens = {EventsIngest(Sink().write).token for _ in range(3)}
    assert len(tokens) == 3


@needs_ipv6
def test_listens_on_ipv6_loopback_when_given_it(sink: Sink) -> None:
    endpoint = EventsIngest(sink.write, "::1", 0, clock=lambda: NOW)
    endpoint.start()
    try:
        assert endpoint.url == f"http://[::1]:{endpoint.port}/v1/events"
        assert post_events(endpoint.url, endpoint.token, [event()]) == 1
        with pytest.raises(EventsRefused, match="refused the events: HTTP 401"):
            post_events(endpoint.url, "wrong", [event()])
    finally:
        endpoint.stop()
    assert sink.rows == [event()]
