"""Read-only SQL over ClickHouse's own HTTP protocol, answered from the embedded store (CLI, Grafana)."""

from __future__ import annotations

import base64
import hmac
import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import SplitResult, parse_qsl, urlsplit

from clickhouse_connect.driver.client import Client
from clickhouse_connect.driver.exceptions import DatabaseError
from clickhouse_connect.driver.exceptions import Error as DriverError

from stepline import chhttp
from stepline.chhttp import SqlRefused
from stepline.querysessions import Sessions
from stepline.selfmetrics import SelfMetrics
from stepline.serving import ServerThread

logger = logging.getLogger(__name__)

_QUERY_ID = re.compile(r"[\x21-\x7e]{1,128}\Z")  # echoed in a header, so no spaces or control characters
_TIMEZONE = re.compile(r"[A-Za-z0-9_+\-/]{1,64}\Z")  # echoed in a header too: an IANA name or nothing
_REVISION = re.compile(r"[0-9]{1,9}\Z")  # ASCII only: str.isdigit() also takes "²", which int() refuses
_DRAIN_CAP_BYTES = 64 << 20
_TEXT = "text/plain; charset=UTF-8"


@dataclass
class _Reply:
    status: int
    body: bytes
    outcome: str  # served | refused | failed | ping
    headers: dict[str, str] = field(default_factory=dict)


