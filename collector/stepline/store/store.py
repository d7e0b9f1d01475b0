"""The store: one class over clickhouse-connect, embedded (chDB) or a ClickHouse server."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import clickhouse_connect
from clickhouse_connect.driver.client import Client
from clickhouse_connect.driver.exceptions import OperationalError
from clickhouse_connect.driver.query import QueryResult

from stepline.model.rows import Request
from stepline.queries.requests import merged
from stepline.store.chdb import open_client
from stepline.store.cluster import ClusterSchema
from stepline.store.discovery import read_beside_store
from stepline.store.errors import StoreError, StoreLocked, StoreUnreachable, error_line
from stepline.store.locking import embedded_store_locked
from stepline.store.migrations import Migration
from stepline.store.url import StoreUrl, parse_store_url

log = logging.getLogger(__name__)


class Store:
    """The timeline store: creates its schema, inserts rows, answers SQL."""

    def __init__(self, url: StoreUrl, client: Client) -> None:
        self.url = url
        self.client = client
        self.database = url.database
        # What each insert asks of the server: set by ensure_schema, which learns how many servers a cluster has.
        self._insert_settings = remote_insert_settings(1, cluster=False) if url.remote else {}

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
                raise kind(f"cannot reach the store at {parsed.redacted()}: {error_line(exc)}") from None
        return cls(parsed, client)

    def ensure_schema(self, retention_days: int) -> None:
        """Create database and tables if missing (idempotent); refuse a store of a newer schema.

        On a cluster (`?cluster=NAME`) nothing is created: refuse one that does not hold this stepline's schema."""
        if self.url.cluster:
            servers = ClusterSchema(self.client, self.database, self.url.cluster).check(self.url.redacted())
            self._insert_settings = remote_insert_settings(servers, cluster=True)
            return
        Migration(self.client, self.database).ensure(retention_days, self.url.redacted())

    def schema_version(self) -> int:
        """The newest schema version recorded in the store (0 for a new store)."""
        return Migration(self.client, self.database).version()

    def insert(self, table: str, rows: Sequence[Sequence[Any]], column_names: Sequence[str]) -> None:
        """Insert rows into one table; raises ClickHouseError (or a transport error) on failure."""
        self.client.insert(f"`{self.database}`.`{table}`", rows, column_names=list(column_names))

    def insert_native(self, table: str, column_names: Sequence[str], data: bytes,
                      dedup_token: str | None = None) -> None:
        """Insert one batch already in Native format (see `stepline.store.batches`); raises on failure.

        With `dedup_token`, a retry of the same batch is stored once (the tables keep a deduplication window).
        """
        settings = dict(self._insert_settings)
        if dedup_token:
            settings["insert_deduplication_token"] = dedup_token
        self.client.raw_insert(f"`{self.database}`.`{table}`", list(column_names), data, settings=settings,
                               fmt="Native")

    def recent_requests(self, host: str, window_s: float) -> list[Request]:
        """The requests this host finished within the last `window_s` seconds, each with what its reports gave,
        in the order they finished."""
        return self._requests("host = {host:String} AND ts >= now64(6) - toIntervalMillisecond({ms:UInt64})",
                              {"host": host, "ms": round(window_s * 1000)})

    def requests_of(self, host: str, keys: Sequence[tuple[str, str]]) -> list[Request]:
        """Every request this host holds under each (engine, request id) of `keys`, in the order they finished."""
        # On a cluster the host and its engines name the shards that can hold them (the sharding key is
        # cityHash64(host, engine)): only those are read.
        # https://clickhouse.com/docs/operations/settings/settings#optimize_skip_unused_shards
        return self._requests("host = {host:String} AND engine IN {engines:Array(String)} "
                              "AND (engine, request_id) IN {keys:Array(Tuple(String, String))}",
                              {"host": host, "keys": list(keys), "engines": sorted({e for e, _ in keys})},
                              " SETTINGS optimize_skip_unused_shards = 1")

    def _requests(self, where: str, parameters: dict[str, Any], settings: str = "") -> list[Request]:
        times = ("ts", "arrival_ts")
        columns = ", ".join(f"toUnixTimestamp64Micro(`{name}`)" if name in times else f"`{name}`"
                            for name in Request._fields)
        return [Request._make(row) for row in self.client.query(
            f"SELECT {columns} FROM {merged(f'`{self.database}`.`requests`')} WHERE {where} ORDER BY ts{settings}",
            parameters=parameters,
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


# Inserts into a ClickHouse server are batched by the server: a fleet's sidecars each send a few rows per table every
# few seconds, and ClickHouse asks for about one insert (one new part) per second per table, of at least 1,000 rows
# ("keeping the number of insert queries around one insert query per second", https://clickhouse.com/docs/optimize/
# bulk-inserts), and names asynchronous inserts as the way when many agents send small batches, as the OpenTelemetry
# ClickHouse exporter does (https://clickhouse.com/docs/optimize/asynchronous-inserts). The server gathers the inserts
# of every sidecar into one buffer per table and writes it as one part per busy timeout; wait_for_async_insert makes
# the answer come after that write, so a batch acknowledged is a batch stored, and a failure is retried from the spool
# with its deduplication token (async_insert_deduplicate). On a cluster, each server that takes inserts writes its
# buffer through the Distributed table, one insert per shard: with a busy timeout of one second per server, each
# shard gets about one new part per second per table while no buffer fills before its timeout (ASYNC_MAX_BYTES,
# ASYNC_MAX_QUERIES): up to about 1,000 8-GPU nodes on 3 shards x 2 replicas (benchmarks/write_model.py). Past that,
# parts per shard grow with the fleet's bytes whatever the shard count: sidecars would have to write to their shard's
# local tables, which stepline does not do yet (docs/limitations.md).
# distributed_foreground_insert sends to the shards before answering: an acknowledged row is on its shard, readable
# by a restarted collector's lookups, and a retry carries its token to the shard's Replicated table.
# A retried asynchronous insert is deduplicated by its token as a synchronous one is: ClickHouse's guide now puts both
# under one window (replicated_deduplication_window; the *_for_async_inserts settings remain for rolling upgrades):
# https://clickhouse.com/docs/guides/developer/deduplicating-inserts-on-retries and https://clickhouse.com/docs/
# reference/settings/merge-tree-settings/replicated-deduplication-window. Older servers deduplicate asynchronous
# inserts into Replicated tables only (async_insert_deduplicate), and whether a token survives a Distributed table is
# not documented (ClickHouse issue 76405): docs/limitations.md says what was not run.
# The settings are those of ClickHouse 24.8 LTS and later (async_insert_use_adaptive_busy_timeout came in 24.2).
# https://clickhouse.com/docs/operations/settings/settings#async_insert_busy_timeout_max_ms
# https://clickhouse.com/docs/operations/settings/settings#distributed_foreground_insert
ASYNC_BUSY_S_PER_SERVER = 1.0
ASYNC_BUSY_MAX_S = 30.0
ASYNC_MAX_QUERIES = 10_000  # sidecars' inserts gathered into one part at most (ClickHouse's default is 450)
# One buffer's data at most (ClickHouse's default is 10 MiB): at 1,000 nodes a server's steps buffer takes 131 MiB in
# its 6 s, and a fuller buffer flushes early, one more part on every shard (benchmarks/write_model.py). A server holds
# one such buffer per table while it fills: size its memory for it.
ASYNC_MAX_BYTES = 256 << 20


def remote_insert_settings(servers: int, *, cluster: bool) -> dict[str, Any]:
    """The settings of every insert into a ClickHouse server, or a cluster of `servers` servers."""
    busy_ms = round(1000 * min(ASYNC_BUSY_MAX_S, ASYNC_BUSY_S_PER_SERVER * max(1, servers)))
    settings: dict[str, Any] = {
        "async_insert": 1, "wait_for_async_insert": 1, "async_insert_deduplicate": 1,
        "async_insert_use_adaptive_busy_timeout": 0, "async_insert_busy_timeout_max_ms": busy_ms,
        "async_insert_max_query_number": ASYNC_MAX_QUERIES, "async_insert_max_data_size": ASYNC_MAX_BYTES,
    }
    if cluster:
        settings["distributed_foreground_insert"] = 1
    return settings


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
        holder = read_beside_store(url.path)
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
        raise StoreError(f"cannot open the embedded store {url.path}: {error_line(exc)}") from None
    client.command(f"CREATE DATABASE IF NOT EXISTS `{url.database}`")
    client.database = url.database
    return client
