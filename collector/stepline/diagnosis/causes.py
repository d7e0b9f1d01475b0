"""One cause, one finding: findings that describe the same requests and window merge under their cause.

A long prefill both slows the decoders beside it (prefill_interference) and queues the requests that arrive
during it (head_of_line_blocking): one cause, told once, under whichever of the two ranks first (graver, then more
request-seconds lost), with both impacts summed.
A slow decode rate under load (scheduler_vs_hardware) is what every cause of the same engine and time looks like
from the requests' side: it becomes evidence of the cause it overlaps. The symptom's figures stay, attached to
the cause's evidence under `symptoms`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from stepline.diagnosis.findings import Finding

# symptom kind -> the kinds that explain it when they cover the same engine and time
EXPLAINED_BY: dict[str, tuple[str, ...]] = {
    # The requests queued behind a prefill are that prefill's doing: its finding counts them too.
    "head_of_line_blocking": ("prefill_interference", "lane_leak", "gateway_fail_open"),
    # A monster the gateway sent to the fast lane (under a bar in the wrong unit, or unmeasured by a hook that failed
    # open) prefills there: the gateway is the cause, the prefill its symptom.
    "prefill_interference": ("lane_leak", "gateway_fail_open"),
    "scheduler_vs_hardware": ("prefill_interference", "head_of_line_blocking", "overload", "gpu_throttling",
                              "kv_pressure", "wedged_engine"),
    "legitimately_slow": ("prefill_interference", "head_of_line_blocking", "overload", "gpu_throttling"),
    # A full KV cache caps what the engine admits: its queue is the cache's doing, not the arrivals'.
    "overload": ("gpu_throttling", "kv_pressure", "wedged_engine"),
}
# Symptoms whose lost request-seconds are the cause's too (requests the cause's own figures do not count).
# (symptom kind -> cause kinds): a prefill's queue and its slowed decoders are one cause's two impacts.
ADDS_IMPACT = {"head_of_line_blocking": ("prefill_interference",)}
# Evidence items a symptom keeps inside its cause's evidence.
SYMPTOM_EVIDENCE = 6


def _explains(cause: Finding, symptom: Finding) -> bool:
    """Whether `cause` is what `symptom` shows: an explaining kind, same engine and time, and the same request."""
    if cause.kind not in EXPLAINED_BY.get(symptom.kind, ()) or cause.engine != symptom.engine:
        return False
    if not (cause.start <= symptom.end and symptom.start <= cause.end):
        return False
    ours, theirs = cause.evidence.get("request_id"), symptom.evidence.get("request_id")
    if "request_ids" in cause.evidence:  # a cause of several requests (lane_leak) explains only its own
        return bool(theirs) and theirs in cause.evidence["request_ids"]
    return not (ours and theirs and ours != theirs)


def _symptom(f: Finding) -> dict[str, Any]:
    return {"kind": f.kind, "severity": f.severity, "title": f.title, "request_s": round(f.score, 1),
            **dict(list(f.evidence.items())[:SYMPTOM_EVIDENCE])}


def _fold(cause: Finding, symptom: Finding) -> Finding:
    """One finding of the two. A symptom whose request-seconds are the cause's too (one prefill's two findings)
    is told under whichever of the two ranks first (graver, then more request-seconds), the impact summed."""
    own = cause.kind in ADDS_IMPACT.get(symptom.kind, ())
    first, second = (symptom, cause) if own and symptom.rank_key() < cause.rank_key() else (cause, symptom)
    evidence = {**first.evidence, "symptoms": [*first.evidence.get("symptoms", []), _symptom(second),
                                               *second.evidence.get("symptoms", [])]}
    return replace(first, evidence=evidence, score=first.score + (second.score if own else 0.0))


def merge(findings: Sequence[Finding]) -> list[Finding]:
    """The findings with each symptom folded into the cause that explains it (the largest, when several do), ranked."""
    # A symptom may explain another (head-of-line blocking explains a slow decode rate): fold the deepest first,
    # so that what a symptom carried moves with it.
    order = {kind: depth for depth, kind in enumerate(("scheduler_vs_hardware", "legitimately_slow", "overload",
                                                       "head_of_line_blocking"))}
    kept = sorted(findings, key=lambda f: -f.score)
    # A fold may leave a symptom under its own kind (a prefill's queue told under head-of-line blocking) that a
    # deeper cause explains (the gateway that sent the prefill there): fold again until nothing moves.
    folded = True
    while folded:
        folded = False
        for kind in sorted(EXPLAINED_BY, key=lambda k: order.get(k, len(order))):
            for s in [f for f in kept if f.kind == kind]:
                cause = next((c for c in kept if c is not s and _explains(c, s)), None)
                if cause is None:
                    continue
                merged = _fold(cause, s)
                kept = [merged if f is cause else f for f in kept if f is not s]
                folded = True
    return sorted(kept, key=Finding.rank_key)
