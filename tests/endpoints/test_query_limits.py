"""The query endpoint's limits: memory a query may take, a fair share of sessions per client, a query killed when
its client leaves, only loopback names on a loopback listener, and no cross-site page."""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import chdb
import pytest

from stepline.endpoints.query import QueryEndpoint
from stepline.store.chdb import open_client

HEAVY = "SELECT sum(cityHash64(number)) FROM numbers(100000000000)"  # minutes of work, no row until the end


def _get(ep: QueryEndpoint, sql: str, headers: dict[str, str] | None = None,
         timeout: float = 30) -> tuple[int, str, bytes]:
    request = urllib.request.Request(f"{ep.url}/", data=sql.encode(), headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, "", response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get("X-ClickHouse-Exception-Code", ""), err.read()


def _running(chdb_dir: Path, text: str) -> int:
    """Queries the engine runs now whose SQL holds `text` (read beside the endpoint, as its operator could)."""
    conn: Any = cast(Any, chdb).connect(str(chdb_dir))
    try:
        sql = "SELECT count() FROM system.processes WHERE query LIKE {t:String} AND query NOT LIKE '%system.processes%'"
        return int(conn.query(sql, "TSV", params={"t": f"%{text}%"}).bytes())
    finally:
        conn.close()


@pytest.fixture
def endpoint(chdb_dir: Path) -> Iterator[QueryEndpoint]:
    ep = QueryEndpoint(open_client(str(chdb_dir)), port=0, database="system", max_sessions=2, max_memory_bytes=64 << 20,
                       max_execution_time_s=60, session_wait_s=1.0)
    ep.start()
    yield ep
    ep.stop()


def test_a_query_cannot_take_more_memory_than_the_cap_nor_lift_it(endpoint: QueryEndpoint) -> None:
    big = "SELECT length(groupArray(number)) FROM numbers(30000000)"  # ~240 MiB of array, over the 64 MiB cap
    status, code, body = _get(endpoint, big)
    assert (status, code) == (500, "241"), body[:200]  # MEMORY_LIMIT_EXCEEDED, from the engine
    assert _get(endpoint, f"{big} SETTINGS max_memory_usage = 0")[1] == "452"  # below the profile's least
    assert _get(endpoint, f"{big} SETTINGS `max_memory_usage` = 4000000000")[1] == "452"  # past its ceiling
    url_lifted = urllib.request.Request(f"{endpoint.url}/?max_memory_usage=0", data=b"SELECT 1")
    with pytest.raises(urllib.error.HTTPError) as refused:  # a URL asking for no limit: the profile's least
        urllib.request.urlopen(url_lifted, timeout=30)
    assert refused.value.headers["X-ClickHouse-Exception-Code"] == "452"


def test_one_client_cannot_hold_every_session(endpoint: QueryEndpoint) -> None:
    slow = "SELECT sleepEachRow(0.5) FROM numbers(6) SETTINGS max_block_size = 1"  # 3 s
    hog = {"User-Agent": "hog"}
    outcomes: list[tuple[int, str]] = []
    threads = [threading.Thread(target=lambda: outcomes.append(_get(endpoint, slow, hog)[:2])) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    started = time.monotonic()
    assert _get(endpoint, "SELECT 1", {"User-Agent": "dashboard"}) == (200, "", b"1\n")
    assert time.monotonic() - started < 2.0  # a session was left for it: no wait behind the hog
    for t in threads:
        t.join()
    # The hog's second query waited its bounded turn and was told so with ClickHouse's own code.
    assert sorted(outcomes) == [(200, ""), (503, "202")]


def test_a_query_whose_client_left_is_killed(endpoint: QueryEndpoint, chdb_dir: Path) -> None:
    marker = "left_behind_7f3a"
    sql = f"SELECT sum(cityHash64(number)) AS {marker} FROM numbers(100000000000)"
    with socket.create_connection((endpoint.host, endpoint.port)) as sock:
        sock.sendall(f"POST / HTTP/1.1\r\nHost: localhost\r\nContent-Length: {len(sql)}\r\n\r\n{sql}".encode())
        deadline = time.monotonic() + 10
        while _running(chdb_dir, marker) == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _running(chdb_dir, marker) == 1
    deadline = time.monotonic() + 10  # the client is gone: the engine stops within a look or two
    while _running(chdb_dir, marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _running(chdb_dir, marker) == 0
    assert _get(endpoint, "SELECT 2") == (200, "", b"2\n")  # its session was closed, the others serve


def test_a_query_whose_client_left_part_way_through_its_result_is_killed(endpoint: QueryEndpoint,
                                                                        chdb_dir: Path) -> None:
    marker = "left_mid_result_5c1e"
    # One row a block, 3 s each: without the kill, the engine would go on until a write to the closed socket failed.
    sql = f"SELECT sleepEachRow(3) AS {marker} FROM numbers(20) SETTINGS max_block_size = 1"
    with socket.create_connection((endpoint.host, endpoint.port)) as sock:
        sock.sendall(f"POST / HTTP/1.1\r\nHost: localhost\r\nContent-Length: {len(sql)}\r\n\r\n{sql}".encode())
        sock.settimeout(30)
        assert sock.recv(1 << 16).startswith(b"HTTP/1.1 200")  # headers and the first block: the result began
    left = time.monotonic()
    while _running(chdb_dir, marker) and time.monotonic() - left < 10:
        time.sleep(0.1)
    assert _running(chdb_dir, marker) == 0
    assert time.monotonic() - left < 2.5  # killed, not left to fail on its next block 3 s on


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8124", "127.0.0.1.nip.io", "localhost.evil.example"])
def test_a_loopback_listener_answers_only_loopback_names(endpoint: QueryEndpoint, host: str) -> None:
    status, code, _ = _get(endpoint, "SELECT 1", {"Host": host})
    assert (status, code) == (403, "516")
    for name in ("localhost", f"127.0.0.1:{endpoint.port}", f"localhost:{endpoint.port}", "127.1.2.3"):
        assert _get(endpoint, "SELECT 1", {"Host": name})[0] == 200


@pytest.mark.parametrize("headers", [{"Origin": "http://evil.example"}, {"Sec-Fetch-Site": "cross-site"},
                                     {"Origin": "http://localhost:1"}, {"Origin": "null"}, {"Origin": "http://[x"}])
def test_a_page_of_another_origin_gets_nothing(endpoint: QueryEndpoint, headers: dict[str, str]) -> None:
    status, _, body = _get(endpoint, "SELECT 1", headers)
    assert status == 403 and b"cross-origin" in body


def test_no_cors_header_is_ever_sent(endpoint: QueryEndpoint) -> None:
    request = urllib.request.Request(f"{endpoint.url}/?add_http_cors_header=1", data=b"SELECT 1")
    with urllib.request.urlopen(request, timeout=30) as response:
        assert "Access-Control-Allow-Origin" not in response.headers


def test_refusals_are_logged_rate_limited(endpoint: QueryEndpoint, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("WARNING", logger="stepline.endpoints.query")
    for _ in range(30):
        assert _get(endpoint, "DROP TABLE x")[1] == "164"
        assert _get(endpoint, "SELECT 1 SETTINGS output_format_schema = '/tmp/x'")[1] == "452"
    lines = [r.getMessage() for r in caplog.records if r.name == "stepline.endpoints.query"]
    assert 2 <= len(lines) <= 4, lines  # one per kind of refusal and interval, not one per request
