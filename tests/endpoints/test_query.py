"""The read-only query endpoint: ClickHouse's HTTP protocol over the embedded store, for real clients."""

from __future__ import annotations

import base64
import gzip
import json
import threading
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from email.message import Message
from pathlib import Path
from typing import Any

import clickhouse_connect
import pytest
from clickhouse_connect.driver.client import Client
from clickhouse_connect.driver.exceptions import DatabaseError
from prometheus_client import CollectorRegistry

from stepline.clickhouse_http.native import BLOCK_INFO
from stepline.endpoints.query import QueryEndpoint, QueryMetrics
from stepline.store.chdb import open_client
from tests.core.test_listener import needs_ipv6

PASSWORD = "s3cret"
ROWS = [
    (datetime(2024, 5, 1, 12, 0, 0, 123456), "h1", 1.5, {"engine": "0"}, [1.0, 2.0]),
    (datetime(2024, 5, 1, 12, 0, 1, 250000), "h2", 2.25, {}, []),
    (datetime(2024, 5, 1, 12, 0, 2), "h1", -3.0, {"a": "b", "c": "d"}, [0.5]),
]


@dataclass
class Http:
    """One raw HTTP exchange."""

    status: int
    headers: Message
    body: bytes


@pytest.fixture(scope="module")
def db(chdb_dir: Path) -> Iterator[str]:
    """A database of this module's own on the session's engine, with one small typed table."""
    name = f"qs_{uuid.uuid4().hex[:10]}"
    client = clickhouse_connect.get_client(dsn=f"chdb://{chdb_dir}")
    client.command(f"CREATE DATABASE `{name}`")
    client.command(
        f"CREATE TABLE `{name}`.steps (ts DateTime64(6, 'UTC'), host LowCardinality(String), step_s Float64, "
        "attrs Map(String, String), tokens Array(Float32)) ENGINE = MergeTree ORDER BY ts"
    )
    client.insert(f"`{name}`.steps", ROWS, column_names=["ts", "host", "step_s", "attrs", "tokens"])
    yield name
    client.command(f"DROP DATABASE IF EXISTS `{name}`")
    client.close()


def _start(chdb_dir: Path, db: str, **kwargs: Any) -> QueryEndpoint:
    endpoint = QueryEndpoint(open_client(str(chdb_dir)), port=0, database=db, **kwargs)
    endpoint.start()
    return endpoint


@pytest.fixture(scope="module")
def endpoint(chdb_dir: Path, db: str) -> Iterator[QueryEndpoint]:
    ep = _start(chdb_dir, db, max_body_bytes=1 << 16)
    yield ep
    ep.stop()


@pytest.fixture(scope="module")
def secured(chdb_dir: Path, db: str) -> Iterator[QueryEndpoint]:
    ep = _start(chdb_dir, db, password=PASSWORD)
    yield ep
    ep.stop()


@pytest.fixture(scope="module")
def client(endpoint: QueryEndpoint, db: str) -> Iterator[Client]:
    """clickhouse-connect's HTTP client, as the CLI uses it."""
    c = clickhouse_connect.get_client(host="127.0.0.1", port=endpoint.port, database=db)
    yield c
    c.close()


