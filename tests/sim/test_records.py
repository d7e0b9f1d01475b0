"""What a simulated step and a finished request leave behind: the records agree with each other as vLLM's stats do
(the phases of a request add up, a step's work is its scheduled tokens, every prompt counted once)."""

from __future__ import annotations

import pytest

from stepline.core.clock import ManualClock
from stepline.sim.config import EngineConfig
from stepline.sim.engine import Simulation
from stepline.sim.records import FinishedRequest, StepRecord, StepWork
from stepline.sim.workloads import Arrival, Workload

START = 1_800_000_000.0
ARRIVALS = (Arrival(0.0, "long", 6000, 20, 0.0, "length", 20), Arrival(0.05, "short", 300, 8, 0.0, "stop", 64),
            Arrival(0.1, "short-2", 300, 8, 0.0, "stop", 64))


@pytest.fixture(scope="module")
def steps() -> list[StepRecord]:
    out: list[StepRecord] = []
    sim = Simulation(Workload("records", 1.0, 30.0, ARRIVALS), EngineConfig(max_num_batched_tokens=2048),
                     ManualClock(START), on_step=out.append)
    sim.advance_to(31.0)
    assert sim.is_done()
    return out


def _finished(steps: list[StepRecord]) -> dict[str, FinishedRequest]:
    return {f.request_id: f for s in steps for f in s.finished_requests}


def test_a_finished_requests_phases_add_up_to_its_latency(steps: list[StepRecord]) -> None:
    finished = _finished(steps)
    assert set(finished) == {"long", "short", "short-2"}
    for f in finished.values():
        assert f.e2e_latency == pytest.approx(f.finished_ts - f.arrival_ts)
        assert f.inference_time == pytest.approx(f.prefill_time + f.decode_time)
        assert f.e2e_latency == pytest.approx(f.queued_time + f.inference_time, abs=1e-6)
        assert f.time_to_first_token >= f.queued_time + f.prefill_time - 1e-6
        assert f.mean_time_per_output_token == pytest.approx(f.decode_time / (f.num_generation_tokens - 1))
    assert (finished["long"].finish_reason, finished["long"].num_generation_tokens) == ("length", 20)


def test_a_steps_work_is_what_it_scheduled(steps: list[StepRecord]) -> None:
    for s in steps:
        work: tuple[StepWork, ...] = s.work
        assert sum(w.prefill_tokens for w in work) == s.num_ctx_tokens
        assert sum(1 for w in work if w.prefill_tokens) == s.num_ctx_requests
        assert sum(1 for w in work if w.decode_context) == s.num_generation_requests
        assert s.elapsed_ms > 0 and s.wait_ms is None  # synchronous scheduling: no wait reading
    assert sum(s.num_ctx_tokens for s in steps) == 6600  # each prompt prefilled once, the long one in chunks
    assert [s.iteration_index for s in steps] == sorted(s.iteration_index for s in steps)


def test_every_prompt_is_counted_once_on_the_step_that_completes_it(steps: list[StepRecord]) -> None:
    assert sum(s.num_prompt_tokens for s in steps) == 6600
    assert sum(len(s.time_to_first_tokens_iter) for s in steps) == 3
    assert sum(s.num_output_tokens for s in steps) == 36
