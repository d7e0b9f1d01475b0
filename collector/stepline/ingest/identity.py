"""Request placement, the write path's stage before the writers: each request report given the request it is of.

The rule is `stepline.ingest.merge` (RecentRequests). This stage applies it to every batch on its way to the writers:
it reads from the store the requests of reports older than the memory reaches (`lookup`), writes a report that adds
no field as nothing (counted in `stepline_requests_deduplicated_total`), and at start-up remembers what the store
and the spool already hold, so that a restart places every report as the first process did.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence

from clickhouse_connect.driver.exceptions import ClickHouseError
from prometheus_client import Counter

from stepline.core.oneline import one_line
from stepline.core.ratelimit import RateLimitedLog
from stepline.ingest.merge import RecentRequests
from stepline.ingest.metrics import RequestMetrics
from stepline.ingest.spool import Spool
from stepline.model.rows import Request, Row
from stepline.store import batches
from stepline.store.errors import StoreError

log = logging.getLogger(__name__)

# The merged requests the store holds for some (engine, request id)s; raises ClickHouseError or StoreError when it
# cannot say.
Lookup = Callable[[Sequence[tuple[str, str]]], Iterable[Request]]


class RequestPlacement:
    """Places the request reports of each batch; every other row passes as it came."""

    def __init__(self, metrics: RequestMetrics, *, recent: RecentRequests | None = None,
                 lookup: Lookup | None = None) -> None:
        """`lookup` reads from the store the requests of some (engine, request id)s, for reports older than what
        memory holds; without it such reports are written as requests of their own (counted)."""
        self._metrics = metrics
        self._recent = recent or RecentRequests()
        self._lookup = lookup
        self._lookup_log = RateLimitedLog(log, interval_s=60.0)
        self._duplicates: dict[str, Counter] = {}

    def place(self, rows: Iterable[Row]) -> list[Row]:
        """The rows to write: each request report with the arrival of the request it is of, those that add nothing
        left out."""
        rows = self._look_up_old_requests(rows)
        place = self._recent.place
        placed: list[Row] = []
        for row in rows:
            if type(row) is Request:
                kept = place(row)
                if kept is None:
                    self._duplicate(row.source)
                    continue
                row = kept
            placed.append(row)
        return placed

    def remember(self, requests: Iterable[Request], *, whole_window: bool = False) -> None:
        """Reports already written (or waiting in the spool): a later report of one of their requests takes its
        arrival, and is written only if it adds a field. `whole_window`: they are all the store's requests that
        finished within the memory's window (RecentRequests.WINDOW_S), read just before."""
        self._recent.remember(requests)
        if whole_window:
            self._recent.remembered_window()

    def remember_spooled(self, spool: Spool) -> None:
        """Remember the reports waiting in the spool, oldest first; of a long outage's, only as many as can be
        remembered."""
        newest: list[list[Request]] = []
        count = 0
        for segment in reversed(spool.pending("requests")):
            if count >= self._recent.max_entries:
                break
            data = spool.load(segment)
            if data is None:
                continue  # unreadable: the spool dropped and counted it
            names, rows = batches.decode(data)
            if names == Request._fields:
                newest.append([Request._make(row) for row in rows])
                count += len(rows)
        self.remember(request for batch in reversed(newest) for request in batch)

    def _look_up_old_requests(self, rows: Iterable[Row]) -> Sequence[Row]:
        """Before placing reports older than the memory of requests reaches (a plugin's backlog after a restart),
        read their ids' requests from the store, so that they join the request they are of."""
        rows = rows if isinstance(rows, Sequence) else list(rows)
        needs_lookup = self._recent.needs_lookup
        old = [row for row in rows if isinstance(row, Request) and needs_lookup(row)]
        if not old:
            return rows
        keys = sorted({(r.engine, r.request_id) for r in old})
        if self._lookup is None:
            reason = "no store to read them from"
        else:
            try:
                self._recent.remember(self._lookup(keys))
                return rows
            except (ClickHouseError, StoreError) as exc:
                reason = one_line(exc, 200)
        self._metrics.requests_unresolved.inc(len(old))
        self._lookup_log.warning("lookup", "cannot tell whether %d request reports older than this collector's "
                                 "memory are of requests already in the store (each is written as a request "
                                 "of its own: one may then be two rows): %s", len(old), reason)
        return rows

    def _duplicate(self, source: str) -> None:
        counter = self._duplicates.get(source)
        if counter is None:
            counter = self._duplicates[source] = self._metrics.requests_deduplicated.labels(source)
        counter.inc()
