"""Scheduler levers a what-if tool prices: admission interval, priority policy, deadline-aware prefill chunks."""

from __future__ import annotations

from dataclasses import replace
from statistics import mean

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepline.core.clock import ManualClock
from stepline.sim.config import EngineConfig
from stepline.sim.engine import Simulation
from stepline.sim.records import FinishedRequest, StepRecord
from stepline.sim.scheduler import Request, Scheduler
from stepline.sim.telemetry import engine_config
from stepline.sim.workloads import Workload, chat_arrivals, compose, one_request, short_burst
from tests.sim.test_scheduler import drive

START = 1_800_000_000.0
OBJECTIVE_S = 0.05  # a 50 ms TPOT objective: about five decode-only steps of the streams below


def simulate(workload: Workload, config: EngineConfig) -> tuple[Simulation, list[StepRecord]]:
    steps: list[StepRecord] = []
    sim = Simulation(workload, config, ManualClock(START), on_step=steps.append)
    sim.advance_to(workload.duration_s + workload.drain_s)
    return sim, steps


def finished_by_id(steps: list[StepRecord]) -> dict[str, FinishedRequest]:
    return {f.request_id: f for s in steps for f in s.finished_requests}


def first_token_ts(request: FinishedRequest) -> float:
    return request.arrival_ts + request.time_to_first_token


def ttfts(steps: list[StepRecord]) -> list[float]:
    return [t for s in steps for t in s.time_to_first_tokens_iter]


@pytest.mark.parametrize(
    "bad",
    [{"prefill_schedule_interval": 0}, {"policy": "lifo"}, {"deadline_tpot_s": 0.0}, {"deadline_tpot_s": -0.1}],
)
def test_bad_lever_values_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        EngineConfig(**bad)  # type: ignore[arg-type]


# -- prefill_schedule_interval -----------------------------------------------------------------------------

SHORT_BURST = compose("short-prompts", 1.0, 60.0, [one_request(f"r{i:02d}", 0.0, 700, 30) for i in range(60)])
SMALL_BUDGET = EngineConfig(max_num_batched_tokens=2048)  # a few admissions per step: the queue lasts many steps


def test_an_interval_of_four_admits_only_every_fourth_step_and_costs_ttft() -> None:
    every, fourth = (simulate(SHORT_BURST, replace(SMALL_BUDGET, prefill_schedule_interval=n)) for n in (1, 4))
    # Steps that admitted someone for the first time are the ones counting prefix-cache requests.
    admitting = [s.iteration_index for s in fourth[1] if s.prefix_cache_requests]
    assert len(admitting) > 5 and all(index % 4 == 0 for index in admitting)
    assert any(s.prefix_cache_requests and s.iteration_index % 4 for s in every[1])
    assert every[0].is_done() and fourth[0].is_done()
    assert len(ttfts(every[1])) == len(ttfts(fourth[1])) == 60
    assert mean(ttfts(fourth[1])) > 1.2 * mean(ttfts(every[1]))


def test_decodes_and_the_partial_prefill_run_between_admission_steps() -> None:
    config = EngineConfig(max_num_batched_tokens=2048, prefill_schedule_interval=4)
    scheduler = Scheduler(config)
    scheduler.add(Request("long", 0.0, 5000, 4))
    scheduler.add(Request("short", 0.0, 16, 4))
    batches = []
    now = 0.0
    for _ in range(3):
        batch = scheduler.schedule(now)
        batches.append([(r.request_id, tokens) for r, _, tokens in batch.prefills])
        now += 0.1
        scheduler.complete(batch, now)
    # "short" waits for step 4 although step 2 has room beside the end of "long".
    assert batches == [[("long", 2048)], [("long", 2048)], [("long", 904)]]
    assert scheduler.step_index == 3 and [r.request_id for r in scheduler.waiting] == ["short"]


def test_an_idle_engine_admits_at_once_whatever_the_step_number() -> None:
    workload = compose("idle", 6.0, 10.0, [one_request("a", 0.0, 100, 3), one_request("b", 5.0, 100, 3)])
    sim, steps = simulate(workload, EngineConfig(prefill_schedule_interval=4))
    assert sim.scheduler.step_index == len(steps) == 6  # "b" was admitted on step 3
    assert finished_by_id(steps)["b"].queued_time == 0.0


# -- policy -------------------------------------------------------------------------------------------------

LOW_THEN_HIGH = compose(
    "priority",
    1.0,
    60.0,
    [one_request(f"low-{i}", 0.01 * i, 500, 100, priority=1) for i in range(8)],
    [one_request("high", 0.2, 500, 100, priority=0)],
)


