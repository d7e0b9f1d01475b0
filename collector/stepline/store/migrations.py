"""Schema creation and migration: a store's database brought to this stepline's schema, in place.

Every step is idempotent and only adds or converts, so a start that stops part way is finished by the next one. A
store of a newer schema is refused, and so is a cluster's (`stepline.store.cluster` keeps a cluster's schema).
"""

from __future__ import annotations

import logging
import re
import time

from clickhouse_connect.driver.client import Client
from clickhouse_connect.driver.exceptions import ClickHouseError

from stepline.model import schema
from stepline.store.errors import StoreError, error_line
from stepline.store.reads import scalar

log = logging.getLogger(__name__)


class Migration:
    """The steps that bring one database, through one client, to today's schema."""

    def __init__(self, client: Client, database: str) -> None:
        self.client = client
        self.database = database

    def ensure(self, retention_days: int, store_name: str) -> None:
        """Create database and tables if missing, upgrade older ones; raise StoreError naming `store_name` (the
        store's URL without its password) for a store of a newer schema or a statement that fails."""
        statements = schema.ddl(self.database, retention_days)
        try:
            if self.on_cluster():
                # `stepline schema --cluster` made these tables: only that job changes them, ON CLUSTER.
                raise StoreError(f"the store at {store_name} holds a cluster's Distributed tables: name the cluster "
                                 "in the store URL (?cluster=NAME), whose schema `stepline schema --cluster NAME "
                                 "--apply URL` keeps")
            self.client.command(statements[0])
            self.client.command(statements[-1])  # schema_version first: check before touching tables
            found = self.version()
            if found > schema.SCHEMA_VERSION:
                raise StoreError(
                    f"the store at {store_name} holds schema version {found}, newer than this "
                    f"stepline's {schema.SCHEMA_VERSION}: upgrade stepline"
                )
            views = [st for st in statements[1:-1] if st.startswith("CREATE OR REPLACE VIEW")]
            for statement in statements[1:-1]:
                if statement not in views:
                    self.client.command(statement)
            self._add_missing_columns()
            self._make_nullable()
            self._rebuild_outdated_engines(retention_days)
            self._describe()
            self._set_projection_mode()
            self._add_missing_projections()
            for statement in views:  # over the tables as they now are
                self.client.command(statement)
            self._apply_retention(retention_days)
            if found < schema.SCHEMA_VERSION:
                self.client.insert(
                    f"`{self.database}`.`schema_version`",
                    [[schema.SCHEMA_VERSION, round(time.time() * 1_000_000)]],
                    column_names=["version", "applied_at"],
                )
        except ClickHouseError as exc:
            raise StoreError(f"cannot create the schema in {store_name}: {error_line(exc)}") from None

    def version(self) -> int:
        """The newest schema version recorded in the store (0 for a new store)."""
        newest = scalar(self.client.query(f"SELECT max(version) FROM `{self.database}`.`schema_version`"))
        return int(newest) if newest is not None else 0

    def on_cluster(self) -> bool:
        """Whether the timeline tables are Distributed tables over a cluster."""
        return bool(scalar(self.client.query("SELECT count() FROM system.tables WHERE database = {db:String} "
                                             "AND engine = 'Distributed'", parameters={"db": self.database})))

    def _missing_columns(self) -> list[str]:
        """`table.column` for each column this stepline has and the store's tables lack, in schema order."""
        rows = self.client.query("SELECT table, name FROM system.columns WHERE database = {db:String}",
                                 parameters={"db": self.database}).result_rows
        present: dict[str, set[str]] = {}
        for table, name in rows:
            present.setdefault(table, set()).add(name)
        return [f"{t.name}.{name}" for t in schema.TABLES if t.name in present
                for name, _ in t.columns if name not in present[t.name]]

    def missing_columns_in_order(self) -> list[tuple[str, schema.Column, str]]:
        """(table, column, ` AFTER ...` or ` FIRST`) for each column the store's tables lack, in schema order."""
        missing = set(self._missing_columns())
        found = []
        for table in schema.TABLES:
            previous = None
            for column in table.definition:
                if f"{table.name}.{column.name}" in missing:
                    found.append((table.name, column, f" AFTER `{previous}`" if previous else " FIRST"))
                previous = column.name
        return found

    def _add_missing_columns(self) -> None:
        """Columns added to a table since the store was created are added in place (additive changes only)."""
        for table, column, after in self.missing_columns_in_order():
            log.info("adding column %s.%s", table, column.name)
            self.client.command(f"ALTER TABLE `{self.database}`.`{table}` "
                                f"ADD COLUMN IF NOT EXISTS {schema.column_sql(column)}{after}")

    def _widened_columns(self) -> list[tuple[schema.Table, schema.Column]]:
        """The columns this stepline declares Nullable that the store's tables hold as plain types (before schema 3)."""
        types = {(str(t), str(n)): str(ty) for t, n, ty in self.client.query(
            "SELECT table, name, type FROM system.columns WHERE database = {db:String}",
            parameters={"db": self.database}).result_rows}
        return [(table, column) for table in schema.TABLES for column in table.definition
                if column.type.startswith("Nullable(")
                and not types.get((table.name, column.name), "Nullable(").startswith("Nullable(")]

    def _make_nullable(self) -> None:
        """Columns that became Nullable (schema 3: cumulative counters, schema 4: GPU memory, whose failed reads are
        NULL) are converted in place. ClickHouse cannot convert a projection's aggregate states, so the table's
        projections are dropped first and built again by _add_missing_projections. Values whose marker column's 0
        meant "read failed" (schema.ZERO_WAS_UNKNOWN) become NULL by a background mutation, queued after the
        conversion of that marker column is; until it reaches a part, that part reads as before."""
        widened = self._widened_columns()
        for table in {t.name: t for t, _ in widened}.values():
            for projection in table.projections:
                self.client.command(f"ALTER TABLE `{self.database}`.`{table.name}` "
                                    f"DROP PROJECTION IF EXISTS `{projection.name}`")
        for table, column in widened:
            log.info("making %s.%s Nullable", table.name, column.name)
            target = f"`{self.database}`.`{table.name}`"
            self.client.command(f"ALTER TABLE {target} MODIFY COLUMN {schema.column_sql(column)}")
            marker = schema.ZERO_WAS_UNKNOWN.get(table.name, {}).get(column.name)
            if marker is not None:
                self.client.command(f"ALTER TABLE {target} UPDATE `{column.name}` = NULL WHERE `{marker}` = 0")

    def layouts(self) -> dict[str, tuple[str, tuple[str, ...]]]:
        """The engine and sorting key of each table in the store's database."""
        return {str(n): (str(e), tuple(c.strip() for c in str(k).split(",") if c.strip()))
                for n, e, k in self.client.query(
                    "SELECT name, engine, sorting_key FROM system.tables WHERE database = {db:String}",
                    parameters={"db": self.database}).result_rows}

    def outdated_engines(self, suffix: str = "") -> list[schema.Table]:
        """The tables (`table` + suffix) whose engine (Replicated or not) or sorting key is not this stepline's:
        version 1's MergeTree `requests`, versions 2-4's `requests` keyed without arrival_ts."""
        layouts = self.layouts()
        outdated = []
        for table in schema.TABLES:
            engine, key = layouts.get(table.name + suffix, (table.engine, table.order_by))
            if engine.removeprefix("Replicated") != table.engine or key != table.order_by:
                outdated.append(table)
        return outdated

    def _rebuild_outdated_engines(self, retention_days: int) -> None:
        """A table whose engine or key changed is copied into today's, then swapped in.

        The copy is made under `<table>_rebuild` and exchanged with the table in one atomic step, so a stop at
        any point leaves either the old table whole (the next open starts over) or the new one whole (the next
        open only drops the leftover). An AggregatingMergeTree's rows are merged as they are copied, by the key
        columns the old key shares with today's (two reports of one request become one row).
        """
        layouts = self.layouts()
        for table in self.outdated_engines():
            spare = f"`{self.database}`.`{table.name}_rebuild`"
            rows = scalar(self.client.query(f"SELECT count() FROM `{self.database}`.`{table.name}`"))
            log.info("rebuilding %s as %s ordered by (%s): %d rows", table.name, table.engine,
                     ", ".join(table.order_by), rows)
            columns = ", ".join(f"`{name}`" for name in table.column_names)
            self.client.command(f"DROP TABLE IF EXISTS {spare}")
            self.client.command(schema.create_table_sql(self.database, table, retention_days,
                                                        name=f"{table.name}_rebuild"))
            self.client.command(f"INSERT INTO {spare} ({columns}) "
                                f"{_copy_select(table, layouts[table.name][1], self.database)}")
            self.client.command(f"EXCHANGE TABLES `{self.database}`.`{table.name}` AND {spare}")
        engines = self.layouts()
        for table in schema.TABLES:  # the old table after an exchange (or what a stop right after one left)
            if f"{table.name}_rebuild" in engines:
                self.client.command(f"DROP TABLE `{self.database}`.`{table.name}_rebuild`")

    def _undescribed(self) -> dict[str, list[str]]:
        """Per table, its columns whose comment is not this stepline's: none yet (an older store), or older words."""
        found = {(str(t), str(n)): str(c) for t, n, c in self.client.query(
            "SELECT table, name, comment FROM system.columns WHERE database = {db:String}",
            parameters={"db": self.database}).result_rows}
        undescribed: dict[str, list[str]] = {}
        for table in schema.STORE_TABLES:
            names = [c.name for c in table.definition if found.get((table.name, c.name), c.comment) != c.comment]
            if names:
                undescribed[table.name] = names
        return undescribed

    def _describe(self) -> None:
        """Give every column (and table) today's comment, so DESCRIBE and Grafana say what it holds: metadata only."""
        undescribed = self._undescribed()
        comments = {str(n): str(c) for n, c in self.client.query(
            "SELECT name, comment FROM system.tables WHERE database = {db:String}",
            parameters={"db": self.database}).result_rows}
        for table in schema.STORE_TABLES:
            if table.name in undescribed:
                log.info("commenting %d columns of %s", len(undescribed[table.name]), table.name)
                self.client.command(schema.comment_columns_sql(self.database, table, undescribed[table.name]))
            if comments.get(table.name, table.comment) != table.comment:
                self.client.command(schema.comment_table_sql(self.database, table))

    def missing_projections(self, suffix: str = "") -> list[tuple[schema.Table, schema.Projection]]:
        """Each projection this stepline has that the store's tables (`table` + suffix) lack."""
        present = {(str(t), str(n)) for t, n in self.client.query(
            "SELECT table, name FROM system.projections WHERE database = {db:String}",
            parameters={"db": self.database}).result_rows}
        return [(table, projection) for table in schema.TABLES for projection in table.projections
                if (f"{table.name}{suffix}", projection.name) not in present]

    def _missing_projections(self, suffix: str = "") -> list[str]:
        """`table.projection` for each projection this stepline has and the store's tables (`table` + suffix) lack."""
        return [f"{table.name}{suffix}.{projection.name}" for table, projection in self.missing_projections(suffix)]

    def _set_projection_mode(self) -> None:
        """Tables that merge rows and now have projections are told how a merge treats them (schema.PROJECTION_MODE),
        which ClickHouse asks for before it adds one: a table setting, no part is touched."""
        setting, value = schema.PROJECTION_MODE
        engines = {str(n): str(e) for n, e in self.client.query(
            "SELECT name, engine_full FROM system.tables WHERE database = {db:String}",
            parameters={"db": self.database}).result_rows}
        for table in schema.TABLES:
            if (schema.needs_projection_mode(table) and table.name in engines
                    and f"{setting} = '{value}'" not in engines[table.name]):
                log.info("setting %s of %s to %s", setting, table.name, value)
                self.client.command(f"ALTER TABLE `{self.database}`.`{table.name}` "
                                    f"MODIFY SETTING {setting} = '{value}'")

    def _add_missing_projections(self) -> None:
        """Projections added since the store was created are added, then built for the parts already there."""
        missing = set(self._missing_projections())
        for table in schema.TABLES:
            for projection in table.projections:
                if f"{table.name}.{projection.name}" in missing:
                    log.info("adding projection %s.%s", table.name, projection.name)
                    for statement in schema.add_projection_sql(self.database, table, projection):
                        self.client.command(statement)

    def _apply_retention(self, retention_days: int) -> None:
        """Each timeline table's TTL set to `retention_days` where it says otherwise."""
        rows = self.client.query(
            "SELECT name, engine_full FROM system.tables WHERE database = {db:String}",
            parameters={"db": self.database},
        ).result_rows
        for name, engine_full in rows:
            if name not in schema.TABLE_BY_NAME:
                continue
            # The server shows the TTL as written or normalised to toIntervalDay(N), by version.
            match = re.search(r"TTL .*?(?:toIntervalDay\((\d+)\)|INTERVAL (\d+) DAY)", engine_full)
            if match and int(match.group(1) or match.group(2)) == retention_days:
                continue
            log.info("setting retention of %s to %d days", name, retention_days)
            self.client.command(
                f"ALTER TABLE `{self.database}`.`{name}` MODIFY TTL toDateTime(ts) + INTERVAL {retention_days} DAY"
            )


_MERGE_FUNCTION = re.compile(r"SimpleAggregateFunction\((\w+),")


def _copy_select(table: schema.Table, old_key: tuple[str, ...], database: str) -> str:
    """The SELECT that copies `table`'s old rows into today's: as they are, or, into an AggregatingMergeTree,
    merged by the key columns the old key shares with today's, each other column as today's table merges it
    (a column that joined the key, which the old table merged, keeps the earliest: arrival_ts as version 4 did)."""
    source = f"`{database}`.`{table.name}`"
    names = table.column_names
    if table.engine != "AggregatingMergeTree":
        return f"SELECT {', '.join(f'`{n}`' for n in names)} FROM {source}"
    by = [name for name in table.order_by if name in old_key]
    types = dict(table.columns)
    merged = []
    for name in names:
        found = _MERGE_FUNCTION.match(types[name])
        merged.append(f"`{name}`" if name in by else f"{found.group(1) if found else 'min'}(`{name}`)")
    return f"SELECT {', '.join(merged)} FROM {source} GROUP BY {', '.join(f'`{n}`' for n in by)}"
