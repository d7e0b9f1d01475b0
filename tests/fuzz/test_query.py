"""Fuzzing the query endpoint's inputs: URL and form parameters, settings, bind values, database, format, query id,
compression and auth headers, through QueryEndpoint.answer() and over real HTTP.

The property: every request ends in a result or a clean one-line ClickHouse-style error with a 4xx/5xx status
(never the endpoint's own "internal error"), each is counted once, headers echo nothing unsafe, and the store is
exactly as it was.
"""

from __future__ import annotations

import base64
import contextlib
import gzip
import http.client
import re
import socket
import tempfile
import urllib.parse
import uuid
import zlib
from collections.abc import Iterator
from email.message import Message
from pathlib import Path

import clickhouse_connect
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepline.endpoints.query import QueryEndpoint
from stepline.store.chdb import open_client

PASSWORD = "pw-fuzz"
MARKER = Path(tempfile.gettempdir()) / f"stepline-fuzz-{uuid.uuid4().hex}"
ERROR_BODY = re.compile(rb"Code: (\d+)\. DB::Exception: [^\n]*\n\Z")


@pytest.fixture(scope="module")
def db(chdb_dir: Path) -> Iterator[str]:
    name = f"fz_{uuid.uuid4().hex[:10]}"
    client = clickhouse_connect.get_client(dsn=f"chdb://{chdb_dir}")
    client.command(f"CREATE DATABASE `{name}`")
    client.command(f"CREATE TABLE `{name}`.t (a UInt8, s String) ENGINE = MergeTree ORDER BY a")
    client.command(f"INSERT INTO `{name}`.t VALUES (1, 'x'), (2, 'y'), (3, 'z')")
    yield name
    client.command(f"DROP DATABASE IF EXISTS `{name}`")
    client.close()


@pytest.fixture(scope="module")
def endpoint(chdb_dir: Path, db: str) -> Iterator[QueryEndpoint]:
    ep = QueryEndpoint(open_client(str(chdb_dir)), port=0, database=db,
                       password=PASSWORD, max_body_bytes=4096, max_execution_time_s=5)
    ep.start()
    yield ep
    ep.stop()


@pytest.fixture(scope="module")
def snapshot(chdb_dir: Path, db: str) -> Iterator[Snapshot]:
    snap = Snapshot(chdb_dir, db)
    yield snap
    snap.client.close()


class Snapshot:
    """What a read-only endpoint must leave alone: the rows, the tables, the databases, the file system."""

    def __init__(self, chdb_dir: Path, db: str) -> None:
        self.client = clickhouse_connect.get_client(dsn=f"chdb://{chdb_dir}")
        self.db = db
        self.before = self.take()

    def take(self) -> tuple[object, ...]:
        rows = self.client.query(
            "SELECT (SELECT groupArray((a, s)) FROM (SELECT a, s FROM {db:Identifier}.t ORDER BY a)), "
            "(SELECT groupArray(name) FROM system.tables WHERE database = {db:String}), "
            "(SELECT count() FROM system.databases WHERE name LIKE 'fz\\_%')", parameters={"db": self.db}).result_rows
        return tuple(rows[0])

    def unchanged(self) -> bool:
        return self.take() == self.before and not MARKER.exists()


