"""One cause, one finding: findings that describe the same requests and window merge under their cause.

A long prefill both slows the decoders beside it (prefill_interference) and queues the requests that arrive
during it (head_of_line_blocking): one cause, told once, as the prefill's own finding with the queued requests'
request-seconds added to its impact (head-of-line blocking stands alone where no decoder was slowed).
A slow decode rate under load (scheduler_vs_hardware) is what every cause of the same engine and time looks like
from the requests' side: it becomes evidence of the cause it overlaps. The symptom's figures stay, attached to
the cause's evidence under `symptoms`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from stepline.diagnosis.findings import SEVERITIES, Finding

# symptom kind -> the kinds that explain it when they cover the same engine and time
EXPLAINED_BY: dict[str, tuple[str, ...]] = {
    # The requests queued behind a prefill are that prefill's doing: its finding counts them too.
    "head_of_line_blocking": ("prefill_interference",),
    "scheduler_vs_hardware": ("prefill_interference", "head_of_line_blocking", "overload", "gpu_throttling",
                              "kv_pressure", "wedged_engine"),
    "legitimately_slow": ("prefill_interference", "head_of_line_blocking", "overload", "gpu_throttling"),
    "overload": ("gpu_throttling",),
}
# Symptoms whose lost request-seconds are the cause's too (requests the cause's own figures do not count).
ADDS_IMPACT = ("head_of_line_blocking",)
# Evidence items a symptom keeps inside its cause's evidence.
SYMPTOM_EVIDENCE = 6


def _explains(cause: Finding, symptom: Finding) -> bool:
    """Whether `cause` is what `symptom` shows: an explaining kind, same engine and time, and the same request."""
    if cause.kind not in EXPLAINED_BY.get(symptom.kind, ()) or cause.engine != symptom.engine:
        return False
    if not (cause.start <= symptom.end and symptom.start <= cause.end):
        return False
    ours, theirs = cause.evidence.get("request_id"), symptom.evidence.get("request_id")
    return not (ours and theirs and ours != theirs)


def _symptom(f: Finding) -> dict[str, Any]:
    return {"kind": f.kind, "severity": f.severity, "title": f.title, "request_s": round(f.score, 1),
            **dict(list(f.evidence.items())[:SYMPTOM_EVIDENCE])}


def merge(findings: Sequence[Finding]) -> list[Finding]:
    """The findings with each symptom folded into the cause that explains it (the largest, when several do);
    the cause keeps the graver severity, and adds the symptom's request-seconds where they are its own; ranked."""
    # A symptom may explain another (head-of-line blocking explains a slow decode rate): fold the deepest first,
    # so that what a symptom carried moves with it.
    order = {kind: depth for depth, kind in enumerate(("scheduler_vs_hardware", "legitimately_slow", "overload",
                                                       "head_of_line_blocking"))}
    kept = sorted(findings, key=lambda f: -f.score)
    for kind in sorted(EXPLAINED_BY, key=lambda k: order.get(k, len(order))):
        for s in [f for f in kept if f.kind == kind]:
            cause = next((c for c in kept if c is not s and _explains(c, s)), None)
            if cause is None:
                continue
            evidence = {**cause.evidence, "symptoms": [*cause.evidence.get("symptoms", []), _symptom(s),
                                                       *s.evidence.get("symptoms", [])]}
            grave = s.kind in ADDS_IMPACT
            severity = max(cause.severity, s.severity, key=SEVERITIES.index) if grave else cause.severity
            merged = replace(cause, severity=severity, evidence=evidence,
                             score=cause.score + (s.score if grave else 0.0))
            kept = [merged if f is cause else f for f in kept if f is not s]
    return sorted(kept, key=Finding.rank_key)
