"""Schema creation and migration: a new store, the version guard, retention, and older stores upgraded in place."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest

from stepline.model import schema
from stepline.model.rows import Request, micros
from stepline.store.errors import StoreError
from stepline.store.migrations import Migration
from stepline.store.store import Store
from tests.store.test_store import request_report

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def _tables(store: Store) -> set[str]:
    rows = store.query("SELECT name FROM system.tables WHERE database = {db:String}",
                       parameters={"db": store.database}).result_rows
    return {r[0] for r in rows}


def test_a_new_database_has_version_0_and_no_cluster(store_url: str) -> None:
    new = Store.open(store_url)
    try:
        migration = Migration(new.client, new.database)
        new.client.command(schema.ddl(new.database, 30)[-1])  # only the schema_version table
        assert migration.version() == 0
        assert not migration.on_cluster()
        migration.ensure(30, new.url.redacted())
        assert migration.version() == schema.SCHEMA_VERSION and not migration.on_cluster()
    finally:
        new.client.command(f"DROP DATABASE IF EXISTS `{new.database}`")
        new.close()


def test_a_failing_statement_is_one_line_naming_the_store(store: Store) -> None:
    # A view where a table belongs: ClickHouse refuses to add today's columns to it.
    store.client.command(f"DROP TABLE `{store.database}`.`steps`")
    store.client.command(f"CREATE VIEW `{store.database}`.`steps` AS SELECT now64(6) AS ts")
    with pytest.raises(StoreError) as info:
        Migration(store.client, store.database).ensure(30, "chdb:///the/store")
    assert str(info.value).startswith("cannot create the schema in chdb:///the/store: ")
    assert "\n" not in str(info.value)


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


def test_columns_added_since_a_store_was_created_are_added_in_place(store: Store) -> None:
    store.client.command(f"ALTER TABLE `{store.database}`.`gpu_samples` DROP COLUMN clock_event_flags")
    store.client.command(f"ALTER TABLE `{store.database}`.`host_samples` DROP COLUMN mem_total_bytes")
    store.ensure_schema(30)
    columns = [r[0] for r in store.query(
        "SELECT name FROM system.columns WHERE database = {db:String} AND table = 'gpu_samples' ORDER BY position",
        parameters={"db": store.database}).result_rows]
    assert columns == list(schema.TABLE_BY_NAME["gpu_samples"].column_names)
    assert store.query("SELECT count() FROM timeline").result_rows == [(0,)]


def test_a_cluster_store_named_without_its_cluster_is_refused_and_left_alone(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    # chDB's test engine has no clusters to hold Distributed tables: the cluster check is stood in, the rest is real
    # (tests/store/test_cluster.py runs a cluster).
    db = store.database
    store.client.command(f"ALTER TABLE `{db}`.`events` DROP COLUMN attributes")
    monkeypatch.setattr(Migration, "on_cluster", lambda self: True)
    with pytest.raises(StoreError, match=r"holds a cluster's Distributed tables: name the cluster in the store URL "
                                         r"\(\?cluster=NAME\)"):
        store.ensure_schema(7)
    columns = {r[0] for r in store.query("SELECT name FROM system.columns WHERE database = {db:String} "
                                         "AND table = 'events'", parameters={"db": db}).result_rows}
    assert "attributes" not in columns  # no ALTER: a cluster's tables are the schema job's
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


def _v1_store(store_url: str) -> Store:
    """A store as stepline's schema version 1 made it (before column comments), with no rows."""
    old = Store.open(store_url)
    ddl = (FIXTURES / "schema-v1-without-comments.sql").read_text().replace("`DB`", f"`{old.database}`")
    for statement in ddl.split(";\n\n"):
        old.client.command(statement.strip().rstrip(";"))
    old.insert("schema_version", [[1, 0]], ["version", "applied_at"])
    return old


