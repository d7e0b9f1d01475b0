"""The collector's write path for events from its own tools (`stepline matrix`): POST /v1/events, with a token.

An embedded store opens in one process only, so a CLI command that has something to put on the timeline while a
collector runs hands it to that collector, which writes it through the same writers and spool as every other row.
The endpoint takes `events` rows only, in one JSON body of bounded size, and only with `Authorization: Bearer
<token>`: the token this collector made when it started (in its runtime file, which only its user can read), or
the configured OTLP token ($STEPLINE_OTLP_TOKEN) for a client that reaches it from elsewhere. A bad token, body or
event refuses the whole request with a one-line reason, and nothing of it is written; only a full writer queue can
take part of one (503, saying how many, the rest counted as dropped like any other row).

Body: {"events": [{"ts": MICROSECONDS, "host": "...", "engine": "...", "source": "...", "kind": "...",
"severity": "info|warning|critical", "message": "...", "attributes": {"k": "v"}}, ...]}.
"""

from __future__ import annotations

import http.client
import json
import logging
import re
import secrets
import time
import unicodedata
import urllib.parse
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler
from typing import Any

from stepline.clickhouse_http.body import BodyTooLarge, read_body
from stepline.core.listener import BEARER_CHALLENGE, Address, HttpServer, ServerThread, bearer_authorized, linger
from stepline.core.ratelimit import RateLimitedLog
from stepline.model.rows import Event

log = logging.getLogger(__name__)

EVENTS_PATH = "/v1/events"
MAX_BODY_BYTES = 1 << 20
MAX_EVENTS = 1000
MAX_TEXT_CHARS = 4096  # host, engine, source, kind, attribute keys and values
MAX_MESSAGE_CHARS = 16384
MAX_ATTRIBUTES = 200
SEVERITIES = ("info", "warning", "critical")
# What the collector says about itself stays its own: a client cannot write as one of its sources.
RESERVED_SOURCES = frozenset({"collector", "watchdog", "plugin", "otlp", "vllm_metrics", "gpu", "host"})
_KIND = re.compile(r"[a-z][a-z0-9_]{0,63}\Z")
_FIELDS = frozenset(Event._fields)
_EARLIEST_US = 978_307_200_000_000  # 2001-01-01: a smaller ts is a unit mistake (seconds, milliseconds)
_FUTURE_S = 86_400.0
_DRAIN_CAP_BYTES = 1 << 20

Write = Callable[[Sequence[Event]], int]


