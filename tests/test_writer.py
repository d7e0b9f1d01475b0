"""The batching writer: flush on size and on time, bounded with counted drops, drain on stop."""

from __future__ import annotations

import time

import pytest

from stepline.rows import Event
from stepline.selfmetrics import SelfMetrics
from stepline.store import Store
from stepline.testing import MemorySink, wait_until
from stepline.writer import TableWriter, Writers


def _event(i: int) -> Event:
    return Event(int(time.time() * 1e6) + i, "h", "e", "test", "k", "info", f"m{i}", {})


def _value(metrics: SelfMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_flushes_when_a_batch_is_full_without_waiting_for_the_timer() -> None:
    sink, metrics = MemorySink(), SelfMetrics()
    writer = TableWriter("events", sink, metrics, max_rows=100, batch_rows=10, flush_interval_s=60)
    writer.start()
    assert writer.put([_event(i) for i in range(25)]) == 25
    wait_until(lambda: len(sink.rows("events")) == 20)
    assert [len(b) for b in sink.batches["events"]] == [10, 10]
    writer.stop()
    assert len(sink.rows("events")) == 25  # the remainder is drained on stop
    assert _value(metrics, "stepline_writer_rows_written_total", table="events") == 25


def test_flushes_on_the_timer_below_batch_size() -> None:
    sink = MemorySink()
    writer = TableWriter("events", sink, SelfMetrics(), max_rows=100, batch_rows=50, flush_interval_s=0.05)
    writer.start()
    writer.put([_event(1)])
    wait_until(lambda: len(sink.rows("events")) == 1)
    writer.stop()


def test_drops_are_counted_when_the_queue_is_full() -> None:
    sink, metrics = MemorySink(), SelfMetrics()
    sink.failing = True
    writer = TableWriter("events", sink, metrics, max_rows=10, batch_rows=5, flush_interval_s=0.01)
    writer.start()
    assert writer.put([_event(i) for i in range(8)]) == 8
    assert writer.put([_event(i) for i in range(8, 16)]) == 2
    assert writer.depth() == 10
    assert _value(metrics, "stepline_writer_rows_dropped_total", table="events", reason="queue_full") == 6
    wait_until(lambda: _value(metrics, "stepline_writer_write_errors_total", table="events") >= 1)
    sink.failing = False  # the store comes back: the retried batches land in order, nothing accepted is lost
    wait_until(lambda: len(sink.rows("events")) == 10, timeout_s=10)
    assert [r.message for r in sink.rows("events")] == [f"m{i}" for i in range(10)]
    writer.stop()
    assert _value(metrics, "stepline_writer_queue_rows", table="events") == 0


def test_rows_the_store_will_not_take_at_stop_are_counted_not_silently_lost() -> None:
    sink, metrics = MemorySink(), SelfMetrics()
    sink.failing = True
    writer = TableWriter("events", sink, metrics, max_rows=100, batch_rows=10, flush_interval_s=0.01)
    writer.start()
    writer.put([_event(i) for i in range(7)])
    writer.stop(drain_timeout_s=0.3)
    assert _value(metrics, "stepline_writer_rows_dropped_total", table="events",
                  reason="store_unavailable_at_stop") == 7
    assert writer.put([_event(99)]) == 0
    assert _value(metrics, "stepline_writer_rows_dropped_total", table="events", reason="stopped") == 1


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="batch_rows"):
        TableWriter("events", MemorySink(), SelfMetrics(), max_rows=5, batch_rows=10)


def test_writers_drain_into_the_real_store_on_stop(store: Store) -> None:
    metrics = SelfMetrics()
    writers = Writers(store, metrics, max_rows=10_000, batch_rows=5_000, flush_interval_s=60)
    writers.start()
    assert writers.write(_event(i) for i in range(1234)) == 1234
    writers.stop()
    assert store.query("SELECT count(), uniqExact(message) FROM events").result_rows[0] == (1234, 1234)
    assert _value(metrics, "stepline_writer_rows_written_total", table="events") == 1234