SQL_FRAGMENTS = st.sampled_from([
    "SELECT", "1", "*", "a", "s", "count()", "FROM", "t", "system.one", "numbers(3)", "WHERE", "a > {x:UInt8}",
    "{s:String}", "{x:Array(UInt8)}", "{db:Identifier}", "FORMAT", "JSON", "JSONEachRow", "Native", "TSV", "CSV",
    "Pretty", "RowBinary", "SETTINGS", "max_threads = 1", "readonly = 0", "allow_ddl = 1", ";", "DROP TABLE t",
    "INSERT INTO t VALUES (9, 'w')", "ALTER TABLE t DELETE WHERE 1", "CREATE TABLE u (a UInt8) ENGINE = Memory",
    "file('/etc/hostname')", "url('http://127.0.0.1:1/')", f"INTO OUTFILE '{MARKER}'", "'", '"', "`", "--", "/*",
    "*/", "$$", "$a$", "\\", "\u200b", "é", "(", ")", ",", "UNION ALL", "0x1F", "-- c\n", "WITH 1 AS w", "SHOW TABLES",
    "DESCRIBE t", "EXISTS t", "EXPLAIN", "SET readonly = 0", "KILL QUERY WHERE 1", "SYSTEM FLUSH LOGS", "USE system",
    "OPTIMIZE TABLE t FINAL", "RENAME TABLE t TO u", "GRANT ALL ON *.* TO default", "toDateTime64('2024-01-01', 6)",
    "sleep(0.001)", "throwIf(1)", "arrayJoin([1, 2])", "LIMIT 2", "remote('127.0.0.1', system.one)",
])
SQL = st.lists(SQL_FRAGMENTS, max_size=8).map(" ".join)
PARAM_KEYS = st.sampled_from([
    "query", "database", "default_format", "query_id", "session_timezone", "client_protocol_version", "password",
    "user", "session_id", "compress", "decompress", "readonly", "max_threads", "max_execution_time",
    "max_result_bytes", "result_overflow_mode", "output_format_json_quote_64bit_integers", "allow_ddl",
    "format_schema", "user_files_path", "allow_introspection_functions", "additional_table_filters",
    "param_x", "param_s", "param_db", "param_", "param_a b", "http_headers", "x", "", "1a", "$x$",
    "max_memory_usage", "wait_end_of_query", "enable_http_compression", "stacktrace",
])
PARAM_VALUES = st.one_of(st.sampled_from([
    "", "0", "1", "2", "-1", "1e400", "nan", "18446744073709551616", "²", "9" * 5000, PASSWORD, "wrong", "UTC",
    "UTC\r\nSet-Cookie: a=b", "Europe/Paris", "Mars/Olympus", "Ωmega", "JSON", "Native", "TabSeparated", "bad format",
    "Parquet", "CapnProto", "system", "nope", "`t`", "x`; DROP TABLE t; --", "54460", "54454", "throw", "break",
    "[1,2", "[1,2]", "'", "\\", "\x00", "{'t': 'a = 1'}", "a" * 200,
]), st.text(max_size=12))
PARAMS = st.lists(st.tuples(PARAM_KEYS, PARAM_VALUES), max_size=5)
HEADERS = st.fixed_dictionaries({}, optional={
    "Content-Encoding": st.sampled_from(["gzip", "deflate", "x-gzip", "identity", "br", "zstd", "lz4", "gzip, br",
                                         " ", "é"]),
    "Content-Type": st.sampled_from(["text/plain", "multipart/form-data; boundary=XyZ", "multipart/form-data",
                                     "multipart/form-data; boundary=", "application/octet-stream"]),
    "X-ClickHouse-Format": st.sampled_from(["JSON", "Native", "bad format", "", "TSVWithNames"]),
    "X-ClickHouse-Database": st.sampled_from(["system", "nope", "x`y", ""]),
    "X-ClickHouse-User": st.sampled_from(["default", "admin", ""]),
    "X-ClickHouse-Key": st.sampled_from([PASSWORD, "wrong", "", "pwé"]),
})


def _basic(credentials: bytes) -> str:
    return "Basic " + base64.b64encode(credentials).decode()


AUTH = st.sampled_from([_basic(f"default:{PASSWORD}".encode())] * 4 + [
    "Basic !!!", "Basic é", _basic(b"\xff:\xfe"), "Bearer x", "", "basic   " + _basic(f"u:{PASSWORD}".encode())[6:]])


def form(fields: list[tuple[str, str]], boundary: str = "XyZ", *, raw: bytes = b"", filename: bool = False) -> bytes:
    """A multipart/form-data body, as clickhouse-connect sends long bind parameters."""
    out = b""
    for name, value in fields:
        disposition = f'form-data; name="{name}"' + ('; filename="f.tsv"' if filename else "")
        out += f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + value.encode() + b"\r\n"
    return out + raw + f"--{boundary}--\r\n".encode()


@st.composite
def http_requests(draw: st.DrawFn) -> tuple[str, str, dict[str, str], bytes]:
    """(method, target, headers, body) of one request to the endpoint."""
    params = draw(PARAMS)
    if draw(st.booleans()):
        params.append(("query", draw(SQL)))
    path = draw(st.sampled_from(["/", "/", "/", "/ping", "/play", "//[x", "/?", "/%zz", "*"]))
    target = path + ("?" + urllib.parse.urlencode(params) if params else "")
    if draw(st.integers(0, 9)) == 0:
        target += draw(st.sampled_from(["&%zz", "&a=%ff%fe", "&&&=", "&query=%00"]))
    headers = draw(HEADERS)
    if authorization := draw(AUTH):
        headers["Authorization"] = authorization
    body = draw(SQL).encode()
    kind = draw(st.sampled_from(["sql", "sql", "bytes", "form", "form-raw", "form-file"]))
    if kind == "bytes":
        body = draw(st.binary(max_size=64))
    elif kind.startswith("form"):
        fields = draw(st.lists(st.tuples(PARAM_KEYS, PARAM_VALUES | SQL), max_size=3))
        undecodable = b'--XyZ\r\nContent-Disposition: form-data; name="query"\r\n\r\n\xff\xfe\r\n'
        raw = undecodable if kind == "form-raw" else b""
        body = form(fields, raw=raw, filename=kind == "form-file")
        headers.setdefault("Content-Type", "multipart/form-data; boundary=XyZ")
    encoding = headers.get("Content-Encoding", "").strip()
    if encoding in ("gzip", "x-gzip") and draw(st.booleans()):
        body = gzip.compress(body)
    elif encoding == "deflate" and draw(st.booleans()):
        body = zlib.compress(body)
    return draw(st.sampled_from(["GET", "POST", "POST", "HEAD"])), target, headers, body


