"""The progress budget: step costs fitted from the engine's own steps, and one engine's state judged from the rows it
was fed (the Watchdog over many engines, its metrics and pages: test_tap.py)."""

from __future__ import annotations

import pytest

from stepline.model.rows import Step
from stepline.watchdog.budget import STATES, EngineModel, Policy, StepCosts

T0 = 1_700_000_000.0


def _step(at: float, *, prefill: int = 0, decoding: int = 8, running: int = 8, waiting: int = 0,
          elapsed_ms: float = 20.0) -> Step:
    return Step(round(at * 1e6), "h", "vllm-0", 0, "m", 1, elapsed_ms, 1 if prefill else 0, prefill, decoding, decoding,
                running, waiting, 0, 0.5, 0, 0, 0, 0, 0, 0, [], [0.02] * decoding, False)


def test_step_costs_are_fitted_from_the_engines_own_steps() -> None:
    costs = StepCosts(Policy())
    assert costs.coefficients() == (20.0, 0.06, 0.3) and len(costs) == 0
    for i in range(64):
        prefill, decoding = (i % 4) * 2048, 1 + i % 7
        costs.add(prefill, decoding, 15 + 0.25 * prefill + 2 * decoding)
    a, b, c = costs.coefficients()
    assert b == pytest.approx(0.25, rel=0.02) and c == pytest.approx(2.0, rel=0.1) and a == pytest.approx(15, abs=2)
    assert costs.predict_ms(8192, 4) == pytest.approx(15 + 2048 + 8, rel=0.02)
    assert len(costs) == 64


def test_the_fit_keeps_only_the_policys_last_steps_and_never_goes_negative() -> None:
    costs = StepCosts(Policy(fit_steps=8))
    for _ in range(100):
        costs.add(0, 4, 1.0)  # cheaper than the priors say a step can be
    assert len(costs) == 8 and min(costs.coefficients()) >= 0.0


def test_an_engine_with_nothing_to_do_is_idle_and_one_stepping_is_progressing() -> None:
    engine = EngineModel("vllm-0", first_seen=T0)
    assert engine.assess(T0 + 1).state == "idle"
    engine.step(_step(T0 + 1))
    judged = engine.assess(T0 + 1.1)
    assert (judged.state, judged.running, judged.decoding_requests) == ("progressing", 8, 8)
    assert judged.budget_s == Policy().floor_s  # ten 20 ms steps are far under the floor
    assert {"idle", "progressing", "slow", "stalled"} < set(STATES)


def test_work_in_flight_with_no_progress_is_slow_after_a_third_of_the_budget_then_stalled() -> None:
    engine = EngineModel("vllm-0", first_seen=T0)
    engine.step(_step(T0))
    assert engine.assess(T0 + 2.0).state == "slow"  # over 5 s / 3 without a step
    stalled = engine.assess(T0 + 6.0)
    assert (stalled.state, stalled.reason) == ("stalled", "no progress for longer than the budget")
    assert stalled.age_s == pytest.approx(6.0)


def test_the_budget_grows_with_the_prefill_in_flight() -> None:
    engine = EngineModel("vllm-0", first_seen=T0)
    engine.step(_step(T0, prefill=8192, elapsed_ms=2000.0, waiting=30))
    judged = engine.assess(T0 + 1)
    assert judged.budget_s == pytest.approx(20.0) and judged.state == "progressing"  # 10 x the 2 s step
    assert judged.inflight_prefill_tokens == 8192 and judged.waiting == 30
