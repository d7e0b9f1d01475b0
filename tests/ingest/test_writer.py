"""The batching writer: flush on size and on time, bounded with counted drops, drain on stop."""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest
from prometheus_client import CollectorRegistry

from stepline.ingest.metrics import IngestMetrics
from stepline.ingest.spool import Spool
from stepline.ingest.writer import TableWriter, Writers
from stepline.model.rows import Event
from stepline.store.store import Store
from stepline.testing.sink import MemorySink, wait_until


def _writer(sink: MemorySink, metrics: IngestMetrics, *, spool: Spool | None = None, **options: float) -> TableWriter:
    """A writer of `events` with a memory spool; the spool counts its drops where the writer counts its own."""
    spool = spool or Spool(metrics.drops, max_bytes=1 << 20)
    return TableWriter("events", sink, metrics.writer, spool, **options)  # type: ignore[arg-type]


def _event(i: int) -> Event:
    return Event(int(time.time() * 1e6) + i, "h", "e", "test", "k", "info", f"m{i}", {})


def _value(metrics: IngestMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_flushes_when_a_batch_is_full_without_waiting_for_the_timer() -> None:
    sink, metrics = MemorySink(), IngestMetrics(CollectorRegistry())
    writer = _writer(sink, metrics, max_rows=100, batch_rows=10, flush_interval_s=60)
    writer.start()
    assert writer.put([_event(i) for i in range(25)]) == 25
    wait_until(lambda: len(sink.rows("events")) == 25)  # cut into batches of at most 10, long before the timer
    assert [len(b) for b in sink.batches["events"]] == [10, 10, 5]
    assert len(set(sink.tokens)) == 3  # each batch with a token of its own
    writer.stop()
    assert _value(metrics, "stepline_writer_rows_written_total", table="events") == 25


def test_flushes_on_the_timer_below_batch_size() -> None:
    sink = MemorySink()
    writer = _writer(sink, IngestMetrics(CollectorRegistry()), max_rows=100, batch_rows=50, flush_interval_s=0.05)
    writer.start()
    writer.put([_event(1)])
    wait_until(lambda: len(sink.rows("events")) == 1)
    writer.stop()


def test_rows_beyond_the_memory_queue_are_dropped_and_counted() -> None:
    sink, metrics = MemorySink(), IngestMetrics(CollectorRegistry())
    writer = _writer(sink, metrics, max_rows=10, batch_rows=5, flush_interval_s=0.01)  # not started: nothing drains
    assert writer.put([_event(i) for i in range(8)]) == 8
    assert writer.put([_event(i) for i in range(8, 16)]) == 2
    assert writer.depth() == 10
    assert _value(metrics, "stepline_writer_rows_dropped_total", table="events", reason="queue_full") == 6
    writer.start()
    wait_until(lambda: len(sink.rows("events")) == 10)
    writer.stop()


def test_a_store_outage_loses_nothing_and_rows_land_in_order() -> None:
    sink, metrics = MemorySink(), IngestMetrics(CollectorRegistry())
    sink.failing = True
    writer = _writer(sink, metrics, max_rows=100, batch_rows=5, flush_interval_s=0.01, retry_max_s=0.05)
    writer.start()
    for i in range(0, 30, 3):
        writer.put([_event(j) for j in range(i, i + 3)])
        time.sleep(0.01)
    wait_until(lambda: _value(metrics, "stepline_writer_write_errors_total", table="events") >= 3)
    assert writer.depth() == 30
    sink.failing = False  # the store comes back: the spooled batches land in order, nothing accepted is lost
    wait_until(lambda: len(sink.rows("events")) == 30)
    assert [r[6] for r in sink.rows("events")] == [f"m{i}" for i in range(30)]
    writer.stop()
    assert _value(metrics, "stepline_writer_queue_rows", table="events") == 0
    assert metrics.registry.get_sample_value("stepline_writer_rows_dropped_total",
                                             {"table": "events", "reason": "spool_full"}) is None


def test_a_full_spool_drops_the_oldest_batches_counted() -> None:
    sink, metrics = MemorySink(), IngestMetrics(CollectorRegistry())
    sink.failing = True
    spool = Spool(metrics.drops, max_bytes=1500)
    writer = _writer(sink, metrics, spool=spool, max_rows=100, batch_rows=4, flush_interval_s=0.01, retry_max_s=0.05)
    writer.start()
    for i in range(0, 40, 4):
        writer.put([_event(j) for j in range(i, i + 4)])
        wait_until(lambda: writer.depth() == 0 or spool.rows() > 0)
        time.sleep(0.02)
    wait_until(lambda: spool.rows() + _value(metrics, "stepline_writer_rows_dropped_total", table="events",
                                             reason="spool_full") == 40)
    dropped = _value(metrics, "stepline_writer_rows_dropped_total", table="events", reason="spool_full")
    assert 0 < dropped < 40 and spool.size_bytes() <= 1500
    sink.failing = False
    wait_until(lambda: len(sink.rows("events")) == 40 - dropped)
    kept = [r[6] for r in sink.rows("events")]
    assert kept == [f"m{i}" for i in range(int(dropped), 40)]  # the oldest went, the newest stayed, in order
    writer.stop()


def test_rows_the_store_will_not_take_at_stop_are_counted_not_silently_lost() -> None:
    sink, metrics = MemorySink(), IngestMetrics(CollectorRegistry())
    sink.failing = True
    writer = _writer(sink, metrics, max_rows=100, batch_rows=10, flush_interval_s=0.01)
    writer.start()
    writer.put([_event(i) for i in range(7)])
    writer.stop(drain_timeout_s=0.3)
    assert _value(metrics, "stepline_writer_rows_dropped_total", table="events",
                  reason="store_unavailable_at_stop") == 7
    assert writer.put([_event(99)]) == 0
    assert _value(metrics, "stepline_writer_rows_dropped_total", table="events", reason="stopped") == 1


def test_a_row_that_does_not_fit_its_table_is_dropped_alone_and_the_rest_flow() -> None:
    sink, metrics = MemorySink(), IngestMetrics(CollectorRegistry())
    writer = _writer(sink, metrics, max_rows=100, batch_rows=50, flush_interval_s=0.01)
    writer.start()
    bad = _event(2)._replace(ts="not a time")  # type: ignore[arg-type]
    writer.put([_event(1), bad, _event(3)])
    wait_until(lambda: len(sink.rows("events")) == 2)
    assert [r.message for r in sink.rows("events")] == ["m1", "m3"]
    assert _value(metrics, "stepline_writer_rows_dropped_total", table="events", reason="rejected") == 1
    writer.stop()


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="batch_rows"):
        _writer(MemorySink(), IngestMetrics(CollectorRegistry()), max_rows=5, batch_rows=10)


