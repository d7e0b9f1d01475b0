"""GPU throttling: clocks held below the GPU's own maximum for a throttle reason, and what it cost the steps.

Judged on the GPU's figures, whatever the load: the throttled samples' SM clock against the GPU's maximum (its
model's boost clock, or the highest clock it reported, whichever is higher) and NVML's throttle reasons. The
cost is read like for like: decode-only steps of the same batch shape, throttled against not; when every step
was throttled (a cap across the whole window) the clock ratio is the slowdown, said so in the evidence.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from stepline.diagnosis.baseline import CLOCK_DROP, THROTTLED_SHARE
from stepline.diagnosis.common import EXACT_MAX_STEPS, clip, engines, number, utc, window_summary
from stepline.diagnosis.findings import Finding, Window
from stepline.diagnosis.rollup import Agg, rolled
from stepline.model.schema import (
    BUSY_GPU_PCT,
    CLOCK_EVENT_FLAGS,
    GPU_THROTTLING,
    THROTTLE_FLAGS,
    timeline_sql,
)
from stepline.queries.query import Query, moment, param
from stepline.queries.window import EACH_ENGINE, IN_WINDOW, between
from stepline.store.reads import Reads

# NVIDIA's maximum (boost) SM clock per model, MHz: the figure a throttled clock is compared with when the GPU
# never reported its own maximum in the window. Matched by substring of NVML's name, first match wins.
MAX_SM_MHZ: tuple[tuple[str, float], ...] = (
    ("H200", 1980.0), ("H100 PCIe", 1755.0), ("H100", 1980.0), ("H800", 1980.0), ("GH200", 1980.0),
    ("B200", 1965.0), ("A100", 1410.0), ("A800", 1410.0), ("L40S", 2520.0), ("L40", 2490.0), ("L4", 2040.0),
    ("A10G", 1710.0), ("A10", 1695.0),
)
MIN_MATCHED_STEPS = 5  # per batch shape and side, for a like-for-like step-time ratio

# Per engine over the window, from the throttling projection (schema.GPU_THROTTLING, in that order): the rows at
# the window's edges, whole minutes in between.
_GPU_AGGS = tuple(Agg(alias, inner, outer) for alias, inner, outer in zip(
    ("gpu_name", "sm_mhz_max_seen", "busy_samples", "throttled_samples", "sm_mhz_throttled_sum",
     "sm_mhz_unthrottled_sum", "reason_bits", "first_throttled", "last_throttled"),
    GPU_THROTTLING,
    ("any({})", "max({})", "sum({})", "sum({})", "sum({})", "sum({})", "groupBitOr({})", "min({})", "max({})"),
    strict=True))
# What a finding shows: the same figures read from the samples.
_GPU = f"""
SELECT engine, {", ".join(GPU_THROTTLING)}
FROM gpu_samples
WHERE {EACH_ENGINE} AND {IN_WINDOW}
GROUP BY engine ORDER BY engine
"""

_GPU_WINDOW = f" AND ts >= {moment('start')} - INTERVAL 10 SECOND AND ts <= {moment('end')}"
_TIMELINE = timeline_sql(
    "", f" AND s.engine = {param('engine', 'String')} AND {between(column='s.ts')} "
        f"AND s.step % {param('every', 'UInt64')} = 0",
    f"{_GPU_WINDOW} AND (host, gpu_index) GLOBAL IN (SELECT host, gpu_index FROM gpu_samples "
    f"WHERE engine = {param('engine', 'String')}{_GPU_WINDOW})")
# Decode-only steps by batch shape (decoding requests in steps of ~19%: round(4 * log2)), throttled or not, and
# what every throttled step held up: its time times the requests decoding or waiting through it.
_MATCHED = f"""
SELECT throttled, shape, countIf(prefill_tokens = 0) AS decode_steps,
       quantileExactIf(0.5)(elapsed_ms, prefill_tokens = 0) AS step_p50_ms,
       sum(elapsed_ms * (decoding + waiting)) / 1000 AS request_s
FROM (SELECT elapsed_ms, prefill_tokens, decoding, waiting, round(4 * log2(greatest(decoding, 1))) AS shape,
             hasAny(clock_event_flags, {param('flags', 'Array(String)')}) AS throttled
      FROM ({_TIMELINE})
      WHERE gpu_ts > 0 AND decoding > 0)
