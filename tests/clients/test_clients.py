"""The query endpoint as third-party ClickHouse clients meet it: clickhouse-connect in every compression mode,
the Node `@clickhouse/client`, clickhouse-driver's Native block reader, and the bytes curl or Grafana's
clickhouse-go would see. None of these clients was written here; each must get exactly its own rows.
"""

from __future__ import annotations

import gzip
import http.client
import io
import json
import os
import shutil
import subprocess
import urllib.parse
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import brotli
import clickhouse_connect
import lz4.frame
import pytest
from backports import zstd
from clickhouse_connect.driver.client import Client
from clickhouse_connect.driver.exceptions import DatabaseError
from clickhouse_driver.bufferedreader import BufferedSocketReader
from clickhouse_driver.connection import ServerInfo
from clickhouse_driver.context import Context
from clickhouse_driver.streams.compressed import CompressedBlockInputStream
from clickhouse_driver.streams.native import BlockInputStream

from stepline.endpoints.query import QueryEndpoint
from stepline.store.chdb import open_client

NODE_DIR = Path(__file__).resolve().parent / "node"
FAILING = "SELECT number, throwIf(number = 500000) FROM numbers(1000000)"  # fails after its first blocks
WIDE = ("SELECT number, toString(number) AS s, [number, 1] AS a, toDateTime64(number, 6, 'UTC') AS t "
        "FROM numbers(200000)")


@pytest.fixture(scope="module")
def db(chdb_dir: Path) -> Iterator[str]:
    name = f"cl_{uuid.uuid4().hex[:10]}"
    client = clickhouse_connect.get_client(dsn=f"chdb://{chdb_dir}")
    client.command(f"CREATE DATABASE `{name}`")
    client.command(f"CREATE TABLE `{name}`.steps (ts DateTime64(6, 'UTC'), n UInt32) ENGINE = MergeTree ORDER BY ts")
    client.command(f"INSERT INTO `{name}`.steps SELECT toDateTime64(number, 6, 'UTC'), number FROM numbers(1000)")
    yield name
    client.command(f"DROP DATABASE IF EXISTS `{name}`")
    client.close()


@pytest.fixture(scope="module")
def endpoint(chdb_dir: Path, db: str) -> Iterator[QueryEndpoint]:
    ep = QueryEndpoint(open_client(str(chdb_dir)), port=0, database=db, max_sessions=3)
    ep.start()
    yield ep
    ep.stop()


def raw(ep: QueryEndpoint, sql: str, headers: dict[str, str] | None = None, **params: str) -> tuple[int, Any, bytes]:
    """One request on a connection of its own; a body cut short is returned as far as it came."""
    conn = http.client.HTTPConnection("127.0.0.1", ep.port, timeout=60)
    try:
        conn.request("POST", "/?" + urllib.parse.urlencode(params), body=sql.encode(), headers=headers or {})
        response = conn.getresponse()
        try:
            body = response.read()
        except http.client.IncompleteRead as cut:
            body = cut.partial
        return response.status, response.headers, body
    finally:
        conn.close()


# ---- the leak: a failed query's rows never reach another response -------------------------------------------


def test_a_query_failing_part_way_leaves_nothing_for_the_next_one(endpoint: QueryEndpoint) -> None:
    for fmt in ("TabSeparated", "Native", "JSON", "XML"):  # streamed, joined, and whole formats
        status, headers, body = raw(endpoint, FAILING, default_format=fmt)
        tag = headers.get("X-ClickHouse-Exception-Tag")
        assert b"FUNCTION_THROW_IF_VALUE_IS_NON_ZERO" in body, fmt
        if status == 200:  # the error came after the result began: ClickHouse's tagged block ends the body
            assert tag and body.endswith(f" {tag}\r\n__exception__\r\n".encode()), fmt
        for _ in range(4):  # every pooled session in turn: each must answer with exactly its own rows
            assert raw(endpoint, "SELECT count() FROM numbers(10)")[2] == b"10\n", fmt


def test_clickhouse_connect_sees_the_failure_and_then_only_its_own_rows(endpoint: QueryEndpoint, db: str) -> None:
    first = clickhouse_connect.get_client(host="127.0.0.1", port=endpoint.port, database=db)
    second = clickhouse_connect.get_client(host="127.0.0.1", port=endpoint.port, database=db)
    try:
        with pytest.raises(DatabaseError, match=r"FUNCTION_THROW_IF_VALUE_IS_NON_ZERO|throwIf"):
            first.query(FAILING)
        assert second.query("SELECT count() FROM numbers(10)").result_rows == [(10,)]
        assert first.query("SELECT count() FROM steps").result_rows == [(1000,)]
    finally:
        first.close()
        second.close()


# ---- clickhouse-connect -------------------------------------------------------------------------------------


