"""A writable ClickHouse HTTP endpoint over an embedded store: the "remote store" of fault-injection tests.

The collector never starts this. It exists so that the remote-store path (clickhouse-connect's HTTP
client, its retries, the spool behind it) can be exercised on one machine without a ClickHouse server:
tests stop it mid-run and start it again on the same port, or make it refuse inserts, and the
benchmarks measure the collector's footprint against it. It answers what clickhouse-connect sends:
pings, queries (any format), DDL, and `INSERT ... FORMAT Native` bodies, with ClickHouse's settings
(`insert_deduplication_token` included) passed through to the engine.
"""

from __future__ import annotations

import logging
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from clickhouse_connect.driver.exceptions import DatabaseError

from stepline.clickhouse_http import body as chbody
from stepline.clickhouse_http import compression as chcompress
from stepline.clickhouse_http import errors as cherrors
from stepline.clickhouse_http import formats as chformats
from stepline.clickhouse_http import native as chnative
from stepline.core.listener import HttpServer, ServerThread
from stepline.core.listener import url as http_url
from stepline.store.chdb import open_client

log = logging.getLogger(__name__)

TOO_MANY_PARTS = 252
_INSERT = re.compile(
    r"\s*INSERT\s+INTO\s+(?P<table>.+?)\s*\((?P<columns>[^)]*)\)\s*FORMAT\s+(?P<fmt>\w+)[ \t]*\n?", re.I | re.S
)
_READS = re.compile(r"\s*(SELECT|WITH|SHOW|DESCRIBE|DESC|EXISTS|EXPLAIN)\b", re.I)
_HAS_FORMAT = re.compile(r"\bFORMAT\s+\w+\s*;?\s*\Z", re.I)
# URL parameters that are HTTP protocol, not ClickHouse settings.
_PROTOCOL = frozenset({
    "query", "database", "default_format", "query_id", "session_id", "session_timeout", "session_check",
    "compress", "decompress", "user", "password", "client_protocol_version", "wait_end_of_query",
    "buffer_size", "quota_key", "enable_http_compression", "send_progress_in_http_headers",
})


class StoreServer:
    """ClickHouse's HTTP protocol over the embedded store at `path`, writes included; restartable on one port."""

    def __init__(self, path: str, host: str = "127.0.0.1", port: int = 0, *, max_body_bytes: int = 256 << 20) -> None:
        self.path = path
        self.host = host
        self._port = port
        self.max_body_bytes = max_body_bytes
        self.refuse_inserts = False  # answer every INSERT as an overloaded server does (TOO_MANY_PARTS)
        self.inserts = 0  # INSERT requests served
        self.refused = 0  # INSERT requests refused while refuse_inserts was on
        self._client = open_client(path)
        self._engine_lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()
        self._serving: ServerThread | None = None

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        """http://host:port, an IPv6 host in brackets."""
        return http_url(self.host, self._port)

    def store_url(self, database: str) -> str:
        return f"{self.url}/{database}"

    def start(self) -> None:
        """Listen (on the same port as before, after a stop)."""
        if self._serving is not None:
            raise RuntimeError("store server already started")
        server = _Server((self.host, self._port), _Handler)
        server.store = self
        self._port = server.server_address[1]
        self._serving = ServerThread(server, "stepline-store-server")

    def stop(self) -> None:
        """Stop listening and cut every open connection, as a server that went away does."""
        serving, self._serving = self._serving, None
        if serving is not None:
            serving.stop()
        with self._connections_lock:
            connections = list(self._connections)
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                continue  # already closed by its handler

    def close(self) -> None:
        self.stop()
        self._client.close()

    def track(self, conn: socket.socket, open_: bool) -> None:
        with self._connections_lock:
            (self._connections.add if open_ else self._connections.discard)(conn)

    def answer(self, target: str, encoding: str, body: bytes) -> tuple[int, bytes, dict[str, str]]:
        """One request to (status, body, headers)."""
        url = urlsplit(target)
        params = dict(parse_qsl(url.query, keep_blank_values=True))
        if url.path in ("/ping", "/replicas_status") or (not params and not body):
            return 200, b"Ok.\n", {}
        try:
            data = chcompress.decode_content(encoding, body, self.max_body_bytes)
            sql = params.get("query", "")
            if not sql:
                sql, data = _split_statement(data)
            settings = {k: v for k, v in params.items() if k not in _PROTOCOL and not k.startswith("param_")}
            binds = {k[len("param_"):]: v for k, v in params.items() if k.startswith("param_")}
            with self._engine_lock:
                self._client.database = params.get("database") or "default"
                insert = _INSERT.match(sql)
                if insert:
                    return self._insert(insert, data, settings)
                if _READS.match(sql):
                    fmt = params.get("default_format") or "TabSeparated"
                    if not _HAS_FORMAT.search(sql):
                        sql = f"{sql}\nFORMAT {fmt}"
                    out = self._client.raw_query(sql, parameters=binds or None, settings=settings)
                    revision = params.get("client_protocol_version", "0")
                    if fmt.lower() == "native" and revision.isascii() and revision.isdigit() and len(revision) < 10:
                        out = chnative.native_for_revision(out, int(revision))
                    return 200, out, {"Content-Type": chformats.content_type(fmt), "X-ClickHouse-Format": fmt}
                self._client.command(sql, parameters=binds or None, settings=settings)
                return 200, b"", {}
        except cherrors.SqlRefused as ex:
            return _error(ex.code, ex.name, str(ex))
        except DatabaseError as ex:
            return _error(ex.code or 1000, ex.name or "UNKNOWN_EXCEPTION", str(ex))

    def _insert(self, match: re.Match[str], data: bytes, settings: dict[str, Any]) -> tuple[int, bytes, dict[str, str]]:
        if self.refuse_inserts:
            self.refused += 1
            return _error(TOO_MANY_PARTS, "TOO_MANY_PARTS", "Too many parts (600). Merges are processing "
                          "significantly slower than inserts (injected by the test)")
        columns = [c.strip().strip("`") for c in match.group("columns").split(",") if c.strip()]
        self._client.raw_insert(match.group("table"), columns, data, settings=settings, fmt=match.group("fmt"))
        self.inserts += 1
        return 200, b"", {}


def _split_statement(body: bytes) -> tuple[str, bytes]:
    """A body that carries the statement: for an INSERT its first line, then the data; else all of it."""
    head, newline, rest = body.partition(b"\n")
    text = head.decode(errors="replace")
    if newline and _INSERT.match(text):
        return text, rest
    return body.decode(errors="replace"), b""


def _error(code: int, name: str, message: str) -> tuple[int, bytes, dict[str, str]]:
    text = cherrors.exception_text(code, name, message).encode()
    return cherrors.http_status(code), text, {"X-ClickHouse-Exception-Code": str(code)}


class _Server(HttpServer):
    store: StoreServer


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 30.0
    server: _Server

    def setup(self) -> None:
        super().setup()
        self.server.store.track(self.connection, True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.store.track(self.connection, False)

    def do_GET(self) -> None:
        self._serve()

    def do_POST(self) -> None:
        self._serve()

    def log_message(self, format: str, *args: Any) -> None:
        """Silenced: clickhouse-connect's traffic is not interesting to print."""

    def _serve(self) -> None:
        try:
            body = chbody.read_body(self.rfile, self.headers, self.server.store.max_body_bytes, drain_cap=0)
        except (ValueError, OSError, chbody.BodyTooLarge):
            self.close_connection = True
            return
        status, data, headers = self.server.store.answer(self.path, self.headers.get("Content-Encoding", ""), body)
        try:
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            self.close_connection = True
