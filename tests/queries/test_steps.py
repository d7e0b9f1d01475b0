"""The steps of an engine, or of several, in a window: the steps inside it and no other."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from stepline.model.rows import Step, micros
from stepline.queries.steps import OF_EACH_ENGINE, OF_ENGINE, OF_ENGINES, of_engine
from stepline.store.store import Store
from tests.queries.conftest import Rows

T0 = (datetime.now(UTC) - timedelta(hours=1)).replace(microsecond=0)
WINDOW = {"start": T0, "end": T0 + timedelta(seconds=10)}


def _step(engine: str, offset_s: float, n: int) -> Step:
    return Step(micros(T0.timestamp() + offset_s), "h", engine, 0, "m", n, 10.0, 0, 0, 2, 2, 2, 0, 0, 0.3, 0, 0,
                0, 0, 0, 0, [], [0.01, 0.01], False)


def _fill(store: Store) -> None:
    """Per engine, a step just before the window, at its start, inside, at its end and just after: steps 0..4."""
    steps = [_step(e, t, n) for e in ("e0", "e1", "e2") for n, t in enumerate((-0.001, 0.0, 5.0, 10.0, 10.001))]
    store.insert("steps", steps, Step._fields)


def test_an_engines_steps_in_the_window_and_no_step_outside_it(store: Store, rows: Rows) -> None:
    _fill(store)
    found = rows(f"SELECT engine, step FROM steps WHERE {OF_ENGINE} ORDER BY ts", engine="e1", **WINDOW)
    assert found == [("e1", 1), ("e1", 2), ("e1", 3)]


def test_numbered_spans_bind_their_own_names(store: Store, rows: Rows) -> None:
    _fill(store)
    sql = (f"SELECT engine, step FROM steps WHERE ({of_engine('e0', 'lo0', 'hi0')}) "
           f"OR ({of_engine('e1', 'lo1', 'hi1')}) ORDER BY engine, step")
    found = rows(sql, e0="e0", lo0=T0, hi0=T0 + timedelta(seconds=1), e1="e2", lo1=T0 + timedelta(seconds=5),
                 hi1=T0 + timedelta(seconds=20))
    assert found == [("e0", 1), ("e2", 2), ("e2", 3), ("e2", 4)]


def test_several_engines_at_once(store: Store, rows: Rows) -> None:
    _fill(store)
    sql = f"SELECT engine, count() FROM steps WHERE {OF_ENGINES} GROUP BY engine ORDER BY engine"
    assert rows(sql, engines=["e0", "e2"], **WINDOW) == [("e0", 3), ("e2", 3)]


def test_every_engine_or_only_the_windows(store: Store, rows: Rows) -> None:
    _fill(store)
    sql = f"SELECT engine, count() FROM steps WHERE {OF_EACH_ENGINE} GROUP BY engine ORDER BY engine"
    assert rows(sql, engine="", **WINDOW) == [("e0", 3), ("e1", 3), ("e2", 3)]
    assert rows(sql, engine="e0", **WINDOW) == [("e0", 3)]