def test_priority_serves_a_late_urgent_request_before_earlier_ones_and_fcfs_does_not() -> None:
    orders = {}
    for policy in ("fcfs", "priority"):
        _, steps = simulate(LOW_THEN_HIGH, EngineConfig(policy=policy, max_num_seqs=2))
        finished = finished_by_id(steps)
        orders[policy] = sorted(finished, key=lambda request_id: first_token_ts(finished[request_id]))
    assert orders["fcfs"][-1] == "high"
    # The two running when it arrives finish first; it takes the next free slot, ahead of six earlier arrivals.
    assert orders["priority"] == ["low-0", "low-1", "high", *(f"low-{i}" for i in range(2, 8))]


def test_the_priority_queue_orders_by_priority_then_arrival() -> None:
    scheduler = Scheduler(EngineConfig(policy="priority"))
    for request_id, arrival, priority in (("a", 0.0, 2), ("b", 0.1, 0), ("c", 0.2, 2), ("d", 0.3, 1), ("e", 0.4, 0)):
        scheduler.add(Request(request_id, arrival, 16, 4, priority=priority))
    assert [r.request_id for r in scheduler.waiting] == ["b", "e", "d", "a", "c"]


@pytest.mark.parametrize(("policy", "queue"), [("fcfs", ["second", "urgent"]), ("priority", ["urgent", "second"])])
def test_a_preempted_request_goes_back_in_policy_order(policy: str, queue: list[str]) -> None:
    # Four blocks: both 32-token prompts fill them, so the first decode preempts "second".
    scheduler = Scheduler(EngineConfig(num_gpu_blocks=4, max_num_batched_tokens=64, policy=policy))
    scheduler.add(Request("first", 0.0, 32, 8, priority=0))
    scheduler.add(Request("second", 0.0, 32, 8, priority=2))
    scheduler.complete(scheduler.schedule(0.0), 0.01)
    scheduler.add(Request("urgent", 0.005, 32, 8, priority=1))
    batch = scheduler.schedule(0.01)
    assert batch.num_preempted == 1
    assert [r.request_id for r in scheduler.waiting] == queue


# -- deadline_tpot_s ----------------------------------------------------------------------------------------


def streams_beside_a_long_prompt(long_at_s: float) -> Workload:
    streams = [one_request(f"stream-{i}", 0.0, 1000, 400) for i in range(8)]
    return compose("deadline", 1.0, 120.0, streams, [one_request("long", long_at_s, 100_000, 8)])


def stream_itls_while_prefilling(steps: list[StepRecord], since_s: float = 0.0) -> list[list[float]]:
    long = finished_by_id(steps)["long"]
    return [
        list(s.inter_token_latencies_iter)
        for s in steps
        if START + since_s < s.ts <= first_token_ts(long) and s.inter_token_latencies_iter
    ]


def test_a_deadline_keeps_itl_near_the_objective_while_a_long_prompt_prefills() -> None:
    workload = streams_beside_a_long_prompt(0.0)
    fixed_sim, fixed = simulate(workload, EngineConfig())
    paced_sim, paced = simulate(workload, EngineConfig(deadline_tpot_s=OBJECTIVE_S))
    fixed_itls = [t for step in stream_itls_while_prefilling(fixed) for t in step]
    paced_itls = [t for step in stream_itls_while_prefilling(paced) for t in step]
    assert max(fixed_itls) > 0.4  # full 8192-token chunks late in a 100k prompt
    assert len(paced_itls) > 500 and max(paced_itls) <= 1.02 * OBJECTIVE_S
    assert mean(paced_itls) > 0.9 * OBJECTIVE_S  # the prefill takes what the objective leaves, not less
    assert fixed_sim.is_done() and paced_sim.is_done()
    long, unpaced = finished_by_id(paced)["long"], finished_by_id(fixed)["long"]
    assert long.num_generation_tokens == 8 and long.time_to_first_token < 2 * unpaced.time_to_first_token
    chunks = [s.num_ctx_tokens for s in paced if s.num_generation_requests and s.num_ctx_tokens]
    assert min(chunks) >= 16 and max(chunks) < 8192 - 8


