"""Several API servers (`vllm serve --api-server-count N`): one plugin per front-end, one engine between them.

vLLM 0.33's engine core returns each step's scheduler stats to only one front-end (vllm/v1/core/sched/scheduler.py:
2669-2674); every front-end records IterationStats made from its own requests' outputs, with scheduler_stats None
when the step's stats went to another (vllm/v1/engine/async_llm.py:883-885, 924-935). Here a simulated engine's
steps go to two plugins that way: every step, request and latency sample must land exactly once.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from collections.abc import Iterator

import pytest

from stepline.core.clock import ManualClock
from stepline.model.rows import Request, Row, Step
from stepline.plugin.core import PluginCore
from stepline.sim.config import EngineConfig
from stepline.sim.engine import Simulation
from stepline.sim.records import StepRecord
from stepline.sim.telemetry import iteration_stats, scheduler_stats
from stepline.sim.workloads import Arrival, Workload
from stepline.sources.base import SourceContext
from stepline.sources.plugin_receiver import PluginReceiver
from stepline.testing import vllm_standins as standins

START = 1_800_000_000.0


@pytest.fixture
def receiver(sock_dir: str) -> Iterator[PluginReceiver]:
    r = PluginReceiver(SourceContext("node-1", ManualClock(START)), os.path.join(sock_dir, "plugin.sock"),
                       window_s=0.02)
    r.start()
    yield r
    r.stop()


def _simulated_steps() -> list[StepRecord]:
    """A run with prefills, decodes, finished requests and preemptions (a KV cache too small for them all)."""
    arrivals = tuple(Arrival(0.01 * i, f"r{i}", 1500, 300, 0.0, "length", 300) for i in range(10))
    steps: list[StepRecord] = []
    sim = Simulation(Workload("two-front-ends", 10.0, 300.0, arrivals), EngineConfig(num_gpu_blocks=600),
                     ManualClock(START), on_step=steps.append)
    sim.advance_to(310.0)
    assert sim.is_done()
    return steps


def _front_end_of(request_id: str) -> int:
    return int(request_id[1:]) % 2  # requests split between the two API servers


def _outputs(step: StepRecord, front_end: int, holds_stats: bool, details: bool) -> tuple[object, object]:
    """What one front-end's output handler hands its plugin for `step`: its own requests' iteration stats, and the
    scheduler stats only if the engine core sent them there. Samples without a request are split by position."""
    it = iteration_stats(step)
    mine = standins.IterationStats(
        iteration_timestamp=it.iteration_timestamp,
        num_generation_tokens=it.num_generation_tokens // 2 + (it.num_generation_tokens % 2 if front_end else 0),
        num_preempted_reqs=it.num_preempted_reqs if front_end else 0,
        finished_requests=[f for f in it.finished_requests if _front_end_of(str(f.request_id)) == front_end],
        time_to_first_tokens_iter=it.time_to_first_tokens_iter[front_end::2],
        inter_token_latencies_iter=it.inter_token_latencies_iter[front_end::2],
    )
    if not holds_stats:
        return None, mine
    stats = scheduler_stats(step)
    return (stats if details else dataclasses.replace(stats, iteration_details=None)), mine


def _poll(receiver: PluginReceiver, into: list[Row]) -> None:
    receiver.poll(into.extend)


@pytest.mark.parametrize("details", [True, False], ids=["iteration-details", "no-iteration-details"])
def test_two_front_ends_of_one_engine_merge_with_nothing_lost_or_twice(receiver: PluginReceiver,
                                                                       details: bool) -> None:
    steps = _simulated_steps()
    assert sum(s.num_preempted_reqs for s in steps) > 0 and len(steps) > 100
    # Two senders of one engine, as two API-server processes are (each its own instance and sequence).
    plugins = [PluginCore("llama", receiver.socket_path, iteration_details=details) for _ in range(2)]
    rows: list[Row] = []
    for n, step in enumerate(steps):
        holder = (n // 3) % 2  # the stats go to one front-end, runs of steps at a time, now one, now the other
        for front_end, plugin in enumerate(plugins):
            plugin.record(*_outputs(step, front_end, front_end == holder, details), 0)
        if n % 50 == 0:
            for plugin in plugins:
                plugin.flush()
            _poll(receiver, rows)
    # Samples a front-end was handed after its last step wait for its next one: each gets one more (idle) step.
    for front_end, plugin in enumerate(plugins):
        index = len(steps) + front_end
        idle = standins.SchedulerStats(iteration_details=standins.SchedulerIterationDetails(index, 0, 0, 0, 0, 1.0)
                                       if details else None)
        plugin.record(idle, standins.IterationStats(iteration_timestamp=START + 400.0 + front_end), 0)
    for plugin in plugins:
        plugin.close()
    for _ in range(20):
        _poll(receiver, rows)

    step_rows = [r for r in rows if isinstance(r, Step)]
    if details:  # the engine core's iteration indexes, shared by the front-ends: each step once
        assert sorted(s.step for s in step_rows) == [*(s.iteration_index for s in steps), len(steps), len(steps) + 1]
    else:  # each plugin numbers the steps it was handed; still one row per step, and every generated token
        assert len(step_rows) == len(steps) + 2
        assert sum(s.num_generation_tokens for s in step_rows) == sum(s.num_output_tokens for s in steps)
    finished = [f.request_id for s in steps for f in s.finished_requests]
    requests = [r for r in rows if isinstance(r, Request)]
    assert Counter(r.request_id for r in requests) == Counter(finished)  # every request once, from its own server
    # The latency samples and preemptions of the front-end not handed a step's stats are not lost either.
    assert sum(len(s.ttft_seconds) for s in step_rows) == sum(len(s.time_to_first_tokens_iter) for s in steps)
    assert sum(len(s.itl_seconds) for s in step_rows) == sum(len(s.inter_token_latencies_iter) for s in steps)
    assert sum(s.preempted for s in step_rows) == sum(s.num_preempted_reqs for s in steps)
    # Each sender's own sequence: nothing counted lost, nothing dropped, every datagram of both read.
    assert receiver.counts["lost_datagrams"] == 0 and receiver.counts["plugin_dropped_records"] == 0
    assert receiver.counts["datagrams"] == sum(p.datagrams_sent for p in plugins)
    assert all(p.datagrams_sent > 0 and p.dropped_total == 0 and p.internal_errors == 0 for p in plugins)