GROUP BY throttled, shape ORDER BY throttled, shape
"""


def max_sm_mhz(gpu_name: str, seen: float) -> tuple[float, str]:
    """The GPU's maximum SM clock and where it came from: its model's boost clock or what it reported."""
    rated = next((mhz for model, mhz in MAX_SM_MHZ if model in gpu_name), 0.0)
    if rated >= seen and rated > 0:
        return rated, f"{gpu_name} boost clock"
    return seen, "highest SM clock reported in the window"


def matched_slowdown(rows: Iterable[tuple[Any, ...]]) -> tuple[float | None, int, float]:
    """Throttled over unthrottled decode-only step p50, geometric mean over the batch shapes both sides ran
    (weighted by throttled steps); the steps compared; and the request-seconds throttled steps held up."""
    sides: dict[tuple[bool, int], tuple[int, float]] = {}
    held = 0.0
    for throttled, shape, n, p50, request_s in rows:
        sides[bool(throttled), int(shape)] = (int(n), number(p50))
        if throttled:
            held += number(request_s)
    logs, weights = 0.0, 0
    for (throttled, shape), (n, p50) in sides.items():
        free = sides.get((False, shape))
        if not throttled or free is None or min(n, free[0]) < MIN_MATCHED_STEPS or p50 <= 0 or free[1] <= 0:
            continue
        logs += n * math.log(p50 / free[1])
        weights += n
    return (math.exp(logs / weights) if weights else None), weights, held


def gpu_throttling(reader: Reads, window: Window) -> list[Finding]:
    """GPUs serving the engine ran throttled, clocks well below their maximum, for a share of the window."""
    findings: list[Finding] = []
    sql, bounds = rolled(_GPU_AGGS, EACH_ENGINE, window.start, window.end, table="gpu_samples")
    gpus = {str(r.engine): r for r in Query(sql, engine=window.engine, **bounds).rows(reader)}
    summary = window_summary(reader, window)
    for engine in engines(reader, window):
        if engine not in gpus:
            continue
        g = gpus[engine]
        name, seen, busy, throttled, throttled_sum, free_sum, bits, first, last = (
            g.gpu_name, g.sm_mhz_max_seen, g.busy_samples, g.throttled_samples, g.sm_mhz_throttled_sum,
            g.sm_mhz_unthrottled_sum, g.reason_bits, g.first_throttled, g.last_throttled)
        if not throttled or not busy:
            continue
        mhz_throttled = number(throttled_sum) / int(throttled)
        mhz_free = number(free_sum) / (int(busy) - int(throttled)) if int(busy) > int(throttled) else 0.0
        reasons = [flag for bit, flag in CLOCK_EVENT_FLAGS if int(bits) & bit]
        top_mhz, top_from = max_sm_mhz(str(name), number(seen))
        share, ratio = int(throttled) / int(busy), mhz_throttled / top_mhz if top_mhz > 0 else 1.0
        if share < THROTTLED_SHARE or ratio > 1 - CLOCK_DROP:
            continue
        every = max(1, math.ceil(int(summary.get(engine, {}).get("steps") or 0) / EXACT_MAX_STEPS))
        matched_q = Query(_MATCHED, engine=engine, start=window.start, end=window.end, every=every,
                          flags=list(THROTTLE_FLAGS))
        slowdown, compared, held = matched_slowdown(matched_q.rows(reader))
        from_clock = slowdown is None
        expected = 1 / max(ratio, 0.05)
        slowdown = expected if slowdown is None else slowdown
        lost = held * every * max(0.0, 1 - 1 / slowdown) if slowdown > 0 else 0.0
        evidence: dict[str, Any] = {
            "sm_mhz_throttled": round(mhz_throttled), "sm_mhz_max": round(top_mhz), "sm_mhz_max_from": top_from,
            "clock_share_of_max": f"{ratio:.0%} (throttling from {1 - CLOCK_DROP:.0%} of max down)",
            "throttled_share_busy_samples": f"{share:.0%} of {busy} (from {THROTTLED_SHARE:.0%})",
            "reasons": list(reasons),
            "step_slowdown": f"{slowdown:.2f}x " + (
                "(from the clock ratio: no unthrottled steps to compare with)" if from_clock else
                f"(decode-only steps of the same batch shape, {compared} throttled steps compared)"),
            "request_s_lost": round(lost, 1),
            "sm_mhz_unthrottled": round(mhz_free) if mhz_free > 0 else None,
            "busy_from_util_pct": BUSY_GPU_PCT,
        }
        if every > 1:
            evidence["steps_compared"] = f"one step in {every} (by step number)"
        findings.append(Finding(
            "gpu_throttling", "warning", engine, utc(first), utc(last),
            clip(f"GPU throttled ({', '.join(reasons) or 'clock events'}): SM {mhz_throttled:.0f} of "
                 f"{top_mhz:.0f} MHz, steps {slowdown:.1f}x slower"),
            evidence, Query(_GPU, engine=engine, start=window.start, end=window.end).literal(),
            "the GPUs throttle (power cap / thermal): check power limits, cooling and clocks "
            "(nvidia-smi -q -d PERFORMANCE) before touching the scheduler", lost))
    return findings
