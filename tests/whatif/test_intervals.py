"""How sure a replayed figure is: intervals over perturbed replays, capacity cliffs, and rankings that separate."""

from __future__ import annotations

import math

import pytest

from stepline.sim.costmodel import CostModel
from stepline.whatif.figures import Figures
from stepline.whatif.fit import MIN_MODEL_ERROR, Fit, form_error
from stepline.whatif.intervals import Band, bands, knife_edge, misses, nominal_coverage, verdict, widened


def _figures(ttft_p99: float = 1.0, goodput: float = 2.0, unfinished: int = 0, rate: float = 40.0) -> Figures:
    return Figures(100, unfinished, 0.5, ttft_p99, 0.05, {"< 1k": (rate - 5, rate, rate + 5)}, 90, goodput)


def test_nominal_coverage_is_that_of_the_lowest_and_highest_of_n_draws() -> None:
    assert nominal_coverage(10) == pytest.approx(9 / 11)
    assert nominal_coverage(20) == pytest.approx(19 / 21)
    assert nominal_coverage(1) == 0.0


def test_an_interval_spans_every_replay_and_keeps_the_central_value() -> None:
    b = bands(_figures(1.0, 2.0, rate=40.0), [_figures(0.8, 2.5, rate=38.0), _figures(1.3, 1.9, rate=41.0)])
    assert b["ttft_p99_s"] == Band(1.0, 0.8, 1.3)
    assert b["goodput_rps"] == Band(2.0, 1.9, 2.5)
    assert b["decode_p50 < 1k"] == Band(40.0, 38.0, 41.0)
    # A replay without a figure (no request in a band) leaves it out; without any, the interval is unknown.
    lone = bands(_figures(), [Figures(0, 0, math.nan, math.nan, math.nan, {}, 0, math.nan)])
    assert lone["ttft_p99_s"] == Band(1.0, 1.0, 1.0) and lone["decode_p50 < 1k"] == Band(40.0, 40.0, 40.0)
    assert Band(1.0, 0.5, 1.5).as_json() == {"value": 1.0, "low": 0.5, "high": 1.5}


def test_replays_that_disagree_on_draining_are_a_knife_edge() -> None:
    drained, backlog = (_figures(), ""), (_figures(unfinished=12), "")
    why = knife_edge(drained, [drained, backlog, drained], ("lane-a", 0.97))
    assert why == "the queue drains in 3 of 4 replays, lane-a busy 97% of the time (headroom 3%)"
    assert knife_edge(backlog, [backlog, (_figures(), "lane-a: stopped after 200,000 steps")], None) == ""


def test_a_ttft_tail_that_triples_across_replays_is_a_knife_edge_and_a_steady_one_is_not() -> None:
    central = (_figures(ttft_p99=0.5), "")
    assert knife_edge(central, [(_figures(ttft_p99=21.0), ""), central], None) == \
        "TTFT p99 spans 0.50-21.00 s over 3 replays"
    assert knife_edge(central, [(_figures(ttft_p99=0.6), ""), (_figures(ttft_p99=1.4), "")], None) == ""


def test_the_best_is_recommended_only_where_its_interval_clears_the_others() -> None:
    clear = verdict(["a", "b", "baseline"], [Band(3.0, 2.8, 3.2), Band(2.0, 1.8, 2.5), Band(1.0, 0.9, 1.1)],
                    [[3.0, 2.8, 3.2], [2.0, 1.8, 2.5], [1.0, 0.9, 1.1]])
    assert (clear.recommended, clear.tied, clear.replays_to_separate) == ("a", [], None)
    tie = verdict(["a", "b", "baseline"], [Band(3.0, 2.4, 3.6), Band(2.9, 2.5, 3.3), Band(1.0, 0.9, 1.1)],
                  [[3.0, 2.4, 3.6], [2.9, 2.5, 3.3], [1.0, 0.9, 1.1]])
    assert (tie.recommended, tie.tied) == ("", ["a", "b"])
    # A gap of 0.1 against spreads of 0.6 and 0.4 (their standard deviations): ~(1.645 x 1.0 / 0.1)^2 replays.
    assert tie.replays_to_separate == math.ceil((1.645 * (0.6 + 0.4) / 0.1) ** 2)


