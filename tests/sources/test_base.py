"""The sources' protocol and what a source is given: which process runs which engine (the host source finds them,
the GPU source asks), which model each engine serves, and a failed poll's reason."""

from __future__ import annotations

from stepline.core.clock import ManualClock
from stepline.sources.base import (
    Counting,
    EngineModels,
    EngineProcesses,
    Listener,
    SourceContext,
    SourceError,
)
from stepline.sources.plugin_receiver import PluginReceiver


def test_a_process_found_runs_its_engine_and_so_do_its_children() -> None:
    processes = EngineProcesses()
    assert processes.engine_of(100) == ""
    processes.found("vllm-0", 100)
    processes.ancestors = lambda pid: [150, 100, 1] if pid == 200 else []
    assert (processes.engine_of(100), processes.engine_of(200), processes.engine_of(300)) == ("vllm-0", "vllm-0", "")
    assert processes.processes() == {100: "vllm-0"}


def test_the_generation_moves_only_when_what_is_known_changes() -> None:
    processes = EngineProcesses()
    start = processes.generation()
    processes.found("vllm-0", 100)
    processes.found("vllm-0", 100)  # the same again: no news
    assert processes.generation() == start + 1
    processes.found("vllm-1", 100)  # the pid now runs another engine
    processes.lost(100)
    processes.lost(100)
    assert processes.generation() == start + 3 and processes.processes() == {}


def test_an_engines_model_is_its_latest_announcement_and_the_store_fills_only_gaps() -> None:
    models = EngineModels()
    assert models.model_of("vllm-0") == ""
    models.announce("vllm-0", "Qwen/Qwen3-8B")
    models.remember({"vllm-0": "old/model", "vllm-1": "meta-llama/Llama-3.1-8B", "vllm-2": ""})
    assert [models.model_of(e) for e in ("vllm-0", "vllm-1", "vllm-2")] == ["Qwen/Qwen3-8B",
                                                                            "meta-llama/Llama-3.1-8B", ""]
    models.announce("vllm-0", "Qwen/Qwen3-32B")  # restarted with another model
    assert models.model_of("vllm-0") == "Qwen/Qwen3-32B"


def test_a_failed_poll_says_its_reason_in_one_word() -> None:
    error = SourceError("vllm-0: connection refused", "refused")
    assert (str(error), error.reason) == ("vllm-0: connection refused", "refused")
    assert SourceError("odd").reason == "error"


def test_a_receiver_is_a_listener_that_counts() -> None:
    receiver = PluginReceiver(SourceContext("h", ManualClock()), "/nonexistent/stepline-test.sock")
    assert isinstance(receiver, Listener) and isinstance(receiver, Counting)
    assert not isinstance(object(), Listener)
