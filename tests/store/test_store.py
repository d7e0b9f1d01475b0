"""The store: schema creation, version guard, retention, cluster DDL, URLs and clear errors."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from clickhouse_connect.driver.exceptions import DatabaseError

from stepline.model import schema
from stepline.model.rows import Request, micros
from stepline.store.store import Store, StoreError, StoreLocked, embedded_store_locked
from stepline.store.url import StoreUrlError, parse_store_url

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def _tables(store: Store) -> set[str]:
    rows = store.query("SELECT name FROM system.tables WHERE database = {db:String}",
                       parameters={"db": store.database}).result_rows
    return {r[0] for r in rows}


def test_schema_creates_every_table_and_is_idempotent(store: Store) -> None:
    expected = {t.name for t in schema.TABLES} | {"schema_version", "timeline"}
    assert _tables(store) == expected
    store.insert("events", [[micros(time.time()), "h", "e", "test", "k", "info", "m", {}]],
                 schema.TABLE_BY_NAME["events"].column_names)
    store.ensure_schema(30)
    store.ensure_schema(30)
    assert _tables(store) == expected
    assert store.query("SELECT count() FROM schema_version").result_rows[0][0] == 1
    assert store.query("SELECT count() FROM events").result_rows[0][0] == 1
    assert store.schema_version() == schema.SCHEMA_VERSION


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


def test_retention_change_rewrites_the_ttl(store: Store) -> None:
    store.ensure_schema(7)
    engine_full = store.query(
        "SELECT engine_full FROM system.tables WHERE database = {db:String} AND name = 'steps'",
        parameters={"db": store.database}).result_rows[0][0]
    assert "toIntervalDay(7)" in engine_full or "INTERVAL 7 DAY" in engine_full


def test_a_store_of_a_newer_schema_is_refused(store: Store) -> None:
    store.insert("schema_version", [[schema.SCHEMA_VERSION + 1, 0]], ["version", "applied_at"])
    with pytest.raises(StoreError, match=rf"schema version {schema.SCHEMA_VERSION + 1}, newer .* upgrade stepline"):
        store.ensure_schema(30)


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
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time, clickhouse_connect
            c = clickhouse_connect.get_client(dsn="chdb://{tmp_path}")
            print("open", flush=True)
            sys.stdin.readline()
        """)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "open"
        assert embedded_store_locked(str(tmp_path))
        started = time.monotonic()
        with pytest.raises(StoreLocked) as info:
            Store.open(f"chdb://{tmp_path}")
        assert "is in use by another process" in str(info.value)
        assert "\n" not in str(info.value)
        assert time.monotonic() - started < 5
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(30)
    assert not embedded_store_locked(str(tmp_path))


def test_the_store_directory_may_not_be_a_file(tmp_path: Path) -> None:
    target = tmp_path / "not-a-dir"
    target.write_text("x")
    with pytest.raises(StoreError, match="is a file, not a directory"):
        Store.open(f"chdb://{target}")


def test_typed_rows_match_their_tables_column_for_column() -> None:
    from stepline.model.rows import TABLE_OF

    for row_type, table in TABLE_OF.items():
        assert row_type._fields == schema.TABLE_BY_NAME[table].column_names, table


def test_columns_added_since_a_store_was_created_are_added_in_place(store: Store) -> None:
    store.client.command(f"ALTER TABLE `{store.database}`.`gpu_samples` DROP COLUMN clock_event_flags")
    store.client.command(f"ALTER TABLE `{store.database}`.`host_samples` DROP COLUMN mem_total_bytes")
    store.ensure_schema(30)
    columns = [r[0] for r in store.query(
        "SELECT name FROM system.columns WHERE database = {db:String} AND table = 'gpu_samples' ORDER BY position",
        parameters={"db": store.database}).result_rows]
    assert columns == list(schema.TABLE_BY_NAME["gpu_samples"].column_names)
    assert store.query("SELECT count() FROM timeline").result_rows == [(0,)]


