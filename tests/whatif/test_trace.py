"""The recorded window as the replay reads it: each engine's finished requests and its steps, from a real store."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from stepline.diagnosis.findings import Window
from stepline.model.rows import Request, Step
from stepline.store.store import Store
from stepline.whatif.trace import EngineTrace, Steps, TracedRequest, load

T0 = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=10)
S0 = T0.timestamp()


def _request(engine: str, rid: str, arrival: float, queue: float = 0.1, ttft: float = 0.5) -> Request:
    return Request(round((S0 + arrival + 2.0) * 1e6), "h", engine, 0, "m", rid, "plugin", "stop",
                   round((S0 + arrival) * 1e6), queue, 0.4, 1.5, 1.9, 2.0, ttft, 0.05, 1000, 200, 31, 64, 0)


def _step(engine: str, at: float, elapsed_ms: float, is_dummy: bool = False) -> Step:
    return Step(round((S0 + at) * 1e6), "h", engine, 0, "m", round(at * 10), elapsed_ms, 1, 800, 2, 2, 3, 1, 0, 0.2,
                0, 0, 0, 0, 0, 0, [], [0.03, 0.04], is_dummy)


def test_each_engines_requests_and_steps_in_time_order(store: Store) -> None:
    store.insert("requests", [_request("b", "b1", 5.0), _request("a", "a2", 3.0), _request("a", "a1", 1.0),
                              _request("a", "late", 90.0)], Request._fields)
    store.insert("steps", [_step("a", 2.0, 30.0), _step("a", 1.5, 20.0), _step("a", 2.5, 1.0, is_dummy=True),
                           _step("b", 6.0, float("nan"))], Step._fields)
    traces = load(store, Window(T0, T0 + timedelta(seconds=60)))
    assert [t.engine for t in traces] == ["a", "b"]
    a, b = traces
    assert [r.request_id for r in a.requests] == ["a1", "a2"]  # the request arriving after the window is not there
    first = a.requests[0]
    assert first.arrival == pytest.approx(S0 + 1.0) and first.finished == pytest.approx(S0 + 3.0)
    assert (first.prompt_tokens, first.cached_tokens, first.generation_tokens, first.max_tokens) == (1000, 200, 31, 64)
    assert first.scheduled == pytest.approx(S0 + 1.1) and first.first_token == pytest.approx(S0 + 1.5)
    assert a.steps.elapsed_s == pytest.approx([0.02, 0.03]) and len(a.steps) == 2  # in time order, no dummy step
    assert a.steps.in_flight_after == [4, 4] and a.steps.itls[0] == pytest.approx((0.03, 0.04))
    assert a.has_iteration_details and not b.has_iteration_details  # NaN: vLLM without iteration details


def test_a_window_with_no_finished_request_is_no_trace(store: Store) -> None:
    store.insert("steps", [_step("a", 2.0, 30.0)], Step._fields)
    assert load(store, Window(T0, T0 + timedelta(seconds=60))) == []


def test_a_trace_built_by_hand_says_whether_it_has_iteration_details() -> None:
    request = TracedRequest("r", 10.0, 12.0, 0.5, 1.0, 1.0, 100, 0, 10, "stop", 16)
    assert EngineTrace("e", {}, [request], Steps()).has_iteration_details is False
    steps = Steps(ts=[10.0], elapsed_s=[0.02], ctx_tokens=[100], gen_requests=[0], gen_tokens=[0],
                  in_flight_after=[1], itls=[()])
    assert EngineTrace("e", {}, [request], steps).has_iteration_details is True