class EventsRejected(ValueError):
    """A body the endpoint refuses: HTTP status and a one-line reason."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def parse_events(body: bytes, *, now_s: float, max_events: int = MAX_EVENTS) -> list[Event]:
    """The events of a request body; EventsRejected (400) naming the first thing wrong."""
    try:
        raw = json.loads(body)
    except RecursionError:
        raise EventsRejected(400, "the body is JSON nested too deeply to decode") from None
    except ValueError as exc:  # bad JSON or UTF-8, or an integer of more digits than int() converts
        raise EventsRejected(400, f"the body is not JSON: {' '.join(str(exc).split())[:200]}") from None
    if not isinstance(raw, dict) or set(raw) != {"events"} or not isinstance(raw["events"], list):
        raise EventsRejected(400, 'the body must be {"events": [...]}')
    items = raw["events"]
    if not items:
        raise EventsRejected(400, "no events in the body")
    if len(items) > max_events:
        raise EventsRejected(413, f"{len(items)} events in one request; at most {max_events}")
    return [_event(i, item, now_s) for i, item in enumerate(items)]


def _event(i: int, item: Any, now_s: float) -> Event:
    where = f"event {i}"
    if not isinstance(item, dict):
        raise EventsRejected(400, f"{where} is not an object")
    unknown = sorted(set(item) - _FIELDS)
    missing = sorted(_FIELDS - set(item) - {"attributes", "engine", "message"})
    if unknown or missing:
        what = f"unknown field(s) {', '.join(unknown)}" if unknown else f"missing {', '.join(missing)}"
        raise EventsRejected(400, f"{where}: {what}"[:300])
    ts = item["ts"]
    if type(ts) is not int or not _EARLIEST_US <= ts <= (now_s + _FUTURE_S) * 1e6:
        raise EventsRejected(400, f"{where}: ts must be wall-clock microseconds since 1970, "
                                  f"not in the future, got {str(ts)[:40]}")
    text = {name: _text(where, name, item.get(name, ""), MAX_MESSAGE_CHARS if name == "message" else MAX_TEXT_CHARS)
            for name in ("host", "engine", "source", "kind", "severity", "message")}
    if not text["host"] or not text["source"]:
        raise EventsRejected(400, f"{where}: host and source must not be empty")
    if _folded(text["source"]) in RESERVED_SOURCES:
        raise EventsRejected(400, f"{where}: source {text['source'][:64]!r} is the collector's own")
    if not _KIND.match(text["kind"]):
        raise EventsRejected(400, f"{where}: kind {text['kind'][:40]!r} must be lower_snake_case")
    if text["severity"] not in SEVERITIES:
        raise EventsRejected(400, f"{where}: severity {text['severity'][:40]!r} must be one of "
                                  f"{', '.join(SEVERITIES)}")
    attributes = item.get("attributes", {})
    if not isinstance(attributes, dict) or len(attributes) > MAX_ATTRIBUTES:
        raise EventsRejected(400, f"{where}: attributes must be an object of at most {MAX_ATTRIBUTES} strings")
    for key, value in attributes.items():
        _text(where, f"attribute {key[:40]!r}", value, MAX_TEXT_CHARS)
        if not key or len(key) > MAX_TEXT_CHARS:
            raise EventsRejected(400, f"{where}: an attribute name is empty or too long")
    return Event(ts, text["host"], text["engine"], text["source"], text["kind"], text["severity"], text["message"],
                 dict(attributes))


def _folded(name: str) -> str:
    """A name as it reads: compatibility forms (fullwidth, ligatures) folded, invisible format characters dropped,
    no surrounding space, no case; so that "Watchdog", " watchdog" and a fullwidth "watchdog" read as the reserved
    one."""
    normal = unicodedata.normalize("NFKC", name)
    return "".join(c for c in normal if unicodedata.category(c) != "Cf").strip().casefold()


def _text(where: str, name: str, value: Any, limit: int) -> str:
    if not isinstance(value, str):
        raise EventsRejected(400, f"{where}: {name} must be a string")
    if len(value) > limit:
        raise EventsRejected(400, f"{where}: {name} is over {limit} characters")
    return value


class EventsIngest(Address):
    """Serves POST /v1/events on a background thread and hands accepted events to `write`."""

    def __init__(self, write: Write, host: str = "127.0.0.1", port: int = 0, *, extra_token: str | None = None,
                 max_body_bytes: int = MAX_BODY_BYTES, max_events: int = MAX_EVENTS,
                 clock: Callable[[], float] = time.time) -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"events endpoint: port {port} is outside 0-65535")
        self._write = write
        self.host = host
        self._port = port
        self.token = secrets.token_urlsafe(32)
        self._tokens = [self.token.encode()] + ([extra_token.encode()] if extra_token else [])
        self.max_body_bytes = max_body_bytes
        self.max_events = max_events
        self._clock = clock
        self._log = RateLimitedLog(log)
        self._server: _Server | None = None
        self._serving: ServerThread | None = None

    @property
    def url(self) -> str:
        """The endpoint's full URL, e.g. http://127.0.0.1:40123/v1/events."""
        return f"{self.base_url}{EVENTS_PATH}"

    def start(self) -> None:
        """Bind and serve; OSError naming the address when it is taken."""
        try:
            server = _Server((self.host, self._port), _Handler)
        except OSError as exc:
            raise OSError(exc.errno, f"events endpoint cannot listen on {self.host}:{self._port}: {exc.strerror}"
                          ) from exc
        server.ingest = self
        self._server = server
        self._serving = ServerThread(server, "stepline-events")
        log.info("events endpoint on %s (token in the runtime file%s)", self.url,
                 ", or the OTLP token" if len(self._tokens) > 1 else "")

    def stop(self) -> None:
        """Stop serving and release the port."""
        serving, self._serving, self._server = self._serving, None, None
        if serving is not None:
            serving.stop()

    def refuse_early(self, method: str, target: str, authorization: str) -> EventsRejected | None:
        """The refusal of a request before its body is read (path, method, token), or None."""
        try:
            path = urllib.parse.urlsplit(target).path
        except ValueError:  # e.g. "http://[x/": an unclosed IPv6 bracket in an absolute-form target
            return EventsRejected(400, f"cannot parse the request target {target[:100]!r}")
        if path != EVENTS_PATH:
            return EventsRejected(404, f"no handler for {path[:100]!r}: events go to POST {EVENTS_PATH}")
        if method != "POST":
            return EventsRejected(405, f"{method} is not allowed: use POST")
        if not bearer_authorized(authorization, self._tokens):
            return EventsRejected(401, "a valid 'Authorization: Bearer <token>' header is required (the token is "
                                       "in the collector's runtime file, or $STEPLINE_OTLP_TOKEN)")
        return None

    def accept(self, content_type: str, body: bytes) -> int:
        """Write the body's events; returns how many; EventsRejected when none may be written."""
        if content_type.split(";")[0].strip().lower() != "application/json":
            raise EventsRejected(415, f"Content-Type {content_type[:60]!r} is not supported: send application/json")
        events = parse_events(body, now_s=self._clock(), max_events=self.max_events)
        written = self._write(events)
        if written < len(events):  # the writer counted the drop; the client hears it too
            raise EventsRejected(503, f"the collector's events queue took {written} of {len(events)} events "
                                      "(the rest are dropped and counted): retry later")
        return written

    def refused(self, rejected: EventsRejected) -> None:
        """Log a refusal, one line per kind and rate limited; the Authorization header is never logged."""
        self._log.warning(f"refused:{rejected.status}", "events endpoint: refused a request (HTTP %d): %s",
                          rejected.status, rejected)


