"""The store: one class over clickhouse-connect, embedded (chDB) or a ClickHouse server."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import clickhouse_connect
from clickhouse_connect.driver.client import Client
from clickhouse_connect.driver.exceptions import ClickHouseError, OperationalError
from clickhouse_connect.driver.query import QueryResult

from stepline.model import schema
from stepline.model.rows import Request
from stepline.store.chdb import open_client
from stepline.store.url import StoreUrl, parse_store_url

log = logging.getLogger(__name__)

# Written by a running collector next to the embedded store, so that the CLI finds its query endpoint.
COLLECTOR_FILE = "stepline-collector.json"


class StoreError(RuntimeError):
    """The store cannot be used; the message is one line naming the problem."""


class StoreUnreachable(StoreError):
    """The store's server does not answer (refused, timed out, name unknown): it may later."""


class StoreLocked(StoreError):
    """Another process holds the embedded store."""

    def __init__(self, message: str, holder: CollectorInfo | None) -> None:
        super().__init__(message)
        self.holder = holder


@dataclass(frozen=True)
class CollectorInfo:
    """What a running collector announces about itself next to its embedded store."""

    pid: int
    query_url: str
    metrics_url: str
    password_required: bool


def read_collector_info(store_dir: str) -> CollectorInfo | None:
    """The announcement of the collector holding `store_dir`, if one is there and readable."""
    try:
        with open(os.path.join(store_dir, COLLECTOR_FILE), encoding="utf-8") as fh:
            raw = json.load(fh)
        return CollectorInfo(int(raw["pid"]), str(raw["query_url"]), str(raw.get("metrics_url", "")),
                             bool(raw.get("password_required")))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring unreadable %s in %s: %s", COLLECTOR_FILE, store_dir, exc)
        return None


