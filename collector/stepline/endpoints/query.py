"""Read-only SQL over ClickHouse's own HTTP protocol, answered from the embedded store (CLI, Grafana)."""

from __future__ import annotations

import base64
import contextlib
import functools
import hmac
import ipaddress
import json
import logging
import re
import secrets
import string
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from email.message import Message
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import SplitResult, parse_qsl, urlsplit

from clickhouse_connect.driver.client import Client
from prometheus_client import CollectorRegistry, Counter

from stepline.clickhouse_http import body as chbody
from stepline.clickhouse_http import compression as chcompress
from stepline.clickhouse_http import errors as cherrors
from stepline.clickhouse_http import formats as chformats
from stepline.clickhouse_http import guard as chguard
from stepline.clickhouse_http import native as chnative
from stepline.clickhouse_http import settings as chsettings
from stepline.clickhouse_http.errors import SqlRefused
from stepline.core.listener import Address, HttpServer, ServerThread
from stepline.core.ratelimit import RateLimitedLog
from stepline.endpoints.chunked import ChunkedBody
from stepline.endpoints.sessions import EngineError, Progress, Sessions
from stepline.endpoints.watch import Watch, Watchers
from stepline.store.query_profile import CEILINGS, PROFILE, refusal

logger = logging.getLogger(__name__)

_QUERY_ID = re.compile(r"[\x21-\x7e]{1,128}\Z")  # echoed in a header, so no spaces or control characters
_TIMEZONE = re.compile(r"[A-Za-z0-9_+\-/]{1,64}\Z")  # echoed in a header too: an IANA name or nothing
_REVISION = re.compile(r"[0-9]{1,9}\Z")  # ASCII only: str.isdigit() also takes "²", which int() refuses
_DRAIN_CAP_BYTES = 64 << 20
_SPOOL_IN_MEMORY_BYTES = 16 << 20  # wait_end_of_query: beyond this, the result waits in a temporary file
_TEXT = "text/plain; charset=UTF-8"
_TAG_ALPHABET = string.ascii_letters + string.digits
_ECHO_CHARS = 2000  # of an error's text sent back: the engine's messages can quote a whole query


