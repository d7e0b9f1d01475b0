"""What becomes a step, and under which model name: scheduler stats without iteration details (vLLM idling, 0-token
steps) never make a step row nor take a step's number; every table names the served model."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stepline.core.clock import ManualClock
from stepline.model.rows import Event, Request, Row, Step
from stepline.plugin.config import describe_config
from stepline.plugin.core import PluginCore
from stepline.sources.base import SourceContext
from stepline.sources.plugin_receiver import PluginReceiver
from stepline.testing import vllm_standins as standins

NOW = 1_790_000_000.25
COLLECTOR_DIR = str(Path(__file__).resolve().parents[2] / "collector")


@pytest.fixture
def receiver(sock_dir: str) -> Iterator[PluginReceiver]:
    r = PluginReceiver(SourceContext("node-1", ManualClock(NOW)), os.path.join(sock_dir, "plugin.sock"),
                       window_s=0.05)
    r.start()
    yield r
    r.stop()


def _poll(receiver: PluginReceiver) -> list[Row]:
    rows: list[Row] = []
    receiver.poll(rows.extend)
    return rows


def _detailed(i: int, queries: int = 0, hits: int = 0) -> tuple[standins.SchedulerStats, standins.IterationStats]:
    sched = standins.SchedulerStats(
        num_running_reqs=4, num_waiting_reqs=1, kv_cache_usage=0.25,
        iteration_details=standins.SchedulerIterationDetails(i, 0, 0, 4, 4, 12.5),
        prefix_cache_stats=standins.PrefixCacheStats(queries=queries, hits=hits),
    )
    return sched, standins.IterationStats(iteration_timestamp=NOW + i, inter_token_latencies_iter=[0.0125] * 4)


def _without_details(queries: int = 0, hits: int = 0, preempted: int = 0, running: int = 2,
                     finished: str | None = None) -> tuple[standins.SchedulerStats, standins.IterationStats]:
    """What vLLM hands its loggers for a 0-token step or while idling: scheduler stats, no iteration details."""
    sched = standins.SchedulerStats(num_running_reqs=running, num_waiting_reqs=1, kv_cache_usage=0.25,
                                    prefix_cache_stats=standins.PrefixCacheStats(queries=queries, hits=hits))
    it = standins.IterationStats(iteration_timestamp=NOW, num_preempted_reqs=preempted, finished_requests=[
        standins.FinishedRequestStats(standins.FinishReason.ABORT, finished)] if finished else [])
    return sched, it


@pytest.mark.parametrize("setting", [True, None], ids=["engine-says-details-on", "learned-from-the-first-step"])
def test_stats_without_iteration_details_make_no_step_and_keep_their_counts(
        receiver: PluginReceiver, setting: bool | None) -> None:
    core = PluginCore("e", receiver.socket_path, iteration_details=setting)
    core.record(*_detailed(0, queries=100, hits=50))
    core.record(*_without_details(queries=30, hits=10, preempted=1))
    core.record(*_without_details(queries=7, finished="aborted-while-idle"))  # its request still counts
    core.record(*_detailed(1, queries=5))
    core.record(*_detailed(2))
    core.record(*_without_details(running=0))  # vLLM idling
    core.flush()
    rows = _poll(receiver)
    steps = [r for r in rows if isinstance(r, Step)]
    assert [s.step for s in steps] == [0, 1, 2]  # vLLM's iteration indexes, each once
    assert not any(math.isnan(s.elapsed_ms) for s in steps)
    # Counts vLLM reported between steps go to the next step: the steps' sums match vLLM's counters.
    assert [(s.prefix_cache_queries, s.prefix_cache_hits, s.preempted) for s in steps] == [
        (100, 50, 0), (42, 10, 1), (0, 0, 0)]
    assert [r.request_id for r in rows if isinstance(r, Request)] == ["aborted-while-idle"]
    assert core.stats_without_details == 3 and core.dropped == {}


def test_an_engine_without_iteration_details_still_has_one_step_per_stats(receiver: PluginReceiver) -> None:
    core = PluginCore("e", receiver.socket_path, iteration_details=False)
    for _ in range(3):
        core.record(*_without_details())
    core.flush()
    steps = [r for r in _poll(receiver) if isinstance(r, Step)]
    assert [s.step for s in steps] == [0, 1, 2] and all(math.isnan(s.elapsed_ms) for s in steps)


def test_the_served_name_is_the_model_name_and_the_path_stays_in_the_config(receiver: PluginReceiver) -> None:
    core = PluginCore("e", receiver.socket_path)
    core.engine_initialized({"model": "/models/llama-3.1-8b", "served_model_name": "llama-chat"})
    sched, it = _detailed(0)
    it.finished_requests = [standins.FinishedRequestStats(standins.FinishReason.STOP, "r-1")]
    core.record(sched, it)
    core.flush()
    rows = _poll(receiver)
    assert {r.model_name for r in rows if isinstance(r, (Step, Request))} == {"llama-chat"}
    (config,) = [r for r in rows if isinstance(r, Event) and r.kind == "engine_config"]
    assert config.attributes["model"] == "/models/llama-3.1-8b"
    assert config.attributes["served_model_name"] == "llama-chat"


class _Section:
    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)


def test_the_configuration_names_the_first_served_name_as_vllm_labels_its_metrics() -> None:
    def described(**model: Any) -> dict[str, Any]:
        return describe_config(_Section(model_config=_Section(**model),
                                        observability_config=_Section(enable_logging_iteration_details=True)))

    several = described(model="/models/x", served_model_name=["chat", "chat-alias"])
    assert (several["model"], several["served_model_name"]) == ("/models/x", "chat")
    assert described(model="/models/x", served_model_name="chat")["served_model_name"] == "chat"
    assert described(model="/models/x")["served_model_name"] == "/models/x"  # vLLM serves the path then
    assert several["enable_logging_iteration_details"] is True


_VLLM_LOADS_THE_PLUGIN = textwrap.dedent("""
    import sys
    sys.path[:0] = [{collector!r}, {standin!r}]
    from types import SimpleNamespace as S
    from stepline.testing import vllm_standins as standins
    from stepline.plugin.vllm_logger import SteplineStatLogger

    config = S(model_config=S(model="/models/llama", served_model_name=["llama-chat", "alias"]),
               observability_config=S(enable_logging_iteration_details=True))
    logger = SteplineStatLogger(config, 0)
    logger.log_engine_initialized()
    idle = standins.SchedulerStats(num_running_reqs=0, num_waiting_reqs=0)  # before any step: still not a step
    logger.record(idle, None)
    for i in range(3):
        logger.record(standins.SchedulerStats(num_running_reqs=1, iteration_details=standins.SchedulerIterationDetails(
            i, 0, 0, 1, 1, 5.0)), standins.IterationStats(iteration_timestamp=1.79e9 + i))
        logger.record(idle, None)
    logger.log()
""")


def test_vllm_s_settings_reach_the_plugin_through_its_entry_class(receiver: PluginReceiver, tmp_path: Path) -> None:
    standin = standins.write_vllm_package(tmp_path / "standin")
    script = _VLLM_LOADS_THE_PLUGIN.format(collector=COLLECTOR_DIR, standin=str(standin))
    env = {**os.environ, "STEPLINE_PLUGIN_SOCKET": receiver.socket_path, "STEPLINE_ENGINE": "real"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    rows = _poll(receiver)
    steps = [r for r in rows if isinstance(r, Step)]
    assert [s.step for s in steps] == [0, 1, 2]  # the idle stats, even the first, took no step number
    assert {s.model_name for s in steps} == {"llama-chat"}