def write_collector_info(store_dir: str, info: CollectorInfo) -> None:
    """Announce a collector's query endpoint (atomically: readers never see half a file)."""
    tmp = os.path.join(store_dir, f".{COLLECTOR_FILE}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(dataclasses.asdict(info), fh)
    os.replace(tmp, os.path.join(store_dir, COLLECTOR_FILE))


def remove_collector_info(store_dir: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(store_dir, COLLECTOR_FILE))


def embedded_store_locked(store_dir: str) -> bool:
    """Whether another process has the embedded ClickHouse at `store_dir` open.

    ClickHouse holds an exclusive flock on `status` for as long as its engine runs; probing it
    tells "busy" apart from every other failure before chDB prints its own noise.
    """
    status = os.path.join(store_dir, "status")
    if _open_in_this_process(status):
        return False  # chDB shares its engine within a process: this process may open it again
    try:
        fd = os.open(status, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def _open_in_this_process(path: str) -> bool:
    real = os.path.realpath(path)
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == real:
                return True
        except OSError:
            continue
    return False


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    # Transport errors nest the cause deep inside retry wrappers: the errno text is what a person needs.
    errno_text = re.search(r"\[Errno -?\d+\] ([^'\")]+)", text)
    if errno_text:
        return errno_text.group(1).strip()
    return text[:300]


class Store:
    """The timeline store: creates its schema, inserts rows, answers SQL."""

    def __init__(self, url: StoreUrl, client: Client) -> None:
        self.url = url
        self.client = client
        self.database = url.database

    @classmethod
    def open(cls, url: str | StoreUrl, *, connect_timeout_s: float = 5.0) -> Store:
        """Connect to the store at `url`; raise StoreError with one clear line when that fails."""
        parsed = parse_store_url(url) if isinstance(url, str) else url
        if parsed.embedded:
            client = _open_embedded(parsed)
        else:
            try:
                client = clickhouse_connect.get_client(
                    interface=parsed.scheme,
                    host=parsed.host,
                    port=parsed.port,
                    username=parsed.username,
                    password=parsed.password,
                    connect_timeout=connect_timeout_s,
                    send_receive_timeout=60,
                    autogenerate_session_id=False,
                )
            except Exception as exc:  # any transport or server failure reads the same to the user
                # A transport failure may pass; a server that answers with an error (credentials) will not.
                kind = StoreUnreachable if isinstance(exc, (OperationalError, OSError)) else StoreError
                raise kind(f"cannot reach the store at {parsed.redacted()}: {_one_line(exc)}") from None
        return cls(parsed, client)

    def ensure_schema(self, retention_days: int) -> None:
        """Create database and tables if missing (idempotent); refuse a store of a newer schema."""
        statements = schema.ddl(self.database, retention_days)
        try:
            self.client.command(statements[0])
            self.client.command(statements[-1])  # schema_version first: check before touching tables
            found = self.schema_version()
            if found > schema.SCHEMA_VERSION:
                raise StoreError(
                    f"the store at {self.url.redacted()} holds schema version {found}, newer than this "
                    f"stepline's {schema.SCHEMA_VERSION}: upgrade stepline"
                )
            if self._on_cluster():
                # `stepline schema --cluster` made these tables: changing them is an ON CLUSTER job for an operator,
                # not something one sidecar does to Distributed tables.
                missing = self._missing_columns() + self._missing_projections(suffix="_local")
                if missing:
                    log.warning("the cluster's tables lack %s: add them ON CLUSTER (see `stepline schema --cluster`); "
                                "dashboards and diagnosis over long windows are slow until then", ", ".join(missing))
                widened = self._widened_columns()
                if widened:
                    log.warning("the cluster's tables hold %s as plain types where this stepline writes NULL for a "
                                "failed reading: MODIFY COLUMN ... ON CLUSTER to today's types (`stepline schema "
                                "--cluster`) before this collector writes to them",
                                ", ".join(f"{t.name}.{c.name}" for t, c in widened))
                for table in self._outdated_engines(suffix="_local"):
                    log.warning("the cluster's %s_local is not today's %s table: until it is rebuilt ON CLUSTER "
                                "(see `stepline schema --cluster`), a request reported by the plugin and by OTLP "
                                "may be two rows", table.name, table.engine)
                undescribed = self._undescribed()
                if undescribed:
                    log.warning("the cluster's tables lack today's comments on %d columns of %s: set them with ALTER "
                                "TABLE ... ON CLUSTER ... COMMENT COLUMN (`stepline schema --cluster` has the words)",
                                sum(map(len, undescribed.values())), ", ".join(undescribed))
                return
            views = [st for st in statements[1:-1] if st.startswith("CREATE OR REPLACE VIEW")]
            for statement in statements[1:-1]:
                if statement not in views:
                    self.client.command(statement)
            self._add_missing_columns()
            self._make_nullable()
            self._rebuild_outdated_engines(retention_days)
            self._describe()
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
            raise StoreError(f"cannot create the schema in {self.url.redacted()}: {_one_line(exc)}") from None

    def schema_version(self) -> int:
        """The newest schema version recorded in the store (0 for a new store)."""
        rows = self.client.query(f"SELECT max(version) FROM `{self.database}`.`schema_version`").result_rows
        return int(rows[0][0]) if rows and rows[0][0] is not None else 0

    def _on_cluster(self) -> bool:
        """Whether the timeline tables are Distributed tables over a cluster."""
        rows = self.client.query("SELECT count() FROM system.tables WHERE database = {db:String} "
                                 "AND engine = 'Distributed'", parameters={"db": self.database}).result_rows
        return bool(rows[0][0])

    def _missing_columns(self) -> list[str]:
        """`table.column` for each column this stepline has and the store's tables lack, in schema order."""
        rows = self.client.query("SELECT table, name FROM system.columns WHERE database = {db:String}",
                                 parameters={"db": self.database}).result_rows
        present: dict[str, set[str]] = {}
        for table, name in rows:
            present.setdefault(table, set()).add(name)
        return [f"{t.name}.{name}" for t in schema.TABLES if t.name in present
                for name, _ in t.columns if name not in present[t.name]]

    def _add_missing_columns(self) -> None:
        """Columns added to a table since the store was created are added in place (additive changes only)."""
        missing = set(self._missing_columns())
        for table in schema.TABLES:
            previous = None
            for column in table.definition:
                if f"{table.name}.{column.name}" in missing:
                    after = f" AFTER `{previous}`" if previous else " FIRST"
                    log.info("adding column %s.%s", table.name, column.name)
                    self.client.command(f"ALTER TABLE `{self.database}`.`{table.name}` "
                                        f"ADD COLUMN IF NOT EXISTS {schema.column_sql(column)}{after}")
                previous = column.name

    def _widened_columns(self) -> list[tuple[schema.Table, schema.Column]]:
        """The columns this stepline declares Nullable that the store's tables hold as plain types (before schema 3)."""
        types = {(str(t), str(n)): str(ty) for t, n, ty in self.client.query(
            "SELECT table, name, type FROM system.columns WHERE database = {db:String}",
            parameters={"db": self.database}).result_rows}
        return [(table, column) for table in schema.TABLES for column in table.definition
                if column.type.startswith("Nullable(")
                and not types.get((table.name, column.name), "Nullable(").startswith("Nullable(")]

    def _make_nullable(self) -> None:
        """Columns that became Nullable (schema 3: cumulative counters whose failed reads are NULL) are converted in
        place. ClickHouse cannot convert a projection's aggregate states, so the table's projections are dropped
        first and built again by _add_missing_projections. Zeros that meant "read failed" (schema.ZERO_WAS_UNKNOWN)
        become NULL by a background mutation; until it reaches a part, that part reads as before."""
        widened = self._widened_columns()
        for table in {t.name: t for t, _ in widened}.values():
            for projection in table.projections:
                self.client.command(f"ALTER TABLE `{self.database}`.`{table.name}` "
                                    f"DROP PROJECTION IF EXISTS `{projection.name}`")
        for table, column in widened:
            log.info("making %s.%s Nullable", table.name, column.name)
            target = f"`{self.database}`.`{table.name}`"
            self.client.command(f"ALTER TABLE {target} MODIFY COLUMN {schema.column_sql(column)}")
            if column.name in schema.ZERO_WAS_UNKNOWN.get(table.name, ()):
                self.client.command(f"ALTER TABLE {target} UPDATE `{column.name}` = NULL WHERE `{column.name}` = 0")

    def _engines(self) -> dict[str, str]:
        """The engine of each table in the store's database."""
        return {str(n): str(e) for n, e in self.client.query(
            "SELECT name, engine FROM system.tables WHERE database = {db:String}",
            parameters={"db": self.database}).result_rows}

    def _outdated_engines(self, suffix: str = "") -> list[schema.Table]:
        """The tables (`table` + suffix) whose engine is not this stepline's (Replicated or not)."""
        engines = self._engines()
        return [table for table in schema.TABLES
                if engines.get(table.name + suffix, table.engine).removeprefix("Replicated") != table.engine]

    def _rebuild_outdated_engines(self, retention_days: int) -> None:
        """A table whose engine changed (version 1's MergeTree `requests`) is copied into today's, then swapped in.

        The copy is made under `<table>_rebuild` and exchanged with the table in one atomic step, so a stop at
        any point leaves either the old table whole (the next open starts over) or the new one whole (the next
        open only drops the leftover). Rows merge as they are copied (two reports of one request become one).
        """
        for table in self._outdated_engines():
            spare = f"`{self.database}`.`{table.name}_rebuild`"
            rows = self.client.query(f"SELECT count() FROM `{self.database}`.`{table.name}`").result_rows[0][0]
            log.info("rebuilding %s as %s ordered by (%s): %d rows", table.name, table.engine,
                     ", ".join(table.order_by), rows)
            columns = ", ".join(f"`{name}`" for name in table.column_names)
            self.client.command(f"DROP TABLE IF EXISTS {spare}")
            self.client.command(schema.create_table_sql(self.database, table, retention_days,
                                                        name=f"{table.name}_rebuild"))
            self.client.command(f"INSERT INTO {spare} ({columns}) SELECT {columns} "
                                f"FROM `{self.database}`.`{table.name}`")
            self.client.command(f"EXCHANGE TABLES `{self.database}`.`{table.name}` AND {spare}")
        engines = self._engines()
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

    def _missing_projections(self, suffix: str = "") -> list[str]:
        """`table.projection` for each projection this stepline has and the store's tables (`table` + suffix) lack."""
        present = {(str(t), str(n)) for t, n in self.client.query(
            "SELECT table, name FROM system.projections WHERE database = {db:String}",
            parameters={"db": self.database}).result_rows}
        return [f"{table.name}{suffix}.{projection.name}" for table in schema.TABLES for projection in table.projections
                if (f"{table.name}{suffix}", projection.name) not in present]

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

    def insert(self, table: str, rows: Sequence[Sequence[Any]], column_names: Sequence[str]) -> None:
        """Insert rows into one table; raises ClickHouseError (or a transport error) on failure."""
        self.client.insert(f"`{self.database}`.`{table}`", rows, column_names=list(column_names))

    def insert_native(self, table: str, column_names: Sequence[str], data: bytes,
                      dedup_token: str | None = None) -> None:
        """Insert one batch already in Native format (see `stepline.store.batches`); raises on failure.

        With `dedup_token`, a retry of the same batch is stored once (the tables keep a deduplication window).
        """
        settings = {"insert_deduplication_token": dedup_token} if dedup_token else None
        self.client.raw_insert(f"`{self.database}`.`{table}`", list(column_names), data, settings=settings,
                               fmt="Native")

    def recent_requests(self, host: str, window_s: float) -> list[Request]:
        """The requests this host finished within the last `window_s` seconds, each with what its reports gave."""
        times = ("ts", "arrival_ts")
        columns = ", ".join(f"toUnixTimestamp64Micro(`{name}`)" if name in times else f"`{name}`"
                            for name in Request._fields)
        return [Request._make(row) for row in self.client.query(
            f"SELECT {columns} FROM `{self.database}`.`requests` FINAL "
            "WHERE host = {host:String} AND ts >= now64(6) - toIntervalMillisecond({ms:UInt64})",
            parameters={"host": host, "ms": round(window_s * 1000)},
        ).result_rows]

    def engine_models(self, host: str) -> dict[str, str]:
        """Each engine's model name as its plugin last announced it on this host (engine_config events)."""
        return {str(engine): str(model) for engine, model in self.client.query(
            f"SELECT engine, argMax(if(attributes['served_model_name'] != '', attributes['served_model_name'], "
            f"attributes['model']), ts) FROM `{self.database}`.`events` "
            "WHERE host = {host:String} AND kind = 'engine_config' AND source = 'plugin' GROUP BY engine",
            parameters={"host": host},
        ).result_rows if model}

    def query(self, sql: str, parameters: dict[str, Any] | None = None) -> QueryResult:
        """Run a query in the store's database."""
        return self.client.query(sql, parameters=parameters)

    def raw(self, sql: str, fmt: str, parameters: dict[str, Any] | None = None) -> bytes:
        """Run a query and return its output in a ClickHouse format (CSV, JSON, ...)."""
        return self.client.raw_query(sql, parameters=parameters, fmt=fmt)

    def reader(self) -> Client:
        """A second client on the same store, so readers never queue behind the writers' inserts."""
        if self.url.embedded:
            # chDB shares one engine per path within a process: this handle joins it, no new lock.
            return open_client(self.url.path, database=self.database)
        return clickhouse_connect.get_client(
            interface=self.url.scheme, host=self.url.host, port=self.url.port, username=self.url.username,
            password=self.url.password, database=self.database, autogenerate_session_id=False,
        )

    def close(self) -> None:
        self.client.close()


class LazyStore:
    """A server store opened on first use, so that a collector started while its store is down still collects.

    Until the store answers, every insert raises StoreUnreachable: the writers keep their batches in the
    spool and retry with backoff. The first insert that reaches the store creates the schema, then goes in.
    """

    def __init__(self, url: StoreUrl, retention_days: int, on_open: Callable[[Store], None]) -> None:
        self.url = url
        self._retention_days = retention_days
        self._on_open = on_open
        self._store: Store | None = None
        self._lock = threading.Lock()

    def get(self) -> Store:
        """The open store; raises StoreError while it cannot be reached or set up."""
        with self._lock:
            if self._store is None:
                store = Store.open(self.url)
                try:
                    store.ensure_schema(self._retention_days)
                except BaseException:
                    store.close()
                    raise
                log.info("the store at %s answers: its schema is in place", self.url.redacted())
                self._store = store
                self._on_open(store)
            return self._store

    def insert_native(self, table: str, column_names: Sequence[str], data: bytes,
                      dedup_token: str | None = None) -> None:
        self.get().insert_native(table, column_names, data, dedup_token)

    def reader(self) -> Client:
        return self.get().reader()


def _open_embedded(url: StoreUrl) -> Client:
    if os.path.exists(url.path) and not os.path.isdir(url.path):
        raise StoreError(f"the embedded store {url.path} is a file, not a directory")
    if embedded_store_locked(url.path):
        holder = read_collector_info(url.path)
        where = f" (collector pid {holder.pid}, query endpoint {holder.query_url})" if holder else ""
        raise StoreLocked(
            f"the embedded store {url.path} is in use by another process{where}: "
            "query it through that collector, or stop it first",
            holder,
        )
    try:
        os.makedirs(url.path, exist_ok=True)
    except OSError as exc:
        raise StoreError(f"cannot create the embedded store directory {url.path}: {exc.strerror}") from None
    try:
        client = open_client(url.path)
    except Exception as exc:  # chDB reports every start-up failure through its own exception types
        raise StoreError(f"cannot open the embedded store {url.path}: {_one_line(exc)}") from None
    client.command(f"CREATE DATABASE IF NOT EXISTS `{url.database}`")
    client.database = url.database
    return client
