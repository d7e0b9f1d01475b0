"""Finding and Window: what a detector returns, ranked by severity then score, and its JSON."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest

from stepline.diagnosis.findings import SEVERITIES, Finding, Window

T0 = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)


def _finding(severity: str, score: float = 0.0, kind: str = "prefill_interference") -> Finding:
    return Finding(kind, severity, "vllm-0", T0, T0 + timedelta(seconds=30), f"{kind} ({severity})", score=score)


def test_findings_rank_by_severity_then_larger_score() -> None:
    found = [_finding("info", 99.0), _finding("warning", 1.0), _finding("critical", 0.5), _finding("warning", 7.0)]
    ranked = sorted(found, key=Finding.rank_key)
    assert [(f.severity, f.score) for f in ranked] == [("critical", 0.5), ("warning", 7.0), ("warning", 1.0),
                                                       ("info", 99.0)]
    assert SEVERITIES == ("info", "warning", "critical")


def test_an_unknown_severity_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="got 'page'"):
        _finding("page")


def test_as_json_is_plain_json_with_utc_times() -> None:
    f = Finding("wedged_engine", "critical", "vllm-0", T0, T0 + timedelta(minutes=2), "no step for 120 s",
                evidence={"seconds_without_step": 120.0}, sql="SELECT 1", lever="restart the engine", score=3.0)
    answer = json.loads(json.dumps(f.as_json()))
    assert answer == {"kind": "wedged_engine", "severity": "critical", "engine": "vllm-0",
                      "start": "2026-12-06T12:00:00+00:00", "end": "2026-12-06T12:02:00+00:00",
                      "title": "no step for 120 s", "evidence": {"seconds_without_step": 120.0}, "sql": "SELECT 1",
                      "lever": "restart the engine", "score": 3.0}


def test_a_window_without_an_engine_means_every_engine() -> None:
    window = Window(T0, T0 + timedelta(minutes=5))
    assert window.engine == "" and window.end - window.start == timedelta(minutes=5)
