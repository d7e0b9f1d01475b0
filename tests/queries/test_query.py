"""queries.query: one form of parameter, the text that runs is the text a finding shows, and which_span's fragments
(the steps of many (engine, from, to) spans in one query, each step numbered by its spans)."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from stepline.clickhouse_http.guard import read_only_statement
from stepline.model.rows import Event, micros
from stepline.queries.query import Query, moment, param, which_span
from stepline.store.store import Store
from tests.diagnosis.test_detectors import T0, insert, step

# One step a second for 10 minutes on each of two engines, the step number its second.
_SECONDS = 600


@pytest.fixture(scope="module")
def two_engines(chdb_dir: Path) -> Iterator[Store]:
    store = Store.open(f"chdb://{chdb_dir}?database=spans_{uuid.uuid4().hex[:10]}")
    store.ensure_schema(30)
    insert(store, [step(float(s), n=s)._replace(engine=engine, host=engine)
                   for engine in ("spans_a", "spans_b") for s in range(_SECONDS)])
    yield store
    store.client.command(f"DROP DATABASE IF EXISTS `{store.database}`")
    store.close()


class Recorder:
    """The store's client, keeping each text and parameters it is asked to run."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.asked: list[tuple[str, dict[str, Any] | None]] = []

    def query(self, sql: str, parameters: dict[str, Any] | None = None) -> Any:
        self.asked.append((sql, parameters))
        return self.store.query(sql, parameters=parameters)


def test_the_text_that_runs_is_the_text_shown_with_its_values(two_engines: Store) -> None:
    start, end = T0 + timedelta(seconds=10, microseconds=250), T0 + timedelta(seconds=12)
    query = Query(f"SELECT step, engine FROM steps WHERE engine IN {param('engines', 'Array(String)')} "
                  f"AND ts >= {moment('start')} AND ts <= {moment('end')} AND {param('quoted', 'String')} != '' "
                  "ORDER BY engine, step", engines=["spans_a", "spans_b"], start=start, end=end, quoted="it's")
    recorder = Recorder(two_engines)
    rows = query.rows(recorder)
    [(ran, bound)] = recorder.asked
    assert ran == query.sql  # nothing rewritten on the way
    assert bound == {"engines": ["spans_a", "spans_b"], "start": micros(start.timestamp()),
                     "end": micros(end.timestamp()), "quoted": "it's"}
    # The literal text is the running text, each placeholder replaced by its value, and reads the same rows.
    values = {"{engines:Array(String)}": "['spans_a', 'spans_b']",
              "{start:Int64}": f"{micros(start.timestamp())} /* {start:%Y-%m-%d %H:%M:%S.%f} UTC */",
              "{end:Int64}": f"{micros(end.timestamp())} /* {end:%Y-%m-%d %H:%M:%S.%f} UTC */",
              "{quoted:String}": "'it\\'s'"}
    assert query.literal() == re.sub(r"\{\w+:[^{}]+\}", lambda m: values[m.group()], ran)
    assert rows == [tuple(r) for r in two_engines.query(query.literal()).result_rows]
    read_only_statement(query.literal())  # what `stepline query` lets through: a reader can paste it there
    assert rows == [(n, e) for e in ("spans_a", "spans_b") for n in (11, 12)]  # 10.00025 s is after step 10


def test_a_moment_reads_as_utc_whatever_the_sessions_zone(two_engines: Store) -> None:
    at = datetime(2026, 12, 6, 14, 0, 0, 123456, tzinfo=UTC)
    query = Query(f"SELECT toUnixTimestamp64Micro({moment('at')}), toString({moment('at')})", at=at)
    for zone in ("UTC", "Asia/Kolkata", "America/New_York"):
        got = two_engines.client.query(query.sql, parameters=query.bound(), settings={"session_timezone": zone})
        assert got.result_rows == [(micros(at.timestamp()), "2026-12-06 14:00:00.123456")]


