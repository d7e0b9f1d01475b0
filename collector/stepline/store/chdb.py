"""clickhouse-connect's chDB client, kept from handing one query's output to the next.

chDB 4.4 leaves the output of a query that fails after its first block in the connection: the next buffered
query on that connection returns it in front of its own result (clickhouse-connect then decodes the stranger's
rows as its own, or fails on "unrecognized data"). The query after that one is clean. So after every failed
call, this client runs one query of its own whose answer it throws away, before the error reaches the caller.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from clickhouse_connect.driver._chdbclient import ChdbClient
from clickhouse_connect.driver.exceptions import DatabaseError
from clickhouse_connect.driver.query import QueryContext, QueryResult

from stepline.core.ratelimit import RateLimitedLog
from stepline.store.query_profile import engine_options

log = logging.getLogger(__name__)
T = TypeVar("T")
_drain_failures = RateLimitedLog(log, 60.0)


class SafeChdbClient(ChdbClient):
    """A ChdbClient whose connection holds no leftover output after a failed query."""

    def _query_with_context(self, context: QueryContext) -> QueryResult:
        return self._drained(super()._query_with_context, context)

    def raw_query(self, *args: Any, **kwargs: Any) -> bytes:
        return self._drained(super().raw_query, *args, **kwargs)

    def command(self, *args: Any, **kwargs: Any) -> Any:
        return self._drained(super().command, *args, **kwargs)

    def _drained(self, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        try:
            return call(*args, **kwargs)
        except DatabaseError:
            self._drain()
            raise

    def _drain(self) -> None:
        try:
            super().raw_query("SELECT 1", fmt="TabSeparated")  # the failed query's leftover, then "1": dropped
        except Exception as ex:  # the connection is unusable anyway: the caller's error says why
            _drain_failures.warning("drain", "chDB connection not drained after a failed query: %s", ex)


def open_client(path: str, database: str | None = None) -> SafeChdbClient:
    """A client on the embedded store at `path` (chDB hosts one path per process; clients of it share it).

    The first client of a process starts the engine, with the query endpoint's read-only profile
    (`stepline.store.query_profile`); later ones join it.
    """
    return SafeChdbClient(path=path, database=database, chdb_options=engine_options())