def http(ep: QueryEndpoint, path: str = "/", body: bytes | None = None, headers: dict[str, str] | None = None,
         **params: str) -> Http:
    url = f"{ep.url}{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
    request = urllib.request.Request(url, data=body, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return Http(response.status, response.headers, response.read())
    except urllib.error.HTTPError as err:
        return Http(err.code, err.headers, err.read())


def _count(chdb_dir: Path, db: str) -> int:
    c = clickhouse_connect.get_client(dsn=f"chdb://{chdb_dir}")
    try:
        return int(str(c.command(f"SELECT count() FROM `{db}`.steps")))
    finally:
        c.close()


# ---- raw HTTP --------------------------------------------------------------------------------------------


def test_ping_and_bare_root_answer_ok(endpoint: QueryEndpoint) -> None:
    for path in ("/ping", "/", "/replicas_status"):
        assert http(endpoint, path).body == b"Ok.\n"


def test_get_query_defaults_to_tabseparated_with_clickhouse_headers(endpoint: QueryEndpoint) -> None:
    r = http(endpoint, query="SELECT 1 AS n, 'a\tb' AS s", query_id="q-42")
    assert (r.status, r.body) == (200, b"1\ta\\tb\n")
    assert r.headers["X-ClickHouse-Format"] == "TabSeparated"
    assert r.headers["Content-Type"].startswith("text/tab-separated-values")
    assert r.headers["X-ClickHouse-Query-Id"] == "q-42"
    assert r.headers["X-ClickHouse-Timezone"] == "UTC"
    assert r.headers["X-ClickHouse-Server-Display-Name"] == "stepline"
    assert json.loads(r.headers["X-ClickHouse-Summary"])["read_rows"] == "1"  # system.one, as ClickHouse counts it


def test_json_from_format_clause_or_default_format(endpoint: QueryEndpoint) -> None:
    clause = http(endpoint, query="SELECT count() AS n FROM steps FORMAT JSONEachRow")
    assert (clause.body, clause.headers["X-ClickHouse-Format"]) == (b'{"n":3}\n', "JSONEachRow")
    param = http(endpoint, body=b"SELECT host FROM steps ORDER BY ts LIMIT 1;", default_format="JSON")
    assert json.loads(param.body)["data"] == [{"host": "h1"}]
    assert param.headers["Content-Type"].startswith("application/json")


def test_query_param_and_body_concatenate_and_gzip_bodies_decode(endpoint: QueryEndpoint) -> None:
    assert http(endpoint, body=b"1 + 1", query="SELECT").body == b"2\n"
    packed = gzip.compress(b"SELECT max(step_s) FROM steps")
    assert http(endpoint, body=packed, headers={"Content-Encoding": "gzip"}).body == b"2.25\n"


def test_param_values_are_clickhouse_escaped_text(endpoint: QueryEndpoint) -> None:
    r = http(endpoint, query="SELECT {s:String} AS s, {a:Array(String)} AS a, {n:UInt32} AS n FORMAT JSONEachRow",
             param_s="tab\\there", param_a="['x','y\\'z']", param_n="7")
    assert json.loads(r.body) == {"s": "tab\there", "a": ["x", "y'z"], "n": 7}


def test_engine_errors_are_clickhouse_shaped(endpoint: QueryEndpoint) -> None:
    r = http(endpoint, query="SELECT * FROM no_such_table")
    assert (r.status, r.headers["X-ClickHouse-Exception-Code"]) == (404, "60")
    assert r.body.startswith(b"Code: 60. DB::Exception: ") and b"(UNKNOWN_TABLE)" in r.body


def test_refusal_body_and_header(endpoint: QueryEndpoint) -> None:
    r = http(endpoint, body=b"DROP TABLE steps")
    assert (r.status, r.headers["X-ClickHouse-Exception-Code"]) == (500, "164")
    message = b"stepline's query endpoint is read-only: DROP is not allowed"
    assert r.body == b"Code: 164. DB::Exception: " + message + b". (READONLY)\n"


def test_settings_from_the_url_apply_but_cannot_lift_readonly(endpoint: QueryEndpoint) -> None:
    r = http(endpoint, query="SELECT getSetting('max_threads'), getSetting('readonly')", max_threads="3",
             session_id="abc", wait_end_of_query="1", readonly="1")
    assert r.body == b"3\t2\n"  # readonly=2: a read-only user who may set settings, as ClickHouse has them
    assert http(endpoint, query="SELECT 1", readonly="0").headers["X-ClickHouse-Exception-Code"] == "164"
    assert b"format_schema" in http(endpoint, query="SELECT 1", format_schema="/etc/passwd:x").body
    lifted = http(endpoint, query="SELECT getSetting('max_execution_time')", max_execution_time="0")
    assert lifted.headers["X-ClickHouse-Exception-Code"] == "452"  # 0 would mean no limit: the profile's min
    lowered = http(endpoint, query="SELECT getSetting('max_execution_time')", max_execution_time="30")
    assert lowered.body == b"30\n"


def test_oversized_body_is_refused_with_413(endpoint: QueryEndpoint) -> None:
    r = http(endpoint, body=b"SELECT 1 -- " + b"x" * 70_000)
    assert (r.status, r.headers["X-ClickHouse-Exception-Code"]) == (413, "229")
    assert b"exceeds the query endpoint's limit of 65536 bytes" in r.body
    bomb = gzip.compress(b"SELECT 1 -- " + b" " * 1_000_000)
    assert http(endpoint, body=bomb, headers={"Content-Encoding": "gzip"}).status == 413


def test_native_framing_follows_client_protocol_version(endpoint: QueryEndpoint) -> None:
    # clickhouse-go asks for revision 54460 and reads its server hello this way.
    sql = b"SELECT toUInt8(7) AS a, 'xy' AS s"
    plain = http(endpoint, body=sql, default_format="Native").body
    framed = http(endpoint, body=sql, default_format="Native", client_protocol_version="54460").body
    assert plain == b"\x02\x01\x01a\x05UInt8\x07\x01s\x06String\x02xy"
    assert framed == BLOCK_INFO + b"\x02\x01\x01a\x05UInt8\x00\x07\x01s\x06String\x00\x02xy"
    hello = http(endpoint, body=b"SELECT displayName(), version(), revision(), timezone()", default_format="Native",
                 client_protocol_version="54460")
    assert hello.status == 200 and hello.body.startswith(BLOCK_INFO + b"\x04\x01")


def test_password_via_basic_key_header_or_param(secured: QueryEndpoint) -> None:
    missing = http(secured, query="SELECT 1")
    assert (missing.status, missing.headers["X-ClickHouse-Exception-Code"]) == (401, "516")
    basic = "Basic " + base64.b64encode(b"default:wrong").decode()
    assert http(secured, query="SELECT 1", headers={"Authorization": basic}).status == 403
    good = "Basic " + base64.b64encode(f"anyone:{PASSWORD}".encode()).decode()
    assert http(secured, query="SELECT 1", headers={"Authorization": good}).body == b"1\n"
    assert http(secured, query="SELECT 1", headers={"X-ClickHouse-Key": PASSWORD}).body == b"1\n"
    assert http(secured, query="SELECT 1", password=PASSWORD).body == b"1\n"
    assert http(secured, "/ping").body == b"Ok.\n"  # health checks need no password


# ---- clickhouse-connect's HTTP client ----------------------------------------------------------------------


def test_clickhouse_connect_reads_typed_rows(client: Client, db: str) -> None:
    assert client.protocol_version > 0  # its Native probe matched: the re-framed path is in use
    result = client.query("SELECT ts, host, step_s, attrs, tokens FROM steps ORDER BY ts")
    assert [t.name for t in result.column_types] == [
        "DateTime64(6, 'UTC')", "LowCardinality(String)", "Float64", "Map(String, String)", "Array(Float32)",
    ]
    assert result.result_rows == ROWS
    assert client.command("SELECT 1") == 1
    assert client.raw_query("SELECT host FROM steps ORDER BY ts", fmt="JSONEachRow").startswith(b'{"host":"h1"}')
    assert client.query("SELECT {x:UInt32} + 1", parameters={"x": 41}).result_rows == [(42,)]
    long_text = "y" * 5000  # over clickhouse-connect's URL budget: sent as multipart/form-data
    assert client.query("SELECT length({s:String})", parameters={"s": long_text}).result_rows == [(5000,)]


def test_clickhouse_connect_dataframes(client: Client) -> None:
    pytest.importorskip("pandas")
    frame = client.query_df("SELECT host, step_s FROM steps ORDER BY ts")
    assert list(frame["host"]) == ["h1", "h2", "h1"] and list(frame["step_s"]) == [1.5, 2.25, -3.0]


def test_clickhouse_connect_reads_many_blocks_of_every_shape(client: Client) -> None:
    result = client.query(
        "SELECT number AS n, toString(number) AS s, [number, 1] AS a, map('k', toString(number)) AS m, "
        "toLowCardinality(toString(number % 7)) AS lc, if(number % 3 = 0, NULL, number) AS maybe, "
        "(number, 'x') AS t, [toLowCardinality('q')] AS alc FROM numbers(150000)"
    )
    assert result.row_count == 150000
    assert result.result_rows[70001] == (70001, "70001", [70001, 1], {"k": "70001"}, "1", 70001, (70001, "x"),
                                         ["q"])
    assert result.result_rows[3][5] is None


@pytest.mark.parametrize("run", [
    lambda c: c.insert("steps", [ROWS[0]], column_names=["ts", "host", "step_s", "attrs", "tokens"]),
    lambda c: c.command("DROP TABLE steps"),
    lambda c: c.command("CREATE TABLE x (a UInt8) ENGINE = Memory"),
    lambda c: c.command("ALTER TABLE steps DELETE WHERE 1"),
    lambda c: c.command("TRUNCATE TABLE steps"),
    lambda c: c.command("SYSTEM DROP MARK CACHE"),
    lambda c: c.command("KILL QUERY WHERE 1"),
    lambda c: c.command("SET readonly = 0"),
    lambda c: c.query("SELECT 1 SETTINGS readonly = 0"),
    lambda c: c.query("SELECT * FROM file('/etc/passwd')"),
    lambda c: c.query("SELECT * FROM url('http://127.0.0.1:1/', 'CSV')"),
    lambda c: c.command("SELECT 1; DROP TABLE steps"),
    lambda c: c.command("SELECT file('/etc/hostname')"),
    lambda c: c.command("SELECT `file`('/etc/hostname')"),
    lambda c: c.command("SELECT file\u200b('/etc/hostname')"),
    lambda c: c.command("SELECT 1 INTO OUTFILE '/tmp/stepline-should-not-exist'"),
    lambda c: c.command("SELECT * FROM remoteSecure('127.0.0.1', system.one)"),
], ids=["insert", "drop", "create", "alter", "truncate", "system", "kill", "set", "settings-clause", "file-table",
        "url", "multi-statement", "file-scalar", "quoted-file", "unicode-space-file", "outfile", "remote"])
def test_writes_and_escapes_are_refused(client: Client, run: Callable[[Client], object], chdb_dir: Path,
                                        db: str) -> None:
    with pytest.raises(DatabaseError, match=r"read-only|READONLY|SETTING_CONSTRAINT_VIOLATION"):  # guard or engine
        run(client)
    assert _count(chdb_dir, db) == len(ROWS)
    assert not Path("/tmp/stepline-should-not-exist").exists()


def test_clickhouse_connect_with_password(secured: QueryEndpoint, db: str) -> None:
    with pytest.raises(DatabaseError, match="516"):
        clickhouse_connect.get_client(host="127.0.0.1", port=secured.port, database=db, password="nope")
    c = clickhouse_connect.get_client(host="127.0.0.1", port=secured.port, database=db, password=PASSWORD)
    assert c.command("SELECT count() FROM steps") == 3
    c.close()


def test_concurrent_queries_share_a_bounded_pool(chdb_dir: Path, db: str) -> None:
    registry = CollectorRegistry()
    ep = _start(chdb_dir, db, max_sessions=2, metrics=QueryMetrics(registry))
    try:
        results: list[bytes] = []
        threads = [threading.Thread(target=lambda: results.append(http(ep, query="SELECT sleep(0.2) + 1").body))
                   for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == [b"1\n"] * 6
        http(ep, body=b"DROP TABLE steps")
        http(ep, query="SELECT nope")
        assert ep.stats() == {"served": 6, "refused": 1, "failed": 1}
        assert registry.get_sample_value("stepline_query_requests_total", {"outcome": "served"}) == 6
    finally:
        ep.stop()


def test_only_embedded_stores_are_served(endpoint: QueryEndpoint) -> None:
    remote = clickhouse_connect.get_client(host="127.0.0.1", port=endpoint.port)
    with pytest.raises(ValueError, match="chdb://"):
        QueryEndpoint(remote)
    remote.close()


@needs_ipv6
def test_listens_on_ipv6_loopback_when_given_it(chdb_dir: Path, db: str) -> None:
    ep = _start(chdb_dir, db, host="::1", password=PASSWORD)
    try:
        assert ep.url == f"http://[::1]:{ep.port}"
        assert http(ep, "/ping").body == b"Ok.\n"
        assert http(ep, query="SELECT count() FROM steps", password=PASSWORD).body == b"3\n"
        c = clickhouse_connect.get_client(host="::1", port=ep.port, database=db, password=PASSWORD)
        assert c.query("SELECT host FROM steps ORDER BY ts").result_rows == [("h1",), ("h2",), ("h1",)]
        c.close()
    finally:
        ep.stop()

