"""How sure a replayed figure is: intervals over perturbed replays, capacity cliffs, and rankings that separate."""

from __future__ import annotations

import math

import pytest

from stepline.sim.costmodel import CostModel
from stepline.whatif.figures import Figures
from stepline.whatif.fit import MIN_MODEL_ERROR, Fit, form_error
from stepline.whatif.intervals import (
    Band,
    Headroom,
    at_capacity,
    bands,
    headroom_edge,
    knife_edge,
    misses,
    nominal_coverage,
    opened,
    past_capacity,
    verdict,
    widened,
)


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
    assert why == "the queue drains in 3 of 4 replays, lane-a at 97% of its capacity (headroom 3%)"
    assert knife_edge(backlog, [backlog, (_figures(), "lane-a: stopped after 200,000 steps")], None) == ""


def test_a_ttft_tail_that_triples_across_replays_is_a_knife_edge_and_a_steady_one_is_not() -> None:
    central = (_figures(ttft_p99=0.5), "")
    assert knife_edge(central, [(_figures(ttft_p99=21.0), ""), central], None) == \
        "TTFT p99 spans 0.50-21.00 s over 3 replays"
    assert knife_edge(central, [(_figures(ttft_p99=0.6), ""), (_figures(ttft_p99=1.4), "")], None) == ""


def test_a_lane_whose_headroom_its_fits_error_could_use_up_is_at_capacity() -> None:
    loads = {"long": 0.9, "short": 0.3, "over": 1.2, "just-over": 1.05}
    # 0.9 x 1.15 >= 1: a cost 15% off fills the long lane; 1.05 x 0.85 < 1: a cost 15% lower drains the lane just
    # over; the short one has room either way, and the one far over its capacity queues in every replay (its spread
    # says by how much).
    errors = dict.fromkeys(loads, 0.15)
    assert at_capacity(loads, errors) == [Headroom("just-over", 1.05, 0.15), Headroom("long", 0.9, 0.15)]
    assert Headroom("just-over", 1.05, 0.15).describe().startswith(
        "just-over at 105% of its capacity (no headroom), within its fit's error (15% of the step cost): steps 5% "
        "cheaper would drain it")
    # Under a fit off by 4% at most: 0.9 x 1.04 < 1, room to spare; 1.05 x 0.96 >= 1, over whatever the error.
    assert at_capacity(loads, dict.fromkeys(loads, 0.04)) == []


def test_a_lane_short_of_headroom_names_its_load_and_the_error_and_says_whether_the_interval_holds() -> None:
    lanes = at_capacity({"long": 0.9}, {"long": 0.15})
    said = headroom_edge(lanes, None)
    assert said.startswith("long at 90% of its capacity (headroom 10%), less than its fit's error (15% of the step "
                           "cost): steps 11% dearer fill it")
    # The dearer replay kept the lane under its capacity: the interval holds it.
    within = headroom_edge(lanes, (_figures(ttft_p99=2.0), "", {"long": 0.97}))
    assert "long at 97% of its capacity, TTFT p99 2.00 s, which the interval holds" in within
    assert not past_capacity(lanes, _figures(ttft_p99=2.0), "", {"long": 0.97})
    # Past its capacity the figures depend on how far past: whatif cannot tell, and says the interval is open.
    assert past_capacity(lanes, _figures(ttft_p99=19.7), "", {"long": 1.04})
    assert past_capacity(lanes, _figures(unfinished=3), "", {"long": 0.99})
    assert "whatif cannot tell" in headroom_edge(lanes, (_figures(ttft_p99=19.7), "", {"long": 1.04}))
    assert headroom_edge([], (_figures(), "", {})) == ""


def test_an_open_ended_interval_has_no_highest_latency_and_goodput_down_to_0() -> None:
    b = opened({"ttft_p99_s": Band(0.47, 0.4, 2.0), "goodput_rps": Band(3.0, 2.5, 3.2),
                "decode_p50 < 1k": Band(40.0, 38.0, 41.0)})
    assert b["ttft_p99_s"] == Band(0.47, 0.4, math.inf)
    assert b["goodput_rps"] == Band(3.0, 0.0, 3.2) and b["decode_p50 < 1k"] == Band(40.0, 0.0, 41.0)
    assert b["ttft_p99_s"].as_json() == {"value": 0.47, "low": 0.4, "high": None}


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
