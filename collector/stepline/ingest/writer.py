"""One batching writer per table: memory, then the spool, then the store; drop with a counter, drain on stop."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from clickhouse_connect.driver.exceptions import DatabaseError

from stepline.clickhouse_http.errors import DATA_ERRORS
from stepline.core.oneline import one_line
from stepline.core.ratelimit import RateLimitedLog
from stepline.ingest.identity import Lookup, RequestPlacement
from stepline.ingest.merge import RecentRequests
from stepline.ingest.metrics import IngestMetrics, WriterMetrics
from stepline.ingest.spool import Segment, Spool
from stepline.model import schema
from stepline.model.rows import TABLE_OF, Row
from stepline.store import batches

log = logging.getLogger(__name__)


class Sink(Protocol):
    """Where batches go: the Store, or an in-memory stand-in in tests."""

    def insert_native(self, table: str, column_names: Sequence[str], data: bytes,
                      dedup_token: str | None = None) -> None:
        """Insert one batch of Native bytes; raises on any failure (the batch is then retried)."""


MEMORY_SPOOL_BYTES = 256 << 20  # the bound when the collector runs without a spool directory


class TableWriter:
    """Buffers rows of one table, cuts them into segments of the spool and inserts those from a thread of its own.

    Rows wait in memory for at most `flush_interval_s` (or until `batch_rows` are queued), then become a
    segment: on disk with a disk spool, which is what makes them survive a store outage and a restart. The
    thread inserts the table's segments oldest first, each with its deduplication token, and retries with
    backoff while the store is down; the spool drops the oldest segments only when it is full, counted.
    Rows beyond `max_rows` in memory (a spool that cannot keep up) are dropped and counted (`queue_full`).
    """

    def __init__(
        self,
        table: str,
        sink: Sink,
        metrics: WriterMetrics,
        spool: Spool,
        *,
        max_rows: int = 200_000,
        batch_rows: int = 20_000,
        flush_interval_s: float = 1.0,
        retry_max_s: float = 30.0,
    ) -> None:
        if batch_rows < 1 or max_rows < batch_rows:
            raise ValueError(f"writer for {table}: need 1 <= batch_rows ({batch_rows}) <= max_rows ({max_rows})")
        self.table = table
        self.columns = schema.TABLE_BY_NAME[table].column_names
        self._sink = sink
        self._metrics = metrics
        self._drops = metrics.drops
        self._spool = spool
        self._max_rows = max_rows
        self._batch_rows = batch_rows
        self._flush_interval_s = flush_interval_s
        self._retry_max_s = retry_max_s
        self._queue: list[Sequence[Any]] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._drain_deadline = 0.0
        self._failing_since: float | None = None
        self._drop_log = RateLimitedLog(log, interval_s=10.0)
        self._thread = threading.Thread(target=self._run, name=f"writer-{table}", daemon=True)
        self._depth = metrics.queue_depth.labels(table)
        self._written = metrics.rows_written.labels(table)

    def start(self) -> None:
        self._thread.start()

    def put(self, rows: Sequence[Sequence[Any]]) -> int:
        """Queue rows; returns how many were accepted (the rest are dropped and counted)."""
        with self._cond:
            reason = "stopped" if self._stopping else "queue_full"
            accepted = 0 if self._stopping else min(len(rows), self._max_rows - len(self._queue))
            self._queue.extend(rows[:accepted])
            if len(self._queue) >= self._batch_rows:
                self._cond.notify()
        if accepted < len(rows):
            self._drops(self.table, len(rows) - accepted, reason)
        return accepted

    def depth(self) -> int:
        """Rows accepted and not yet in the store: in memory and in the spool."""
        with self._cond:
            queued = len(self._queue)
        return queued + self._spool.rows(self.table)

    def request_stop(self, drain_timeout_s: float = 10.0) -> None:
        """Stop accepting rows; the thread spools what is queued and inserts for up to drain_timeout_s."""
        with self._cond:
            if not self._stopping:
                self._stopping = True
                self._drain_deadline = time.monotonic() + drain_timeout_s
            self._cond.notify()

    def stop(self, drain_timeout_s: float = 10.0) -> None:
        """Stop and drain. Rows the store would not take in time stay in a disk spool for the next start;
        without one they are counted as dropped."""
        self.request_stop(drain_timeout_s)
        if self._thread.is_alive():
            self._thread.join(drain_timeout_s + 30.0)  # one insert in flight may outlast the deadline
        if self._thread.is_alive():
            log.error("writer for %s did not finish draining", self.table)
        with self._cond:
            unspooled, self._queue = self._queue, []
        if unspooled:
            self._drops(self.table, len(unspooled), "store_unavailable_at_stop")
        left = self._spool.rows(self.table)
        if not left:
            return
        if self._spool.directory is not None:
            log.warning("%d %s rows wait in the spool %s for the store", left, self.table, self._spool.directory)
            return
        for segment in self._spool.pending(self.table):
            self._spool.ack(segment)
        self._drops(self.table, left, "store_unavailable_at_stop")

    def _run(self) -> None:
        backoff = 0.0
        next_try = 0.0
        while True:
            with self._cond:
                if not self._stopping and len(self._queue) < self._batch_rows:
                    wait = self._flush_interval_s
                    if self._spool.rows(self.table):  # segments wait for a retry: wake for it
                        wait = min(wait, max(0.0, next_try - time.monotonic()))
                    self._cond.wait(wait)
                rows, self._queue = self._queue, []
                stopping = self._stopping
            self._spool_rows(rows)
            while time.monotonic() >= next_try and (segment := self._spool.claim(self.table)) is not None:
                if self._insert(segment):
                    backoff = 0.0
                    continue
                backoff = min(self._retry_max_s, max(0.5, backoff * 2))
                next_try = time.monotonic() + backoff
            self._depth.set(self.depth())
            self._metrics.spool_bytes.set(self._spool.size_bytes())
            if stopping:
                if not self._spool.rows(self.table) or time.monotonic() > self._drain_deadline:
                    return
                time.sleep(min(max(0.0, next_try - time.monotonic()), 0.2))

    def _spool_rows(self, rows: list[Sequence[Any]]) -> None:
        for start in range(0, len(rows), self._batch_rows):
            chunk = rows[start:start + self._batch_rows]
            data, kept, error = batches.encode_valid(self.table, chunk)
            if kept < len(chunk):
                self._drops.count(self.table, len(chunk) - kept, "rejected")
                self._drop_log.warning(f"{self.table}:rejected", "%d %s rows do not fit the table: %s",
                                       len(chunk) - kept, self.table, error)
            if not kept:
                continue
            try:
                self._spool.append(self.table, self.columns, data, kept)
            except OSError as exc:  # a full or failing disk: the rows cannot be kept
                self._drops(self.table, kept, "spool_write_failed")
                self._drop_log.warning(f"{self.table}:spool", "cannot spool %d %s rows: %s", kept, self.table, exc)

    def _insert(self, segment: Segment) -> bool:
        """Insert one segment; True when it left the spool (written, or unreadable and dropped)."""
        data = self._spool.load(segment)
        if data is None:
            return True  # unreadable: the spool dropped and counted it
        started = time.perf_counter()
        try:
            self._sink.insert_native(self.table, segment.columns, data, segment.token)
        except DatabaseError as exc:
            # Only errors that condemn the batch itself drop it; anything else (unreachable, too many parts, memory, a
            # missing column an operator may add) is retried.
            if getattr(exc, "code", None) not in DATA_ERRORS:
                return self._failed(segment, exc)
            self._spool.ack(segment)
            self._drops.count(self.table, segment.rows, "rejected")
            self._drop_log.warning(f"{self.table}:refused", "the store refuses a %s batch of %d rows as bad data, "
                                   "dropped: %s", self.table, segment.rows, one_line(exc, 200))
            return True
        except Exception as exc:  # the store's failures are many (transport, server, engine): all retried
            return self._failed(segment, exc)
        self._spool.ack(segment)
        self._metrics.write_seconds.labels(self.table).observe(time.perf_counter() - started)
        self._written.inc(segment.rows)
        if self._failing_since is not None:
            log.info("store accepts %s rows again after %.1f s", self.table, time.monotonic() - self._failing_since)
            self._failing_since = None
        return True

    def _failed(self, segment: Segment, exc: Exception) -> bool:
        self._spool.release(segment)
        self._metrics.write_errors.labels(self.table).inc()
        if self._failing_since is None:
            self._failing_since = time.monotonic()
        self._drop_log.warning(
            f"{self.table}:write", "cannot write %d rows to %s (%d rows wait in the spool; will retry): %s",
            segment.rows, self.table, self._spool.rows(self.table), one_line(exc, 200),
        )
        return False


class Writers:
    """One TableWriter per table, behind the request placement stage; routes typed rows to theirs."""

    def __init__(self, sink: Sink, metrics: IngestMetrics, *, spool_dir: str | None = None,
                 spool_max_bytes: int = MEMORY_SPOOL_BYTES, recent: RecentRequests | None = None,
                 lookup: Lookup | None = None, **writer_options: Any) -> None:
        """Without `spool_dir`, batches wait in memory: bounded, but lost by a restart. `recent` and `lookup` are
        the placement stage's (`stepline.ingest.identity`): it remembers the request reports the spool holds before
        anything is written.

        Raises SpoolError when the spool directory cannot be used.
        """
        self.spool = Spool(metrics.drops, max_bytes=spool_max_bytes, directory=spool_dir)
        metrics.writer.spool_limit.set(spool_max_bytes)
        metrics.writer.spool_bytes.set(self.spool.size_bytes())
        self._writers = {
            table.name: TableWriter(table.name, sink, metrics.writer, self.spool, **writer_options)
            for table in schema.TABLES
        }
        self.placement = RequestPlacement(metrics.requests, recent=recent, lookup=lookup)
        self.placement.remember_spooled(self.spool)

    def start(self) -> None:
        for writer in self._writers.values():
            writer.start()

    def write(self, rows: Iterable[Row]) -> int:
        """Queue typed rows for their tables, request reports as placed; returns how many were accepted."""
        by_table: dict[str, list[Row]] = {}
        table_of = TABLE_OF
        for row in self.placement.place(rows):
            table = table_of[type(row)]
            batch = by_table.get(table)
            if batch is None:
                by_table[table] = [row]
            else:
                batch.append(row)
        return sum(self._writers[table].put(batch) for table, batch in by_table.items())

    def depth(self) -> dict[str, int]:
        return {name: writer.depth() for name, writer in self._writers.items()}

    def stop(self, drain_timeout_s: float = 10.0) -> None:
        """Drain every table at once, then count what could not be written."""
        for writer in self._writers.values():
            writer.request_stop(drain_timeout_s)
        for writer in self._writers.values():
            writer.stop(drain_timeout_s)
