"""common.which_span: the steps of many (engine, from, to) spans in one query, each step numbered by its spans."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest

from stepline.diagnosis import common
from stepline.diagnosis.common import Query, which_span
from tests.diagnosis.conftest import Timelines
from tests.diagnosis.test_detectors import T0, step

# One step a second for 10 minutes on each of two engines, the step number its second.
_SECONDS = 600


@pytest.fixture(scope="module")
def two_engines(timelines: Timelines) -> Timelines:
    for engine in ("spans_a", "spans_b"):
        timelines.add(engine, [step(float(s), n=s) for s in range(_SECONDS)])
    return timelines


def _at(second: float) -> datetime:
    return T0 + timedelta(seconds=second)


def _spans_of_each_step(timelines: Timelines, spans: list[tuple[str, datetime, datetime]]
                        ) -> dict[tuple[str, int], list[int]]:
    sql, params = which_span("SELECT engine, step, EVERY_SPAN, WHICH FROM steps PREWHERE INSIDE_ANY", spans)
    out = {}
    for engine, n, every, first in Query(sql, **params).rows(timelines.store):
        assert first == min(every)  # WHICH is the first of EVERY_SPAN
        out[str(engine), int(n)] = sorted(int(k) for k in every)
    return out


def test_steps_are_numbered_by_the_spans_of_their_own_engine(two_engines: Timelines) -> None:
    spans = [("spans_a", _at(10), _at(12)), ("spans_b", _at(11), _at(13)), ("spans_a", _at(12), _at(14)),
             ("spans_a", _at(400), _at(400.5))]
    got = _spans_of_each_step(two_engines, spans)
    # Inclusive at both ends; step 12 of spans_a lies in two spans; spans_b's steps only in its own.
    assert got == {("spans_a", 10): [0], ("spans_a", 11): [0], ("spans_a", 12): [0, 2], ("spans_a", 13): [2],
                   ("spans_a", 14): [2], ("spans_a", 400): [3],
                   ("spans_b", 11): [1], ("spans_b", 12): [1], ("spans_b", 13): [1]}


def test_an_engine_without_spans_and_a_span_without_steps_give_nothing(two_engines: Timelines) -> None:
    spans = [("spans_a", _at(30.2), _at(30.8)), ("no_such_engine", _at(0), _at(_SECONDS))]
    assert _spans_of_each_step(two_engines, spans) == {}


def test_long_spans_prune_by_hours_and_are_still_exact(two_engines: Timelines, monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    # Ten minutes of one engine are 11 minute keys: over a limit of 4 the keys are hours, and the exact test
    # still bounds each span to its own steps.
    monkeypatch.setattr(common, "MAX_SPAN_KEYS", 4)
    sql, params = which_span("SELECT 1 FROM steps WHERE INSIDE_ANY", [("spans_a", _at(0), _at(_SECONDS - 1))])
    assert "toStartOfHour" in sql and len(params["span_key_times"]) <= 2
    got = _spans_of_each_step(two_engines, [("spans_a", _at(5), _at(_SECONDS - 6)), ("spans_b", _at(0), _at(0))])
    assert sorted(got) == [("spans_a", s) for s in range(5, _SECONDS - 5)] + [("spans_b", 0)]


def test_the_query_does_not_grow_with_the_spans(two_engines: Timelines) -> None:
    few, _ = which_span("SELECT 1 FROM steps WHERE INSIDE_ANY", [("spans_a", _at(1), _at(2))])
    many, params = which_span("SELECT 1 FROM steps WHERE INSIDE_ANY",
                              [("spans_a", _at(s), _at(s + 0.5)) for s in range(300)])
    assert many == few and len(params["span_lo"]) == 300
    assert len(_spans_of_each_step(two_engines, [("spans_a", _at(s), _at(s + 0.5)) for s in range(300)])) == 300
