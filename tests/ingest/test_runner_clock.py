"""The clock rule: rows too far ahead of the collector's clock, or older than the retention, are dropped and counted."""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Sequence
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from stepline.app.collector import Collector
from stepline.config.settings import Settings
from stepline.core.clock import ManualClock
from stepline.ingest.metrics import IngestMetrics
from stepline.ingest.runner import MAX_AHEAD_S, Runner
from stepline.ingest.writer import Writers
from stepline.model.rows import Event, Request, Row
from stepline.plugin import wire
from stepline.sources.base import Emit
from stepline.testing.sink import MemorySink, wait_until

NOW = 1_790_000_000.0
NOW_US = int(NOW * 1e6)
DAY_US = 86_400 * 1_000_000


def _event(ts: int, message: str = "") -> Event:
    return Event(ts, "h", "e", "test", "tick", "info", message, {})


def _request(ts: int, request_id: str) -> Request:
    nan = float("nan")
    return Request(ts, "h", "e", 0, "m", request_id, "otlp", "stop", ts, nan, nan, nan, nan, nan, nan, nan, 1, 0, 1, 1,
                   0)


class Emitting:
    """A source that emits the batches it is given, one list per poll."""

    def __init__(self, name: str = "skewed") -> None:
        self.name = name
        self.batches: list[list[Row]] = []

    def poll(self, emit: Emit) -> None:
        if self.batches:
            emit(self.batches.pop(0))


class Harness:
    def __init__(self, retention_days: int = 30) -> None:
        self.clock = ManualClock(NOW)
        self.metrics = IngestMetrics(CollectorRegistry())
        self.sink = MemorySink()
        self.writers = Writers(self.sink, self.metrics, flush_interval_s=0.01)
        self.observed: list[Row] = []
        self.runner = Runner([], self.writers, self.metrics, "h", observer=self.observed.extend,
                             retention_days=retention_days, clock=self.clock)

    def poll(self, source: Emitting, *batches: Sequence[Row]) -> bool:
        source.batches = [list(b) for b in batches]
        return all(self.runner.poll_once(source) for _ in batches)

    def flushed(self, table: str) -> list[Any]:
        self.writers.start()
        self.writers.stop()
        return self.sink.rows(table)

    def value(self, name: str, **labels: str) -> float | None:
        return self.metrics.registry.get_sample_value(name, labels)


def test_rows_out_of_range_are_dropped_and_counted_the_rest_kept_in_arrival_order() -> None:
    h = Harness(retention_days=2)
    ahead_limit, oldest = NOW_US + int(MAX_AHEAD_S * 1e6), NOW_US - 2 * DAY_US
    events = [_event(NOW_US - 5_000_000, "late"), _event(ahead_limit + 1, "future"), _event(ahead_limit, "edge-ahead"),
              _event(oldest - 1, "expired"), _event(oldest, "edge-old"), _event(NOW_US - 60_000_000, "older")]
    requests = [_request(NOW_US + 3600 * 1_000_000, "r-future"), _request(NOW_US, "r-now")]
    assert h.poll(Emitting(), [*events, *requests])  # dropping rows is not a failed poll
    assert [e.message for e in h.flushed("events")] == ["late", "edge-ahead", "edge-old", "older"]
    assert [r.request_id for r in h.sink.rows("requests")] == ["r-now"]
    dropped = "stepline_writer_rows_dropped_total"
    assert h.value(dropped, table="events", reason="ts_out_of_range") == 2
    assert h.value(dropped, table="requests", reason="ts_out_of_range") == 1
    assert h.value("stepline_source_rows_total", source="skewed") == 5
    # The watchdog's tap sees what the store gets, never a row from the future.
    assert sorted(r.ts for r in h.observed) == sorted(r.ts for r in h.sink.rows("events") + h.sink.rows("requests"))


def test_one_rate_limited_line_names_the_source_the_table_and_the_skew(caplog: pytest.LogCaptureFixture) -> None:
    h = Harness()
    source = Emitting("plugin")
    with caplog.at_level(logging.WARNING, logger="stepline.ingest.runner"):
        h.poll(source, [_event(NOW_US + 600_000_000)], [_event(NOW_US + 900_000_000)])
    lines = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "source plugin" in lines[0] and "events" in lines[0] and "+600.0 s" in lines[0]
    assert h.value("stepline_writer_rows_dropped_total", table="events", reason="ts_out_of_range") == 2


