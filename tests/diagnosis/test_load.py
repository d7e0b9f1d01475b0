"""Overload: requests arrive faster than the engine serves them, its queue held while it steps flat out, with no
single prompt to blame."""

from __future__ import annotations

from typing import Any

import pytest

from stepline.diagnosis.load import overload
from stepline.model.rows import Request, Step
from tests.diagnosis.conftest import Timelines
from tests.diagnosis.test_detectors import T0, request, steady, step

STEP_S = 0.025  # the loaded engine steps back to back: 25 ms steps, every 25 ms


def loaded(*, queue_s: float = 8.0, every_s: float = STEP_S, prefill: int = 0) -> list[Any]:
    """A healthy engine that, from 200 s to 300 s, steps every `every_s` with 20 waiting (carrying `prefill`
    tokens of one request a step), while 60 requests arrive and each queues `queue_s`."""
    quiet = [r for r in steady() if not isinstance(r, Request) and not (isinstance(r, Step) and 200 <= _s(r) < 300)]
    busy = [step(200 + i * every_s, 25.0, prefill=prefill, decoding=4, waiting=20, n=10_000 + i)
            for i in range(int(100 / every_s))]
    arrivals = [request(f"queued{i}", 220.0 + i, queue_s, queue_s + 0.1, 2.0, 2000) for i in range(60)]
    return quiet + busy + arrivals


def _s(row: Step) -> float:
    return row.ts / 1e6 - T0.timestamp()


def test_a_queue_held_while_the_engine_steps_flat_out_is_overload(timelines: Timelines) -> None:
    [found] = overload(timelines.store, timelines.add("overloaded", loaded()))
    assert (found.kind, found.severity) == ("overload", "warning")
    e = found.evidence
    assert (e["requests_arrived"], e["queue_p50_s"], e["queue_max_s"]) == (60, 8.0, 8.0)
    assert e["waiting_max"] == 20 and e["loaded_s"] >= 60
    # Long is relative to the engine: 100 of its decode-only steps (p50 25 ms: most of its steps are loaded ones).
    assert e["long_wait_from_s"] == "2.500 (100 decode-only steps of 25.0 ms, p50)"
    assert e["long_prefill_share"].startswith("0% of the busy time")
    assert (e["token_budget"], e["token_budget_from"]) == (8192, "engine_config")
    [row] = timelines.store.query(found.sql).result_rows  # the SQL gives the arrivals and queue figures shown
    assert (row[0], row[2]) == (60, 8.0)


@pytest.mark.parametrize(("name", "rows"), [
    ("behind_prefills", loaded(prefill=8192)),  # the busy time went to long prefills: head-of-line blocking's
    ("short_waits", loaded(queue_s=1.0)),  # queued under 100 of the engine's decode-only steps
    ("idle_gaps", loaded(every_s=0.1)),  # 25 ms of every 100 ms: not stepping flat out
])
def test_what_is_not_overload(timelines: Timelines, name: str, rows: list[Any]) -> None:
    assert overload(timelines.store, timelines.add(name, rows)) == []


def test_an_engine_that_never_queued_ten_is_not_read(timelines: Timelines) -> None:
    assert overload(timelines.store, timelines.add("calm", steady())) == []
