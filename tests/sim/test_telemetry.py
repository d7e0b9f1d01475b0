"""What a simulated engine sends besides /metrics: its steps as the stats vLLM hands a stat logger, its start-up
configuration, and the real plugin's datagrams on a socket (the spans, through a collector: tests/e2e)."""

from __future__ import annotations

import socket
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from stepline.core.clock import ManualClock
from stepline.plugin import wire
from stepline.sim.config import EngineConfig, SpecDecode
from stepline.sim.engine import Simulation
from stepline.sim.records import StepRecord
from stepline.sim.telemetry import LateBound, Telemetry, engine_config, iteration_stats, scheduler_stats
from stepline.sim.workloads import Arrival, Workload

ARRIVALS = (Arrival(0.0, "a", 3000, 5, 0.0, "stop", 16), Arrival(0.01, "b", 100, 4, 0.0, "length", 4))


@pytest.fixture(scope="module")
def steps() -> list[StepRecord]:
    out: list[StepRecord] = []
    sim = Simulation(Workload("telemetry", 1.0, 10.0, ARRIVALS), EngineConfig(max_num_batched_tokens=2048),
                     ManualClock(1_800_000_000.0), on_step=out.append)
    sim.advance_to(11.0)
    return out


def test_a_step_becomes_the_stats_vllm_would_hand_its_loggers(steps: list[StepRecord]) -> None:
    first = steps[0]
    stats = scheduler_stats(first)
    details = stats.iteration_details
    assert details is not None
    assert (details.num_ctx_tokens, details.elapsed_ms, stats.num_running_reqs) == (
        first.num_ctx_tokens, first.elapsed_ms, first.num_running_reqs)
    assert stats.spec_decoding_stats is None  # no drafts verified: vLLM hands none
    finished = [f for s in steps for f in iteration_stats(s).finished_requests]
    assert sorted((f.request_id, f.finish_reason.name) for f in finished) == [("a", "STOP"), ("b", "LENGTH")]


def test_under_async_scheduling_the_reported_elapsed_is_the_wait(steps: list[StepRecord]) -> None:
    waited = replace(steps[0], wait_ms=0.5)
    details = scheduler_stats(waited).iteration_details
    assert details is not None and details.elapsed_ms == 0.5


def test_the_start_up_configuration_names_the_settings_as_the_plugin_does() -> None:
    config = engine_config(EngineConfig(model="m", max_num_seqs=8, speculative=SpecDecode(3, 0.7)))
    assert (config["served_model_name"], config["max_num_seqs"], config["scheduling_policy"]) == ("m", 8, "fcfs")
    assert (config["speculative_method"], config["num_speculative_tokens"]) == ("ngram", 3)
    assert engine_config(EngineConfig(async_scheduling=True))["max_concurrent_batches"] == 2


def test_late_bound_replays_the_early_steps_to_what_attaches_later(steps: list[StepRecord]) -> None:
    first: list[StepRecord] = []
    then: list[StepRecord] = []
    callback = LateBound(first.append)
    callback(steps[0])
    callback(steps[1])
    callback.attach(then.append)
    callback(steps[2])
    assert first == steps[:3] and then == steps[:3]


@pytest.fixture
def plugin_socket() -> Iterator[tuple[str, socket.socket]]:
    path = Path(tempfile.mkdtemp(prefix="stepline-")) / "p.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(str(path))
    server.settimeout(10)
    yield str(path), server
    server.close()
    path.unlink()
    path.parent.rmdir()


def test_the_real_plugin_sends_the_configuration_then_every_step(steps: list[StepRecord],
                                                                  plugin_socket: tuple[str, socket.socket]) -> None:
    path, server = plugin_socket
    telemetry = Telemetry("sim-0", EngineConfig(max_num_batched_tokens=2048), plugin_socket=path, plugin_token="")
    for step in steps:
        telemetry.on_step(step)
    telemetry.close()
    records: list[object] = []
    server.setblocking(False)
    while True:
        try:
            datagram = wire.decode(server.recv(wire.MAX_DATAGRAM))
        except BlockingIOError:
            break
        assert datagram.header.engine == "sim-0"
        records.extend(datagram.records)
    assert isinstance(records[0], wire.ConfigRecord) and records[0].config["max_num_batched_tokens"] == 2048
    sent = [r for r in records if isinstance(r, wire.StepRecord)]
    assert [s.iteration for s in sent] == [s.iteration_index for s in steps]
    assert sorted(r.request_id for r in records if isinstance(r, wire.RequestRecord)) == ["a", "b"]
