"""The steps of an engine, or of several, in a window: the steps inside it and no other."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

from stepline.model.rows import Step, micros
from stepline.queries.steps import GENERATED, OF_EACH_ENGINE, OF_ENGINE, OF_ENGINES, generated, of_engine
from stepline.queries.window import EACH_ENGINE
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


def _drafting(engine: str, offset_s: float, n: int, elapsed_ms: float, scheduled: int, accepted: int) -> Step:
    """Two decoding requests with three drafts each: `scheduled` tokens (2 + 6 with details), `accepted` of the 6."""
    return _step(engine, offset_s, n)._replace(elapsed_ms=elapsed_ms, num_generation_tokens=scheduled,
                                               spec_num_drafts=2, spec_num_draft_tokens=6,
                                               spec_num_accepted_tokens=accepted)


def _fill_drafting(store: Store) -> None:
    """e0 with iteration details: a step that kept 4 of its 6 drafts, one that kept none, one without speculative
    decoding. e1 without them (elapsed_ms NaN): its column already counts the tokens output."""
    store.insert("steps", [_drafting("e0", 1.0, 0, 10.0, 8, 4), _drafting("e0", 1.5, 1, 10.0, 8, 0),
                           _step("e0", 2.0, 2), _drafting("e1", 1.0, 0, math.nan, 5, 3)], Step._fields)


def test_a_steps_generated_tokens_leave_its_rejected_drafts_out(store: Store, rows: Rows) -> None:
    _fill_drafting(store)
    sql = f"SELECT engine, num_generation_tokens, {GENERATED} FROM steps WHERE {OF_EACH_ENGINE} ORDER BY engine, ts"
    # Each decoding request samples one token and its accepted drafts: 2 + 4, 2 + 0, 2 without drafts.
    assert rows(sql, engine="", **WINDOW) == [("e0", 8, 6), ("e0", 8, 2), ("e0", 2, 2), ("e1", 5, 5)]


def test_summed_generated_tokens_read_the_steps_projections(store: Store, rows: Rows) -> None:
    _fill_drafting(store)
    forced = {"force_optimize_projection": 1}  # the query fails unless a projection answers it
    for bucket in ("toStartOfSecond(ts)", "toStartOfMinute(ts)"):
        # A projection holds buckets, not rows: the read filters on the bucket (the store holds these steps alone).
        sql = (f"WITH {bucket} AS bucket SELECT engine, sum(num_generation_tokens), {generated()} FROM steps "
               f"WHERE {EACH_ENGINE} GROUP BY bucket, engine ORDER BY bucket, engine")
        found = rows(sql, settings=forced, engine="")
        if bucket == "toStartOfSecond(ts)":
            assert found == [("e0", 16, 8), ("e1", 5, 5), ("e0", 2, 2)]
        totals: dict[str, tuple[int, int]] = {}
        for engine, scheduled, got in found:  # the steps may straddle a minute
            before = totals.get(engine, (0, 0))
            totals[engine] = (before[0] + scheduled, before[1] + got)
        assert totals == {"e0": (18, 10), "e1": (5, 5)}
