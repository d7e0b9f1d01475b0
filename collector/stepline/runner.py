"""The runner: polls every source on its interval, times it, and never lets one failure spread."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from stepline.ratelimit import RateLimitedLog
from stepline.rows import Event, Row, micros
from stepline.selfmetrics import SelfMetrics
from stepline.sources.base import Counting, Listener, Source, SourceError
from stepline.writer import Writers

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Scheduled:
    """A source and how often to poll it."""

    source: Source
    interval_s: float


class Runner:
    """One thread per source: poll, record timing and success, sleep until the next tick."""

    def __init__(self, scheduled: Iterable[Scheduled], writers: Writers, metrics: SelfMetrics, host: str, *,
                 observer: Callable[[Sequence[Row]], None] | None = None) -> None:
        """`observer` sees every batch the sources emit (the watchdog's tap); it must be cheap and never raise."""
        self._scheduled = list(scheduled)
        self._observer = observer
        self._writers = writers
        self._metrics = metrics
        self._host = host
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._error_log = RateLimitedLog(log, interval_s=30.0)
        self._last_error: dict[str, str] = {}
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

        def emit(batch: Iterable[Row]) -> None:
            nonlocal rows
            if self._observer is None:
                rows += self._writers.write(batch)
                return
            listed = batch if isinstance(batch, list) else list(batch)  # a generator could be read only once
            rows += self._writers.write(listed)
            self._observer(listed)

        started = time.perf_counter()
        ok = False
        try:
            source.poll(emit)
            ok = True
        except SourceError as exc:
            self._failed(name, str(exc), traceback=False)
        except Exception as exc:  # a bug in one source must not stop the others
            self._failed(name, f"{type(exc).__name__}: {exc}", traceback=True)
        self._metrics.source_seconds.labels(name).set(time.perf_counter() - started)
        self._metrics.source_up.labels(name).set(1 if ok else 0)
        self._metrics.source_rows.labels(name).inc(rows)
        if isinstance(source, Counting):
            self._publish_counts(name, source.stats())
        if ok and name in self._last_error:
            log.info("source %s recovered", name)
            del self._last_error[name]
        return ok

    def _publish_counts(self, name: str, counts: Mapping[str, int]) -> None:
        last = self._last_counts.setdefault(name, {})
        for counter, value in counts.items():
            if value > last.get(counter, 0):
                self._metrics.source_counts.labels(name, counter).inc(value - last.get(counter, 0))
            last[counter] = value

    def _failed(self, name: str, message: str, *, traceback: bool) -> None:
        self._metrics.source_errors.labels(name).inc()
        first = self._last_error.get(name) != message
        self._last_error[name] = message
        if traceback:
            log.exception("source %s failed: %s", name, message)
            # An unexpected failure is a stepline bug: it also goes on the timeline, once per message.
            if first:
                self._writers.write([Event(micros(time.time()), self._host, "", name, "source_error", "warning",
                                           message[:500], {})])
        elif first:
            log.warning("source %s: %s", name, message)
            self._error_log.mark(name)
        else:
            self._error_log.warning(name, "source %s still failing: %s", name, message)

    def _loop(self, item: Scheduled) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            self.poll_once(item.source)
            # Keep a fixed cadence; after an overlong poll, skip the missed ticks rather than bunch them.
            next_at += item.interval_s
            now = time.monotonic()
            if next_at < now:
                next_at = now + item.interval_s - ((now - next_at) % item.interval_s)
            self._stop.wait(next_at - now)
