"""The runner: polls every source on its interval, times it, and never lets one failure spread.

The clock rule. Every row a source emits passes through the runner, and the runner alone judges its `ts`
against the collector's clock: a row more than MAX_AHEAD_S (5 minutes) ahead of it, or older than the
retention window (`retention_days`), is dropped and counted in
`stepline_writer_rows_dropped_total{table, reason="ts_out_of_range"}`, with one rate-limited log line naming the
source, the table and the skew. A row from the future would sit past every dashboard's "now" and skew the
watchdog; one older than the retention would land in a part its TTL drops at once. The largest skew of each
source's latest batch (row ts minus the collector's clock, positive when the source runs ahead) is exported as
`stepline_source_clock_skew_max_seconds{source}`. Rows in range are accepted in whatever order they arrive:
the store sorts by each table's ORDER BY, and nothing downstream assumes arrival order.

A source that is down and knows when it will try again (no NVML: a retry a minute) says so through
`retry_in_s()`: the runner polls it then, not at its poll rate, so a down source costs one failed poll, one
error count and one warning per attempt (repeats of the same failure are logged at debug), and
`stepline_source_up{source} 0` in between.
"""

from __future__ import annotations

import logging
import operator
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from stepline.core.clock import Clock, SystemClock
from stepline.core.oneline import one_line
from stepline.core.ratelimit import RateLimitedLog
from stepline.ingest.metrics import IngestMetrics
from stepline.ingest.writer import Writers
from stepline.model.rows import TABLE_OF, Event, Row, micros
from stepline.sources.base import Counting, Listener, Source, SourceError

log = logging.getLogger(__name__)

MAX_AHEAD_S = 300.0  # a source's clock may run this far ahead of the collector's before its rows are dropped
_DAY_US = 86_400_000_000
_TS = operator.itemgetter(0)


@runtime_checkable
class Retrying(Protocol):
    """A source that, while down, attempts again only at a time of its own."""

    def retry_in_s(self) -> float:
        """Seconds until its next attempt; 0 while it is up (poll at the usual rate)."""


def next_poll_at(next_at: float, now: float, interval_s: float, retry_in_s: float = 0.0) -> float:
    """When to poll next: the next tick of a fixed cadence, or a down source's own retry time if later.

    After an overlong poll the missed ticks are skipped rather than bunched.
    """
    next_at += interval_s
    if next_at < now:
        next_at = now + interval_s - ((now - next_at) % interval_s)
    return max(next_at, now + retry_in_s)


@dataclass(frozen=True)
class Scheduled:
    """A source and how often to poll it."""

    source: Source
    interval_s: float


