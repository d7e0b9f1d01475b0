"""Step-cost properties the simulator must reproduce (the decode collapse seen in production)."""

from __future__ import annotations

import dataclasses
import itertools
import statistics

import pytest

from stepline.core.clock import ManualClock
from stepline.sim.config import EngineConfig
from stepline.sim.costmodel import CostModel, ShapedCostModel, Throttle, ThrottledCostModel, attention_pairs
from stepline.sim.engine import Simulation
from stepline.sim.records import StepRecord
from stepline.sim.workloads import Arrival, Workload, isolated

COST = CostModel()


def test_attention_pairs_count_the_chunk_against_its_prefix() -> None:
    assert attention_pairs(0, 4) == 8.0
    assert attention_pairs(100, 4) == 4 * 102


def test_isolated_512k_decode_runs_near_40_tokens_per_second() -> None:
    step = COST.step_seconds(0, 0.0, 1, 524_288)
    assert 0.022 <= step <= 0.028
    assert 36 <= 1 / step <= 45


@pytest.mark.parametrize(("requests", "context"), [(24, 4096), (32, 4096), (64, 2048)])
def test_decode_only_steps_of_a_modest_batch_take_15_to_30_ms(requests: int, context: int) -> None:
    assert 0.015 <= COST.step_seconds(0, 0.0, requests, requests * context) <= 0.030


def test_an_8192_token_chunk_makes_the_step_far_slower() -> None:
    decode_only = COST.step_seconds(0, 0.0, 32, 32 * 4096)
    with_chunk = COST.chunk_step_seconds(0, 8192, 32, 32 * 4096)
    assert with_chunk >= 0.2
    assert with_chunk >= 10 * decode_only


def test_chunks_of_a_359k_prompt_slow_down_with_depth_and_collapse_decode_to_half_to_five_tps() -> None:
    prompt, chunk, decodes = 359_000, 8192, 16
    steps = [
        COST.chunk_step_seconds(start, min(chunk, prompt - start), decodes, decodes * 4096)
        for start in range(0, prompt, chunk)
    ]
    full = steps[:-1]  # the last chunk is shorter
    assert all(later > earlier for earlier, later in itertools.pairwise(full))
    rates = [1 / s for s in steps]
    assert max(rates) <= 5.0
    assert min(rates) >= 0.5
    assert steps[-2] >= 5 * steps[0], "deep chunks must cost far more than the first"


def test_cached_prefix_is_cheaper_than_computing_it() -> None:
    # Same request, prompt cached vs not: only the uncached part pays the per-token cost.
    cold = sum(COST.chunk_step_seconds(start, 8192) for start in range(0, 131_072, 8192))
    warm = COST.chunk_step_seconds(131_072 - 16, 16)
    assert warm < cold / 100


def _decode_rates(steps: list[StepRecord], start: float, end: float) -> list[float]:
    itls = [itl for s in steps if start <= s.ts < end for itl in s.inter_token_latencies_iter]
    return [1 / itl for itl in itls]


def test_simulated_isolated_request_decodes_near_40_tps() -> None:
    steps: list[StepRecord] = []
    workload = isolated(duration_s=10.0)
    sim = Simulation(workload, EngineConfig(), ManualClock(0.0), on_step=steps.append)
    sim.advance_to(workload.duration_s + workload.drain_s)
    assert sim.is_done()
    rates = _decode_rates(steps, 0.0, 1e9)
    assert len(rates) == workload.arrivals[0].output_tokens - 1
    assert 36 <= statistics.median(rates) <= 45


def test_one_uncached_monster_collapses_concurrent_decode_without_queue_or_preemption() -> None:
    chatters = [Arrival(0.1 * i, f"chat-{i}", 2048, 4000, 0.0, "length", 4000) for i in range(8)]
    monster = Arrival(5.0, "monster", 359_000, 124, 0.0, "length", 124)
    workload = Workload("collapse", 120.0, 0.0, (*chatters, monster))
    steps: list[StepRecord] = []
    sim = Simulation(workload, EngineConfig(), ManualClock(0.0), on_step=steps.append)
    sim.advance_to(120.0)
    first_token = next(s.ts for s in steps if s.time_to_first_tokens_iter and s.ts > 5.0)
    before = _decode_rates(steps, 2.0, 5.0)
    during = _decode_rates(steps, 6.0, first_token)
    after = _decode_rates(steps, first_token + 1.0, first_token + 5.0)
    assert statistics.median(before) > 40
    assert min(during) >= 0.4 and max(during) <= 5.0
    assert statistics.median(after) > 40, "decode recovers once the long prefill ends"
    window = [s for s in steps if 6.0 <= s.ts < first_token]
    assert all(s.num_waiting_reqs == 0 and s.num_preempted_reqs == 0 for s in window)
    assert max(s.kv_cache_usage for s in window) < 0.9
    assert first_token - 5.0 > 30, "a 359k-token prefill takes tens of seconds"


def test_a_shaped_cost_departs_from_the_linear_form_each_way_it_says() -> None:
    linear = CostModel()
    assert ShapedCostModel().step_seconds(1000, 5e5, 8, 40_000) == pytest.approx(
        linear.step_seconds(1000, 5e5, 8, 40_000))
    # 1,000 prefill tokens computed as 2,048 in tiles; a fixed cost for the step that carries prefill.
    tiled = ShapedCostModel(prefill_tile=2048).step_seconds(1000, 0.0, 0, 0)
    assert tiled == pytest.approx(linear.step_seconds(2048, 0.0, 0, 0))
    chunked = ShapedCostModel(chunk_overhead_s=0.02)
    assert chunked.step_seconds(10, 0.0, 0, 0) - linear.step_seconds(10, 0.0, 0, 0) == pytest.approx(0.02)
    assert chunked.step_seconds(0, 0.0, 4, 0) == pytest.approx(linear.step_seconds(0, 0.0, 4, 0))
    # 64 decoding requests cost 64^0.8 of one; a context at the knee costs twice as much per token.
    assert ShapedCostModel(decode_batch_exponent=0.8).step_seconds(0, 0.0, 64, 0) == pytest.approx(
        linear.step_overhead_s + linear.decode_request_s * 64 ** 0.8)
    assert ShapedCostModel(context_knee_tokens=100_000).step_seconds(0, 0.0, 0, 100_000) == pytest.approx(
        linear.step_overhead_s + 2 * linear.decode_context_token_s * 100_000)


def test_a_shaped_costs_jitter_is_seeded_and_each_copy_draws_its_own_sequence() -> None:
    cost = ShapedCostModel(jitter=0.2, seed=7)
    first = [cost.step_seconds(0, 0.0, 8, 10_000) for _ in range(50)]
    again = dataclasses.replace(cost)  # as a lever's settings copy the engine's configuration
    assert [again.step_seconds(0, 0.0, 8, 10_000) for _ in range(50)] == first
    assert len(set(first)) == 50 and 0.5 < statistics.median(first) / CostModel().step_seconds(0, 0.0, 8, 10_000) < 2


def test_a_throttled_shaped_cost_keeps_its_shape() -> None:
    shaped = ShapedCostModel(prefill_tile=2048, chunk_overhead_s=0.02)
    throttle = Throttle(2.0)
    slowed = ThrottledCostModel.wrap(shaped, throttle)
    assert slowed.step_seconds(10, 0.0, 0, 0) == pytest.approx(2 * shaped.step_seconds(10, 0.0, 0, 0))
    assert ThrottledCostModel.wrap(CostModel(), throttle).inner is None
