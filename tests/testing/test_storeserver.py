"""The test store server: ClickHouse's HTTP protocol over the embedded store, writes included, on IPv4 or IPv6."""

from __future__ import annotations

import urllib.request
import uuid
from pathlib import Path

import clickhouse_connect

from stepline.store.url import parse_store_url
from stepline.testing.storeserver import StoreServer
from tests.core.test_listener import needs_ipv6


def test_url_and_a_restart_on_the_same_port(store_server: StoreServer) -> None:
    port = store_server.port
    assert store_server.url == f"http://127.0.0.1:{port}" and store_server.store_url("db") == f"{store_server.url}/db"
    store_server.stop()
    store_server.start()
    assert store_server.port == port
    with urllib.request.urlopen(f"{store_server.url}/ping", timeout=10) as response:
        assert response.read() == b"Ok.\n"


@needs_ipv6
def test_listens_on_ipv6_loopback_when_given_it(chdb_dir: Path) -> None:
    server = StoreServer(str(chdb_dir), "::1")
    server.start()
    database = f"s6_{uuid.uuid4().hex[:10]}"
    try:
        assert server.url == f"http://[::1]:{server.port}"
        store_url = server.store_url(database)
        assert parse_store_url(store_url).redacted() == store_url  # as the collector prints and announces it
        with urllib.request.urlopen(f"{server.url}/ping", timeout=10) as response:
            assert response.read() == b"Ok.\n"
        client = clickhouse_connect.get_client(host="::1", port=server.port)
        client.command(f"CREATE DATABASE `{database}`")
        client.command(f"CREATE TABLE `{database}`.t (n UInt32) ENGINE = MergeTree ORDER BY n")
        client.insert(f"`{database}`.t", [(1,), (2,)], column_names=["n"])
        assert client.query(f"SELECT sum(n) FROM `{database}`.t").result_rows == [(3,)]
        assert server.inserts == 1
        client.command(f"DROP DATABASE `{database}`")
        client.close()
    finally:
        server.close()