@pytest.mark.parametrize("compress", [False, True, "lz4", "zstd", "br", "gzip", "deflate"])
def test_clickhouse_connect_in_every_compression_mode(endpoint: QueryEndpoint, db: str, compress: bool | str) -> None:
    client = clickhouse_connect.get_client(host="127.0.0.1", port=endpoint.port, database=db, compress=compress)
    try:
        result = client.query(WIDE)
        assert len(result.result_rows) == 200_000
        last = result.result_rows[-1]
        assert (last[0], last[1], last[2]) == (199_999, "199999", [199_999, 1])
        assert int(result.summary["read_rows"]) > 0  # what the engine read by the time the headers went out
    finally:
        client.close()


def test_clickhouse_connect_dataframes_arrow_and_settings(endpoint: QueryEndpoint, db: str) -> None:
    client = clickhouse_connect.get_client(host="127.0.0.1", port=endpoint.port, database=db)
    try:
        frame = client.query_df("SELECT n, ts FROM steps ORDER BY n")
        assert len(frame) == 1000 and int(frame["n"].sum()) == sum(range(1000))
        table = client.query_arrow(WIDE)
        assert table.num_rows == 200_000 and table.column("number")[-1].as_py() == 199_999
        with client.query_arrow_stream(WIDE) as stream:
            assert sum(batch.num_rows for batch in stream) == 200_000
        empty = client.query_arrow("SELECT n FROM steps WHERE n > 5000")
        assert (empty.num_rows, empty.column_names) == (0, ["n"])
        # readonly=2: clickhouse-connect reads system.settings and sends settings, as it does to ClickHouse.
        got = client.query("SELECT getSetting('max_threads'), getSetting('readonly')", settings={"max_threads": 2})
        assert got.result_rows == [(2, 2)]
        with pytest.raises(DatabaseError, match="SETTING_CONSTRAINT_VIOLATION"):
            client.query("SELECT 1 SETTINGS max_execution_time = 0")
        with pytest.raises(DatabaseError) as syntax:
            client.query("SELEC 1")
        assert "62" in str(syntax.value) and "SYNTAX_ERROR" in str(syntax.value)
    finally:
        client.close()


# ---- clickhouse-driver's Native reader: an independent decoder ---------------------------------------------


class _Bytes:
    """What clickhouse-driver's socket reader reads from: a response body instead of a socket."""

    def __init__(self, data: bytes) -> None:
        self._data = io.BytesIO(data)

    def recv_into(self, buffer: Any, size: int = 0) -> int:
        chunk = self._data.read(size or len(buffer))
        buffer[: len(chunk)] = chunk
        return len(chunk)


def _driver_rows(data: bytes, revision: int, compressed: bool = False) -> list[tuple[Any, ...]]:
    context = Context()
    context.server_info = ServerInfo("stepline", 24, 1, 1, revision, "UTC", "stepline", revision)
    context.client_settings = {"strings_as_bytes": False, "strings_encoding": "utf-8", "use_numpy": False,
                               "input_format_null_as_default": False, "namedtuple_as_json": False}
    reader = BufferedSocketReader(_Bytes(data), 1 << 16)
    stream = (CompressedBlockInputStream if compressed else BlockInputStream)(reader, context)
    rows: list[tuple[Any, ...]] = []
    while True:
        try:
            block = stream.read()
        except EOFError:
            return rows
        rows.extend(block.get_rows())


@pytest.mark.parametrize("revision", [0, 54405, 54460])
def test_native_blocks_decode_with_clickhouse_driver(endpoint: QueryEndpoint, revision: int) -> None:
    status, _, body = raw(endpoint, WIDE, default_format="Native", client_protocol_version=str(revision))
    rows = _driver_rows(body, revision)
    assert status == 200 and len(rows) == 200_000
    assert rows[-1][:3] == (199_999, "199999", [199_999, 1])


@pytest.mark.parametrize("method", ["lz4", "zstd"])  # clickhouse-driver reads no other method
def test_compress_1_is_clickhouse_compressed_blocks(endpoint: QueryEndpoint, method: str) -> None:
    # clickhouse-go asks for compress=1 whenever LZ4/ZSTD compression is on; clickhouse-driver checks every checksum.
    status, _, body = raw(endpoint, WIDE, default_format="Native", client_protocol_version="54460", compress="1",
                          network_compression_method=method)
    rows = _driver_rows(body, 54460, compressed=True)
    assert status == 200 and len(rows) == 200_000 and rows[-1][0] == 199_999
    assert raw(endpoint, "SELECT 1", compress="1", network_compression_method="snappy")[0] == 500


def test_decompress_1_reads_a_compressed_query() -> None:
    from stepline.clickhouse_http import compression as chcompress
    from stepline.clickhouse_http.errors import SqlRefused
    packed = chcompress.compress_block(b"SELECT 42", chcompress.method_byte("zstd"))
    assert chcompress.decompress_blocks(packed, 1 << 20) == b"SELECT 42"
    damaged = packed[:-1] + bytes([packed[-1] ^ 1])
    with pytest.raises(SqlRefused, match="checksum"):
        chcompress.decompress_blocks(damaged, 1 << 20)


