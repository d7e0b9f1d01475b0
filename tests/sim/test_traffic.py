"""Random traffic for generated cases: bursty Poisson arrivals, heavy-tailed prompts, and load reckoned against
what the engine can serve."""

from __future__ import annotations

import math
import random

import pytest

from stepline.sim import traffic
from stepline.sim.config import EngineConfig
from stepline.sim.costmodel import CostModel
from stepline.sim.workloads import compose, one_request
from tests.sim.test_engine import simulate

COST = CostModel()
BUDGET = 8192
CHAT = traffic.Mix(prompt_median=2000, prompt_sigma=1.0, max_prompt=32_000, cached=(0.5, 0.9), output_median=200)


def test_the_mix_means() -> None:
    assert CHAT.mean_prompt == pytest.approx(2000 * math.exp(0.5))
    assert traffic.Mix(2000, 3.0, 8000, (0.0, 0.0), 100).mean_prompt == 8000  # the cap clips the mean
    assert CHAT.mean_output == pytest.approx(200 * math.exp(0.18))
    assert traffic.Mix(10, 1.0, 100, (0, 0), 100, output_sigma=3.0).mean_output == 400  # at most four medians
    assert CHAT.mean_cached == pytest.approx(0.7)
    assert CHAT.with_cached((0.0, 0.1)) == traffic.Mix(2000, 1.0, 32_000, (0.0, 0.1), 200)


@pytest.mark.parametrize("prompt", [1, 8192, 20_000, 50_000])
def test_prefill_seconds_is_what_the_simulator_takes_to_prefill_a_prompt_alone(prompt: int) -> None:
    _, steps = simulate(compose("alone", 10, 60, [one_request("r", 0.0, prompt, 1)]), EngineConfig(cost=COST))
    prefilling = [s for s in steps if s.num_ctx_tokens > 0]
    assert len(prefilling) == math.ceil(prompt / BUDGET)
    alone = traffic.prefill_seconds(COST, prompt, BUDGET)
    assert sum(s.elapsed_ms for s in prefilling) / 1000 == pytest.approx(alone, rel=1e-3)


def test_smaller_chunks_cost_a_step_overhead_each() -> None:
    assert traffic.prefill_seconds(COST, 0, BUDGET) == 0.0
    extra = traffic.prefill_seconds(COST, 8192, 1024) - traffic.prefill_seconds(COST, 8192, 8192)
    assert extra == pytest.approx(7 * COST.step_overhead_s)
    # Later in the context, each token attends to more: the same tokens cost more.
    assert traffic.prefill_seconds(COST, 8192, BUDGET, start=100_000) > traffic.prefill_seconds(COST, 8192, BUDGET)


def test_tokens_for_prefill_inverts_prefill_seconds() -> None:
    tokens = traffic.tokens_for_prefill(COST, 2.0, BUDGET, cap=500_000)
    assert traffic.prefill_seconds(COST, tokens, BUDGET) >= 2.0
    assert traffic.prefill_seconds(COST, tokens - 257, BUDGET) < 2.0  # found to within the search's 256 tokens
    assert traffic.tokens_for_prefill(COST, 1000.0, BUDGET, cap=10_000) == 10_000  # the cap is reached first


def test_capacity_and_concurrency_scale_with_the_engine() -> None:
    fast, slow = traffic.capacity_rps(COST, CHAT, BUDGET), traffic.capacity_rps(COST.scaled(2.0), CHAT, BUDGET)
    assert slow == pytest.approx(fast / 2)  # every step twice as long: half the requests
    assert traffic.capacity_rps(COST, CHAT.with_cached((0.95, 1.0)), BUDGET) > fast  # cached prompts prefill less
    assert traffic.decode_step_seconds(COST, 64, 3000.0) == pytest.approx(COST.step_seconds(0, 0.0, 64, 192_000))
    assert 0 < traffic.concurrency(COST, CHAT, 0.5 * fast) < traffic.concurrency(COST, CHAT, 0.9 * fast)


def test_bursts_are_drawn_inside_the_span() -> None:
    found = traffic.bursts(random.Random(7), 10.0, 110.0, 5, 4.0)
    assert found == traffic.bursts(random.Random(7), 10.0, 110.0, 5, 4.0)  # the seed decides
    assert len(found) == 5
    assert all(10.0 <= b.start_s < b.end_s <= 110.0 and 5.0 <= b.end_s - b.start_s <= 15.0 for b in found)
    assert all(1.2 <= b.factor <= 4.0 for b in found)
    assert traffic.bursts(random.Random(7), 0.0, 100.0, 5, 1.2) == []  # no room to be faster
    assert traffic.bursts(random.Random(7), 0.0, 19.0, 5, 4.0) == []  # too short a span


def test_arrivals_are_poisson_and_faster_inside_a_burst() -> None:
    burst = traffic.Burst(400.0, 500.0, 5.0)
    found = traffic.arrivals(random.Random(1), "chat", 0.0, 1000.0, 2.0, CHAT, [burst])
    times = [a.offset_s for a in found]
    assert times == sorted(times) and all(0.0 <= t < 1000.0 for t in times)
    assert [a.request_id for a in found[:2]] == ["chat-00000", "chat-00001"]
    inside = sum(1 for t in times if burst.start_s <= t < burst.end_s)
    outside = len(times) - inside
    assert inside == pytest.approx(2.0 * 5.0 * 100, rel=0.15)  # 1,000 expected in the burst's 100 s
    assert outside == pytest.approx(2.0 * 900, rel=0.1)
    assert traffic.arrivals(random.Random(1), "none", 0.0, 100.0, 0.0, CHAT) == []


def test_a_request_is_drawn_from_the_mix() -> None:
    rng = random.Random(3)
    drawn = [traffic.request(rng, f"r{i}", 1.0, CHAT) for i in range(2000)]
    assert all(16 <= a.prompt_tokens <= CHAT.max_prompt and 1 <= a.output_tokens <= 800 for a in drawn)
    assert all(0.5 <= a.cached_fraction <= 0.9 for a in drawn)
    assert sorted(a.prompt_tokens for a in drawn)[1000] == pytest.approx(2000, rel=0.1)  # the median
    assert {a.finish_reason for a in drawn} == {"stop", "length"}
    capped = [a for a in drawn if a.finish_reason == "length"]
    assert 0.2 < len(capped) / len(drawn) < 0.4 and all(a.max_tokens == a.output_tokens for a in capped)
    aborts = traffic.Mix(2000, 1.0, 32_000, (0, 0), 200, abort_share=1.0)
    aborting = [traffic.request(rng, "a", 1.0, aborts) for _ in range(50)]
    assert all(a.finish_reason == "abort" and a.max_tokens > a.output_tokens for a in aborting)