class QueryEndpoint:
    """ClickHouse's HTTP interface, read-only, over the embedded (chDB) store a clickhouse-connect client opened.

    The endpoint owns `client` and closes it on stop(); it only reads its path, and runs queries in read-only
    sessions of its own there. chDB hosts one engine path per process: stop the endpoint before opening another.
    """

    def __init__(
        self,
        client: Client,
        host: str = "127.0.0.1",
        port: int = 8123,
        password: str | None = None,
        database: str = "stepline",
        max_body_bytes: int = 1 << 20,
        *,
        max_execution_time_s: int = 60,
        max_result_bytes: int = 1 << 30,
        max_sessions: int = 4,
        metrics: SelfMetrics | None = None,
    ) -> None:
        uri = str(getattr(client, "uri", ""))
        if not uri.startswith("chdb://"):
            raise ValueError(f"query endpoint: serves embedded chdb:// stores only, not {uri!r}")
        if not 0 <= port <= 65535:
            raise ValueError(f"query endpoint: port {port} is outside 0-65535")
        limits = {"max_body_bytes": max_body_bytes, "max_execution_time_s": max_execution_time_s,
                  "max_result_bytes": max_result_bytes, "max_sessions": max_sessions}
        for name, value in limits.items():
            if value < 1:
                raise ValueError(f"query endpoint: {name} must be at least 1, got {value}")
        self._client = client
        self._sessions = Sessions(uri[len("chdb://") :], max_sessions)
        self.host, self._port, self.database, self.max_body_bytes = host, port, database, max_body_bytes
        self._password = password.encode() if password is not None else None
        self._base_settings = {"session_timezone": "UTC", "result_overflow_mode": "throw"}
        self._caps = {"max_execution_time": max_execution_time_s, "max_result_bytes": max_result_bytes}
        self._counts = {"served": 0, "refused": 0, "failed": 0}
        self._metrics = metrics
        self._lock = threading.Lock()
        self._server: _Server | None = None
        self._serving: ServerThread | None = None

    @property
    def port(self) -> int:
        """The bound port once started (useful with port 0), else the configured one."""
        return self._server.server_address[1] if self._server is not None else self._port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        """Bind and serve on a background thread."""
        if self._server is not None:
            raise RuntimeError("query endpoint already started")
        self._server = _Server((self.host, self._port), _Handler)
        self._server.endpoint = self
        self._serving = ServerThread(self._server, "stepline-query")
        logger.info("query endpoint listening on %s (password %s)", self.url, "on" if self._password else "off")

    def stop(self) -> None:
        """Stop serving, then close the read-only sessions and the client."""
        serving, self._serving, self._server = self._serving, None, None
        if serving is not None:
            serving.stop()
        self._sessions.close()
        self._client.close()

    def stats(self) -> dict[str, int]:
        """Requests served, refused (read-only guard, password, size) and failed (engine or request errors)."""
        with self._lock:
            return dict(self._counts)

    def count(self, outcome: str) -> None:
        """Count one request's outcome; pings are not counted."""
        if outcome in self._counts:
            with self._lock:
                self._counts[outcome] += 1
            if self._metrics is not None:
                self._metrics.queries.labels(outcome=outcome).inc()

    def answer(self, method: str, target: str, headers: Message, body: bytes, peer: str) -> _Reply:
        """Turn one HTTP request into a reply; never raises."""
        try:
            url: SplitResult | None = urlsplit(target)
        except ValueError:  # e.g. "//[x": an unclosed IPv6 bracket where urlsplit expects a host
            url = None
        params = dict(parse_qsl(url.query, keep_blank_values=True)) if url is not None else {}
        if url is not None and (url.path in ("/ping", "/replicas_status")
                                or (url.path == "/" and method != "POST" and not params)):
            return _Reply(200, b"Ok.\n", "ping", {"Content-Type": _TEXT})
        try:
            if url is None:
                raise SqlRefused(f"cannot parse the request target {target[:100]!r}", 36, "BAD_ARGUMENTS", status=400)
            if url.path != "/":
                raise SqlRefused(f"There is no handle {url.path}: use / or /ping", 0, "NO_HANDLE", status=404)
            self._authenticate(headers, params)
            reply = self._query(params, headers, body)
        except SqlRefused as ex:
            reply = self._error(ex.code, ex.name, str(ex), ex.status)
        except DatabaseError as ex:
            reply = self._error(ex.code or 1000, ex.name or "UNKNOWN_EXCEPTION", str(ex))
        except DriverError as ex:  # e.g. a bind parameter clickhouse-connect rejects
            reply = self._error(36, "BAD_ARGUMENTS", str(ex), 400)
        except Exception as ex:
            logger.exception("query endpoint: internal error answering %s", peer)
            reply = self._error(1001, "STD_EXCEPTION", f"internal error: {type(ex).__name__}: {ex}")
        if reply.outcome != "served":
            line = reply.body.decode(errors="replace").strip().split("\n")[0][:300]
            logger.warning("query endpoint: %s (HTTP %d) for %s: %s", reply.outcome, reply.status, peer, line)
        query_id, timezone = params.get("query_id", ""), params.get("session_timezone", "")
        reply.headers.update({
            "X-ClickHouse-Query-Id": query_id if _QUERY_ID.match(query_id) else str(uuid.uuid4()),
            "X-ClickHouse-Server-Display-Name": "stepline",
            "X-ClickHouse-Timezone": timezone if _TIMEZONE.match(timezone) else "UTC",
        })
        return reply

    def unreadable(self, message: str) -> _Reply:
        """The reply to a request whose framing is broken (Content-Length, chunks): the connection closes after."""
        logger.warning("query endpoint: unreadable request: %s", message)
        reply = self._error(36, "BAD_ARGUMENTS", f"cannot read the request: {message}", 400)
        reply.headers["Connection"] = "close"
        return reply

    def too_large(self, size: int) -> _Reply:
        """The reply to a body over max_body_bytes."""
        ex = chhttp.too_large(size, self.max_body_bytes)
        logger.warning("query endpoint: refused: %s", ex)
        return self._error(ex.code, ex.name, str(ex))

    def _error(self, code: int, name: str, message: str, status: int | None = None) -> _Reply:
        refused = code in (chhttp.READONLY, chhttp.AUTHENTICATION_FAILED, chhttp.QUERY_IS_TOO_LARGE)
        headers = {"Content-Type": _TEXT, "X-ClickHouse-Exception-Code": str(code)}
        status = status or chhttp.http_status(code)
        if status == 401:
            headers["WWW-Authenticate"] = 'Basic realm="stepline", charset="UTF-8"'
        body = chhttp.exception_text(code, name, message).encode()
        return _Reply(status, body, "refused" if refused else "failed", headers)

    def _authenticate(self, headers: Message, params: Mapping[str, str]) -> None:
        if self._password is None:
            return
        supplied = headers.get("X-ClickHouse-Key")
        basic = headers.get("Authorization", "")
        if supplied is None and basic[:6].lower() == "basic ":
            try:
                supplied = base64.b64decode(basic[6:].strip(), validate=True).decode().partition(":")[2]
            except ValueError:  # binascii.Error, UnicodeDecodeError, or non-ASCII text in the header
                supplied = ""
        supplied = params.get("password") if supplied is None else str(supplied)
        if supplied is None or not hmac.compare_digest(supplied.encode(), self._password):
            what = "required" if supplied is None else "failed: password is incorrect"
            raise SqlRefused(f"default: Authentication {what}", chhttp.AUTHENTICATION_FAILED,
                             "AUTHENTICATION_FAILED", status=401 if supplied is None else 403)

    def _query(self, params: dict[str, str], headers: Message, body: bytes) -> _Reply:
        body = chhttp.decompress(headers.get("Content-Encoding", "").strip().lower(), body, self.max_body_bytes)
        content_type = headers.get("Content-Type", "")
        if content_type.lower().startswith("multipart/form-data"):
            params.update(chhttp.form_fields(content_type, body))
            body = b""
        try:
            text, valid = body.decode(), True
        except UnicodeDecodeError:
            text, valid = body.decode(errors="replace"), False  # still guarded first: an INSERT's binary rows
        statement = chhttp.read_only_statement(f"{params['query']}\n{text}" if params.get("query") else text)
        if not valid:
            raise SqlRefused("the query is not valid UTF-8", 36, "BAD_ARGUMENTS")
        fmt = statement.format or params.get("default_format") or headers.get("X-ClickHouse-Format") or "TabSeparated"
        if not chhttp.NAME.match(fmt):
            raise SqlRefused(f"Unknown format {fmt!r}", 73, "UNKNOWN_FORMAT")
        settings = chhttp.query_settings(params, self._base_settings, self._caps)
        sql = statement.sql if statement.format else f"{statement.sql}\nFORMAT {fmt}"
        binds = {k[len("param_") :]: v for k, v in params.items() if k.startswith("param_")}
        database = params.get("database") or headers.get("X-ClickHouse-Database") or self.database
        started = time.monotonic_ns()
        data = self._sessions.run(tuple(sorted(settings.items())), database, sql, binds)
        revision = params.get("client_protocol_version", "0")
        if fmt.lower() == "native" and _REVISION.match(revision):
            data = chhttp.native_for_revision(data, int(revision))
        summary = dict.fromkeys(("read_rows", "read_bytes", "written_rows", "written_bytes", "total_rows_to_read",
                                 "result_rows"), "0")  # chDB does not report these through clickhouse-connect
        summary.update(result_bytes=str(len(data)), elapsed_ns=str(time.monotonic_ns() - started))
        return _Reply(200, data, "served", {
            "Content-Type": chhttp.content_type(fmt), "X-ClickHouse-Format": fmt,
            "X-ClickHouse-Summary": json.dumps(summary, separators=(",", ":")),
        })


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    endpoint: QueryEndpoint


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: clickhouse-connect and clickhouse-go pool connections
    server_version = "stepline-query"
    timeout = 60.0  # an idle keep-alive connection gives its thread back
    server: _Server

    def do_GET(self) -> None:
        self._serve()

    def do_POST(self) -> None:
        self._serve()

    def do_HEAD(self) -> None:
        self._serve(head=True)

    def log_message(self, format: str, *args: Any) -> None:
        """Silenced: a request line can carry `password=`; the endpoint logs outcomes itself."""

    def _serve(self, head: bool = False) -> None:
        endpoint = self.server.endpoint
        try:
            body = self._read_body(endpoint.max_body_bytes)
        except chhttp.BodyTooLarge as ex:
            endpoint.count("refused")
            self._send(endpoint.too_large(ex.size), head)
            self._discard(min(ex.declared, _DRAIN_CAP_BYTES))
            return
        except ValueError as ex:  # broken framing: say so, then close (the rest of the stream cannot be trusted)
            endpoint.count("failed")
            self._send(endpoint.unreadable(f"{ex} (from {self.client_address[0]})"), head)
            self.close_connection = True
            return
        except OSError as ex:  # a dropped or stalled connection: nobody to answer
            logger.warning("query endpoint: unreadable request from %s: %s", self.client_address[0], ex)
            endpoint.count("failed")
            self.close_connection = True
            return
        reply = endpoint.answer(self.command, self.path, self.headers, body, self.client_address[0])
        endpoint.count(reply.outcome)
        self._send(reply, head)

    def _read_body(self, limit: int) -> bytes:
        """The request body; ValueError for broken framing, OSError when the client goes away mid-body."""
        return chhttp.read_body(self.rfile, self.headers, limit, drain_cap=_DRAIN_CAP_BYTES)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The server's own refusals (a malformed request line or header, an unknown method) are counted too."""
        self.server.endpoint.count("failed")
        logger.warning("query endpoint: HTTP %d for %s: %s", code, self.client_address[0], message or "")
        super().send_error(code, message, explain)

    def _discard(self, size: int) -> None:
        # Read what the client is still sending, so closing does not reset the connection before it reads the reply.
        try:
            self.connection.settimeout(2.0)
            while size > 0 and (chunk := self.rfile.read(min(size, 1 << 16))):
                size -= len(chunk)
        except OSError:
            pass

    def _send(self, reply: _Reply, head: bool) -> None:
        try:
            self.send_response(reply.status)
            for key, value in reply.headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(reply.body)))
            if reply.status == 413:  # the rest of the body is left unread
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            if not head:
                self.wfile.write(reply.body)
            self.wfile.flush()
        except OSError:
            self.close_connection = True
