"""The home-made router's recorder: decisions reach the collector's receiver; what cannot is counted, never raised."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stepline.gateway.record import DecisionRecorder
from stepline.model.rows import GatewayDecision
from stepline.sources.otlp import OtlpReceiver
from stepline.testing.alertstack import free_port
from tests.sources.test_otlp import drain, make_receiver, receiver  # noqa: F401


def _route(recorder: DecisionRecorder, body: str, threshold_chars: int) -> str:
    """A routing hook as the seed's router had it, with the except branch that reports what it swallowed."""
    started, swallowed = time.time(), None
    try:
        lane = "heavy" if len(body) > threshold_chars else "fast"
    except Exception as exc:  # what the seed's hook did silently
        lane, swallowed = "fast", exc
    recorder.record(request_id=f"r{len(body)}", lane=lane, backend="http://127.0.0.1:8001/v1", start_s=started,
                    end_s=started + 0.25, size_chars=len(body), threshold=threshold_chars, threshold_unit="chars",
                    status=200, swallowed=swallowed)
    return lane


def test_decisions_reach_the_receiver(receiver: OtlpReceiver) -> None:  # noqa: F811
    recorder = DecisionRecorder(f"{receiver.url}/v1/traces", gateway="seed-router")
    assert [_route(recorder, "x" * n, 1000) for n in (10, 2000)] == ["fast", "heavy"]
    recorder.record(lane="fast", start_s=time.time(), swallowed=KeyError("messages"))
    assert recorder.flush(10)
    recorder.close()
    rows = [r for r in drain(receiver) if isinstance(r, GatewayDecision)]
    assert sorted(((r.lane, r.size_chars, r.engine, r.gateway, r.swallowed_exception) for r in rows), key=str) == [
        ("fast", 10, "127.0.0.1:8001", "seed-router", ""), ("fast", None, "", "seed-router", "KeyError: 'messages'"),
        ("heavy", 2000, "127.0.0.1:8001", "seed-router", "")]
    assert recorder.stats() == {"recorded": 3, "sent": 3, "dropped_full": 0, "dropped_unsent": 0, "send_failures": 0}


def test_a_collector_that_is_down_costs_counted_decisions_and_a_log_line(caplog: pytest.LogCaptureFixture) -> None:
    recorder = DecisionRecorder(f"http://127.0.0.1:{free_port()}/v1/traces", gateway="g", timeout_s=1)  # nothing there
    with caplog.at_level(logging.WARNING, logger="stepline.gateway.record"):
        recorder.record(lane="fast", start_s=time.time())  # never raises in the hook
        recorder.close()
    stats = recorder.stats()
    assert (stats["recorded"], stats["sent"], stats["dropped_unsent"], stats["send_failures"]) == (1, 0, 1, 1)
    assert any("not delivered" in r.getMessage() for r in caplog.records)


def test_a_full_queue_drops_and_counts() -> None:
    recorder = DecisionRecorder("http://127.0.0.1:9/v1/traces", gateway="g", max_pending=2, interval_s=60)
    for _ in range(5):
        recorder.record(lane="fast", start_s=time.time())
    assert recorder.stats()["dropped_full"] == 3
    recorder.close(timeout_s=2)
    stats = recorder.stats()
    assert stats["recorded"] == 2 and stats["sent"] == 0 and stats["dropped_unsent"] == 2


def test_a_bad_argument_is_counted_not_raised() -> None:
    recorder = DecisionRecorder("http://127.0.0.1:9/v1/traces", gateway="g", interval_s=60)
    recorder.record(lane="fast", start_s=time.time(), threshold="not a number")  # type: ignore[arg-type]
    assert recorder.stats()["dropped_unsent"] == 1 and recorder.stats()["recorded"] == 0
    recorder.close(timeout_s=1)


def test_a_recorder_left_open_sends_its_queue_at_exit(tmp_path: Path, receiver: OtlpReceiver) -> None:  # noqa: F811
    """A gateway that exits without closing its recorder: what it queued is still posted (atexit), not dropped with
    the daemon thread."""
    script = tmp_path / "router.py"
    script.write_text(
        "import sys, time\n"
        "from stepline.gateway.record import DecisionRecorder\n"
        "r = DecisionRecorder(sys.argv[1], gateway='router', interval_s=3600)\n"
        "for i in range(5):\n"
        "    r.record(request_id=f'r{i}', lane='fast', start_s=time.time())\n")
    subprocess.run([sys.executable, str(script), f"{receiver.url}/v1/traces"], check=True, timeout=60)
    rows = [r for r in drain(receiver) if isinstance(r, GatewayDecision)]
    assert sorted(r.request_id for r in rows) == [f"r{i}" for i in range(5)]


def test_who_sent_it_reaches_the_row(receiver: OtlpReceiver) -> None:  # noqa: F811
    """The key (by its alias), team, user, end user and the model asked for travel as the decision's attributes;
    what was not said is ''."""
    recorder = DecisionRecorder(f"{receiver.url}/v1/traces", gateway="edge")
    recorder.record(lane="fast", start_s=time.time(), model="tiny-lora", key="alpha-key", team="alpha", user="ann",
                    end_user="customer-7")
    recorder.record(lane="fast", start_s=time.time(), team="beta")
    assert recorder.flush(10)
    recorder.close()
    rows = [r for r in drain(receiver) if isinstance(r, GatewayDecision)]
    assert sorted((r.model, r.key, r.team, r.user, r.end_user) for r in rows) == [
        ("", "", "beta", "", ""), ("tiny-lora", "alpha-key", "alpha", "ann", "customer-7")]
