"""The step cost fitted from recorded steps: coefficients recovered from steps of a known cost, checked on steps held
out, refused where the steps cannot tell, and the draws and jitter the replays run with."""

from __future__ import annotations

import pytest

from stepline.sim.costmodel import CostModel
from stepline.whatif.fit import MIN_MODEL_ERROR, MIN_STEPS, FitError, Jitter, fit, scaled
from stepline.whatif.trace import EngineTrace, Steps

OVERHEAD_S, TOKEN_S, REQUEST_S = 0.005, 2e-6, 3e-4


def _trace(n: int, elapsed_s: float = 0.01) -> EngineTrace:
    """`n` back-to-back steps (no requests recorded: no attention pairs or decode context to rebuild) whose periods
    follow a known cost exactly."""
    steps = Steps()
    t = 1_700_000_000.0
    for i in range(n):
        ctx, decoding = (i % 5) * 512, 1 + i % 7
        t += OVERHEAD_S + TOKEN_S * ctx + REQUEST_S * decoding
        steps.ts.append(t)
        steps.elapsed_s.append(elapsed_s)
        steps.ctx_tokens.append(ctx)
        steps.gen_requests.append(decoding)
        steps.gen_tokens.append(decoding)
        steps.in_flight_after.append(4)
        steps.itls.append(())
    return EngineTrace("vllm-0", {}, [], steps)


def test_the_fit_recovers_a_known_cost_and_scores_it_on_held_out_steps() -> None:
    f = fit(_trace(600))
    assert f.cost.step_overhead_s == pytest.approx(OVERHEAD_S, rel=1e-3)
    assert f.cost.prefill_token_s == pytest.approx(TOKEN_S, rel=1e-3)
    assert f.cost.decode_request_s == pytest.approx(REQUEST_S, rel=1e-3)
    assert f.steps == 599 and f.held_out == 100  # every fifth run of 50 steps
    assert f.median_error < 1e-4 and abs(f.total_error) < 1e-4 and f.model_error == MIN_MODEL_ERROR  # float noise
    assert f.describe().startswith("step = 5.00 ms + 2 us/prefill token + ")


def test_steps_without_iteration_details_or_too_few_are_refused_saying_why() -> None:
    with pytest.raises(FitError, match="--enable-logging-iteration-details"):
        fit(_trace(100, elapsed_s=float("nan")))
    with pytest.raises(FitError, match=f"too few to fit its step cost \\(at least {MIN_STEPS}\\)"):
        fit(_trace(MIN_STEPS))  # one fewer back-to-back pair than steps


def test_draws_spread_the_cost_over_the_model_error_and_repeat_for_the_same_seed() -> None:
    f = fit(_trace(300))
    draws = f.draws(10, "seed")
    assert draws == f.draws(10, "seed") and len(draws) == 10
    overheads = sorted(d.step_overhead_s / OVERHEAD_S for d in draws)
    assert overheads[0] == pytest.approx(1 - 0.9 * MIN_MODEL_ERROR, rel=1e-3)
    assert overheads[-1] == pytest.approx(1 + 0.9 * MIN_MODEL_ERROR, rel=1e-3)


def test_scaled_multiplies_every_term() -> None:
    cost = CostModel(1.0, 2.0, 3.0, 4.0, 5.0)
    assert scaled(cost, 0.5) == CostModel(0.5, 1.0, 1.5, 2.0, 2.5)


def test_jitter_draws_a_residual_of_the_steps_bucket_and_never_below_its_floor() -> None:
    assert Jitter((), "s")(0.02) == 0.02
    jitter = Jitter(((0.01, (0.001,)), (1.0, (-5.0,))), "s")
    assert jitter(0.005) == pytest.approx(0.006)
    assert jitter(0.5) == pytest.approx(0.05)  # 0.5 - 5 s: held at a tenth of the prediction
