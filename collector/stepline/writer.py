"""One bounded batching writer per table: flush on size or time, drop with a counter, drain on stop."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from stepline import schema
from stepline.dedup import RecentRequests
from stepline.ratelimit import RateLimitedLog
from stepline.rows import TABLE_OF, Request, Row
from stepline.selfmetrics import SelfMetrics

log = logging.getLogger(__name__)


class Sink(Protocol):
    """Where batches go: the Store, or an in-memory stand-in in tests."""

    def insert(self, table: str, rows: Sequence[Sequence[Any]], column_names: Sequence[str]) -> None: ...


class TableWriter:
    """Buffers rows of one table and inserts them in batches from a thread of its own.

    Rows are accepted while fewer than `max_rows` wait; beyond that new rows are dropped and
    counted (reason `queue_full`). A batch the store refuses stays queued and is retried with
    backoff, so a short store outage loses nothing until the queue fills.
    """

    def __init__(
        self,
        table: str,
        sink: Sink,
        metrics: SelfMetrics,
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
        self._max_rows = max_rows
        self._batch_rows = batch_rows
        self._flush_interval_s = flush_interval_s
        self._retry_max_s = retry_max_s
        self._queue: deque[Sequence[Any]] = deque()
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
            self._depth.set(len(self._queue))
        if accepted < len(rows):
            self._drop(len(rows) - accepted, reason)
        return accepted

    def depth(self) -> int:
        with self._cond:
            return len(self._queue)

    def request_stop(self, drain_timeout_s: float = 10.0) -> None:
        """Stop accepting rows; the thread writes what is queued, retrying for up to drain_timeout_s."""
        with self._cond:
            if not self._stopping:
                self._stopping = True
                self._drain_deadline = time.monotonic() + drain_timeout_s
            self._cond.notify()

    def stop(self, drain_timeout_s: float = 10.0) -> None:
        """Stop, drain, and count as dropped whatever the store would not take in time."""
        self.request_stop(drain_timeout_s)
        if self._thread.is_alive():
            self._thread.join(drain_timeout_s + 30.0)  # one insert in flight may outlast the deadline
        if self._thread.is_alive():
            log.error("writer for %s did not finish draining", self.table)
        left = self.depth()
        if left:
            self._drop(left, "store_unavailable_at_stop")

    def _drop(self, count: int, reason: str) -> None:
        self._metrics.rows_dropped.labels(self.table, reason).inc(count)
        self._drop_log.warning(f"{self.table}:{reason}", "dropped %d %s rows: %s", count, self.table, reason)

    def _run(self) -> None:
        backoff = 0.0
        while True:
            with self._cond:
                if not self._stopping and len(self._queue) < self._batch_rows:
                    self._cond.wait(max(self._flush_interval_s, backoff))
                batch = [self._queue[i] for i in range(min(self._batch_rows, len(self._queue)))]
                stopping = self._stopping
            if batch and self._write(batch):
                backoff = 0.0
                with self._cond:
                    for _ in batch:
                        self._queue.popleft()
                    self._depth.set(len(self._queue))
                continue
            if batch:
                backoff = min(self._retry_max_s, max(0.5, backoff * 2))
            if stopping:
                if not batch or time.monotonic() > self._drain_deadline:
                    return
                time.sleep(min(backoff, 1.0))

    def _write(self, batch: list[Sequence[Any]]) -> bool:
        started = time.perf_counter()
        try:
            self._sink.insert(self.table, batch, self.columns)
        except Exception as exc:  # the store's failures are many (transport, server, engine); all retried
            self._metrics.write_errors.labels(self.table).inc()
            if self._failing_since is None:
                self._failing_since = time.monotonic()
            self._drop_log.warning(
                f"{self.table}:write", "cannot write %d rows to %s (will retry): %s",
                len(batch), self.table, " ".join(str(exc).split())[:200],
            )
            return False
        self._metrics.write_seconds.labels(self.table).observe(time.perf_counter() - started)
        self._written.inc(len(batch))
        if self._failing_since is not None:
            log.info("store accepts %s rows again after %.1f s", self.table, time.monotonic() - self._failing_since)
            self._failing_since = None
        return True


class Writers:
    """One TableWriter per table; routes typed rows to theirs, writing each request once."""

    def __init__(self, sink: Sink, metrics: SelfMetrics, *, recent: RecentRequests | None = None,
                 **writer_options: Any) -> None:
        self._writers = {
            table.name: TableWriter(table.name, sink, metrics, **writer_options) for table in schema.TABLES
        }
        self._recent = recent or RecentRequests()
        self._duplicates = metrics.requests_deduplicated

    def start(self) -> None:
        for writer in self._writers.values():
            writer.start()

    def write(self, rows: Iterable[Row]) -> int:
        """Queue typed rows for their tables; returns how many were accepted."""
        by_table: dict[str, list[Row]] = {}
        for row in rows:
            if isinstance(row, Request) and not self._recent.first_time(row.engine, row.request_id):
                self._duplicates.labels(row.source).inc()
                continue
            by_table.setdefault(TABLE_OF[type(row)], []).append(row)
        return sum(self._writers[table].put(batch) for table, batch in by_table.items())

    def depth(self) -> dict[str, int]:
        return {name: writer.depth() for name, writer in self._writers.items()}

    def stop(self, drain_timeout_s: float = 10.0) -> None:
        """Drain every table at once, then count what could not be written."""
        for writer in self._writers.values():
            writer.request_stop(drain_timeout_s)
        for writer in self._writers.values():
            writer.stop(drain_timeout_s)
