"""The engine and time conditions: bounds inclusive, the window's engine or every engine, epoch-microsecond since."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from stepline.model.rows import Event, micros
from stepline.queries.window import EACH_ENGINE, ENGINE, ENGINES, IN_WINDOW, SINCE, between, one_engine
from stepline.store.store import Store
from tests.queries.conftest import Rows

T0 = (datetime.now(UTC) - timedelta(hours=1)).replace(microsecond=0)


def _event(engine: str, offset_s: float) -> Event:
    return Event(micros(T0.timestamp() + offset_s), "h", engine, "test", "k", "info", f"{engine}@{offset_s}", {})


def _fill(store: Store) -> None:
    events = [_event(e, t) for e in ("e0", "e1", "e2") for t in (-0.000001, 0.0, 5.0, 10.0, 10.000001)]
    store.insert("events", events, Event._fields)


def test_the_window_holds_its_bounds_and_nothing_beyond(store: Store, rows: Rows) -> None:
    _fill(store)
    found = rows(f"SELECT message FROM events WHERE {ENGINE} AND {IN_WINDOW} ORDER BY ts",
                 engine="e0", start=T0, end=T0 + timedelta(seconds=10))
    assert found == [("e0@0.0",), ("e0@5.0",), ("e0@10.0",)]


def test_named_bounds_and_columns(store: Store, rows: Rows) -> None:
    _fill(store)
    assert between("lo", "hi", "e.ts") == ("e.ts >= fromUnixTimestamp64Micro({lo:Int64}, 'UTC') "
                                           "AND e.ts <= fromUnixTimestamp64Micro({hi:Int64}, 'UTC')")
    found = rows(f"SELECT e.message FROM events AS e WHERE {one_engine('which')} AND {between('lo', 'hi', 'e.ts')} "
                 "ORDER BY e.ts", which="e1", lo=T0 + timedelta(seconds=1), hi=T0 + timedelta(seconds=10))
    assert found == [("e1@5.0",), ("e1@10.0",)]


def test_each_engine_is_every_engine_or_the_windows(store: Store, rows: Rows) -> None:
    _fill(store)
    sql = f"SELECT engine, count() FROM events WHERE {EACH_ENGINE} GROUP BY engine ORDER BY engine"
    assert rows(sql, engine="") == [("e0", 5), ("e1", 5), ("e2", 5)]
    assert rows(sql, engine="e2") == [("e2", 5)]


def test_engines_picks_the_listed_ones(store: Store, rows: Rows) -> None:
    _fill(store)
    found = rows(f"SELECT DISTINCT engine FROM events WHERE {ENGINES} ORDER BY engine", engines=["e0", "e2"])
    assert found == [("e0",), ("e2",)]


def test_since_is_epoch_microseconds(store: Store, rows: Rows) -> None:
    _fill(store)
    found = rows(f"SELECT message FROM events WHERE {ENGINE} AND {SINCE} ORDER BY ts", engine="e0",
                 since=micros(T0.timestamp() + 10))
    assert found == [("e0@10.0",), ("e0@10.000001",)]