class Runner:
    """One thread per source: poll, record timing and success, sleep until the next tick."""

    def __init__(self, scheduled: Iterable[Scheduled], writers: Writers, metrics: IngestMetrics, host: str, *,
                 observer: Callable[[Sequence[Row]], None] | None = None, retention_days: int = 30,
                 clock: Clock | None = None) -> None:
        """`observer` sees every batch of rows in range (the watchdog's tap); it must be cheap and never raise.

        Rows are judged against `clock` (the collector's) by the clock rule in this module's docstring.
        """
        if retention_days < 1:
            raise ValueError(f"runner: retention must be at least 1 day, got {retention_days}")
        self._scheduled = list(scheduled)
        self._clock = clock or SystemClock()
        self._retention_us = retention_days * _DAY_US
        self._observer = observer
        self._writers = writers
        self._metrics = metrics.sources
        self._drops = metrics.drops
        self._host = host
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._error_log = RateLimitedLog(log, interval_s=30.0)
        self._skew_log = RateLimitedLog(log, interval_s=60.0)
        self._last_error: dict[str, str] = {}
        self._last_reason: dict[str, str] = {}  # source -> the kind of its latest failure, while it fails
        self._last_counts: dict[str, dict[str, int]] = {}

    def start(self) -> None:
        """Bind every listening source first (a taken port fails start-up), then start polling."""
        started: list[Listener] = []
        try:
            for item in self._scheduled:
                if isinstance(item.source, Listener):
                    item.source.start()
                    started.append(item.source)
        except BaseException:
            for listener in started:
                listener.stop()
            raise
        for item in self._scheduled:
            thread = threading.Thread(target=self._loop, args=(item,), name=f"source-{item.source.name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop polling; listeners stop receiving, and what they had received is polled one last time."""
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        for item in self._scheduled:
            if isinstance(item.source, Listener):
                item.source.stop()
                self.poll_once(item.source)

    def poll_once(self, source: Source) -> bool:
        """Poll one source now; returns whether the poll succeeded."""
        name = source.name
        rows = 0
        skew: int | None = None  # the largest ts - now of this poll's rows, microseconds

        def emit(batch: Iterable[Row]) -> None:
            nonlocal rows, skew
            listed = batch if isinstance(batch, list) else list(batch)  # a generator could be read only once
            if not listed:
                return
            listed, newest = self._in_range(name, listed)
            skew = newest if skew is None else max(skew, newest)
            rows += self._writers.write(listed)
            if self._observer is not None and listed:
                self._observer(listed)

        started = time.perf_counter()
        ok = False
        try:
            source.poll(emit)
            ok = True
        except SourceError as exc:
            retry_in_s = source.retry_in_s() if isinstance(source, Retrying) else 0.0
            self._failed(name, str(exc), traceback=False, retry_in_s=retry_in_s, reason=exc.reason)
        except Exception as exc:  # a bug in one source must not stop the others
            self._failed(name, f"{type(exc).__name__}: {exc}", traceback=True)
        self._metrics.source_seconds.labels(name).set(time.perf_counter() - started)
        self._metrics.source_up.labels(name).set(1 if ok else 0)
        self._metrics.source_rows.labels(name).inc(rows)
        if skew is not None:
            self._metrics.clock_skew.labels(name).set(skew / 1e6)
        if isinstance(source, Counting):
            self._publish_counts(name, source.stats())
        if ok and name in self._last_error:
            log.info("source %s recovered", name)
            self._metrics.source_last_error.remove(name, _error_label(self._last_error.pop(name)))
            self._metrics.source_failure.remove(name, self._last_reason.pop(name))
        return ok

    def _in_range(self, name: str, rows: list[Row]) -> tuple[list[Row], int]:
        """The rows whose ts obeys the clock rule, and the largest ts - now among all of them (microseconds)."""
        now = micros(self._clock.time())
        earliest, latest = now - self._retention_us, now + int(MAX_AHEAD_S * 1e6)
        stamps = list(map(_TS, rows))  # every row type's first field is its ts
        oldest, newest = min(stamps), max(stamps)
        if earliest <= oldest and newest <= latest:
            return rows, newest - now  # the usual case: three passes in C, the rows not copied
        kept = [row for row in rows if earliest <= row.ts <= latest]
        dropped: dict[str, list[int]] = {}
        for row in rows:
            if not earliest <= row.ts <= latest:
                dropped.setdefault(TABLE_OF[type(row)], []).append(row.ts - now)
        for table, skews in dropped.items():
            self._drops.count(table, len(skews), "ts_out_of_range")
            worst = max(skews, key=abs) / 1e6
            self._skew_log.warning(
                f"{name}:{table}", "dropped %d %s rows from source %s: ts %+.1f s from the collector's clock (rows may "
                "be at most %.0f s ahead and %d days old)", len(skews), table, name, worst, MAX_AHEAD_S,
                self._retention_us // _DAY_US)
        return kept, newest - now

    def _publish_counts(self, name: str, counts: Mapping[str, int]) -> None:
        last = self._last_counts.setdefault(name, {})
        for counter, value in counts.items():
            if value > last.get(counter, 0):
                self._metrics.source_counts.labels(name, counter).inc(value - last.get(counter, 0))
            last[counter] = value

    def _failed(self, name: str, message: str, *, traceback: bool, retry_in_s: float = 0.0,
                reason: str = "error") -> None:
        self._metrics.source_errors.labels(name).inc()
        # One series per source, its latest failure's kind: EngineGone pages a refused engine at once, a timeout
        # waits EngineDown's patience.
        previous_reason = self._last_reason.get(name)
        if previous_reason != reason:
            if previous_reason is not None:
                self._metrics.source_failure.remove(name, previous_reason)
            self._last_reason[name] = reason
            self._metrics.source_failure.labels(name, reason).set(1)
        previous = self._last_error.get(name)
        first = previous != message
        self._last_error[name] = message
        if first:  # one series per source: `stepline status` shows it beside DOWN
            if previous is not None:
                self._metrics.source_last_error.remove(name, _error_label(previous))
            self._metrics.source_last_error.labels(name, _error_label(message)).set(1)
        if traceback:
            log.exception("source %s failed: %s", name, message)
            # An unexpected failure is a stepline bug: it also goes on the timeline, once per message.
            if first:
                self._writers.write([Event(micros(self._clock.time()), self._host, "", name, "source_error", "warning",
                                           message[:500], {})])
        elif first:
            when = f" (next attempt in {retry_in_s:.0f} s)" if retry_in_s else ""
            log.warning("source %s: %s%s", name, message, when)
            self._error_log.mark(name)
        elif retry_in_s:  # a down source retrying on its own schedule: the first warning said it all
            log.debug("source %s still down, next attempt in %.0f s: %s", name, retry_in_s, message)
        else:
            self._error_log.warning(name, "source %s still failing: %s", name, message)

    def _loop(self, item: Scheduled) -> None:
        source = item.source
        next_at = time.monotonic()
        while not self._stop.is_set():
            self.poll_once(source)
            now = time.monotonic()
            next_at = next_poll_at(next_at, now, item.interval_s,
                                   source.retry_in_s() if isinstance(source, Retrying) else 0.0)
            self._stop.wait(next_at - now)


def _error_label(message: str) -> str:
    line = one_line(message)
    return line if len(line) <= 200 else line[:199] + "…"
