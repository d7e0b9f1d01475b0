"""The embedded store's client: a query that fails after its first block leaves nothing behind for the next one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from clickhouse_connect.driver._chdbclient import ChdbClient
from clickhouse_connect.driver.exceptions import DatabaseError

from stepline.store.chdb import SafeChdbClient, open_client

# Fails at row 50,000 of 100,000, blocks of 1,000: chDB has written 50 blocks of output by then.
FAILS_LATE = "SELECT throwIf(number = 50000, 'late failure') AS x FROM numbers(100000) SETTINGS max_block_size = 1000"


@pytest.fixture
def client(chdb_dir: Path) -> Iterator[SafeChdbClient]:
    c = open_client(str(chdb_dir))
    yield c
    c.close()


@pytest.mark.parametrize("call", ["query", "command", "raw_query"])
def test_after_a_late_failure_the_next_query_gets_its_own_rows(client: SafeChdbClient, call: str) -> None:
    with pytest.raises(DatabaseError, match="late failure"):
        getattr(client, call)(FAILS_LATE)
    assert client.query("SELECT 42").result_rows == [(42,)]
    assert client.command("SELECT 43") == 43
    assert client.raw_query("SELECT 44", fmt="TabSeparated") == b"44\n"


def test_the_plain_chdb_client_hands_the_failed_output_to_the_next_query(chdb_dir: Path) -> None:
    """Why SafeChdbClient exists (chDB 4.4): when this stops failing, the drain can go."""
    plain = ChdbClient(path=str(chdb_dir))
    try:
        with pytest.raises(DatabaseError):
            plain.query(FAILS_LATE)
        assert len(plain.query("SELECT 42").result_rows) > 1  # the stranger's rows, then its own
        assert plain.query("SELECT 42").result_rows == [(42,)]  # the query after that one is clean
    finally:
        plain.close()


def test_a_client_opens_on_the_sessions_engine_with_its_database(client: SafeChdbClient, chdb_dir: Path) -> None:
    client.command("CREATE DATABASE IF NOT EXISTS chdb_client_db")
    try:
        scoped = open_client(str(chdb_dir), database="chdb_client_db")
        try:
            assert scoped.command("SELECT currentDatabase()") == "chdb_client_db"
        finally:
            scoped.close()
    finally:
        client.command("DROP DATABASE IF EXISTS chdb_client_db")