class QueryMetrics:
    """The endpoint's own metric, on the registry the collector passes."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "stepline_query_requests", "Requests to the read-only query endpoint, by outcome.", ["outcome"],
            registry=registry,
        )


@dataclass
class _Reply:
    status: int
    body: bytes
    outcome: str  # served | refused | failed | ping
    headers: dict[str, str] = field(default_factory=dict)
    rest: Iterator[bytes] | None = None  # a streamed result: `body` is its first piece, `rest` the others
    frame: Callable[[bytes], bytes] | None = None  # compress=1: ClickHouse's compressed blocks
    encoding: str | None = None  # the Content-Encoding the response is written with
    exception_tag: str = ""  # marks an error written after the result began (X-ClickHouse-Exception-Tag)


class QueryEndpoint(Address):
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
        max_memory_bytes: int = 1 << 30,
        session_wait_s: float | None = None,
        metrics: QueryMetrics | None = None,
    ) -> None:
        uri = str(getattr(client, "uri", ""))
        if not uri.startswith("chdb://"):
            raise ValueError(f"query endpoint: serves embedded chdb:// stores only, not {uri!r}")
        if not 0 <= port <= 65535:
            raise ValueError(f"query endpoint: port {port} is outside 0-65535")
        limits = {"max_body_bytes": max_body_bytes, "max_execution_time_s": max_execution_time_s,
                  "max_result_bytes": max_result_bytes, "max_sessions": max_sessions,
                  "max_memory_bytes": max_memory_bytes}
        for name, value in limits.items():
            if value < 1:
                raise ValueError(f"query endpoint: {name} must be at least 1, got {value}")
        # The limits each session starts with; a query may lower them, and raise them no further than the
        # engine's profile allows (its ceilings), so each must be within those.
        self._caps = {"max_execution_time": max_execution_time_s, "max_result_bytes": max_result_bytes,
                      "max_memory_usage": max_memory_bytes}
        for name, value in self._caps.items():
            least, most = CEILINGS[name]
            if not least <= value <= most:
                raise ValueError(f"query endpoint: {name} {value} is outside the query profile's {least}-{most}")
        # chDB's defaults allow DDL and introspection (addressToSymbol, ...): the profile keeps them off here.
        preset = (("session_timezone", "UTC"), ("result_overflow_mode", "throw"), ("allow_ddl", "0"),
                  ("allow_introspection_functions", "0"),
                  *((name, str(value)) for name, value in self._caps.items()))
        self._client = client
        self._sessions = Sessions(uri[len("chdb://") :], max_sessions, preset, wait_s=session_wait_s)
        self.host, self._port, self.database, self.max_body_bytes = host, port, database, max_body_bytes
        self._loopback = host == "localhost" or _is_loopback(host)
        self._password = password.encode() if password is not None else None
        self._refusals = RateLimitedLog(logger, 10.0)
        self.watchers = Watchers()
        self._counts = {"served": 0, "refused": 0, "failed": 0}
        self._metrics = metrics
        self._lock = threading.Lock()
        self._server: _Server | None = None
        self._serving: ServerThread | None = None

    @property
    def url(self) -> str:
        return self.base_url

    def start(self) -> None:
        """Bind and serve on a background thread."""
        if self._server is not None:
            raise RuntimeError("query endpoint already started")
        self._sessions.verify()  # the engine's profile covers every setting, or nothing is served
        self.watchers.start()
        self._server = _Server((self.host, self._port), _Handler)
        self._server.endpoint = self
        self._serving = ServerThread(self._server, "stepline-query")
        logger.info("query endpoint listening on %s (password %s)", self.url, "on" if self._password else "off")

    def stop(self) -> None:
        """Stop serving, then close the read-only sessions and the client."""
        serving, self._serving, self._server = self._serving, None, None
        if serving is not None:
            serving.stop()
        self.watchers.stop()
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
                self._metrics.requests.labels(outcome=outcome).inc()

    def answer(self, method: str, target: str, headers: Message, body: bytes, peer: str,
               watch: Watch | None = None) -> _Reply:
        """Turn one HTTP request into a reply; never raises. `watch` learns how to kill the query it starts."""
        try:
            url: SplitResult | None = urlsplit(target)
        except ValueError:  # e.g. "//[x": an unclosed IPv6 bracket where urlsplit expects a host
            url = None
        params = dict(parse_qsl(url.query, keep_blank_values=True)) if url is not None else {}
        if (foreign := self._foreign(headers)) is not None:
            reply = self._error(cherrors.AUTHENTICATION_FAILED, "AUTHENTICATION_FAILED", foreign, 403)
        elif url is not None and (url.path in ("/ping", "/replicas_status")
                                  or (url.path == "/" and method != "POST" and not params)):
            return _Reply(200, b"Ok.\n", "ping", {"Content-Type": _TEXT})
        else:
            reply = self._answer(url, target, params, headers, body, peer, watch)
        if reply.outcome != "served":
            line = reply.body.decode(errors="replace").strip().split("\n")[0][:300]
            self._refusals.warning(f"{reply.outcome} {reply.status}", "query endpoint: %s (HTTP %d) for %s: %s",
                                   reply.outcome, reply.status, peer, line)
        query_id, timezone = params.get("query_id", ""), params.get("session_timezone", "")
        reply.headers.update({
            "X-ClickHouse-Query-Id": query_id if _QUERY_ID.match(query_id) else str(uuid.uuid4()),
            "X-ClickHouse-Server-Display-Name": "stepline",
            "X-ClickHouse-Timezone": timezone if _TIMEZONE.match(timezone) else "UTC",
        })
        return reply

    def _foreign(self, headers: Message) -> str | None:
        """Why a request comes from a browser page of another site, or through a name that is not this host's."""
        host = headers.get("Host", "")
        if self._loopback and not _loopback_name(host):
            # DNS rebinding: a page's own name, resolved to 127.0.0.1, reaches a loopback listener.
            return f"Host {host[:80]!r} is not a loopback name: this endpoint answers only localhost"
        origin = headers.get("Origin")  # "null" too: a sandboxed page or a file's
        if origin is not None and _netloc(origin) != host.lower():
            return f"a request from the web page {origin[:80]!r} (no cross-origin queries)"
        if headers.get("Sec-Fetch-Site", "").lower() in ("cross-site", "same-site"):
            return "a request from another site's web page (no cross-origin queries)"
        return None

    def _answer(self, url: SplitResult | None, target: str, params: dict[str, str], headers: Message, body: bytes,
                peer: str, watch: Watch | None) -> _Reply:
        try:
            if url is None:
                raise SqlRefused(f"cannot parse the request target {target[:100]!r}", 36, "BAD_ARGUMENTS", status=400)
            if url.path != "/":
                raise SqlRefused(f"There is no handle {url.path}: use / or /ping", 0, "NO_HANDLE", status=404)
            self._authenticate(headers, params)
            client = f"{peer} {headers.get('User-Agent', '')[:80]} {params.get('quota_key', '')[:40]}"
            return self._query(params, headers, body, client, watch)
        except SqlRefused as ex:
            return self._error(ex.code, ex.name, str(ex), ex.status)
        except EngineError as ex:
            return self._error(ex.code, ex.name, str(ex))
        except Exception as ex:
            logger.exception("query endpoint: internal error answering %s", peer)
            return self._error(1001, "STD_EXCEPTION", f"internal error: {type(ex).__name__}")

    def unreadable(self, message: str) -> _Reply:
        """The reply to a request whose framing is broken (Content-Length, chunks): the connection closes after."""
        logger.warning("query endpoint: unreadable request: %s", message)
        reply = self._error(36, "BAD_ARGUMENTS", f"cannot read the request: {message}", 400)
        reply.headers["Connection"] = "close"
        return reply

    def too_large(self, size: int) -> _Reply:
        """The reply to a body over max_body_bytes."""
        ex = chbody.too_large(size, self.max_body_bytes)
        logger.warning("query endpoint: refused: %s", ex)
        return self._error(ex.code, ex.name, str(ex))

    def _error(self, code: int, name: str, message: str, status: int | None = None) -> _Reply:
        refused = code in (cherrors.READONLY, cherrors.AUTHENTICATION_FAILED, cherrors.QUERY_IS_TOO_LARGE)
        headers = {"Content-Type": _TEXT, "X-ClickHouse-Exception-Code": str(code)}
        status = status or cherrors.http_status(code)
        if status == 401:
            headers["WWW-Authenticate"] = 'Basic realm="stepline", charset="UTF-8"'
        text = cherrors.exception_text(code, name, message)
        if len(text) > _ECHO_CHARS:
            text = text[: _ECHO_CHARS - 20] + f"... ({name})\n"
        body = text.encode()
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
            raise SqlRefused(f"default: Authentication {what}", cherrors.AUTHENTICATION_FAILED,
                             "AUTHENTICATION_FAILED", status=401 if supplied is None else 403)

    def _query(self, params: dict[str, str], headers: Message, body: bytes, client: str,
               watch: Watch | None) -> _Reply:
        body = chcompress.decode_content(headers.get("Content-Encoding", "").strip().lower(), body, self.max_body_bytes)
        if _flag(params, "decompress"):
            body = chcompress.decompress_blocks(body, self.max_body_bytes)
        content_type = headers.get("Content-Type", "")
        if content_type.lower().startswith("multipart/form-data"):
            params.update(chbody.form_fields(content_type, body))
            body = b""
        try:
            text, valid = body.decode(), True
        except UnicodeDecodeError:
            text, valid = body.decode(errors="replace"), False  # still guarded first: an INSERT's binary rows
        database = params.get("database") or headers.get("X-ClickHouse-Database") or self.database
        statement = chguard.read_only_statement(f"{params['query']}\n{text}" if params.get("query") else text,
                                                database)
        if not valid:
            raise SqlRefused("the query is not valid UTF-8", 36, "BAD_ARGUMENTS")
        # The engine drops a subquery's settings the profile forbids, silently: refuse them, as at the top level.
        if "settings" in statement.sql.lower():
            for name, value in chguard.settings_named(self._sessions.canonical(statement.sql)):
                if (why := refusal(name, value)) is not None:
                    raise SqlRefused(f"Setting {name[:64]} {why} (stepline's {PROFILE!r} profile)",
                                     cherrors.SETTING_CONSTRAINT_VIOLATION, "SETTING_CONSTRAINT_VIOLATION")
        fmt = statement.format or params.get("default_format") or headers.get("X-ClickHouse-Format") or "TabSeparated"
        if not chsettings.NAME.match(fmt):
            raise SqlRefused(f"Unknown format {fmt!r}", 73, "UNKNOWN_FORMAT")
        key = chsettings.query_settings(params)
        settings = dict(key)
        frame = None
        if _flag(params, "compress"):
            method = chcompress.method_byte(settings.get("network_compression_method", "lz4"))
            frame = lambda data: chcompress.compress_block(data, method)  # noqa: E731
        encoding = None
        if _flag(params, "enable_http_compression") or _flag(settings, "enable_http_compression"):
            encoding = chcompress.response_encoding(headers.get("Accept-Encoding", ""))
        sql = statement.sql if statement.format else f"{statement.sql}\nFORMAT {fmt}"
        query_tag = uuid.uuid4().hex  # in the text the engine lists the query by: KILL QUERY finds it
        sql = f"{sql}\n/* stepline-query {query_tag} */"
        if watch is not None:
            watch.on_gone(functools.partial(self._sessions.kill, query_tag))
        binds = {k[len("param_") :]: v for k, v in params.items() if k.startswith("param_")}
        started, progress = time.monotonic_ns(), Progress()
        revision = params.get("client_protocol_version", "0")
        pieces = self._pieces(key, database, sql, fmt, binds, progress, statement.leading in ("SELECT", "WITH"),
                              client)
        if fmt.lower() == "native" and _REVISION.match(revision) and int(revision):
            pieces = (chnative.native_for_revision(piece, int(revision)) for piece in pieces)
        if _flag(params, "wait_end_of_query"):
            first, rest = b"", _spooled(pieces)
        else:
            first, rest = next(pieces, b""), pieces  # the first block before any header: an early error is a status
        summary = {"read_rows": str(progress.read_rows), "read_bytes": str(progress.read_bytes), "written_rows": "0",
                   "written_bytes": "0", "total_rows_to_read": str(progress.read_rows), "result_rows": "0",
                   "result_bytes": "0", "elapsed_ns": str(time.monotonic_ns() - started)}
        reply_headers = {
            "Content-Type": chformats.content_type(fmt), "X-ClickHouse-Format": fmt,
            "X-ClickHouse-Summary": json.dumps(summary, separators=(",", ":")),
        }
        if _flag(params, "send_progress_in_http_headers") or _flag(settings, "send_progress_in_http_headers"):
            progress_now = {k: summary[k] for k in ("read_rows", "read_bytes", "total_rows_to_read", "elapsed_ns")}
            reply_headers["X-ClickHouse-Progress"] = json.dumps(progress_now, separators=(",", ":"))
        tag = "".join(secrets.choice(_TAG_ALPHABET) for _ in range(16))
        reply_headers["X-ClickHouse-Exception-Tag"] = tag
        return _Reply(200, first, "served", reply_headers, rest=rest, frame=frame, encoding=encoding,
                      exception_tag=tag)

    def _pieces(self, key: tuple[tuple[str, str], ...], database: str, sql: str, fmt: str, binds: dict[str, str],
                progress: Progress, streams: bool, client: str) -> Iterator[bytes]:
        """The result in `fmt` as it streams, joined into one document; whole where the format allows no other way,
        and for SHOW, DESCRIBE, EXISTS and EXPLAIN (short answers chDB will not stream)."""
        join = chformats.joiner(fmt) if streams else None
        if join is not None:
            produced = False
            for piece in join(self._sessions.run(key, database, sql, fmt, binds, progress, client=client)):
                produced = produced or bool(piece)
                yield piece
            if produced or not chformats.needs_header(fmt):
                return
            # No block came, so no header either (chDB streams blocks only): ask again, whole, for the empty
            # document (JSON's meta, the names line, Arrow's schema) that ClickHouse sends for zero rows.
        yield from self._sessions.run(key, database, sql, fmt, binds, progress, whole=True, client=client)


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _netloc(origin: str) -> str | None:
    try:
        return urlsplit(origin).netloc.lower()
    except ValueError:  # "http://[x": no origin a page of this host sends
        return None


