"""The simulation driver: stepping in simulated time, records, completion, repetition."""

from __future__ import annotations

import itertools

import pytest

from stepline.core.clock import ManualClock
from stepline.sim.config import EngineConfig
from stepline.sim.engine import Simulation
from stepline.sim.records import FinishedRequest, StepRecord
from stepline.sim.workloads import Arrival, Workload, make_workload

START = 1_800_000_000.0


def simulate(
    workload: Workload, config: EngineConfig | None = None, until: float | None = None
) -> tuple[Simulation, list[StepRecord]]:
    steps: list[StepRecord] = []
    sim = Simulation(workload, config, ManualClock(START), on_step=steps.append)
    sim.advance_to(until if until is not None else workload.duration_s + workload.drain_s)
    return sim, steps


def finished_of(steps: list[StepRecord]) -> list[FinishedRequest]:
    return [f for s in steps for f in s.finished_requests]


@pytest.mark.parametrize(
    ("name", "config"),
    [
        ("steady", EngineConfig()),
        ("burst", EngineConfig()),
        ("burst", EngineConfig(num_gpu_blocks=24_000, max_num_seqs=16, long_prefill_token_threshold=2048)),
        ("isolated", EngineConfig()),
    ],
)
def test_every_request_finishes_with_its_output_tokens(name: str, config: EngineConfig) -> None:
    workload = make_workload(name, duration_s=60.0)
    sim, steps = simulate(workload, config)
    assert sim.is_done()
    finished = {f.request_id: f for f in finished_of(steps)}
    expected = {a.request_id: a for a in workload.arrivals}
    assert finished.keys() == expected.keys()
    for request_id, record in finished.items():
        arrival = expected[request_id]
        assert record.num_generation_tokens == arrival.output_tokens
        assert record.finish_reason == arrival.finish_reason
        assert record.max_tokens_param == arrival.max_tokens
        assert record.num_prompt_tokens == arrival.prompt_tokens
    assert all(s.num_ctx_tokens + s.num_generation_tokens <= config.max_num_batched_tokens for s in steps)
    assert max(s.num_running_reqs for s in steps) <= config.max_num_seqs
    if config.long_prefill_token_threshold:
        # Capped wherever another request shares the engine; a prompt alone there is not (vLLM).
        shared = [s.num_ctx_tokens for s in steps if s.num_ctx_requests == 1 and s.num_generation_requests > 0]
        assert max(shared) == config.long_prefill_token_threshold


def test_request_phases_add_up() -> None:
    _, steps = simulate(make_workload("burst", duration_s=90.0))
    for f in finished_of(steps):
        assert f.queued_time >= 0 and f.prefill_time > 0 and f.decode_time >= 0
        assert f.inference_time == pytest.approx(f.prefill_time + f.decode_time)
        assert f.e2e_latency == pytest.approx(f.queued_time + f.inference_time)
        assert f.time_to_first_token == pytest.approx(f.queued_time + f.prefill_time)
        assert f.finished_ts == pytest.approx(f.arrival_ts + f.e2e_latency)
        if f.num_generation_tokens > 1:
            assert f.mean_time_per_output_token == pytest.approx(f.decode_time / (f.num_generation_tokens - 1))


def test_steps_are_stamped_in_order_on_the_clock() -> None:
    sim, steps = simulate(make_workload("steady", duration_s=20.0))
    stamps = [s.ts for s in steps]
    assert stamps == sorted(stamps)
    assert [s.iteration_index for s in steps] == list(range(len(steps)))
    assert stamps[0] > START and stamps[-1] <= START + sim.now
    for earlier, later in itertools.pairwise(steps):
        assert later.ts - later.elapsed_ms / 1e3 >= earlier.ts - 1e-6, "steps overlap"


def test_small_advances_give_the_same_run_as_one_big_one() -> None:
    workload = make_workload("burst", duration_s=60.0)
    _, whole = simulate(workload)
    steps: list[StepRecord] = []
    sim = Simulation(workload, None, ManualClock(START), on_step=steps.append)
    t = 0.0
    while t < workload.duration_s + workload.drain_s:
        t += 0.37
        sim.advance_to(t)
        assert all(s.ts <= START + t + 1e-9 for s in steps), "a step ended after the time advanced to"
    assert steps == whole


def test_a_long_step_stays_in_flight_until_it_ends() -> None:
    monster = Arrival(0.0, "monster", 300_000, 2, 0.0, "length", 2)
    steps: list[StepRecord] = []
    sim = Simulation(Workload("one", 10.0, 0.0, (monster,)), None, ManualClock(START), on_step=steps.append)
    sim.advance_to(0.1)
    assert steps == [], "the first 8192-token chunk takes longer than 0.1 s"
    sim.advance_to(0.5)
    assert len(steps) == 1 and steps[0].num_ctx_tokens == 8192
    assert not sim.is_done()