# ---- HTTP response compression --------------------------------------------------------------------------------


_DECODERS = {
    "gzip": gzip.decompress, "deflate": zlib.decompress, "br": brotli.decompress,
    "zstd": zstd.decompress, "lz4": lz4.frame.decompress,
}


@pytest.mark.parametrize("encoding", sorted(_DECODERS))
def test_response_compression_follows_accept_encoding(endpoint: QueryEndpoint, encoding: str) -> None:
    sql = "SELECT number FROM numbers(300000)"
    expected = b"".join(b"%d\n" % n for n in range(300_000))
    status, headers, body = raw(endpoint, sql, headers={"Accept-Encoding": encoding}, enable_http_compression="1")
    assert (status, headers["Content-Encoding"]) == (200, encoding)
    assert _DECODERS[encoding](body) == expected and len(body) < len(expected)
    plain = raw(endpoint, sql, headers={"Accept-Encoding": encoding})  # not asked for: never compressed
    assert plain[1].get("Content-Encoding") is None and plain[2] == expected


# ---- formats joined from chDB's per-block documents -------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["JSON", "JSONCompact", "TSVWithNamesAndTypes", "CSVWithNames",
                                 "JSONCompactEachRowWithNames", "RowBinaryWithNamesAndTypes", "Parquet"])
def test_formats_match_the_engine_answering_in_process(endpoint: QueryEndpoint, chdb_client: Client, db: str,
                                                       fmt: str) -> None:
    for where in ("", "WHERE number > 10000000"):  # many blocks, and none
        sql = f"SELECT number, toString(number) AS s FROM numbers(200000) {where} FORMAT {fmt}"
        status, _, body = raw(endpoint, sql)
        whole = chdb_client.raw_query(sql)  # the engine's own one-document answer
        assert status == 200
        if fmt.startswith("JSON") and "EachRow" not in fmt:
            got, want = json.loads(body), json.loads(whole)
            assert (got["meta"], got["data"], got["rows"]) == (want["meta"], want["data"], want["rows"])
        elif fmt == "Parquet":
            import pyarrow.parquet as pq
            assert pq.read_table(io.BytesIO(body)).equals(pq.read_table(io.BytesIO(whole)))
        else:
            assert body == whole, fmt


def test_wait_end_of_query_reports_the_whole_summary(endpoint: QueryEndpoint) -> None:
    status, headers, body = raw(endpoint, "SELECT number FROM numbers(300000)", wait_end_of_query="1",
                                send_progress_in_http_headers="1")
    summary = json.loads(headers["X-ClickHouse-Summary"])
    assert status == 200 and body.count(b"\n") == 300_000
    assert summary["read_rows"] == "300000" and json.loads(headers["X-ClickHouse-Progress"])["read_rows"] == "300000"
    failed = raw(endpoint, FAILING, wait_end_of_query="1")  # nothing was sent yet: a proper error status
    assert failed[0] == 500 and failed[1]["X-ClickHouse-Exception-Code"] == "395"


# ---- the Node client ---------------------------------------------------------------------------------------


def _node_client_ready() -> str | None:
    if shutil.which("node") is None:
        return "node is not installed"
    if not (NODE_DIR / "node_modules" / "@clickhouse" / "client").is_dir():
        return f"@clickhouse/client is not installed: npm ci --prefix {NODE_DIR}"
    return None


def test_node_clickhouse_client(endpoint: QueryEndpoint, db: str) -> None:
    if (missing := _node_client_ready()) is not None:
        if os.environ.get("CI"):
            pytest.fail(f"{missing} (.ci/run installs it)")
        pytest.skip(missing)
    run = subprocess.run(["node", str(NODE_DIR / "queries.mjs"), endpoint.url, db], capture_output=True, text=True,
                         timeout=180, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout)
    assert got["each_row"]["ok"] == {"rows": 200_000, "last": {"number": 199_999, "s": "199999"}}
    assert got["json_document"]["ok"] == {"rows": 200_000, "data": 200_000, "meta": ["number", "s"]}
    assert got["compressed"]["ok"] == {"rows": 200_000, "last": [199_999, "199999"]}
    assert got["streamed"]["ok"] == {"rows": 200_000}
    assert got["settings"]["ok"] == [{"t": 3, "r": 2}]
    assert got["syntax_error"]["code"] == "62" and got["write_refused"]["code"] == "164"
    # The client read the tagged error, not a short result. @clickhouse/client parses the block from the end of the
    # chunk its socket read ended on; when a loaded machine's read splits the block, it still fails the result but
    # with its own message and no code (clickhouse-js PR #514: "the exception byte sequence is split").
    failed = got["failed_mid_result"]
    assert "ok" not in failed, failed
    assert failed.get("code") == "395" or failed["error"].startswith("there was an error in the stream"), failed
    assert got["after_failure"]["ok"] == [{"n": 10}]  # on another connection: exactly its own row
    assert got["tables"]["ok"] == ["steps"]
