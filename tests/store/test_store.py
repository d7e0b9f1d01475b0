"""The store: opening it (embedded or a server) with clear errors, its tables, cluster DDL, URLs, reads."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
from clickhouse_connect.driver.exceptions import DatabaseError

from stepline.model import schema
from stepline.model.rows import Request, micros
from stepline.store.discovery import announce_beside_store
from stepline.store.errors import StoreError, StoreLocked
from stepline.store.store import Store
from stepline.store.url import StoreUrlError, parse_store_url
from tests.store.test_locking import held_elsewhere


def test_tables_follow_the_timeline_conventions(store: Store) -> None:
    rows = store.query(
        "SELECT name, partition_key, sorting_key, engine_full FROM system.tables "
        "WHERE database = {db:String} AND name != 'schema_version' AND engine != 'View'",
        parameters={"db": store.database}
    ).result_rows
    for name, partition_key, sorting_key, engine_full in rows:
        assert partition_key == "toDate(ts)", name
        assert sorting_key.startswith("host"), name
        assert "ttl_only_drop_parts = 1" in engine_full, name
    types = {name: type_ for name, type_ in store.query(
        "SELECT concat(table, '.', name), type FROM system.columns WHERE database = {db:String}",
        parameters={"db": store.database}).result_rows}
    for table in schema.TABLES:
        ts = "DateTime64(6, 'UTC')"
        if table.name == "requests":  # it merges its reports: the earliest ts stays (reads as a plain DateTime64)
            ts = f"SimpleAggregateFunction(min, {ts})"
        assert types[f"{table.name}.ts"] == ts
        assert types[f"{table.name}.host"] == "LowCardinality(String)"
        assert types[f"{table.name}.engine"] == "LowCardinality(String)"


@pytest.mark.parametrize("cluster", [None, "fleet"])
def test_every_ddl_statement_parses_with_clickhouse_own_parser(store: Store, cluster: str | None) -> None:
    statements = schema.ddl("stepline", 30, cluster=cluster)
    for statement in statements:
        formatted = store.query("SELECT formatQuery({q:String})", parameters={"q": statement}).result_rows[0][0]
        assert formatted.startswith("CREATE")
    text = "\n".join(statements)
    if cluster:
        assert text.count("ON CLUSTER `fleet`") == len(statements)
        assert text.count("ENGINE = Distributed(`fleet`") == len(schema.TABLES)
        assert text.count("ReplicatedMergeTree(") == len(schema.TABLES)  # requests: ReplicatedAggregatingMergeTree
        assert text.count("ReplicatedAggregatingMergeTree(") == 1
    else:
        assert "ON CLUSTER" not in text and "Replicated" not in text


def test_retention_below_one_day_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1 day"):
        schema.ddl("stepline", 0)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("mysql://host/db", "scheme 'mysql'"),
        ("/var/lib/stepline", "has no scheme"),
        ("chdb://", "names no directory"),
        ("http://:8123/db", "names no host"),
        ("http://host:99999/db", "bad port"),
        ("http://host:8123/bad-name", "letters, digits or _"),
    ],
)
def test_bad_store_urls_get_one_clear_line(text: str, fragment: str) -> None:
    with pytest.raises(StoreUrlError) as info:
        parse_store_url(text)
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


def test_store_urls_parse() -> None:
    embedded = parse_store_url("chdb:///var/lib/stepline?database=prod")
    assert (embedded.scheme, embedded.path, embedded.database) == ("chdb", "/var/lib/stepline", "prod")
    server = parse_store_url("https://reader:s%40cret@ch.internal:8443/timeline")
    assert (server.host, server.port, server.username, server.password, server.database) == (
        "ch.internal", 8443, "reader", "s@cret", "timeline")
    assert "s@cret" not in server.redacted()
    assert parse_store_url("http://ch").port == 8123
    assert parse_store_url("chdb://relative/dir").path == os.path.abspath("relative/dir")


def test_an_unreachable_server_is_one_line() -> None:
    with pytest.raises(StoreError) as info:
        Store.open("http://127.0.0.1:9/stepline", connect_timeout_s=1.0)
    assert str(info.value).startswith("cannot reach the store at http://127.0.0.1:9/stepline")
    assert "\n" not in str(info.value)


def test_an_embedded_store_held_by_another_process_is_reported(tmp_path: Path) -> None:
    with held_elsewhere(tmp_path):
        started = time.monotonic()
        with pytest.raises(StoreLocked) as info:
            Store.open(f"chdb://{tmp_path}")
        assert str(info.value) == (f"the embedded store {tmp_path} is in use by another process: query it through "
                                   "that collector, or stop it first")
        assert info.value.holder is None
        assert time.monotonic() - started < 5
        # A collector announces itself beside the store it holds: the message names it.
        announce_beside_store(str(tmp_path), "http://127.0.0.1:8124", "http://127.0.0.1:9465/metrics", False)
        with pytest.raises(StoreLocked) as info:
            Store.open(f"chdb://{tmp_path}")
        assert f"another process (collector pid {os.getpid()}, query endpoint http://127.0.0.1:8124): " in str(
            info.value)
        assert info.value.holder is not None and info.value.holder.metrics_url == "http://127.0.0.1:9465/metrics"


def test_the_store_directory_may_not_be_a_file(tmp_path: Path) -> None:
    target = tmp_path / "not-a-dir"
    target.write_text("x")
    with pytest.raises(StoreError, match="is a file, not a directory"):
        Store.open(f"chdb://{target}")


def test_typed_rows_match_their_tables_column_for_column() -> None:
    from stepline.model.rows import TABLE_OF

    for row_type, table in TABLE_OF.items():
        assert row_type._fields == schema.TABLE_BY_NAME[table].column_names, table


@pytest.mark.parametrize("table", [t.name for t in schema.TABLES])
def test_both_tables_of_the_cluster_rendering_carry_the_comments(store: Store, table: str) -> None:
    # chDB has no cluster and no Keeper: run the cluster DDL with stand-in engines (MergeTree for the replicated
    # table, Merge for Distributed) to see what `CREATE TABLE ... AS local` gives the table over the shards.
    db = f"{store.database}_c"
    statements = [s.replace(" ON CLUSTER `fleet`", "") for s in schema.ddl(db, 30, cluster="fleet")]
    local = next(s for s in statements if f"`{db}`.`{table}_local`" in s.split("\n")[0])
    over = next(s for s in statements if s.split("\n")[0].endswith(f"`{db}`.`{table}`"))
    try:
        store.client.command(f"CREATE DATABASE `{db}`")
        store.client.command(re.sub(r"Replicated(\w*)MergeTree\('[^']*', '[^']*'\)", r"\1MergeTree", local))
        store.client.command(over.split("ENGINE = Distributed")[0] + f"ENGINE = Merge(`{db}`, '^{table}_local$')")
        comments = {(str(t), str(n)): str(c) for t, n, c in store.query(
            "SELECT table, name, comment FROM system.columns WHERE database = {db:String}",
            parameters={"db": db}).result_rows}
        for column in schema.TABLE_BY_NAME[table].definition:
            assert comments[(f"{table}_local", column.name)] == column.comment
            assert comments[(table, column.name)] == column.comment
    finally:
        store.client.command(f"DROP DATABASE IF EXISTS `{db}`")


def test_a_query_failing_part_way_leaves_nothing_for_the_next_one(store: Store) -> None:
    # chDB 4.4 keeps a failed query's first blocks in the connection, in front of the next query's answer.
    for run in (store.query, store.reader().query):
        with pytest.raises(DatabaseError):
            run("SELECT number, throwIf(number = 500000) FROM numbers(1000000)")
        assert run("SELECT count() FROM numbers(10)").result_rows == [(10,)]
    with pytest.raises(DatabaseError):
        store.raw("SELECT number, throwIf(number = 500000) FROM numbers(1000000)", "TabSeparated")
    assert store.raw("SELECT 7", "TabSeparated") == b"7\n"


def request_report(rid: str, source: str, at: float) -> Request:
    """One report of request `rid` finished at `at`: the plugin's (cached tokens, finish reason) or OTLP's."""
    if source == "plugin":
        return Request(micros(at), "h", "e", 1, "m", rid, "plugin", "stop", micros(at - 2), 0.1, 0.2, 1.7, 1.9, 2.0,
                       0.3, 0.1, 5000, 4096, 18, 64, 1)
    return Request(micros(at + 0.002), "h", "e", 0, "m", rid, "otlp", "", micros(at - 2), 0.1, float("nan"), 1.7,
                   1.9, 2.0, 0.3, 0.1, 5000, 0, 18, 64, 0)


def test_recent_requests_are_read_merged(store: Store) -> None:
    t = time.time() - 60
    store.insert("requests", [request_report("a", "otlp", t), request_report("a", "plugin", t),
                              request_report("old", "plugin", t - 3600)], Request._fields)
    (recent,) = store.recent_requests("h", 600)

    def rounded(r: Request) -> tuple[object, ...]:  # the seconds are Float32 in the store
        return tuple(round(v, 6) if isinstance(v, float) else v for v in r)

    assert rounded(recent) == rounded(request_report("a", "plugin", t))