def test_a_version_1_store_gets_requests_that_merge_in_place(store_url: str) -> None:
    old = _v1_store(store_url)
    db = old.database
    try:
        t = time.time() - 60
        # Version 1 wrote the first report only: "a" came from OTLP (no cached tokens), "b" from the plugin.
        old.insert("requests", [request_report("a", "otlp", t), request_report("b", "plugin", t)], Request._fields)
        old.client.command(f"CREATE TABLE `{db}`.`requests_rebuild` (x UInt8) ENGINE = Memory")  # a stop mid-way
        old.ensure_schema(30)
        assert old.schema_version() == schema.SCHEMA_VERSION
        engines = {str(n): str(e) for n, e in old.query(
            "SELECT name, engine FROM system.tables WHERE database = {db:String}", parameters={"db": db}).result_rows}
        assert engines["requests"] == "AggregatingMergeTree" and "requests_rebuild" not in engines
        assert old.query("SELECT request_id, source, cached_tokens FROM requests FINAL ORDER BY request_id"
                         ).result_rows == [("a", "otlp", 0), ("b", "plugin", 4096)]
        _assert_every_column_described(old)
        # The plugin's report of "a", written after the upgrade, completes it; "b"'s span changes nothing.
        old.insert("requests", [request_report("a", "plugin", t), request_report("b", "otlp", t)], Request._fields)
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


def _gpu_columns_as_uint64(store: Store, columns: tuple[tuple[str, str], ...]) -> None:
    """`gpu_samples` with `columns` (name, the column before it) plain UInt64, as an older schema made them."""
    db = store.database
    table = schema.TABLE_BY_NAME["gpu_samples"]
    for projection in table.projections:
        store.client.command(f"ALTER TABLE `{db}`.gpu_samples DROP PROJECTION `{projection.name}`")
    for name, after in columns:
        store.client.command(f"ALTER TABLE `{db}`.gpu_samples DROP COLUMN `{name}`")
        store.client.command(f"ALTER TABLE `{db}`.gpu_samples ADD COLUMN `{name}` UInt64 CODEC(Delta, ZSTD(1)) "
                             f"AFTER `{after}`")
    for projection in table.projections:
        for statement in schema.add_projection_sql(db, table, projection):
            store.client.command(statement)


def _converted(store: Store, columns: tuple[str, ...], query: str, want: list[tuple[object, ...]]) -> None:
    """After ensure_schema: `columns` are Nullable, the projections are back, and `query` reads `want` once the
    background zero-to-NULL mutations have reached every part."""
    store.ensure_schema(30)
    db = store.database
    types = {str(n): str(t) for n, t in store.query("SELECT name, type FROM system.columns WHERE "
                                                     "database = {db:String} AND table = 'gpu_samples'",
                                                     parameters={"db": db}).result_rows}
    assert {types[c] for c in columns} == {"Nullable(UInt64)"}
    projections = [r[0] for r in store.query("SELECT name FROM system.projections WHERE database = {db:String} "
                                             "AND table = 'gpu_samples'", parameters={"db": db}).result_rows]
    assert projections == [p.name for p in schema.TABLE_BY_NAME["gpu_samples"].projections]
    for _ in range(100):
        got = store.query(query).result_rows
        if got == want:
            break
        time.sleep(0.05)
    assert got == want
    assert store.schema_version() == schema.SCHEMA_VERSION


def test_a_version_2_store_gets_nullable_counters_in_place(store: Store) -> None:
    _gpu_columns_as_uint64(store, (("energy_mj", "power_w"), ("pcie_replay_total", "pcie_rx_bytes_per_s")))
    store.client.command(f"INSERT INTO `{store.database}`.gpu_samples (ts, host, gpu_index, energy_mj, "
                         "pcie_replay_total) VALUES (now64(6), 'h', 0, 9000, 0), (now64(6), 'h', 0, 0, 0), "
                         "(now64(6), 'h', 0, 12000, 1)")
    # The version-2 zero was a failed read: passed over, not 12 J since load.
    _converted(store, ("energy_mj", "pcie_replay_total"), "SELECT max(energy_mj) - min(energy_mj), "
               "max(pcie_replay_total) - min(pcie_replay_total) FROM gpu_samples", [(3000, 1)])


def test_a_version_3_store_gets_nullable_gpu_memory_in_place(store: Store) -> None:
    _gpu_columns_as_uint64(store, (("mem_used_bytes", "util_mem_copy_pct"), ("mem_total_bytes", "mem_used_bytes")))
    # Version 3 wrote a failed memory read as 0 used of 0 in all.
    store.client.command(f"INSERT INTO `{store.database}`.gpu_samples (ts, host, gpu_index, mem_used_bytes, "
                         f"mem_total_bytes) VALUES (now64(6), 'h', 0, {70 << 30}, {141 << 30}), "
                         f"(now64(6), 'h', 0, 0, 0), (now64(6), 'h', 1, 0, {141 << 30})")
    _converted(store, ("mem_used_bytes", "mem_total_bytes"),
               "SELECT gpu_index, mem_used_bytes, mem_total_bytes FROM gpu_samples "
               "ORDER BY gpu_index, mem_total_bytes NULLS FIRST",
               [(0, None, None), (0, 70 << 30, 141 << 30), (1, 0, 141 << 30)])  # a used of 0 beside a total is real
    assert store.query("SELECT max(mem_total_bytes) FROM gpu_samples").result_rows == [(141 << 30,)]


