"""The plugin receiver's per-sender and per-engine state: bounded, with evictions counted and no loss left untold."""

from __future__ import annotations

import pytest

from stepline.core.clock import ManualClock
from stepline.model.rows import UNKNOWN_FINISH_REASON, Event, Request, Row, Step
from stepline.plugin import wire
from stepline.sources.base import EngineModels, SourceContext
from stepline.sources.plugin_receiver import MAX_SENDERS, PluginReceiver

NOW = 1_790_000_000.25


@pytest.fixture
def receiver() -> PluginReceiver:
    # rows() decodes and accounts one datagram as poll() does, without a socket.
    return PluginReceiver(SourceContext("node-1", ManualClock(NOW)), "/nonexistent/plugin.sock")


def _datagram(engine: str, pid: int, sequence: int, dropped: int = 0, instance: int = 9) -> bytes:
    return wire.encode_header(engine.encode(), pid, instance, sequence, dropped)


def _events(rows: list[Row]) -> list[Event]:
    return [r for r in rows if isinstance(r, Event) and r.kind == "plugin_data_lost"]


def test_the_sender_table_is_bounded_and_evictions_are_counted(receiver: PluginReceiver) -> None:
    for pid in range(MAX_SENDERS + 10):
        receiver.rows(_datagram("forged", pid, 0))
    assert len(receiver._senders) == MAX_SENDERS
    stats = receiver.stats()
    assert stats["evicted_senders"] == 10 and stats["datagrams"] == MAX_SENDERS + 10
    assert stats["resumed_senders"] == 0  # every one of them was at its first datagram: nothing was forgotten of it


def test_a_sender_heard_from_keeps_its_accounting_through_a_flood_of_others(receiver: PluginReceiver) -> None:
    sequence = 0
    receiver.rows(_datagram("prod", 1, sequence))
    for burst in range(6):
        for pid in range(MAX_SENDERS // 2):
            receiver.rows(_datagram(f"forged-{burst}", 10 + pid, 3))
        sequence += 2 if burst == 3 else 1  # one datagram of the live sender never came
        receiver.rows(_datagram("prod", 1, sequence, dropped=burst))
    stats = receiver.stats()
    assert stats["evicted_senders"] > 0 and len(receiver._senders) == MAX_SENDERS
    # Least recently heard goes first: a sender heard from between the flood's senders stays, its gap counted exactly
    # and its drop counter read as a difference (0+1+...+5 would be 15 if it had been met afresh each time).
    assert stats["lost_datagrams"] == 1 and stats["plugin_dropped_records"] == 5


def test_a_forgotten_sender_heard_from_again_is_counted_not_silent(receiver: PluginReceiver) -> None:
    receiver.rows(_datagram("prod", 1, 0))
    for pid in range(MAX_SENDERS):
        receiver.rows(_datagram("forged", 10 + pid, 0))
    assert ("prod", 1, 9) not in receiver._senders and receiver.stats()["evicted_senders"] == 1
    rows = receiver.rows(_datagram("prod", 1, 1, dropped=4))
    # Met as after a collector restart: its drops are told from its start, and that it was met again is counted.
    assert receiver.stats()["resumed_senders"] == 1 and receiver.stats()["plugin_dropped_records"] == 4
    (event,) = _events(rows)
    assert event.engine == "prod" and event.attributes["dropped_records"] == "4"


def test_loss_of_many_engines_is_bounded_and_all_of_it_reaches_the_timeline(receiver: PluginReceiver) -> None:
    told: list[Event] = []
    engines = MAX_SENDERS + 50
    for i in range(engines):
        told += _events(receiver.rows(_datagram(f"e{i}", i, 0, dropped=1)))  # told at once
        told += _events(receiver.rows(_datagram(f"e{i}", i, 1, dropped=3)))  # within the minute: kept untold
    assert len(receiver._untold) <= MAX_SENDERS and len(receiver._told_at) <= MAX_SENDERS
    untold = sum(u.dropped for u in receiver._untold.values())
    assert sum(int(e.attributes["dropped_records"]) for e in told) + untold == 3 * engines
    assert receiver.stats()["plugin_dropped_records"] == 3 * engines


def _step(waiting: int, deferred: int) -> bytes:
    """A step record as the plugin encodes vLLM's SchedulerStats: num_waiting_reqs and num_skipped_waiting_reqs."""
    return wire.encode_step(wire.StepRecord(NOW, 7, 0, 12.5, 0, 0, 3, 3, 3, waiting, deferred, 0.5, 0, 0, 0, 0, 0, 0,
                                            False))


def test_deferred_waiters_are_counted_as_waiting(receiver: PluginReceiver) -> None:
    # vLLM 0.33 leaves the deferred out of num_waiting_reqs; vllm:num_requests_waiting and the steps' `waiting` hold
    # both, so that every read of the queue (detectors, watchdog, dashboards, projections) counts them.
    steps = [r for r in receiver.rows(_datagram("e", 1, 0) + _step(2, 3) + _step(0, 4)) if isinstance(r, Step)]
    assert [(s.waiting, s.skipped_waiting) for s in steps] == [(5, 3), (4, 4)]


def test_waiting_stays_within_what_its_column_holds(receiver: PluginReceiver) -> None:
    (step,) = [r for r in receiver.rows(_datagram("e", 1, 0) + _step(wire.U32, wire.U32)) if isinstance(r, Step)]
    assert (step.waiting, step.skipped_waiting) == (wire.U32, wire.U32)


def test_the_engines_model_is_shared_with_the_other_sources() -> None:
    models = EngineModels()
    models.remember({"e": "from-the-store", "f": "old"})
    receiver = PluginReceiver(SourceContext("node-1", ManualClock(NOW), engine_models=models), "/nonexistent/p.sock")
    config = wire.encode_config({"model": "/models/qwen", "served_model_name": "qwen"})
    receiver.rows(_datagram("f", 1, 0) + config)
    assert (models.model_of("e"), models.model_of("f")) == ("from-the-store", "qwen")  # what it says now wins
    models.remember({"f": "from-the-store"})  # read back late (a store that answered after the engine spoke)
    assert models.model_of("f") == "qwen"


def test_a_finish_reason_the_plugin_does_not_know_is_unknown(receiver: PluginReceiver) -> None:
    record = wire.REQUEST.pack(NOW, 0, 1.0, 0.1, 0.2, 0.9, 0.7, 0.1, 10, 8, 8, 0, 0, 0, 3)
    data = _datagram("e", 1, 0) + wire.RECORD.pack(wire.REQUEST_RECORD, len(record) + 3) + record + b"r-1"
    (request,) = [r for r in receiver.rows(data) if isinstance(r, Request)]
    assert request.finish_reason == UNKNOWN_FINISH_REASON
