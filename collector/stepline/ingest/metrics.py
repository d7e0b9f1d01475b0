"""The ingest path's own metrics, declared here beside the code that moves them, on the registry the collector passes.

    SourceMetrics   the runner's view of each source: up, poll time, errors and why, rows, counts, clock skew
    RowDrops        every row given up on the way to the store, by table and reason, counted where it is given up
    WriterMetrics   the writers and the spool: rows written and queued, insert time and errors, the spool's size
    RequestMetrics  request placement: reports merged away, reports that could not be looked up
    IngestMetrics   the four on one registry, what the runner and the writers are built with

Names, labels and help texts are what the alert rules and the collector-health dashboard read: they do not change.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from stepline.core.ratelimit import RateLimitedLog

log = logging.getLogger(__name__)

WRITE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class SourceMetrics:
    """What the runner records of every poll of every source."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.source_up = Gauge(
            "stepline_source_up", "1 when the source's last poll succeeded.", ["source"], registry=r
        )
        self.source_seconds = Gauge(
            "stepline_source_poll_duration_seconds", "Duration of the source's last poll.", ["source"],
            registry=r,
        )
        self.source_errors = Counter(
            "stepline_source_errors", "Polls of the source that failed.", ["source"], registry=r
        )
        self.source_last_error = Gauge(
            "stepline_source_last_error_info", "1 while the source's last poll failed, with why (one line, at most "
            "200 characters); absent while it succeeds.", ["source", "error"], registry=r,
        )
        self.source_failure = Gauge(
            "stepline_source_failure_info", "1 while the source's last poll failed, with the failure's kind: for an "
            "engine's scrape refused (nothing listens: its process is gone), gone (closed without an answer), "
            "timeout, unreachable, http, invalid; error otherwise. Absent while it succeeds.", ["source", "reason"],
            registry=r,
        )
        self.source_counts = Counter(
            "stepline_source_counts", "What a source counted: datagrams, malformed input, data the engine side "
            "dropped, spans rejected.", ["source", "counter"], registry=r,
        )
        self.source_rows = Counter(
            "stepline_source_rows", "Rows the source produced.", ["source"], registry=r
        )
        self.clock_skew = Gauge(
            "stepline_source_clock_skew_max_seconds", "Largest row ts minus the collector's clock in the source's "
            "latest batch (positive: its clock runs ahead; rows over 300 s ahead are dropped).", ["source"],
            registry=r,
        )
        self.engine_up = Gauge(
            "stepline_engine_up", "1 when the engine's /metrics answered with a valid exposition.", ["engine"],
            registry=r,
        )


class RowDrops:
    """stepline_writer_rows_dropped_total{table, reason}: rows given up before reaching the store. Whoever gives rows up
    counts them here, where it happens: the runner (ts_out_of_range), a table's writer, the spool."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.counter = Counter(
            "stepline_writer_rows_dropped", "Rows dropped before reaching the store.", ["table", "reason"],
            registry=registry,
        )
        self._log = RateLimitedLog(log, interval_s=10.0)

    def __call__(self, table: str, rows: int, reason: str) -> None:
        """Count `rows` of `table` given up for `reason`, and log it (at most once per 10 s per table and reason). A
        count of 0 (a spool segment too damaged to say its rows, which the spool names in a line of its own) is
        counted, so the series shows, and not logged."""
        self.count(table, rows, reason)
        if rows:
            self._log.warning(f"{table}:{reason}", "dropped %d %s rows: %s", rows, table, reason)

    def count(self, table: str, rows: int, reason: str) -> None:
        """Count them only, for a caller that logs a line of its own naming more than the reason."""
        self.counter.labels(table, reason).inc(rows)


class WriterMetrics:
    """The writers' and the spool's figures, per table where they have one."""

    def __init__(self, registry: CollectorRegistry, drops: RowDrops) -> None:
        r = registry
        self.drops = drops
        self.rows_written = Counter(
            "stepline_writer_rows_written", "Rows written to the store.", ["table"], registry=r
        )
        self.queue_depth = Gauge(
            "stepline_writer_queue_rows", "Rows accepted and not yet written.", ["table"], registry=r
        )
        self.write_seconds = Histogram(
            "stepline_writer_write_duration_seconds", "Time of one batch insert into the store.", ["table"],
            buckets=WRITE_BUCKETS, registry=r,
        )
        self.write_errors = Counter(
            "stepline_writer_write_errors", "Batch inserts the store refused or could not take.", ["table"],
            registry=r,
        )
        self.spool_bytes = Gauge("stepline_spool_bytes", "Bytes of batches waiting in the spool for the store.",
                                 registry=r)
        self.spool_limit = Gauge("stepline_spool_limit_bytes", "The spool's bound; past it the oldest batches go.",
                                 registry=r)


class RequestMetrics:
    """What request placement (`stepline.ingest.placement`) counts of the reports it places."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.requests_deduplicated = Counter(
            "stepline_requests_deduplicated", "Request reports not written because they added no field to what "
            "earlier reports of the same request gave, by the source of the skipped report.", ["source"], registry=r,
        )
        self.requests_unresolved = Counter(
            "stepline_requests_unresolved", "Request reports older than the collector's memory of requests that "
            "could not be looked up in the store (it was down): each was written as a request of its own, so a "
            "request reported before and after a restart may be two rows.", registry=r,
        )


class IngestMetrics:
    """The ingest path's metrics on `registry`: `sources` (the runner's), `writer` (with `drops`), `requests`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.drops = RowDrops(registry)
        self.writer = WriterMetrics(registry, self.drops)
        self.sources = SourceMetrics(registry)
        self.requests = RequestMetrics(registry)