def test_writers_drain_into_the_real_store_on_stop(store: Store) -> None:
    metrics = IngestMetrics(CollectorRegistry())
    writers = Writers(store, metrics, max_rows=10_000, batch_rows=5_000, flush_interval_s=60)
    writers.start()
    assert writers.write(_event(i) for i in range(1234)) == 1234
    writers.stop()
    assert store.query("SELECT count(), uniqExact(message) FROM events").result_rows[0] == (1234, 1234)
    assert _value(metrics, "stepline_writer_rows_written_total", table="events") == 1234


def test_a_batch_the_store_refuses_as_bad_data_is_dropped_not_retried_forever() -> None:
    from clickhouse_connect.driver.exceptions import DatabaseError

    class Refusing(MemorySink):
        def insert_native(self, table: str, column_names: Sequence[str], data: bytes,
                          dedup_token: str | None = None) -> None:
            if self.attempts == 0:
                self.attempts += 1
                error = DatabaseError("Code: 53. DB::Exception: Type mismatch")
                error.code = 53
                raise error
            super().insert_native(table, column_names, data, dedup_token)

    sink, metrics = Refusing(), IngestMetrics(CollectorRegistry())
    writer = _writer(sink, metrics, max_rows=100, batch_rows=2, flush_interval_s=0.01)
    writer.put([_event(i) for i in range(4)])
    writer.start()
    wait_until(lambda: len(sink.rows("events")) == 2)
    assert _value(metrics, "stepline_writer_rows_dropped_total", table="events", reason="rejected") == 2
    writer.stop()