def _loopback_name(host: str) -> bool:
    """Whether a Host header names this machine's loopback: localhost, 127.0.0.0/8 or ::1, with any port."""
    name = host.strip().lower()
    if name.startswith("["):
        name = name[1:name.find("]")] if "]" in name else name
    elif name.count(":") == 1:
        name = name.partition(":")[0]
    return name == "localhost" or _is_loopback(name)


def _flag(params: Mapping[str, str], name: str) -> bool:
    return params.get(name, "0").strip().lower() in ("1", "true")


def _spooled(pieces: Iterator[bytes]) -> Iterator[bytes]:
    """wait_end_of_query=1: the whole result is computed before the first byte goes out (in memory, then on disk)."""
    spool = tempfile.SpooledTemporaryFile(max_size=_SPOOL_IN_MEMORY_BYTES)  # noqa: SIM115 (closed by replay())
    for piece in pieces:
        spool.write(piece)
    spool.seek(0)

    def replay() -> Iterator[bytes]:
        with spool:
            while piece := spool.read(1 << 20):
                yield piece
    return replay()


class _Server(HttpServer):
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
        except chbody.BodyTooLarge as ex:
            self._send(endpoint.too_large(ex.size), head)
            self._discard(min(ex.declared, _DRAIN_CAP_BYTES))
            return
        except ValueError as ex:  # broken framing: say so, then close (the rest of the stream cannot be trusted)
            self._send(endpoint.unreadable(f"{ex} (from {self.client_address[0]})"), head)
            self.close_connection = True
            return
        except OSError as ex:  # a dropped or stalled connection: nobody to answer
            logger.warning("query endpoint: unreadable request from %s: %s", self.client_address[0], ex)
            endpoint.count("failed")
            self.close_connection = True
            return
        watch = Watch(endpoint.watchers, self.connection)
        try:
            self._send(endpoint.answer(self.command, self.path, self.headers, body, self.client_address[0], watch),
                       head)
        finally:
            watch.stop()

    def _read_body(self, limit: int) -> bytes:
        """The request body; ValueError for broken framing, OSError when the client goes away mid-body."""
        return chbody.read_body(self.rfile, self.headers, limit, drain_cap=_DRAIN_CAP_BYTES)

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
        """Write `reply`, counting its outcome before its last bytes go out (a client that has read a reply
        sees it counted); a result that fails after it began counts as failed."""
        if reply.rest is not None:
            try:
                self._stream(reply, head)
            finally:
                close = getattr(reply.rest, "close", None)
                if close is not None:  # a result not read to its end gives its session back (closed)
                    close()
            return
        self.server.endpoint.count(reply.outcome)
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

    def _stream(self, reply: _Reply, head: bool) -> None:
        """A result, chunk by chunk as the engine makes it, in bounded memory."""
        assert reply.rest is not None
        endpoint = self.server.endpoint
        body = ChunkedBody(self.connection, reply.frame, reply.encoding)
        try:
            self.send_response(reply.status)
            for key, value in reply.headers.items():
                self.send_header(key, value)
            if reply.encoding is not None:
                self.send_header("Content-Encoding", reply.encoding)
            self.send_header("Transfer-Encoding", "chunked")
            if head:
                endpoint.count(reply.outcome)
                self.end_headers()
                return
            self.end_headers()
            body.write(reply.body)
            for piece in reply.rest:
                body.write(piece)
            endpoint.count(reply.outcome)
            body.finish()
        except (EngineError, SqlRefused, ValueError) as ex:  # the engine failed after the result began
            code, name = (ex.code, ex.name) if isinstance(ex, EngineError | SqlRefused) else (1001, "STD_EXCEPTION")
            text = cherrors.exception_text(code, name, str(ex))
            logger.warning("query endpoint: failed part way through a result for %s: %s", self.client_address[0],
                           text.strip()[:300])
            self.close_connection = True
            endpoint.count("failed")
            with contextlib.suppress(OSError):  # the client is gone as well: nobody left to tell
                body.fail(text, reply.exception_tag)
        except OSError as ex:  # the client went away mid-result: its session is closed, not reused
            logger.warning("query endpoint: client %s left during a result: %s", self.client_address[0], ex)
            self.close_connection = True
            endpoint.count("failed")