def test_the_largest_skew_of_each_sources_latest_batch_is_a_gauge() -> None:
    h = Harness()
    ahead, behind = Emitting("ahead"), Emitting("behind")
    h.poll(ahead, [_event(NOW_US + 120_000_000), _event(NOW_US - 5_000_000)])
    h.poll(behind, [_event(NOW_US - 10_000_000), _event(NOW_US - 30_000_000)])
    gauge = "stepline_source_clock_skew_max_seconds"
    assert (h.value(gauge, source="ahead"), h.value(gauge, source="behind")) == (120.0, -10.0)
    # A dropped row still says how far off its source's clock is; an empty poll changes nothing.
    h.poll(ahead, [_event(NOW_US + 7200_000_000)], [])
    assert h.value(gauge, source="ahead") == 7200.0
    h.clock.advance(60)
    h.poll(ahead, [_event(NOW_US)])
    assert h.value(gauge, source="ahead") == -60.0


def test_the_rule_follows_the_collectors_clock_not_the_hosts() -> None:
    h = Harness(retention_days=1)
    h.clock.set(NOW + 10 * 86_400)  # the collector's clock, ten days on
    h.poll(Emitting(), [_event(NOW_US), _event(NOW_US + 10 * DAY_US)])
    assert [e.ts for e in h.flushed("events")] == [NOW_US + 10 * DAY_US]


def test_retention_must_be_a_day_or_more() -> None:
    metrics = IngestMetrics(CollectorRegistry())
    with pytest.raises(ValueError, match="at least 1 day"):
        Runner([], Writers(MemorySink(), metrics), metrics, "h", retention_days=0)


def _datagram(sequence: int, *steps: float) -> bytes:
    records = b"".join(wire.encode_step(wire.StepRecord(ts, i, 0, 5.0, 0, 0, 1, 1, 1, 0, 0, 0.1, 0, 0, 0, 0, 0, 0,
                                                        False)) for i, ts in enumerate(steps))
    return wire.encode_header(b"skewed", 1, 1, sequence, 0) + records


def test_the_collector_applies_its_retention_to_plugin_rows(store_url: str, sock_dir: str) -> None:
    now = float(int(time.time()))  # the store's TTL runs on the real clock: stay near it
    settings = Settings.from_env({}, store=store_url, retention_days=1, metrics_port=0, query_port=0, otlp_port=0,
                                 plugin_socket=os.path.join(sock_dir, "p.sock"), flush_interval_s=0.1,
                                 disabled_sources=frozenset({"gpu", "host"}))
    collector = Collector(settings, clock=ManualClock(now))
    collector.start()
    try:
        sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sender.connect(settings.plugin_socket)
        # Two days old, on time, a minute early (within the rule), an hour early; then one out of order.
        sender.send(_datagram(0, now - 2 * 86_400, now, now + 60, now + 3600))
        sender.send(_datagram(1, now - 30))
        sender.close()
        wait_until(lambda: collector.metrics.registry.get_sample_value(
            "stepline_writer_rows_dropped_total", {"table": "steps", "reason": "ts_out_of_range"}) == 2)
        wait_until(lambda: collector.wait_for_rows("steps", 3, 0.1) >= 3)
        assert collector.store is not None
        kept = collector.store.query("SELECT toUnixTimestamp64Micro(ts) FROM steps ORDER BY ts").result_rows
        assert [row[0] for row in kept] == [int((now + d) * 1e6) for d in (-30, 0, 60)]
    finally:
        collector.stop()


class Broken:
    """A source with a bug: its poll raises what no source should."""

    name = "broken"

    def poll(self, emit: Emit) -> None:
        raise KeyError("a bug")


def test_a_source_errors_event_is_stamped_by_the_collectors_clock() -> None:
    h = Harness()
    assert not h.runner.poll_once(Broken())
    events = [e for e in h.flushed("events") if e.source == "broken"]
    assert [(e.kind, e.ts) for e in events] == [("source_error", NOW_US)]  # the ManualClock's now, not the machine's