class _Server(HttpServer):
    ingest: EventsIngest


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "stepline-events"
    timeout = 30.0
    server: _Server

    def do_POST(self) -> None:
        ingest = self.server.ingest
        rejected = ingest.refuse_early(self.command, self.path, self.headers.get("Authorization", ""))
        if rejected is not None:
            self._refuse(rejected, drain=True)
            return
        try:
            body = read_body(self.rfile, self.headers, ingest.max_body_bytes, drain_cap=_DRAIN_CAP_BYTES)
        except BodyTooLarge as exc:
            self._refuse(EventsRejected(413, f"body of {exc.size} bytes is over the {ingest.max_body_bytes}-byte "
                                             "limit"), drain=True)
            return
        except ValueError as exc:
            self._refuse(EventsRejected(400, str(exc)), drain=True)
            return
        except OSError:
            self.close_connection = True  # the client went away mid-body: nobody to answer
            return
        try:
            written = ingest.accept(self.headers.get("Content-Type", ""), body)
        except EventsRejected as exc:
            self._refuse(exc)
            return
        self._send(200, {"accepted": written})

    do_GET = do_PUT = do_DELETE = do_PATCH = do_POST

    def log_message(self, format: str, *args: Any) -> None:
        """Silenced: refusals are logged by the ingest, rate limited."""

    def _refuse(self, rejected: EventsRejected, *, drain: bool = False) -> None:
        self.server.ingest.refused(rejected)
        self._send(rejected.status, {"error": str(rejected)}, close=drain)
        if drain:
            linger(self.connection)
            self.close_connection = True

    def _send(self, status: int, payload: dict[str, Any], *, close: bool = False) -> None:
        body = json.dumps(payload, separators=(",", ":")).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            if status == 401:
                self.send_header("WWW-Authenticate", BEARER_CHALLENGE)
            if close:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            self.wfile.write(body)
            self.wfile.flush()
        except OSError:
            self.close_connection = True



class EventsRefused(RuntimeError):
    """The collector did not take the events; the message is one line."""


def post_events(url: str, token: str, events: Sequence[Event], timeout_s: float = 10.0) -> int:
    """Send events to a collector's events endpoint; returns how many it took. Raises EventsRefused."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise EventsRefused(f"collector URL {url!r} must be http(s)://host:port")
    path = parts.path.rstrip("/") or ""
    if not path.endswith(EVENTS_PATH):
        path += EVENTS_PATH
    body = json.dumps({"events": [e._asdict() for e in events]}, separators=(",", ":")).encode()
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = cls(parts.hostname, parts.port, timeout=timeout_s)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json",
                                                      "Authorization": f"Bearer {token}"})
        response = conn.getresponse()
        raw = response.read(65536)
    except (OSError, http.client.HTTPException) as exc:
        raise EventsRefused(f"cannot reach the collector at {url}: {' '.join(str(exc).split()) or type(exc).__name__}"
                            ) from None
    finally:
        conn.close()
    try:
        answer = json.loads(raw)
    except ValueError:
        answer = None
    if response.status != 200 or not isinstance(answer, dict) or type(answer.get("accepted")) is not int:
        detail = answer.get("error") if isinstance(answer, dict) and answer.get("error") else raw[:200].decode(
            errors="replace")
        raise EventsRefused(f"the collector at {url} refused the events: HTTP {response.status}: "
                            f"{' '.join(str(detail).split())[:300]}")
    return int(answer["accepted"])