def check_reply(status: int, headers: dict[str, str], body: bytes) -> None:
    assert status == 200 or 400 <= status < 600, status
    for key, value in headers.items():
        assert "\r" not in value and "\n" not in value, (key, value)  # nothing echoed can split a header
        value.encode("latin-1")
    if status >= 400 and "X-ClickHouse-Exception-Code" not in headers:
        assert status != 500 and body.startswith(b"<!DOCTYPE HTML>"), body[:300]  # the HTTP server's own refusal
    elif status >= 400:
        match = ERROR_BODY.match(body)
        assert match is not None, body[:300]
        assert match.group(1) != b"1001" and b"internal error" not in body, body[:300]
        assert headers["X-ClickHouse-Exception-Code"] == match.group(1).decode()


@settings(max_examples=150, deadline=20_000, suppress_health_check=[HealthCheck.too_slow])
@given(http_requests())
def test_every_request_gets_a_result_or_one_clean_error_and_writes_nothing(
        endpoint: QueryEndpoint, snapshot: Snapshot, request: tuple[str, str, dict[str, str], bytes]) -> None:
    method, target, headers, body = request
    message = Message()
    for key, value in headers.items():
        message[key] = value
    reply = endpoint.answer(method, target, message, body, "fuzz")
    assert reply.outcome in ("served", "refused", "failed", "ping")
    check_reply(reply.status, reply.headers, reply.body)
    assert snapshot.unchanged()


RAW_FRAMINGS = st.sampled_from([
    "length", "length", "chunked", "chunked-bad-size", "chunked-no-crlf", "chunked-huge", "length-short",
    "length-long", "length-junk", "length-twice", "none", "chunked-trailers",
])


def frame(framing: str, body: bytes) -> tuple[str, bytes]:
    """Headers and bytes that carry `body` the way `framing` says (some of them broken on purpose)."""
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (body[:7], body[7:]) if part) + b"0\r\n\r\n"
    return {
        "length": (f"Content-Length: {len(body)}\r\n", body),
        "length-short": (f"Content-Length: {max(0, len(body) - 3)}\r\n", body),
        "length-long": (f"Content-Length: {len(body) + 10}\r\n", body),
        "length-junk": ("Content-Length: 1_0\r\n", body),
        "length-twice": (f"Content-Length: {len(body)}\r\nContent-Length: 1\r\n", body),
        "none": ("", body),
        "chunked": ("Transfer-Encoding: chunked\r\n", chunks),
        "chunked-trailers": ("Transfer-Encoding: chunked\r\n", chunks[:-2] + b"X-T: 1\r\n" * 70 + b"\r\n"),
        "chunked-bad-size": ("Transfer-Encoding: chunked\r\n", b"zz\r\n" + body + b"\r\n0\r\n\r\n"),
        "chunked-no-crlf": ("Transfer-Encoding: chunked\r\n", b"%x\r\n%sXX0\r\n\r\n" % (len(body), body)),
        "chunked-huge": ("Transfer-Encoding: chunked\r\n", b"ffffffffffff\r\n" + body),
    }[framing]


def exchange(port: int, request: bytes, method: str, timeout_s: float = 10.0
             ) -> tuple[int | None, dict[str, str], bytes]:
    """Send raw bytes, half-close, read one response; (None, {}, b"") when the server closed without one."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        with contextlib.suppress(OSError):
            sock.sendall(request)
            sock.shutdown(socket.SHUT_WR)
        response = http.client.HTTPResponse(sock, method=method)
        try:
            response.begin()
        except (http.client.RemoteDisconnected, ConnectionResetError):
            return None, {}, b""
        except http.client.BadStatusLine:  # a two-word request line is HTTP/0.9: its reply has no status line
            return 0, {}, b""
        headers = dict(response.getheaders())
        try:
            return response.status, headers, response.read()
        except (http.client.IncompleteRead, ConnectionResetError):
            return response.status, headers, b""


@settings(max_examples=100, deadline=20_000, suppress_health_check=[HealthCheck.too_slow])
@given(http_requests(), RAW_FRAMINGS, st.sampled_from(["GET", "POST", "HEAD", "PUT", "BREW", ""]))
def test_over_http_every_request_is_answered_or_closed_and_counted_once(
        endpoint: QueryEndpoint, snapshot: Snapshot, request: tuple[str, str, dict[str, str], bytes], framing: str,
        method: str) -> None:
    _, target, headers, body = request
    length_headers, payload = frame(framing, body)
    head = f"{method} {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{length_headers}"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    before = sum(endpoint.stats().values())
    status, reply_headers, reply = exchange(endpoint.port, head.encode("utf-8") + b"\r\n" + payload, method)
    counted = sum(endpoint.stats().values()) - before
    if status == 200 and (reply == b"Ok.\n" or method == "HEAD"):
        assert counted in (0, 1)  # a ping is not counted
    else:
        assert counted == 1, (status, reply[:200])
    if status and not (method == "HEAD" or framing == "length-short"):
        check_reply(status, reply_headers, reply)
    assert snapshot.unchanged()
