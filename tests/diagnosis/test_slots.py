"""Leaked slots: running requests that no step schedules while others wait and the budget has room."""

from __future__ import annotations

from stepline.core.clock import ManualClock
from stepline.diagnosis.baseline import MIN_LEAK_STEPS
from stepline.diagnosis.slots import leaked_slots
from stepline.model.rows import Step
from stepline.plugin import wire
from stepline.sources.base import SourceContext
from stepline.sources.plugin_receiver import PluginReceiver
from tests.diagnosis.conftest import Timelines
from tests.diagnosis.test_detectors import config, steady, step


def held(count: int, running: int, decoding: int = 4, waiting: int = 5, start_s: float = 500.0) -> list[Step]:
    """`count` steps from `start_s` (inside the window's last quarter) with `running` requests admitted, of which
    `decoding` are scheduled, and `waiting` queued."""
    return [step(start_s + 0.5 * i, decoding=decoding, waiting=waiting, n=5000 + i)._replace(running=running)
            for i in range(count)]


def deferred(steps: list[Step]) -> list[Step]:
    """`steps` as the collector stores them from the plugin, when vLLM 0.33 deferred every waiting request: its
    num_waiting_reqs 0, its num_skipped_waiting_reqs the rest."""
    records = b"".join(wire.encode_step(wire.StepRecord(
        s.ts / 1e6, s.step, s.engine_index, s.elapsed_ms, s.num_ctx_requests, s.num_ctx_tokens,
        s.num_generation_requests, s.num_generation_tokens, s.running, 0, s.waiting, s.kv_cache_usage,
        s.prefix_cache_queries, s.prefix_cache_hits, s.preempted, s.spec_num_drafts, s.spec_num_draft_tokens,
        s.spec_num_accepted_tokens, s.is_dummy, tuple(s.ttft_seconds), tuple(s.itl_seconds))) for s in steps)
    receiver = PluginReceiver(SourceContext("h", ManualClock()), "/nonexistent/plugin.sock")
    return [r for r in receiver.rows(wire.encode_header(b"e", 1, 1, 0, 0) + records) if isinstance(r, Step)]


def test_slots_held_without_work_while_requests_wait_are_a_wedge_on_its_way(timelines: Timelines) -> None:
    window = timelines.add("leaking", [*steady(), *held(100, running=16)])
    [found] = leaked_slots(timelines.store, window)
    assert (found.kind, found.severity, found.engine) == ("wedged_engine", "critical", "leaking")
    e = found.evidence
    assert (e["idle_slots_p50"], e["running_max"], e["waiting_last"], e["steps_compared"]) == (12.0, 16, 5, 100)
    assert e["idle_slots_first_last"] == "12 -> 12"
    assert "(8192, engine_config)" in e["idle_from"]
    assert found.title == "wedging: 12 of 16 slots do no work, 5 waiting"
    assert timelines.store.query(found.sql).result_rows[0][1] == 100  # the SQL counts the same steps


def test_requests_the_scheduler_deferred_are_waiting_too(timelines: Timelines) -> None:
    # The engine's whole queue is deferred (grammars compiling, KVs on their way): vLLM's num_waiting_reqs says 0.
    window = timelines.add("leaking_deferred", [*steady(), *deferred(held(100, running=16))])
    [found] = leaked_slots(timelines.store, window)
    assert found.title == "wedging: 12 of 16 slots do no work, 5 waiting"


def test_every_running_request_scheduled_is_no_leak(timelines: Timelines) -> None:
    window = timelines.add("busy", [*steady(), *held(100, running=4)])
    assert leaked_slots(timelines.store, window) == []


def test_a_few_idle_slots_are_no_leak(timelines: Timelines) -> None:
    # 1 of 16 slots idle (6%): below IDLE_SLOT_SHARE of the running ones.
    window = timelines.add("one_idle", [*steady(), *held(100, running=16, decoding=15)])
    assert leaked_slots(timelines.store, window) == []


def test_too_few_steps_or_nobody_waiting_is_no_leak(timelines: Timelines) -> None:
    brief = timelines.add("brief", [*steady(), *held(MIN_LEAK_STEPS - 1, running=16)])
    assert leaked_slots(timelines.store, brief) == []
    idle = timelines.add("nobody_waits", [*steady(), *held(100, running=16, waiting=0)])
    assert leaked_slots(timelines.store, idle) == []


def test_idle_slots_before_the_windows_last_quarter_are_not_read(timelines: Timelines) -> None:
    window = timelines.add("earlier", [*steady(), *held(100, running=16, start_s=100.0)])
    assert leaked_slots(timelines.store, window) == []


def test_a_step_using_the_budget_has_no_room_for_the_idle_slots(timelines: Timelines) -> None:
    # Half the budget or more in use: the idle slots may wait for tokens, not be leaked.
    full = [s._replace(num_ctx_tokens=4096, num_ctx_requests=1) for s in held(100, running=16)]
    window = timelines.add("full_budget", [config(), *full])
    assert leaked_slots(timelines.store, window) == []
