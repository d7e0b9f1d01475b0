"""The runner: every poll timed and counted; one failing or buggy source never stops the others."""

from __future__ import annotations

import logging
import time

import pytest
from prometheus_client import CollectorRegistry

from stepline.ingest.metrics import IngestMetrics
from stepline.ingest.runner import Runner, Scheduled
from stepline.ingest.writer import Writers
from stepline.model.rows import Event, micros
from stepline.sources.base import Emit, SourceError
from stepline.testing.sink import MemorySink


class Ticker:
    """Emits one event per poll."""

    name = "ticker"

    def __init__(self) -> None:
        self.polls = 0

    def poll(self, emit: Emit) -> None:
        self.polls += 1
        emit([Event(micros(time.time()), "h", "", self.name, "tick", "info", str(self.polls), {})])


class Broken:
    """Fails the way a source reports failure, after emitting what it had."""

    name = "broken"

    def poll(self, emit: Emit) -> None:
        emit([Event(micros(time.time()), "h", "", self.name, "engine_down", "critical", "down", {})])
        raise SourceError("engine x unreachable")


class Buggy:
    """Has a bug."""

    name = "buggy"

    def poll(self, emit: Emit) -> None:
        raise KeyError("oops")


def _value(metrics: IngestMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_failures_are_counted_and_contained(caplog: pytest.LogCaptureFixture) -> None:
    sink, metrics = MemorySink(), IngestMetrics(CollectorRegistry())
    writers = Writers(sink, metrics, flush_interval_s=0.01)
    writers.start()
    ticker = Ticker()
    runner = Runner([Scheduled(ticker, 0.02), Scheduled(Broken(), 0.02), Scheduled(Buggy(), 0.02)], writers,
                    metrics, "h")
    with caplog.at_level(logging.INFO):
        runner.start()
        time.sleep(0.3)
        runner.stop()
    writers.stop()
    assert ticker.polls >= 5
    assert _value(metrics, "stepline_source_up", source="ticker") == 1
    assert _value(metrics, "stepline_source_up", source="broken") == 0
    assert _value(metrics, "stepline_source_up", source="buggy") == 0
    assert (_value(metrics, "stepline_source_errors_total", source="broken") or 0) >= 5
    assert (_value(metrics, "stepline_source_poll_duration_seconds", source="ticker") or -1) >= 0
    events = sink.rows("events")
    # The broken source's own rows are kept; the bug goes on the timeline once, not once per poll.
    assert sum(1 for e in events if e.kind == "engine_down") >= 5
    bugs = [e for e in events if e.kind == "source_error"]
    assert len(bugs) == 1 and bugs[0].source == "buggy" and "KeyError" in bugs[0].message
    # One warning per distinct failure, not one per poll: the repeats wait out the 30 s interval.
    assert sum("engine x unreachable" in r.getMessage() for r in caplog.records) == 1


def test_poll_once_reports_recovery(caplog: pytest.LogCaptureFixture) -> None:
    metrics = IngestMetrics(CollectorRegistry())
    runner = Runner([], Writers(MemorySink(), metrics), metrics, "h")

    class Flaky:
        name = "flaky"
        fail = True

        def poll(self, emit: Emit) -> None:
            if self.fail:
                raise SourceError("not yet")

    flaky = Flaky()
    assert not runner.poll_once(flaky)
    flaky.fail = False
    with caplog.at_level(logging.INFO):
        assert runner.poll_once(flaky)
    assert "source flaky recovered" in caplog.text
    assert _value(metrics, "stepline_source_up", source="flaky") == 1


def test_a_failure_exports_its_kind_while_it_lasts() -> None:
    metrics = IngestMetrics(CollectorRegistry())
    runner = Runner([], Writers(MemorySink(), metrics), metrics, "h")

    class Engine:
        name = "vllm_metrics:e1"
        reason: str | None = "timeout"

        def poll(self, emit: Emit) -> None:
            if self.reason is not None:
                raise SourceError("engine e1 unreachable", self.reason)

    engine = Engine()
    assert not runner.poll_once(engine)
    assert _value(metrics, "stepline_source_failure_info", source="vllm_metrics:e1", reason="timeout") == 1
    engine.reason = "refused"  # one series per source: the latest failure's kind
    assert not runner.poll_once(engine)
    assert _value(metrics, "stepline_source_failure_info", source="vllm_metrics:e1", reason="timeout") is None
    assert _value(metrics, "stepline_source_failure_info", source="vllm_metrics:e1", reason="refused") == 1
    engine.reason = None
    assert runner.poll_once(engine)
    assert _value(metrics, "stepline_source_failure_info", source="vllm_metrics:e1", reason="refused") is None
