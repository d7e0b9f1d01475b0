"""Source: an OTLP/HTTP trace receiver; vLLM's `llm_request` spans become `requests` rows, named with their engine's
model as the collector knows it (SourceContext.engine_models: vLLM's spans name none).

OTLP/gRPC is not served (grpcio is a heavy dependency): run vLLM with OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from dataclasses import dataclass, field
from email.message import Message
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import urlsplit

from google.protobuf import json_format  # type: ignore[import-untyped]
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from stepline.core.listener import BEARER_CHALLENGE, Address, HttpServer, ServerThread, bearer_authorized, linger
from stepline.core.ratelimit import RateLimitedLog
from stepline.model.rows import GatewayDecision, Request
from stepline.sources.base import Emit, SourceContext
from stepline.sources.otlp_decode import (
    ENCODINGS,
    JSON,
    PROTOBUF,
    BodyTooLarge,
    Decoded,
    OtlpDecodeError,
    decode,
    inflate,
)

logger = logging.getLogger(__name__)

TRACES_PATH = "/v1/traces"
STATS_KEYS = ("spans_accepted", "spans_ignored", "spans_rejected", "spans_truncated", "requests_accepted",
              "requests_bad", "requests_too_large", "requests_unauthorized", "requests_busy", "requests_unsupported")
_DRAIN_CAP_BYTES = 1 << 20
_DIGITS = re.compile(r"[0-9]+")  # ASCII only: str.isdigit() also takes "²", which int() refuses
# google.rpc.Code for each status we answer; OTLP/HTTP error bodies are a google.rpc.Status.
_RPC_CODE = {400: 3, 401: 16, 404: 12, 405: 12, 411: 3, 413: 8, 415: 3, 503: 14}
_COUNTER = {400: "requests_bad", 401: "requests_unauthorized", 404: "requests_unsupported",
            405: "requests_unsupported", 411: "requests_unsupported", 413: "requests_too_large",
            415: "requests_unsupported", 503: "requests_busy"}


def rpc_status(code: int, message: str) -> bytes:
    """A serialized google.rpc.Status {code, message}.

    Encoded by hand: google.rpc ships in googleapis-common-protos, which opentelemetry-proto does not depend on,
    and the message is two scalar fields.
    """
    text = message.encode("utf-8")
    return b"\x08" + _varint(code) + b"\x12" + _varint(len(text)) + text


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


@dataclass
class _Reply:
    status: int
    body: bytes
    content_type: str
    headers: dict[str, str] = field(default_factory=dict)
    read_body: bool = True  # False: the body was left unread, so the connection must close


class OtlpReceiver(Address):
    """Receives OTLP/HTTP trace exports on a background thread; poll() hands the rows over."""

    def __init__(
        self,
        ctx: SourceContext,
        host: str = "127.0.0.1",
        port: int = 4318,
        *,
        max_body_bytes: int = 8 << 20,
        max_pending_rows: int = 100_000,
        token: str | None = None,
    ) -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"otlp receiver: port {port} is outside 0-65535")
        for what, value in (("max_body_bytes", max_body_bytes), ("max_pending_rows", max_pending_rows)):
            if value < 1:
                raise ValueError(f"otlp receiver: {what} must be at least 1, got {value}")
        if token is not None and not token:
            raise ValueError("otlp receiver: token must not be empty (use None for no authentication)")
        self._ctx = ctx
        self.host = host
        self._port = port
        self.max_body_bytes = max_body_bytes
        self.max_pending_rows = max_pending_rows
        self._tokens = [token.encode()] if token is not None else []  # none: no authentication
        self._pending: list[Request | GatewayDecision] = []
        self._counts = dict.fromkeys(STATS_KEYS, 0)
        self._lock = threading.Lock()
        self._log = RateLimitedLog(logger)
        self._server: _Server | None = None
        self._serving: ServerThread | None = None

    @property
    def name(self) -> str:
        return "otlp"

    @property
    def url(self) -> str:
        return self.base_url

    def start(self) -> None:
        """Bind and serve on a background thread."""
        if self._server is not None:
            raise RuntimeError("otlp receiver already started")
        try:
            server = _Server((self.host, self._port), _Handler)
        except OSError as exc:
            raise OSError(exc.errno, f"otlp receiver cannot listen on {self.host}:{self._port}: {exc.strerror}"
                          ) from exc
        server.receiver = self
        self._server = server
        self._serving = ServerThread(server, "stepline-otlp")
        logger.info("otlp receiver listening on %s%s (token %s)", self.url, TRACES_PATH,
                    "on" if self._tokens else "off")

    def stop(self) -> None:
        """Stop serving and release the port; rows received stay for the next poll."""
        serving, self._serving, self._server = self._serving, None, None
        if serving is not None:
            serving.stop()

    def poll(self, emit: Emit) -> None:
        """Emit the rows received since the last poll."""
        with self._lock:
            rows, self._pending = self._pending, []
        if rows:
            emit(rows)

    def stats(self) -> dict[str, int]:
        """Spans accepted (llm_request and gateway decisions), ignored (any other) and rejected; requests by outcome."""
        with self._lock:
            return dict(self._counts)

    def refuse_early(self, method: str, target: str, headers: Message) -> _Reply | None:
        """The reply to a request that fails before its body is read (path, method, auth, framing, size), or None."""
        media_type = _media_type(headers)
        try:
            path = urlsplit(target).path
        except ValueError:  # e.g. "//[x": an unclosed IPv6 bracket where urlsplit expects a host
            return self._refuse(400, f"cannot parse the request target {target[:100]!r}", media_type, read=False)
        if path != TRACES_PATH:
            return self._refuse(404, f"no handler for {path[:100]!r}: OTLP traces go to POST {TRACES_PATH}",
                                media_type, read=False)
        if method != "POST":
            return self._refuse(405, f"{method} is not allowed: use POST", media_type, read=False,
                                headers={"Allow": "POST"})
        if self._tokens and not bearer_authorized(headers.get("Authorization", ""), self._tokens):
            return self._refuse(401, "a valid 'Authorization: Bearer <token>' header is required", media_type,
                                read=False, headers={"WWW-Authenticate": BEARER_CHALLENGE})
        if headers.get("Transfer-Encoding"):
            return self._refuse(411, "chunked bodies are not accepted: send Content-Length", media_type,
                                read=False)
        lengths = {value.strip() for value in headers.get_all("Content-Length", [])}
        if not lengths:
            return self._refuse(411, "Content-Length is required", media_type, read=False)
        length = lengths.pop()
        if lengths or not _DIGITS.fullmatch(length):
            shown = ", ".join(sorted({length, *lengths}))[:60]
            return self._refuse(400, f"Content-Length {shown!r} is not one byte count", media_type, read=False)
        if len(length.lstrip("0")) > 18 or int(length) > self.max_body_bytes:
            return self._refuse(413, f"body of {length[:40]} bytes is over the {self.max_body_bytes}-byte limit",
                                media_type, read=False)
        if media_type not in (PROTOBUF, JSON):
            shown = headers.get("Content-Type", "")[:60] or "no Content-Type"
            return self._refuse(415, f"{shown!r} is not supported: send {PROTOBUF} or {JSON}", PROTOBUF, read=False)
        encoding = headers.get("Content-Encoding", "").strip().lower()
        if encoding not in ENCODINGS:
            return self._refuse(415, f"Content-Encoding {encoding[:40]!r} is not supported: use gzip, deflate or "
                                     "none", media_type, read=False)
        return None

    def answer(self, headers: Message, body: bytes) -> _Reply:
        """The reply to an export whose body (at most max_body_bytes) was read; never raises."""
        media_type = _media_type(headers)
        with self._lock:
            full = len(self._pending) >= self.max_pending_rows
        if full:
            return self._busy(media_type)
        try:
            payload = inflate(body, headers.get("Content-Encoding", ""), self.max_body_bytes)
            decoded = decode(payload, media_type, self._ctx.host, self._ctx.engine_models.model_of)
        except BodyTooLarge as exc:
            return self._refuse(413, str(exc), media_type)
        except OtlpDecodeError as exc:
            return self._refuse(400, str(exc), media_type)
        except Exception as exc:  # a bug here must not kill the handler thread silently
            logger.exception("otlp receiver: internal error decoding an export")
            return _Reply(500, rpc_status(13, f"internal error: {type(exc).__name__}"), PROTOBUF)
        if not self._admit(decoded):
            return self._busy(media_type)
        if decoded.rejected:
            self._log.warning("rejected_spans", "otlp receiver: %s", decoded.error_message)
        if decoded.truncated:
            self._log.warning("truncated_spans", "otlp receiver: kept %d decision span(s) with their swallowed "
                              "exception's text cut short", decoded.truncated)
        response = ExportTraceServiceResponse()
        if decoded.rejected:
            response.partial_success.rejected_spans = decoded.rejected
            response.partial_success.error_message = decoded.error_message
        return _Reply(200, _encode(response, media_type), media_type)

    def _admit(self, decoded: Decoded) -> bool:
        # All or nothing, so a retried batch is not half duplicated; an empty buffer takes any batch, so a batch
        # larger than the buffer is not refused for ever.
        with self._lock:
            pending, rows = len(self._pending), len(decoded.rows) + len(decoded.decisions)
            if rows and pending and pending + rows > self.max_pending_rows:
                return False
            self._pending.extend(decoded.rows)
            # A decision's backend, as the gateway called it (a URL's host:port), named as the collector names the
            # engine at that address (sources/addresses.py): the decision joins that engine's requests, or those
            # of the engines behind it where the address stands for several.
            addresses = self._ctx.engine_addresses
            self._pending.extend(d._replace(engine=addresses.name_of(d.engine),
                                            candidates=[addresses.name_of(c) for c in d.candidates],
                                            backend_engines=tuple(addresses.behind(d.engine)))
                                 for d in decoded.decisions)
            self._counts["spans_accepted"] += rows
            self._counts["spans_ignored"] += decoded.ignored
            self._counts["spans_rejected"] += decoded.rejected
            self._counts["spans_truncated"] += decoded.truncated
            self._counts["requests_accepted"] += 1
        return True

    def protocol_error(self, status: int, message: str) -> None:
        """Count (and log, rate limited) a request the HTTP server refused before the receiver saw it."""
        counter = _COUNTER.get(status, "requests_too_large" if status in (414, 431) else "requests_unsupported")
        with self._lock:
            self._counts[counter] += 1
        self._log.warning(f"refused:{status}", "otlp receiver: refused a request (HTTP %d): %s", status, message)

    def _busy(self, media_type: str) -> _Reply:
        message = f"{self.max_pending_rows} rows are waiting for the collector: retry later"
        return self._refuse(503, message, media_type)

    def _refuse(self, status: int, message: str, media_type: str, *, read: bool = True,
                headers: dict[str, str] | None = None) -> _Reply:
        with self._lock:
            self._counts[_COUNTER[status]] += 1
        # One line per kind of problem; the Authorization header is never part of the message.
        self._log.warning(f"refused:{status}", "otlp receiver: refused an export (HTTP %d): %s", status, message)
        code = _RPC_CODE[status]
        if media_type == JSON:
            body = json.dumps({"code": code, "message": message}, separators=(",", ":")).encode()
        else:
            body = rpc_status(code, message)
        return _Reply(status, body, JSON if media_type == JSON else PROTOBUF, headers or {}, read)


def _encode(response: ExportTraceServiceResponse, media_type: str) -> bytes:
    if media_type == JSON:
        return str(json_format.MessageToJson(response, indent=None)).encode()
    return bytes(response.SerializeToString())


def _media_type(headers: Message) -> str:
    return headers.get("Content-Type", "").split(";")[0].strip().lower()


class _Server(HttpServer):
    receiver: OtlpReceiver


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: the exporters pool connections
    server_version = "stepline-otlp"
    timeout = 30.0  # a stalled or idle client gives its thread back
    server: _Server

    def do_POST(self) -> None:
        self._serve()

    do_GET = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = do_POST

    def log_message(self, format: str, *args: Any) -> None:
        """Silenced: the receiver logs refusals itself, rate limited."""

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The server's own refusals (a malformed request line or header, an unknown method) are counted too."""
        self.server.receiver.protocol_error(code, message or "")
        super().send_error(code, message, explain)

    def _serve(self) -> None:
        receiver = self.server.receiver
        reply = receiver.refuse_early(self.command, self.path, self.headers)
        if reply is None:
            length = int(self.headers.get("Content-Length", "0"))
            try:
                body = self.rfile.read(length)
            except OSError:
                body = b""
            if len(body) < length:  # the client went away or stalled past the timeout: nobody to answer
                receiver.protocol_error(400, f"the body ended after {len(body)} of {length} bytes")
                self.close_connection = True
                return
            reply = receiver.answer(self.headers, body)
        self._send(reply)

    def _send(self, reply: _Reply) -> None:
        try:
            self.send_response(reply.status)
            self.send_header("Content-Type", reply.content_type)
            for key, value in reply.headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(reply.body)))
            if not reply.read_body:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(reply.body)
            self.wfile.flush()
            if not reply.read_body:
                linger(self.connection)
                self.close_connection = True
        except OSError:
            self.close_connection = True

