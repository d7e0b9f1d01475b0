"""The query endpoint's chDB sessions: read-only whatever a query sets, pooled by settings, a failed session not
reused, a full pool refused with ClickHouse's own code, and engine errors carried with their code and name."""

from __future__ import annotations

import uuid
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import cast

import pytest
from clickhouse_connect.driver.client import Client

from stepline.clickhouse_http.errors import SqlRefused
from stepline.endpoints import sessions
from stepline.endpoints.sessions import EngineError, Progress, Sessions


@pytest.fixture
def database(chdb_client: Client) -> Iterator[str]:
    """A database of its own holding `t`, the numbers 0 to 9."""
    name = f"t_sessions_{uuid.uuid4().hex[:8]}"
    for statement in (f"CREATE DATABASE {name}",
                      f"CREATE TABLE {name}.t ENGINE = MergeTree ORDER BY n AS SELECT toUInt32(number) AS n "
                      "FROM numbers(10)"):
        chdb_client.command(statement)
    yield name
    chdb_client.command(f"DROP DATABASE {name}")


@pytest.fixture
def pool(chdb_dir: Path) -> Iterator[Sessions]:
    opened = Sessions(str(chdb_dir), max_sessions=2)
    yield opened
    opened.close()


def _text(pool: Sessions, database: str, sql: str, settings: sessions.Settings = (), whole: bool = False) -> str:
    return b"".join(pool.run(settings, database, sql, "TSV", {}, Progress(), whole=whole)).decode()


def test_a_query_streams_its_blocks_and_counts_what_it_read(pool: Sessions, database: str) -> None:
    progress = Progress()
    blocks = list(pool.run((), database, "SELECT n FROM t ORDER BY n", "TSV", {}, progress))
    assert b"".join(blocks) == b"".join(b"%d\n" % n for n in range(10))
    assert progress.read_rows == 10 and progress.read_bytes > 0
    assert _text(pool, database, "SELECT count() FROM t", whole=True) == "10\n"


def test_parameters_are_bound_not_spliced(pool: Sessions, database: str) -> None:
    blocks = pool.run((), database, "SELECT count() FROM t WHERE n < {k:UInt32}", "TSV", {"k": "4"}, Progress())
    assert b"".join(blocks) == b"4\n"


def test_a_session_is_read_only_whatever_the_query_sets(pool: Sessions, database: str) -> None:
    with pytest.raises(EngineError) as refused:
        _text(pool, database, "INSERT INTO t VALUES (99)", whole=True)
    assert refused.value.code == 164 and refused.value.name == "READONLY"
    with pytest.raises(EngineError) as lifted:
        _text(pool, database, "SELECT 1 SETTINGS readonly = 0")
    assert lifted.value.code == 164
    assert _text(pool, database, "SELECT count() FROM t") == "10\n"  # nothing was written


def test_the_settings_a_session_opened_with_apply_to_its_queries(pool: Sessions, database: str) -> None:
    limited = (("max_result_rows", "3"), ("result_overflow_mode", "break"))
    assert _text(pool, database, "SELECT getSetting('max_result_rows')", limited) == "3\n"
    assert _text(pool, database, "SELECT getSetting('max_result_rows')") == "0\n"  # another session, pooled apart


def test_an_engine_error_carries_clickhouses_code_and_name(pool: Sessions, database: str) -> None:
    with pytest.raises(EngineError) as failed:
        _text(pool, database, "SELECT no_such_column FROM t")
    assert (failed.value.code, failed.value.name) == (47, "UNKNOWN_IDENTIFIER")
    assert str(failed.value).startswith("Code: 47. DB::Exception: ")
    assert _text(pool, database, "SELECT 1") == "1\n"  # the failed session was closed, not handed out again


def test_a_full_pool_is_refused_with_too_many_simultaneous_queries(chdb_dir: Path, database: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sessions, "_SESSION_WAIT_S", 0.2)
    pool = Sessions(str(chdb_dir), max_sessions=1)
    try:
        held = cast(Generator[bytes, None, None], pool.run((), database, "SELECT n FROM t", "TSV", {}, Progress()))
        next(held)  # the one session is busy streaming
        with pytest.raises(SqlRefused, match="all 1 query sessions are busy") as refused:
            _text(pool, database, "SELECT 1")
        assert (refused.value.code, refused.value.name) == (202, "TOO_MANY_SIMULTANEOUS_QUERIES")
        held.close()
        assert _text(pool, database, "SELECT 2") == "2\n"
    finally:
        pool.close()
    with pytest.raises(SqlRefused, match="stopping"):
        _text(pool, database, "SELECT 3")


@pytest.mark.parametrize("name", ["no\\`; DROP DATABASE x; --", "a`b", "back\\slash", "tick\\"])
def test_a_database_name_is_quoted_whole(pool: Sessions, name: str) -> None:
    with pytest.raises(EngineError) as unknown:
        _text(pool, name, "SELECT 1")
    assert unknown.value.name == "UNKNOWN_DATABASE"  # the name reached the engine as one identifier, whatever it held


def test_a_session_cannot_set_what_the_profile_does_not_allow(pool: Sessions, database: str) -> None:
    with pytest.raises(EngineError) as refused:
        _text(pool, database, "SELECT 1", (("output_format_schema", "/tmp/x.proto"),))
    assert refused.value.code == 452
    assert _text(pool, database, "SELECT 1", (("max_threads", "2"),)) == "1\n"


def test_the_parser_prints_a_query_back_once_per_text(pool: Sessions, monkeypatch: pytest.MonkeyPatch) -> None:
    sql = "SELECT * FROM (SELECT 1 SETTINGS `max_threads` = 2) /* x */ SETTINGS \"max_block_size\" = 10"
    assert pool.canonical(sql) == "SELECT * FROM (SELECT 1 SETTINGS max_threads = 2) SETTINGS max_block_size = 10"
    calls: list[str] = []
    parser = pool._parser
    assert parser is not None
    real = parser.conn

    class Counting:
        def query(self, *args: object, **kwargs: object) -> object:
            calls.append("query")
            return real.query(*args, **kwargs)

        def close(self) -> None:
            real.close()

    monkeypatch.setattr(parser, "conn", Counting())
    pool.canonical(sql)
    assert calls == []  # the same text again: the answer kept
    pool.canonical(sql + " ")
    assert calls == ["query"]
    with pytest.raises(EngineError) as bad:
        pool.canonical("SELECT 1 SETTINGS")
    assert bad.value.name == "SYNTAX_ERROR"
