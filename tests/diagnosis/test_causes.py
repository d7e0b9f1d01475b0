"""One cause, one finding: symptoms fold into the cause that explains them, with their figures kept."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from stepline.diagnosis.causes import SYMPTOM_EVIDENCE, merge
from stepline.diagnosis.findings import Finding
from tests.diagnosis.test_detectors import T0


def finding(kind: str, severity: str = "warning", score: float = 1.0, engine: str = "e0", start_s: float = 0.0,
            end_s: float = 120.0, **evidence: Any) -> Finding:
    return Finding(kind, severity, engine, T0 + timedelta(seconds=start_s), T0 + timedelta(seconds=end_s),
                   f"{kind} title", evidence, score=score)


def test_head_of_line_blocking_is_told_under_its_prefill_with_both_impacts() -> None:
    prefill = finding("prefill_interference", "critical", 100.0, request_id="monster", chunk_tokens=8192)
    queued = finding("head_of_line_blocking", "warning", 40.0, request_id="monster", queued_requests=20)
    [merged] = merge([queued, prefill])
    assert (merged.kind, merged.severity, merged.score) == ("prefill_interference", "critical", 140.0)
    assert merged.evidence["chunk_tokens"] == 8192
    [symptom] = merged.evidence["symptoms"]
    assert symptom == {"kind": "head_of_line_blocking", "severity": "warning", "title": "head_of_line_blocking title",
                       "request_s": 40.0, "request_id": "monster", "queued_requests": 20}


def test_the_graver_of_a_prefills_two_findings_tells_it() -> None:
    # The queue did more damage than the decode slowdown: the prefill is told as head-of-line blocking.
    prefill = finding("prefill_interference", "warning", 10.0, request_id="monster")
    queued = finding("head_of_line_blocking", "warning", 40.0, request_id="monster")
    [merged] = merge([prefill, queued])
    assert (merged.kind, merged.score) == ("head_of_line_blocking", 50.0)
    assert [s["kind"] for s in merged.evidence["symptoms"]] == ["prefill_interference"]


def test_findings_of_other_requests_engines_or_times_stay_apart() -> None:
    prefill = finding("prefill_interference", request_id="monster")
    others = [finding("head_of_line_blocking", request_id="another"),
              finding("head_of_line_blocking", engine="e1", request_id="monster"),
              finding("head_of_line_blocking", start_s=200.0, end_s=300.0, request_id="monster")]
    assert len(merge([prefill, *others])) == 4


def test_a_slow_decode_rate_is_evidence_of_its_cause_not_more_damage() -> None:
    throttled = finding("gpu_throttling", "warning", 30.0)
    slow = finding("scheduler_vs_hardware", "info", 0.0, alone_tok_s="90..110 (p50 100.0)")
    [merged] = merge([slow, throttled])
    assert (merged.kind, merged.score) == ("gpu_throttling", 30.0)
    assert merged.evidence["symptoms"][0]["alone_tok_s"] == "90..110 (p50 100.0)"


def test_what_a_symptom_carried_moves_with_it_to_the_deepest_cause() -> None:
    # The slow decode rate folds into the queue (the larger), then the queue, with it, into its graver prefill.
    slow = finding("scheduler_vs_hardware", "info", 0.0)
    queued = finding("head_of_line_blocking", "warning", 40.0, request_id="monster")
    prefill = finding("prefill_interference", "critical", 10.0, request_id="monster")
    [merged] = merge([slow, queued, prefill])
    assert (merged.kind, merged.score) == ("prefill_interference", 50.0)
    assert [s["kind"] for s in merged.evidence["symptoms"]] == ["head_of_line_blocking", "scheduler_vs_hardware"]


def test_of_several_explaining_causes_the_largest_takes_the_symptom() -> None:
    small = finding("prefill_interference", "warning", 5.0, request_id="monster")
    large = finding("gpu_throttling", "warning", 50.0)
    slow = finding("legitimately_slow", "info", 0.0)
    merged = merge([small, slow, large])
    assert [(f.kind, len(f.evidence.get("symptoms", []))) for f in merged] == [
        ("gpu_throttling", 1), ("prefill_interference", 0)]


def test_a_symptom_keeps_its_first_evidence_items_only() -> None:
    evidence: dict[str, Any] = {f"figure_{i}": i for i in range(SYMPTOM_EVIDENCE + 3)}
    [merged] = merge([finding("kv_pressure", "critical", 9.0), finding("overload", "warning", 1.0, **evidence)])
    symptom = merged.evidence["symptoms"][0]
    assert [k for k in symptom if k.startswith("figure_")] == [f"figure_{i}" for i in range(SYMPTOM_EVIDENCE)]


def test_the_result_is_ranked_by_severity_then_score() -> None:
    merged = merge([finding("gpu_xid", "critical", 1.0), finding("kv_pressure", "critical", 9.0),
                    finding("prefix_cache_collapse", "warning", 99.0), finding("config_not_in_effect", "info", 500.0)])
    assert [f.kind for f in merged] == ["kv_pressure", "gpu_xid", "prefix_cache_collapse", "config_not_in_effect"]
