"""How a time-to-truth run is judged, from its polls and pages: when the top finding and the watchdog first named
the cause, what wrong findings came first, which page named it, and the false alarms of a run with nothing injected
(the runs themselves, live: tests/e2e/test_time_to_truth.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from stepline.drills.timetotruth import CAUSE_ALERTS, LiveResult, Poll

ONSET = 1000.0


def _poll(at: float, top: tuple[str, str, str, str] | None = None, watchdog: str | None = None) -> Poll:
    return Poll(at, top, 0.25, "progressing", watchdog)


def _page(name: str, severity: str, received: float, description: str = "", engine: str = "e1",
          status: str = "firing") -> dict[str, Any]:
    return {"labels": {"alertname": name, "severity": severity, "engine": engine}, "status": status,
            "annotations": {"description": description}, "received": received}


def _result(polls: list[Poll], pages: Sequence[dict[str, Any]] = (), truth: str | None = "wedged_engine"
            ) -> LiveResult:
    return LiveResult("wedge", "a wedge", truth, "e1", ONSET if truth else None, polls, list(pages))


def test_the_first_correct_finding_is_the_causes_on_its_engine_after_the_onset() -> None:
    right = ("critical", "wedged_engine", "e1", "no step for 12 s")
    result = _result([_poll(990.0, right), _poll(1002.0, ("warning", "kv_pressure", "e1", "KV full")),
                      _poll(1004.0, ("critical", "wedged_engine", "e2", "other engine")), _poll(1006.0, right),
                      _poll(1008.0, watchdog="critical wedged_engine: no step")])
    assert result.first_correct() == 1006.0 and result.since_onset(result.first_correct()) == 6.0
    assert result.first_watchdog() == 1008.0
    # The cause named before its onset is not a wrong finding, only not yet the truth's.
    assert result.wrong_before() == ["warning kv_pressure@e1", "critical wedged_engine@e2"]
    assert result.diagnose_seconds() == [0.25] * 5 and result.since_onset(None) is None


def test_the_first_page_is_the_earliest_firing_alert_of_the_engine_that_names_the_cause() -> None:
    pages = [_page("HighQueue", "warning", 1003.0, "top finding: warning kv_pressure: KV full"),
             _page("EngineStalled", "critical", 1009.0, "top finding: critical wedged_engine: no step"),
             _page(CAUSE_ALERTS["wedged_engine"], "critical", 1012.0),
             _page("EngineStalled", "critical", 1001.0, engine="e2"),
             _page("Heartbeat", "none", 1000.5)]
    result = _result([], pages)
    assert [a["labels"]["alertname"] for a in result.firing()] == ["HighQueue", "EngineStalled",
                                                                    "EngineWedgedWithQueue"]
    first = result.first_page()
    assert first is not None and first["received"] == 1009.0
    assert result.names_cause(pages[2])  # the cause's own alert names it whatever its text


def test_a_run_with_nothing_injected_counts_every_alarming_finding_as_false() -> None:
    polls = [_poll(1.0, ("warning", "kv_pressure", "e1", "t")), _poll(2.0, ("info", "load", "e1", "t")),
             _poll(3.0, ("warning", "kv_pressure", "e1", "t"))]
    healthy = _result(polls, truth=None)
    assert healthy.false_findings() == ["warning kv_pressure@e1"] and healthy.first_correct() is None
    assert _result(polls).false_findings() == []  # a run with a cause has wrong findings, not false alarms
