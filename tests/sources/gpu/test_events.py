"""What the GPU source reports besides its samples: events stamped with the clock and the host and taken once, and
failed calls counted every time but logged once a minute per GPU and reading."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import pytest

from stepline.core.clock import ManualClock
from stepline.model.rows import Event, Row, micros
from stepline.sources.gpu.events import GpuEvents
from stepline.sources.gpu.nvml import NvmlError, NvmlGone, XidEvent


def test_events_are_stamped_queued_and_taken_once() -> None:
    clock = ManualClock(1_700_000_000.5)
    events = GpuEvents(clock, "gpu-node-1")
    events.unsupported(1, "GPU-1", "vllm-0", "energy", "Not Supported")
    events.lost(2, "", NvmlGone("GPU requires reset", 16), "")
    events.xid(XidEvent(0, "GPU-0", 79), "vllm-1")
    rows = events.take()
    assert [(e.kind, e.severity, e.engine) for e in rows] == [
        ("gpu_reading_unsupported", "info", "vllm-0"), ("gpu_lost", "critical", ""), ("gpu_xid", "critical", "vllm-1")]
    assert all(e.ts == micros(clock.time()) and e.host == "gpu-node-1" and e.source == "gpu" for e in rows)
    assert rows[0].message == "GPU 1 (GPU-1) does not support energy: Not Supported"
    assert rows[0].attributes == {"gpu": "1", "uuid": "GPU-1", "reading": "energy"}
    assert rows[1].message == ("GPU 2 (uuid unknown) was lost: GPU requires reset (NVML_ERROR_RESET_REQUIRED); "
                               "sampling the others")
    assert rows[1].attributes == {"gpu": "2", "uuid": "", "error": "RESET_REQUIRED"}
    assert rows[2].message == "GPU 0 (GPU-0) reported XID 79: GPU has fallen off the bus"
    assert rows[2].attributes == {"xid": "79", "gpu": "0", "uuid": "GPU-0"}
    assert (events.unsupported_readings, events.gpus_lost, events.xid_events, events.nvml_errors) == (1, 1, 1, 0)
    assert events.take() == []


def test_flush_emits_what_is_queued_and_nothing_when_nothing_is() -> None:
    events = GpuEvents(ManualClock(), "h")
    emitted: list[list[Row]] = []

    def emit(rows: Iterable[Row]) -> None:
        emitted.append(list(rows))

    events.flush(emit)
    assert emitted == []
    events.xid(XidEvent(0, "GPU-0", 13), "")
    events.flush(emit)
    assert [[r.kind for r in rows if isinstance(r, Event)] for rows in emitted] == [["gpu_xid"]]
    assert events.take() == []


def test_a_failing_call_is_counted_every_time_and_logged_once_a_minute(caplog: pytest.LogCaptureFixture) -> None:
    events = GpuEvents(ManualClock(), "h")
    with caplog.at_level(logging.WARNING, logger="stepline.sources.gpu"):
        for _ in range(5):
            events.failed(0, "utilization", NvmlError("Timeout", 10))
        events.failed(1, "utilization", NvmlError("Timeout", 10))
    assert events.nvml_errors == 6 and not events.take()
    assert [r.getMessage() for r in caplog.records] == ["GPU 0: NVML utilization failed: Timeout",
                                                         "GPU 1: NVML utilization failed: Timeout"]
