"""The disk spool: batches survive a restart, replays are stored once, damaged segments are counted."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from stepline.ingest.metrics import IngestMetrics
from stepline.ingest.spool import Spool, SpoolError
from stepline.ingest.writer import Writers
from stepline.model.rows import Event, Request
from stepline.store import batches
from stepline.store.store import Store
from stepline.testing.sink import MemorySink, wait_until


def _events(n: int, start: int = 0) -> list[Event]:
    now = int(time.time() * 1e6)
    return [Event(now + i, "h", "e", "test", "k", "info", f"m{i}", {"i": str(i)}) for i in range(start, start + n)]


LOADED_US = int(time.time() * 1e6)


def _request(request_id: str, source: str) -> Request:
    """A report of a request that arrived a millisecond before this module was loaded (both reports of one request
    give one arrival: how the collector knows them for one request's)."""
    now = LOADED_US
    return Request(now, "h", "e", 0, "m", request_id, source, "stop", now - 1000, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1,
                   10, 0, 5, 16, 0)


def _metrics() -> IngestMetrics:
    return IngestMetrics(CollectorRegistry())


def _dropped(metrics: IngestMetrics, reason: str, table: str = "events") -> float:
    return metrics.registry.get_sample_value("stepline_writer_rows_dropped_total",
                                             {"table": table, "reason": reason}) or 0.0


def test_rows_the_store_did_not_take_wait_on_disk_for_the_next_start(tmp_path: Path) -> None:
    spool_dir = str(tmp_path / "spool")
    sink, metrics = MemorySink(), IngestMetrics(CollectorRegistry())
    sink.failing = True
    writers = Writers(sink, metrics, spool_dir=spool_dir, spool_max_bytes=1 << 20, batch_rows=10,
                      flush_interval_s=0.01)
    writers.start()
    writers.write(_events(25))
    writers.stop(drain_timeout_s=0.3)
    assert _dropped(metrics, "store_unavailable_at_stop") == 0
    assert len([n for n in os.listdir(spool_dir) if n.endswith(".events.seg")]) == 3

    sink.failing = False
    again = Writers(sink, _metrics(), spool_dir=spool_dir, spool_max_bytes=1 << 20, flush_interval_s=0.01)
    assert again.spool.rows("events") == 25
    again.start()
    wait_until(lambda: len(sink.rows("events")) == 25)
    again.stop()
    assert [row[6] for row in sink.rows("events")] == [f"m{i}" for i in range(25)]
    assert not [n for n in os.listdir(spool_dir) if n.endswith(".seg")]


def test_a_segment_replayed_after_it_was_written_is_stored_once(store: Store, tmp_path: Path) -> None:
    """A kill -9 between the store's reply and the segment's removal: the restart replays it with its token."""
    spool_dir = str(tmp_path / "spool")
    dropped: list[tuple[str, int, str]] = []
    spool = Spool(lambda *d: dropped.append(d), max_bytes=1 << 20, directory=spool_dir)
    columns = Event._fields
    first = spool.append("events", columns, batches.encode("events", _events(40)), 40)
    second = spool.append("events", columns, batches.encode("events", _events(60, start=40)), 60)
    store.insert_native("events", columns, batches.encode("events", _events(40)), first.token)  # then kill -9

    writers = Writers(store, _metrics(), spool_dir=spool_dir, spool_max_bytes=1 << 20, flush_interval_s=0.01)
    assert writers.spool.pending("events")[0].token == first.token and writers.spool.rows("events") == 100
    writers.start()
    wait_until(lambda: writers.spool.rows("events") == 0)
    writers.stop()
    assert store.query("SELECT count(), uniqExact(message) FROM events").result_rows[0] == (100, 100)
    assert second.seq > first.seq and not dropped


def test_an_insert_whose_reply_was_lost_is_retried_and_stored_once(store: Store) -> None:
    lost = {"replies": 2}

    class LosingReplies:
        def insert_native(self, table: str, column_names: Sequence[str], data: bytes,
                          dedup_token: str | None = None) -> None:
            store.insert_native(table, column_names, data, dedup_token)
            if lost["replies"]:
                lost["replies"] -= 1
                raise ConnectionError("connection reset before the reply")

    metrics = IngestMetrics(CollectorRegistry())
    writers = Writers(LosingReplies(), metrics, batch_rows=50, flush_interval_s=0.01, retry_max_s=0.05)
    writers.start()
    writers.write(_events(120))
    wait_until(lambda: writers.depth()["events"] == 0 and not lost["replies"])
    writers.stop()
    assert store.query("SELECT count(), uniqExact(message) FROM events").result_rows[0] == (120, 120)
    assert metrics.registry.get_sample_value("stepline_writer_write_errors_total", {"table": "events"}) == 2


def test_damaged_segments_are_counted_and_torn_ones_removed(tmp_path: Path) -> None:
    spool_dir = tmp_path / "spool"
    spool = Spool(lambda *d: None, max_bytes=1 << 20, directory=str(spool_dir))
    good = spool.append("events", Event._fields, batches.encode("events", _events(5)), 5)
    bad = spool.append("events", Event._fields, batches.encode("events", _events(7)), 7)
    path = spool_dir / f"{bad.seq:016d}.events.seg"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # a flipped bit in the rows (the checksum catches it)
    path.write_bytes(bytes(data))
    (spool_dir / "0000000000000099.events.seg").write_bytes(b"not a segment at all")
    (spool_dir / ".0000000000000100.events.seg.tmp").write_bytes(b"half a segm")

    sink, metrics = MemorySink(), IngestMetrics(CollectorRegistry())
    writers = Writers(sink, metrics, spool_dir=str(spool_dir), spool_max_bytes=1 << 20, flush_interval_s=0.01)
    assert writers.spool.rows("events") == 12  # the unreadable header was dropped at once, the bad payload waits
    assert not (spool_dir / ".0000000000000100.events.seg.tmp").exists()
    writers.start()
    wait_until(lambda: writers.spool.rows("events") == 0)
    writers.stop()
    assert [row[6] for row in sink.rows("events")] == [f"m{i}" for i in range(5)]
    assert _dropped(metrics, "spool_corrupt") == 7
    assert good.seq < bad.seq


def test_a_restarted_collector_never_reuses_a_token_even_with_an_empty_spool(store: Store, tmp_path: Path) -> None:
    """Tokens name a segment for good: a new run's first batch must not look like the last run's first batch."""
    spool_dir = str(tmp_path / "spool")
    tokens: list[str] = []
    for run in range(3):
        writers = Writers(store, _metrics(), spool_dir=spool_dir, spool_max_bytes=1 << 20, flush_interval_s=0.01)
        writers.start()
        writers.write(_events(10, start=run * 10))
        wait_until(lambda w=writers: w.depth()["events"] == 0)  # type: ignore[misc]
        tokens.append(f"stepline-{writers.spool.run_id}-1")
        writers.stop()
    assert len(set(tokens)) == 3
    assert store.query("SELECT count(), uniqExact(message) FROM events").result_rows[0] == (30, 30)


def test_a_request_waiting_in_the_spool_is_not_written_again_after_a_restart(tmp_path: Path) -> None:
    spool_dir = str(tmp_path / "spool")
    sink = MemorySink()
    sink.failing = True
    writers = Writers(sink, _metrics(), spool_dir=spool_dir, spool_max_bytes=1 << 20, flush_interval_s=0.01)
    writers.start()
    writers.write([_request("r-1", "plugin")])
    writers.stop(drain_timeout_s=0.2)

    sink.failing = False
    metrics = IngestMetrics(CollectorRegistry())
    again = Writers(sink, metrics, spool_dir=spool_dir, spool_max_bytes=1 << 20, flush_interval_s=0.01)
    again.start()
    again.write([_request("r-1", "otlp"), _request("r-2", "otlp")])  # r-1's span, exported after the restart
    wait_until(lambda: len(sink.rows("requests")) == 2)
    again.stop()
    assert sorted((row[5], row[6]) for row in sink.rows("requests")) == [("r-1", "plugin"), ("r-2", "otlp")]
    assert metrics.registry.get_sample_value("stepline_requests_deduplicated_total", {"source": "otlp"}) == 1


def test_an_unusable_spool_directory_is_one_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(SpoolError, match=f"cannot use the spool directory {blocker}/spool: Not a directory"):
        Spool(lambda *d: None, max_bytes=1 << 20, directory=str(blocker / "spool"))