def test_a_recording_outside_the_baselines_interval_widens_every_plan_by_the_miss() -> None:
    baseline = bands(_figures(ttft_p99=1.0, goodput=2.0), [_figures(ttft_p99=1.2, goodput=2.1)])
    # TTFT p99 recorded 25% over the baseline's highest replay; goodput inside.
    miss = misses(_figures(ttft_p99=1.5, goodput=2.05), baseline)
    assert miss == pytest.approx({"ttft_p99_s": 0.25})
    assert misses(_figures(ttft_p99=0.5, goodput=2.0), baseline) == pytest.approx({"ttft_p99_s": 0.5})
    lever = widened({"ttft_p99_s": Band(0.4, 0.36, 0.44), "goodput_rps": Band(3.0, 2.9, 3.1)}, miss)
    ttft = lever["ttft_p99_s"]
    assert ttft.value == 0.4 and ttft.low == pytest.approx(0.27) and ttft.high == pytest.approx(0.55)
    assert lever["goodput_rps"] == Band(3.0, 2.9, 3.1)
    # A miss of more than 100% (the recording 3x the highest replay) widens the low end to 0, never below.
    far = widened({"ttft_p99_s": Band(0.4, 0.36, 0.44)}, misses(_figures(ttft_p99=3.6, goodput=2.05), baseline))
    assert far["ttft_p99_s"].low == 0.0 and far["ttft_p99_s"].high == pytest.approx(0.44 * 3)


def test_a_cost_of_another_form_shows_in_the_form_error_where_the_total_cancels_out() -> None:
    # A line through all steps (10 ms + 10 us per prefill token) where decode-only steps take 8 ms (predicted 25%
    # over) and steps carrying 2,000 prefill tokens 40 ms (25% under): the total cancels, the form error does not.
    coefficients = [0.01, 1e-5]
    decode = [((1.0, 0.0), 0.008) for _ in range(50)]
    prefill = [((1.0, 2000.0), 0.040) for _ in range(10)]
    assert sum(0.01 for _ in decode) + sum(0.03 for _ in prefill) == pytest.approx(0.008 * 50 + 0.040 * 10)
    assert form_error(coefficients, decode + prefill) == pytest.approx(0.25)
    # A step's own jitter, among steps predicted alike, is no form error: it averages out in its group.
    jittered = [((1.0, 0.0), 0.010 * (1.25 if k % 2 else 0.75)) for k in range(400)]
    assert form_error(coefficients, jittered) < 0.02
    assert form_error(coefficients, []) == 0.0


def test_the_perturbed_costs_spread_over_the_larger_of_the_total_and_form_errors() -> None:
    cost = CostModel(0.01, 1e-5, 0.0, 0.0, 0.0)
    f = Fit(cost, 100, 20, 0.1, 0.3, 0.02, 0.2)
    assert f.model_error == 0.2
    assert Fit(cost, 100, 20, 0.1, 0.3, -0.08, 0.03).model_error == 0.08
    assert Fit(cost, 100, 20, 0.1, 0.3, 0.01, 0.01).model_error == MIN_MODEL_ERROR
    # The draws' scale factors spread evenly over +-model_error, at the middles of n equal parts (no samples: the
    # fitted cost itself, scaled).
    scales = sorted(d.step_overhead_s / cost.step_overhead_s for d in f.draws(10, "e"))
    assert scales[0] == pytest.approx(1 - 0.2 * 0.9) and scales[-1] == pytest.approx(1 + 0.2 * 0.9)
    # A fit off by more than 100% scales its lowest draws to nothing, never below: no step of negative time.
    poor = Fit(cost, 100, 20, 0.1, 0.3, 0.02, 1.5)
    scales = sorted(d.step_overhead_s / cost.step_overhead_s for d in poor.draws(10, "e"))
    assert scales[:2] == [0.0, 0.0] and scales[2] == pytest.approx(1 - 1.5 * 0.5)
    assert scales[-1] == pytest.approx(1 + 1.5 * 0.9)