def test_streams_ahead_of_the_objective_lend_their_slack_to_the_prefill() -> None:
    # Decoding alone for half a second (~10 ms a token), the streams bank ~2 s on a 50 ms-per-token schedule.
    _, steps = simulate(streams_beside_a_long_prompt(0.5), EngineConfig(deadline_tpot_s=OBJECTIVE_S))
    per_step = stream_itls_while_prefilling(steps, since_s=0.5)
    assert max(per_step[1]) > 4 * OBJECTIVE_S  # a full chunk while the slack lasts
    assert max(max(itls) for itls in per_step[10:]) <= 1.02 * OBJECTIVE_S  # then back on the objective


def test_without_decodes_a_deadline_leaves_chunks_uncut() -> None:
    scheduler = Scheduler(EngineConfig(deadline_tpot_s=0.001))
    scheduler.add(Request("long", 0.0, 20_000, 4))
    assert [tokens for _, _, tokens in scheduler.schedule(0.0).prefills] == [8192]


def test_a_deadline_never_cuts_a_chunk_below_one_block() -> None:
    scheduler = Scheduler(EngineConfig(deadline_tpot_s=0.001))  # shorter than any step
    scheduler.add(Request("chat", 0.0, 100, 50))
    scheduler.complete(scheduler.schedule(0.0), 0.01)
    scheduler.add(Request("long", 0.01, 20_000, 4))
    batch = scheduler.schedule(0.01)
    assert len(batch.decodes) == 1 and [tokens for _, _, tokens in batch.prefills] == [16]


# -- defaults and invariants --------------------------------------------------------------------------------


def test_default_levers_leave_a_workload_unchanged() -> None:
    workload = short_burst(seed=3)
    # A small cache as well, so preempted requests go back to the queue.
    for base in (EngineConfig(), EngineConfig(num_gpu_blocks=3000)):
        _, default = simulate(workload, base)
        explicit = replace(base, prefill_schedule_interval=1, policy="fcfs", deadline_tpot_s=None)
        # Equal priorities keep arrival order; a deadline no step comes near never cuts a chunk.
        for config in (explicit, replace(base, policy="priority"), replace(base, deadline_tpot_s=1e6)):
            _, steps = simulate(workload, config)
            assert ttfts(steps) == ttfts(default)
            assert [(s.ts, s.num_ctx_tokens, s.num_generation_requests) for s in steps] == [
                (s.ts, s.num_ctx_tokens, s.num_generation_requests) for s in default
            ]
    assert sum(s.num_preempted_reqs for s in default) > 0


def test_the_plugin_event_reports_the_levers_under_vllms_names() -> None:
    defaults = engine_config(EngineConfig())
    assert (defaults["prefill_schedule_interval"], defaults["scheduling_policy"]) == (1, "fcfs")
    described = engine_config(EngineConfig(prefill_schedule_interval=4, policy="priority"))
    assert (described["prefill_schedule_interval"], described["scheduling_policy"]) == (4, "priority")


def test_chat_traffic_drains_under_every_lever() -> None:
    arrivals = chat_arrivals("chat", 0.0, 20.0, 6.0, prompt_median=2000, output_median=80)
    workload = compose("levers", 20.0, 120.0, arrivals, [one_request("doc", 3.0, 60_000, 20, priority=-1)])
    config = EngineConfig(prefill_schedule_interval=3, policy="priority", deadline_tpot_s=0.04)
    sim, steps = simulate(workload, config)
    assert sim.is_done() and len(finished_by_id(steps)) == len(arrivals) + 1


@settings(max_examples=40, deadline=None, database=None)
@given(
    sizes=st.lists(st.tuples(st.integers(1, 3000), st.integers(1, 60), st.integers(0, 3)), min_size=1, max_size=20),
    budget=st.integers(32, 4096),
    interval=st.integers(1, 5),
    policy=st.sampled_from(["fcfs", "priority"]),
    deadline=st.sampled_from([None, 0.001, 0.03]),
    extra_blocks=st.integers(0, 200),
)
def test_invariants_hold_with_levers(
    sizes: list[tuple[int, int, int]], budget: int, interval: int, policy: str, deadline: float | None,
    extra_blocks: int,
) -> None:
    largest = max(-(-(prompt + output) // 16) for prompt, output, _ in sizes)
    config = EngineConfig(max_num_batched_tokens=budget, max_num_seqs=8, num_gpu_blocks=largest + extra_blocks,
                          prefill_schedule_interval=interval, policy=policy, deadline_tpot_s=deadline)
    requests = [Request(f"r{i}", i * 0.003, p, o, priority=k) for i, (p, o, k) in enumerate(sizes)]
    run = drive(config, requests)
    assert sorted(r.request_id for r in run.finished) == sorted(r.request_id for r in requests)
    assert all(r.generated == r.output_tokens for r in run.finished)