def test_a_cluster_store_is_left_to_its_operator(store: Store, caplog: pytest.LogCaptureFixture,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # chDB has no clusters to hold Distributed tables: the cluster check is stood in, the rest is real.
    db = store.database
    store.client.command(f"ALTER TABLE `{db}`.`events` DROP COLUMN attributes")
    store.client.command(f"ALTER TABLE `{db}`.`steps` COMMENT COLUMN elapsed_ms '', COMMENT COLUMN step ''")
    store.client.command(f"CREATE TABLE `{db}`.`requests_local` (ts DateTime64(6, 'UTC')) ENGINE = MergeTree "
                         "ORDER BY ts")  # as version 1 made it
    monkeypatch.setattr(store, "_on_cluster", lambda: True)
    with caplog.at_level("WARNING"):
        store.ensure_schema(7)  # no ALTER: on a cluster that is the operator's ON CLUSTER job
    assert "requests_local is not today's AggregatingMergeTree table" in caplog.text
    assert "lack events.attributes" in caplog.text
    assert "comments on 2 columns of steps" in caplog.text
    assert _comments(store)[("steps", "elapsed_ms")] == ""
    assert "steps_local.steps_per_second" in caplog.text  # projections are added ON CLUSTER to the shards' tables
    columns = {r[0] for r in store.query("SELECT name FROM system.columns WHERE database = {db:String} "
                                         "AND table = 'events'", parameters={"db": db}).result_rows}
    assert "attributes" not in columns
    assert "toIntervalDay(30)" in store.query("SELECT engine_full FROM system.tables WHERE database = {db:String} "
                                              "AND name = 'steps'", parameters={"db": db}).result_rows[0][0]


def _comments(store: Store) -> dict[tuple[str, str], str]:
    return {(str(t), str(n)): str(c) for t, n, c in store.query(
        "SELECT table, name, comment FROM system.columns WHERE database = {db:String}",
        parameters={"db": store.database}).result_rows}


def _assert_every_column_described(store: Store) -> None:
    comments = _comments(store)
    for table in schema.STORE_TABLES:
        for column in table.definition:
            assert comments[(table.name, column.name)] == column.comment, f"{table.name}.{column.name}"
            assert column.comment.strip(), f"{table.name}.{column.name} has no comment"


def test_every_column_of_a_new_store_says_what_it_holds(store: Store) -> None:
    _assert_every_column_described(store)
    described = store.query("DESCRIBE TABLE steps")  # what Grafana's query builder reads
    comment_at = described.column_names.index("comment")
    assert [row[comment_at] for row in described.result_rows] == [c.comment for c in schema.TABLES[0].definition]


def test_a_store_made_before_column_comments_gets_them_when_opened(store_url: str) -> None:
    old = Store.open(store_url)
    db = old.database
    try:
        ddl = (FIXTURES / "schema-v1-without-comments.sql").read_text().replace("`DB`", f"`{db}`")
        for statement in ddl.split(";\n\n"):
            old.client.command(statement.strip().rstrip(";"))
        old.insert("schema_version", [[1, 0]], ["version", "applied_at"])
        old.insert("events", [[micros(time.time()), "h", "e", "test", "k", "info", "m", {}]],
                   schema.TABLE_BY_NAME["events"].column_names)
        assert set(_comments(old).values()) == {""}  # the fixture is what it says
        old.ensure_schema(30)
        _assert_every_column_described(old)
        assert old.query("SELECT count() FROM events").result_rows == [(1,)]
        assert old.schema_version() == schema.SCHEMA_VERSION
        tables = {str(n): str(c) for n, c in old.query(
            "SELECT name, comment FROM system.tables WHERE database = {db:String}", parameters={"db": db}).result_rows}
        assert tables["schema_version"] == schema.SCHEMA_VERSION_TABLE.comment
    finally:
        old.client.command(f"DROP DATABASE IF EXISTS `{db}`")
        old.close()


def test_a_reworded_comment_reaches_an_existing_store(store: Store) -> None:
    store.client.command(f"ALTER TABLE `{store.database}`.`gpu_samples` COMMENT COLUMN power_w 'watts, once'")
    store.ensure_schema(30)
    assert _comments(store)[("gpu_samples", "power_w")] == schema.TABLE_BY_NAME["gpu_samples"].column_comments[
        "power_w"]


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


def _v1_store(store_url: str) -> Store:
    """A store as stepline's schema version 1 made it (before column comments), with no rows."""
    old = Store.open(store_url)
    ddl = (FIXTURES / "schema-v1-without-comments.sql").read_text().replace("`DB`", f"`{old.database}`")
    for statement in ddl.split(";\n\n"):
        old.client.command(statement.strip().rstrip(";"))
    old.insert("schema_version", [[1, 0]], ["version", "applied_at"])
    return old


def _request(rid: str, source: str, at: float) -> Request:
    if source == "plugin":
        return Request(micros(at), "h", "e", 1, "m", rid, "plugin", "stop", micros(at - 2), 0.1, 0.2, 1.7, 1.9, 2.0,
                       0.3, 0.1, 5000, 4096, 18, 64, 1)
    return Request(micros(at + 0.002), "h", "e", 0, "m", rid, "otlp", "", micros(at - 2), 0.1, float("nan"), 1.7,
                   1.9, 2.0, 0.3, 0.1, 5000, 0, 18, 64, 0)


def test_a_version_1_store_gets_requests_that_merge_in_place(store_url: str) -> None:
    old = _v1_store(store_url)
    db = old.database
    try:
        t = time.time() - 60
        # Version 1 wrote the first report only: "a" came from OTLP (no cached tokens), "b" from the plugin.
        old.insert("requests", [_request("a", "otlp", t), _request("b", "plugin", t)], Request._fields)
        old.client.command(f"CREATE TABLE `{db}`.`requests_rebuild` (x UInt8) ENGINE = Memory")  # a stop mid-way
        old.ensure_schema(30)
        assert old.schema_version() == schema.SCHEMA_VERSION == 3
        engines = {str(n): str(e) for n, e in old.query(
            "SELECT name, engine FROM system.tables WHERE database = {db:String}", parameters={"db": db}).result_rows}
        assert engines["requests"] == "AggregatingMergeTree" and "requests_rebuild" not in engines
        assert old.query("SELECT request_id, source, cached_tokens FROM requests FINAL ORDER BY request_id"
                         ).result_rows == [("a", "otlp", 0), ("b", "plugin", 4096)]
        _assert_every_column_described(old)
        # The plugin's report of "a", written after the upgrade, completes it; "b"'s span changes nothing.
        old.insert("requests", [_request("a", "plugin", t), _request("b", "otlp", t)], Request._fields)
        assert old.query("SELECT request_id, source, finish_reason, cached_tokens, preemptions, engine_index "
                         "FROM requests FINAL ORDER BY request_id").result_rows == [
            ("a", "plugin", "stop", 4096, 1, 1), ("b", "plugin", "stop", 4096, 1, 1)]
        old.ensure_schema(30)  # the next open finds nothing to rebuild
        assert old.query("SELECT count() FROM requests FINAL").result_rows == [(2,)]
    finally:
        old.client.command(f"DROP DATABASE IF EXISTS `{db}`")
        old.close()


def test_a_store_stopped_after_the_exchange_drops_the_old_table_at_the_next_open(store: Store) -> None:
    store.client.command(f"CREATE TABLE `{store.database}`.`requests_rebuild` AS `{store.database}`.`events`")
    store.ensure_schema(30)
    assert "requests_rebuild" not in _tables(store)


def test_recent_requests_are_read_merged(store: Store) -> None:
    t = time.time() - 60
    store.insert("requests", [_request("a", "otlp", t), _request("a", "plugin", t),
                              _request("old", "plugin", t - 3600)], Request._fields)
    (recent,) = store.recent_requests("h", 600)

    def rounded(r: Request) -> tuple[object, ...]:  # the seconds are Float32 in the store
        return tuple(round(v, 6) if isinstance(v, float) else v for v in r)

    assert rounded(recent) == rounded(_request("a", "plugin", t))