def test_requests_too_large_for_the_kv_cache_are_refused() -> None:
    arrivals = (Arrival(0.0, "big", 10_000, 10, 0.0, "length", 10), Arrival(0.1, "ok", 100, 10, 0.0, "length", 10))
    sim, steps = simulate(Workload("w", 5.0, 5.0, arrivals), EngineConfig(num_gpu_blocks=100))
    assert sim.rejected == 1
    assert [f.request_id for f in finished_of(steps)] == ["ok"]
    assert sim.is_done()


def test_repeat_keeps_traffic_coming_with_fresh_ids() -> None:
    workload = make_workload("steady", duration_s=10.0)
    steps: list[StepRecord] = []
    sim = Simulation(workload, None, ManualClock(START), on_step=steps.append, repeat=True)
    sim.advance_to(35.0)
    ids = [f.request_id for f in finished_of(steps)]
    assert len(ids) == len(set(ids))
    assert any(i.endswith("-2") for i in ids)
    assert not sim.is_done()


def test_preemption_shows_in_steps_and_finished_requests() -> None:
    config = EngineConfig(num_gpu_blocks=2_000)
    arrivals = tuple(Arrival(0.01 * i, f"r{i}", 3000, 1500, 0.0, "length", 1500) for i in range(12))
    sim, steps = simulate(Workload("tight", 30.0, 600.0, arrivals), config)
    assert sim.is_done()
    preempted = sum(s.num_preempted_reqs for s in steps)
    assert preempted > 0
    assert sum(f.num_preemptions for f in finished_of(steps)) == preempted
    assert max(s.kv_cache_usage for s in steps) > 0.95


def _async_pair(host_s: float) -> tuple[list[StepRecord], list[StepRecord]]:
    from stepline.sim.workloads import compose, one_request
    work = compose("async", 5.0, 60.0, [one_request("a", 0.0, 500, 40, 0.0), one_request("b", 0.05, 9000, 20, 0.0),
                                        one_request("c", 0.5, 300, 30, 0.0)])
    return (simulate(work, EngineConfig())[1],
            simulate(work, EngineConfig(async_scheduling=True, host_overhead_s=host_s))[1])


def test_async_scheduling_reports_the_wait_vllms_batch_queue_times() -> None:
    """vLLM 0.33's step_with_batch_queue times only the core's wait for a launched step (vllm/v1/engine/core.py:
    777-783): the step less the host's work on the next one, 0 when the GPU finished first."""
    synchronous, pipelined = _async_pair(host_s=0.012)
    assert all(s.wait_ms is None for s in synchronous)
    for s in pipelined:
        assert s.wait_ms == pytest.approx(max(0.0, s.elapsed_ms - 12.0))
    assert min(s.wait_ms or 0.0 for s in pipelined) == 0.0  # decode-only steps shorter than the host's 12 ms
    # The steps themselves run back to back as long: the same tokens, in as many steps, each as long.
    assert sum(s.num_output_tokens for s in pipelined) == sum(s.num_output_tokens for s in synchronous) == 90


def test_async_scheduling_schedules_a_step_ahead() -> None:
    """A request that arrives while a step runs joins the step after next: the next one was scheduled as the
    running one began. An idle engine schedules an arrival at once, in both modes."""
    synchronous, pipelined = _async_pair(host_s=0.004)
    assert synchronous[0].num_ctx_tokens == pipelined[0].num_ctx_tokens == 500  # a, alone, at once
    b_sync, b_async = (next(s for s in steps if s.num_ctx_tokens >= 8000) for steps in (synchronous, pipelined))
    assert b_async.iteration_index == b_sync.iteration_index + 1


@pytest.mark.parametrize("config", [EngineConfig(), EngineConfig(long_prefill_token_threshold=512),
                                    EngineConfig(async_scheduling=True)])
def test_each_steps_work_is_who_it_carried_and_what_the_cost_model_charged(config: EngineConfig) -> None:
    from stepline.sim.costmodel import attention_pairs

    _, steps = simulate(make_workload("short-burst"), config)
    cost = config.cost
    carried = 0
    for step in steps:
        prefills = [w for w in step.work if w.prefill_tokens]
        decodes = [w for w in step.work if w.decode_context]
        assert sum(w.prefill_tokens for w in prefills) == step.num_ctx_tokens
        assert (len(prefills), len(decodes)) == (step.num_ctx_requests, step.num_generation_requests)
        seconds = cost.step_seconds(step.num_ctx_tokens + sum(w.draft_tokens for w in decodes),
                                    sum(attention_pairs(w.prefill_start, w.prefill_tokens) for w in prefills),
                                    len(decodes), sum(w.decode_context for w in decodes))
        assert step.elapsed_ms == pytest.approx(seconds * 1e3, rel=1e-9)
        carried += len(step.work)
    assert carried > len(steps)
