"""The store: opening it (embedded or a server) with clear errors, and its reads."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from clickhouse_connect.driver.exceptions import DatabaseError

from stepline.model.rows import Request, micros
from stepline.store.discovery import announce_beside_store
from stepline.store.errors import StoreError, StoreLocked
from stepline.store.store import Store
from tests.store.test_locking import held_elsewhere


def test_an_unreachable_server_is_one_line() -> None:
    with pytest.raises(StoreError) as info:
        Store.open("http://127.0.0.1:9/stepline", connect_timeout_s=1.0)
    assert str(info.value).startswith("cannot reach the store at http://127.0.0.1:9/stepline")
    assert "\n" not in str(info.value)


def test_an_embedded_store_held_by_another_process_is_reported(tmp_path: Path) -> None:
    with held_elsewhere(tmp_path):
        started = time.monotonic()
        with pytest.raises(StoreLocked) as info:
            Store.open(f"chdb://{tmp_path}")
        assert str(info.value) == (f"the embedded store {tmp_path} is in use by another process: query it through "
                                   "that collector, or stop it first")
        assert info.value.holder is None
        assert time.monotonic() - started < 5
        # A collector announces itself beside the store it holds: the message names it.
        announce_beside_store(str(tmp_path), "http://127.0.0.1:8124", "http://127.0.0.1:9465/metrics", False)
        with pytest.raises(StoreLocked) as info:
            Store.open(f"chdb://{tmp_path}")
        assert f"another process (collector pid {os.getpid()}, query endpoint http://127.0.0.1:8124): " in str(
            info.value)
        assert info.value.holder is not None and info.value.holder.metrics_url == "http://127.0.0.1:9465/metrics"


def test_the_store_directory_may_not_be_a_file(tmp_path: Path) -> None:
    target = tmp_path / "not-a-dir"
    target.write_text("x")
    with pytest.raises(StoreError, match="is a file, not a directory"):
        Store.open(f"chdb://{target}")


def test_a_query_failing_part_way_leaves_nothing_for_the_next_one(store: Store) -> None:
    # chDB 4.4 keeps a failed query's first blocks in the connection, in front of the next query's answer.
    for run in (store.query, store.reader().query):
        with pytest.raises(DatabaseError):
            run("SELECT number, throwIf(number = 500000) FROM numbers(1000000)")
        assert run("SELECT count() FROM numbers(10)").result_rows == [(10,)]
    with pytest.raises(DatabaseError):
        store.raw("SELECT number, throwIf(number = 500000) FROM numbers(1000000)", "TabSeparated")
    assert store.raw("SELECT 7", "TabSeparated") == b"7\n"


def request_report(rid: str, source: str, at: float) -> Request:
    """One report of request `rid` finished at `at`: the plugin's (cached tokens, finish reason) or OTLP's."""
    if source == "plugin":
        return Request(micros(at), "h", "e", 1, "m", rid, "plugin", "stop", micros(at - 2), 0.1, 0.2, 1.7, 1.9, 2.0,
                       0.3, 0.1, 5000, 4096, 18, 64, 1)
    return Request(micros(at + 0.002), "h", "e", 0, "m", rid, "otlp", "", micros(at - 2), 0.1, float("nan"), 1.7,
                   1.9, 2.0, 0.3, 0.1, 5000, 0, 18, 64, 0)


def test_recent_requests_are_read_merged(store: Store) -> None:
    t = time.time() - 60
    store.insert("requests", [request_report("a", "otlp", t), request_report("a", "plugin", t),
                              request_report("old", "plugin", t - 3600)], Request._fields)
    (recent,) = store.recent_requests("h", 600)

    def rounded(r: Request) -> tuple[object, ...]:  # the seconds are Float32 in the store
        return tuple(round(v, 6) if isinstance(v, float) else v for v in r)

    assert rounded(recent) == rounded(request_report("a", "plugin", t))