def test_a_version_4_store_gets_requests_keyed_by_arrival_in_place(store: Store) -> None:
    # Version 4 keyed requests by (host, engine, request_id) and merged arrival_ts with min.
    db, table = store.database, schema.TABLE_BY_NAME["requests"]
    v4 = dataclasses.replace(table, order_by=("host", "engine", "request_id"), definition=tuple(
        c._replace(type=schema.merged(schema.TIME, "min")) if c.name == "arrival_ts" else c
        for c in table.definition))
    store.client.command(f"DROP TABLE `{db}`.`requests`")
    store.client.command(schema.create_table_sql(db, v4, 30))
    t = time.time() - 60
    # "a"'s two reports not merged yet, the span's arrival a microsecond off the plugin's; "b" the plugin's only.
    span = request_report("a", "otlp", t)
    store.insert("requests", [span._replace(arrival_ts=span.arrival_ts + 1, model_name="served"),
                              request_report("a", "plugin", t)._replace(model_name=""),
                              request_report("b", "plugin", t)], Request._fields)
    store.ensure_schema(30)
    key = store.query("SELECT sorting_key FROM system.tables WHERE database = {db:String} AND name = 'requests'",
                      parameters={"db": db}).result_rows
    assert key == [("host, engine, request_id, arrival_ts",)]
    assert store.query("SELECT request_id, model_name, cached_tokens, toUnixTimestamp64Micro(arrival_ts) "
                       "FROM requests FINAL ORDER BY request_id").result_rows == [
        ("a", "served", 4096, micros(t - 2)), ("b", "m", 4096, micros(t - 2))]
    # From now on, "a" again (a retry under the same id, a minute later) is a request of its own.
    store.insert("requests", [request_report("a", "plugin", t + 60)], Request._fields)
    assert store.query("SELECT count(), sum(prompt_tokens) FROM requests FINAL").result_rows == [(3, 15_000)]
    store.ensure_schema(30)  # and nothing is rebuilt twice
    assert "requests_rebuild" not in _tables(store)


def test_a_store_made_before_requests_by_prompt_gets_it_in_place(store: Store) -> None:
    db = store.database
    store.client.command(f"ALTER TABLE `{db}`.requests DROP PROJECTION `{schema.REQUESTS_BY_PROMPT.name}`")
    store.client.command(f"ALTER TABLE `{db}`.requests MODIFY SETTING deduplicate_merge_projection_mode = 'throw'")
    store.insert("requests", [request_report("r1", "plugin", time.time())],
                 schema.TABLE_BY_NAME["requests"].column_names)
    store.ensure_schema(30)
    engine_full, = store.query("SELECT engine_full FROM system.tables WHERE database = {db:String} "
                               "AND name = 'requests'", parameters={"db": db}).result_rows[0]
    assert "deduplicate_merge_projection_mode = 'rebuild'" in engine_full
    projections = [r[0] for r in store.query("SELECT name FROM system.projections WHERE database = {db:String} "
                                             "AND table = 'requests'", parameters={"db": db}).result_rows]
    assert sorted(projections) == [schema.REQUESTS_BY_PROMPT.name, schema.REQUESTS_PER_MINUTE.name]
    for _ in range(100):  # MATERIALIZE PROJECTION is a background mutation
        if not store.query("SELECT count() FROM system.mutations WHERE database = {db:String} AND NOT is_done",
                           parameters={"db": db}).result_rows[0][0]:
            break
        time.sleep(0.05)
    built = store.query("SELECT sum(rows) FROM system.projection_parts WHERE database = {db:String} AND active "
                        "AND table = 'requests' AND name = {name:String}",
                        parameters={"db": db, "name": schema.REQUESTS_BY_PROMPT.name}).result_rows[0][0]
    assert built == 1  # the row written before is in it