def test_a_moment_bound_to_another_type_or_a_placeholder_without_value_is_refused() -> None:
    at = datetime(2026, 12, 6, tzinfo=UTC)
    with pytest.raises(ValueError, match=r"write it as moment\('start'\)"):
        Query("SELECT 1 WHERE now() > {start:DateTime64(6)}", start=at)
    with pytest.raises(ValueError, match="has no parameter"):
        Query(f"SELECT {moment('start')}, {param('engine', 'String')}", start=at)
    assert param("x", "Array(UInt64)") == "{x:Array(UInt64)}"


def test_events_bound_by_a_moment_hold_their_bounds(two_engines: Store) -> None:
    # Inclusive at both ends, to the microsecond: the bound is the very DateTime64(6) the column holds.
    t = T0 + timedelta(seconds=1, microseconds=1)
    two_engines.insert("events", [Event(micros(t.timestamp()) + d, "h", "bounds", "test", "k", "info", str(d), {})
                                  for d in (-1, 0, 1)], Event._fields)
    query = Query(f"SELECT message FROM events WHERE engine = 'bounds' AND ts >= {moment('at')} AND ts <= "
                  f"{moment('at')} ORDER BY ts", at=t)
    assert query.rows(two_engines) == [("0",)]


def _at(second: float) -> datetime:
    return T0 + timedelta(seconds=second)


def _spans_of_each_step(store: Store, spans: list[tuple[str, datetime, datetime]]) -> dict[tuple[str, int], list[int]]:
    found = which_span(spans)
    out = {}
    for engine, n, every, first in Query(f"SELECT engine, step, {found.every}, {found.which} FROM steps "
                                         f"PREWHERE {found.inside}", **found.parameters).rows(store):
        assert first == min(every)  # `which` is the first of `every`
        out[str(engine), int(n)] = sorted(int(k) for k in every)
    return out


def test_steps_are_numbered_by_the_spans_of_their_own_engine(two_engines: Store) -> None:
    spans = [("spans_a", _at(10), _at(12)), ("spans_b", _at(11), _at(13)), ("spans_a", _at(12), _at(14)),
             ("spans_a", _at(400), _at(400.5))]
    got = _spans_of_each_step(two_engines, spans)
    # Inclusive at both ends; step 12 of spans_a lies in two spans; spans_b's steps only in its own.
    assert got == {("spans_a", 10): [0], ("spans_a", 11): [0], ("spans_a", 12): [0, 2], ("spans_a", 13): [2],
                   ("spans_a", 14): [2], ("spans_a", 400): [3],
                   ("spans_b", 11): [1], ("spans_b", 12): [1], ("spans_b", 13): [1]}


def test_an_engine_without_spans_and_a_span_without_steps_give_nothing(two_engines: Store) -> None:
    spans = [("spans_a", _at(30.2), _at(30.8)), ("no_such_engine", _at(0), _at(_SECONDS))]
    assert _spans_of_each_step(two_engines, spans) == {}


def test_long_spans_prune_by_hours_and_are_still_exact(two_engines: Store) -> None:
    # Ten minutes of one engine are 11 minute keys: over a limit of 4 the keys are hours, and the exact test
    # still bounds each span to its own steps.
    spans = [("spans_a", _at(5), _at(_SECONDS - 6)), ("spans_b", _at(0), _at(0))]
    found = which_span(spans, max_keys=4)
    assert "toStartOfHour" in found.inside and len(found.parameters["span_key_times"]) <= 3
    got = Query(f"SELECT engine, step FROM steps PREWHERE {found.inside} ORDER BY engine, step",
                **found.parameters).rows(two_engines)
    assert got == [("spans_a", s) for s in range(5, _SECONDS - 5)] + [("spans_b", 0)]


def test_the_query_does_not_grow_with_the_spans(two_engines: Store) -> None:
    few = which_span([("spans_a", _at(1), _at(2))])
    many = which_span([("spans_a", _at(s), _at(s + 0.5)) for s in range(300)])
    assert (many.inside, many.which, many.every) == (few.inside, few.which, few.every)
    assert len(many.parameters["span_lo"]) == 300
    assert len(_spans_of_each_step(two_engines, [("spans_a", _at(s), _at(s + 0.5)) for s in range(300)])) == 300
