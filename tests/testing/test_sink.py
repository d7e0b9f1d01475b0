"""MemorySink and wait_until: the in-memory store the writer tests insert into, deduplicating by token as ClickHouse
does, failing on demand, and the poll tests wait with."""

from __future__ import annotations

import threading

import pytest

from stepline.model.rows import Event
from stepline.model.schema import TABLE_BY_NAME
from stepline.store.batches import encode
from stepline.testing.sink import MemorySink, wait_until

COLUMNS = [name for name, _ in TABLE_BY_NAME["events"].columns]


def _event(n: int) -> Event:
    return Event(1_700_000_000_000_000 + n, "h", "vllm-0", "test", "k", "info", f"message {n}", {"n": str(n)})


def test_rows_come_back_typed_in_insert_order_from_plain_and_native_inserts() -> None:
    sink = MemorySink()
    sink.insert("events", [tuple(_event(0))], COLUMNS)
    sink.insert_native("events", COLUMNS, encode("events", [tuple(_event(1)), tuple(_event(2))]))
    assert sink.rows("events") == [_event(0), _event(1), _event(2)]
    assert sink.rows("steps") == [] and sink.attempts == 2


def test_a_token_seen_before_is_not_kept_again_in_the_same_table() -> None:
    sink = MemorySink()
    for table in ("events", "events", "steps"):
        sink.insert(table, [tuple(_event(0))] if table == "events" else [], COLUMNS, dedup_token="t1")
    assert len(sink.batches["events"]) == 1 and sink.batches["steps"] == [[]]
    assert sink.tokens == ["t1", "t1", "t1"] and sink.attempts == 3


def test_a_failing_sink_raises_like_an_unreachable_store_and_counts_the_attempt() -> None:
    sink = MemorySink()
    sink.failing = True
    with pytest.raises(ConnectionError, match="unreachable"):
        sink.insert("events", [tuple(_event(0))], COLUMNS)
    assert sink.attempts == 1 and sink.rows("events") == []


def test_wait_until_returns_once_true_and_fails_the_test_when_never() -> None:
    flag = threading.Event()
    threading.Timer(0.05, flag.set).start()
    wait_until(flag.is_set, timeout_s=5)
    with pytest.raises(AssertionError, match=r"within 0\.05 s"):
        wait_until(lambda: False, timeout_s=0.05)
