"""The schema: tables that follow the timeline's conventions, DDL ClickHouse's own parser reads, alone or over a
cluster with the comments on both tables, and the timeline view."""

from __future__ import annotations

import re

import pytest

from stepline.model import schema
from stepline.store.store import Store


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



def test_the_timeline_view_reads_the_database_it_is_given_or_the_sessions() -> None:
    named = schema.timeline_sql("prod", step_filter="AND engine = {engine:String}")
    assert "`prod`.steps" in named or "`prod`.`steps`" in named
    assert "DB." not in named and "STEP_FILTER" not in named and "GPU_FILTER" not in named
    assert "AND engine = {engine:String}" in named
    assert "`prod`." not in schema.timeline_sql("")


def test_every_table_is_one_the_store_holds_under_its_name() -> None:
    assert set(schema.TABLE_BY_NAME) == {t.name for t in schema.TABLES}
    assert schema.STORE_TABLES[-1] is schema.SCHEMA_VERSION_TABLE
    assert schema.local_name("steps") == "steps_local"
    for table in schema.TABLES:
        assert table.column_names[:1] == ("ts",) and "host" in table.column_names, table.name
        assert all(comment for comment in table.column_comments.values()), table.name
