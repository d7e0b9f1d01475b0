"""Scheduling or silicon: decode rates under load against the engine alone, GPU throttling, XID errors."""

from __future__ import annotations

from stepline.diagnosis.common import Query, clip, engines, hms, number, utc
from stepline.diagnosis.findings import Finding, Window
from stepline.summary import Reads

LOAD_SLOWDOWN = 5.0  # alone rate over loaded rate before decode is called starved
CLOCK_DROP = 0.10
THROTTLE_FLAGS = ("sw_power_cap", "hw_slowdown", "hw_thermal_slowdown", "sw_thermal_slowdown",
                  "hw_power_brake_slowdown")

_BANDS = """
SELECT multiIf(prompt_tokens < 1024, '< 1k', prompt_tokens < 8192, '1k-8k', prompt_tokens < 32768, '8k-32k',
               prompt_tokens < 100000, '32k-100k', '>= 100k') AS band,
       min(prompt_tokens) AS lo, count() AS n,
       quantileExact(0.01)(1 / mean_tpot_seconds) AS rate_p1, quantileExact(0.5)(1 / mean_tpot_seconds) AS rate_p50
FROM requests
WHERE engine = {engine:String} AND ts >= {start:DateTime64(6)} AND ts <= {end:DateTime64(6)}
  AND mean_tpot_seconds > 0 AND isFinite(mean_tpot_seconds) AND generation_tokens > 1
GROUP BY band ORDER BY lo
"""

# Few decoders and no prefill: what one request gets from this engine with nobody in its way.
_ALONE = """
SELECT count() AS steps, quantilesExact(0.1, 0.5, 0.9)(1000 / elapsed_ms) AS rate, quantileExact(0.5)(elapsed_ms)
FROM steps
WHERE engine = {engine:String} AND ts >= {start:DateTime64(6)} AND ts <= {end:DateTime64(6)}
  AND num_ctx_tokens = 0 AND num_generation_requests BETWEEN 1 AND 4 AND elapsed_ms > 0
"""

_GPU_DURING = """
SELECT elapsed_ms > {slow_ms:Float64} AS slow, count() AS n, quantileExact(0.5)(elapsed_ms) AS step_p50_ms,
       avg(sm_clock_mhz) AS sm_mhz, avg(power_w) AS power_w,
       countIf(hasAny(clock_event_flags, {flags:Array(String)})) / count() AS throttled_share,
       arrayDistinct(arrayFlatten(groupArray(clock_event_flags))) AS flags
FROM timeline
WHERE engine = {engine:String} AND ts >= {start:DateTime64(6)} AND ts <= {end:DateTime64(6)} AND gpu_ts > 0
GROUP BY slow ORDER BY slow
"""


# Like for like: decode-only steps of a similar batch, throttled against not. Under open-loop load the batch
# grows as steps slow, so comparing against every fast step would always blame the scheduler.
_MATCHED = """
WITH base AS (
    SELECT elapsed_ms, sm_clock_mhz, decoding, hasAny(clock_event_flags, {flags:Array(String)}) AS throttled
    FROM timeline
    WHERE engine = {engine:String} AND ts >= {start:DateTime64(6)} AND ts <= {end:DateTime64(6)} AND gpu_ts > 0
      AND prefill_tokens = 0 AND decoding > 0
),
band AS (SELECT quantileExact(0.5)(decoding) AS mid FROM base WHERE throttled)
SELECT throttled, count() AS n, quantileExact(0.5)(elapsed_ms) AS step_p50_ms, avg(sm_clock_mhz) AS sm_mhz
FROM base
WHERE decoding BETWEEN (SELECT mid FROM band) * 0.7 AND (SELECT mid FROM band) * 1.3
GROUP BY throttled ORDER BY throttled
"""
MATCHED_MIN_STEPS = 20


def _clock_explains(reader: Reads, engine: str, window: Window) -> tuple[bool, dict[str, object]]:
    """Whether throttled decode-only steps are slower than unthrottled ones of the same batch by what the clock lost."""
    rows = {bool(r[0]): r for r in Query(_MATCHED, engine=engine, start=window.start, end=window.end,
                                         flags=list(THROTTLE_FLAGS)).rows(reader)}
    if True not in rows or False not in rows or min(int(rows[True][1]), int(rows[False][1])) < MATCHED_MIN_STEPS:
        return False, {}
    throttled, free = rows[True], rows[False]
    drop = 1 - number(throttled[3]) / number(free[3], 1e-9)
    slowdown = number(throttled[2]) / number(free[2], 1e-9)
    evidence: dict[str, object] = {"matched_clock_drop": round(drop, 3), "matched_step_slowdown": round(slowdown, 2),
                                   "matched_steps": f"{throttled[1]} throttled vs {free[1]} not, same batch size"}
    # A clock drop explains a slowdown up to about its own ratio (with slack for memory stalls).
    return drop > CLOCK_DROP and 1.2 <= slowdown <= 2 / max(1 - drop, 0.05), evidence


def scheduler_vs_hardware(reader: Reads, window: Window) -> list[Finding]:
    """Per prompt band, decode rates under load against the engine alone; GPU counters say whether silicon slowed."""
    findings = []
    for engine in engines(reader, window):
        alone_q = Query(_ALONE, engine=engine, start=window.start, end=window.end)
        alone = alone_q.rows(reader)
        if not alone or int(alone[0][0]) < 20:
            continue  # without quiet steps there is nothing to compare with
        alone_lo, alone_mid, alone_hi = (number(v) for v in alone[0][1])
        alone_step_ms = number(alone[0][2])
        bands_q = Query(_BANDS, engine=engine, start=window.start, end=window.end)
        bands = bands_q.rows(reader)
        if not bands:
            continue
        worst = min(bands, key=lambda b: number(b[4], 1e9))
        if number(worst[4], 1e9) * LOAD_SLOWDOWN > alone_mid:
            continue
        by_band = {str(b[0]): f"{number(b[3]):.1f}..{number(b[4]):.1f} tok/s (p1..p50, {b[2]} req)" for b in bands}
        gpu_q = Query(_GPU_DURING, engine=engine, start=window.start, end=window.end,
                      slow_ms=LOAD_SLOWDOWN * alone_step_ms, flags=list(THROTTLE_FLAGS))
        gpu = {bool(r[0]): r for r in gpu_q.rows(reader)}
        evidence: dict[str, object] = {
            "alone_tok_s": f"{alone_lo:.1f}..{alone_hi:.1f} (p50 {alone_mid:.1f})", "under_load_by_band": by_band,
            "alone_from": "steps without prefill and 1-4 decoding requests: 1000 / elapsed_ms"}
        hardware = False
        if True in gpu and False in gpu:
            fast, slow = gpu[False], gpu[True]
            drop = 1 - number(slow[3]) / number(fast[3], 1e-9)
            slowdown = number(slow[2]) / number(fast[2], 1e-9)
            evidence.update({"sm_mhz_fast_steps": round(number(fast[3])), "sm_mhz_slow_steps": round(number(slow[3])),
                             "clock_drop": round(drop, 3), "step_slowdown": round(slowdown, 1),
                             "throttled_share_slow_steps": round(number(slow[5]), 2),
                             "clock_flags_slow_steps": list(slow[6])})
            # A clock drop explains at most its own ratio of slowdown (with slack for memory stalls); failing that,
            # like-for-like steps decide.
            hardware = drop > CLOCK_DROP and number(slow[5]) > 0.5 and slowdown <= 2 / max(1 - drop, 0.05)
            if not hardware and drop > CLOCK_DROP and number(slow[5]) > 0.5:
                hardware, matched = _clock_explains(reader, engine, window)
                evidence.update(matched)
        rate = f"{number(worst[3]):.1f}..{number(worst[4]):.1f}"
        if hardware:
            findings.append(Finding(
                "gpu_throttling", "warning", engine, window.start, window.end,
                clip(f"{rate} tok/s under load vs {alone_mid:.0f} alone: GPU clocks fell "
                     f"{number(evidence['clock_drop']):.0%}"),
                evidence, gpu_q.literal(), "the GPUs throttle (power cap / thermal): check power limits, cooling "
                "and clocks (nvidia-smi -q -d PERFORMANCE) before touching the scheduler", alone_mid / max(
                    number(worst[4]), 1e-3)))
        else:
            findings.append(Finding(
                "scheduler_vs_hardware", "warning", engine, window.start, window.end,
                clip(f"{rate} tok/s under load ({worst[0]}) vs {alone_mid:.0f} alone: scheduling, not roofline"),
                evidence, bands_q.literal(),
                "the GPU can decode faster than requests get: the scheduler shares steps with prefill or too many "
                "sequences; see prefill_interference and head_of_line_blocking findings",
                alone_mid / max(number(worst[4]), 1e-3)))
    return findings


_XID = """
SELECT e.ts, e.message, e.attributes['xid'] AS xid,
       (SELECT count() FROM steps WHERE engine = {engine:String} AND elapsed_ms > {slow_ms:Float64}
            AND ts >= {start:DateTime64(6)} AND ts <= {end:DateTime64(6)}) AS slow_steps_in_window
FROM events AS e
WHERE e.kind = 'gpu_xid' AND (e.engine = {engine:String} OR e.engine = '')
  AND e.ts >= {start:DateTime64(6)} AND e.ts <= {end:DateTime64(6)}
ORDER BY e.ts
"""


def gpu_xid(reader: Reads, window: Window) -> list[Finding]:
    """GPU XID errors: the driver saw the hardware fail; always critical."""
    findings = []
    for engine in engines(reader, window):
        query = Query(_XID, engine=engine, start=window.start, end=window.end, slow_ms=1000.0)
        rows = query.rows(reader)
        if not rows:
            continue
        xids = sorted({str(r[2]) for r in rows if r[2]})
        findings.append(Finding(
            "gpu_xid", "critical", engine, utc(rows[0][0]), utc(rows[-1][0]),
            clip(f"{len(rows)} GPU XID error(s) {', '.join(xids)} from {hms(rows[0][0])}"),
            {"xid_events": len(rows), "xids": xids, "first_message": str(rows[0][1])[:200],
             "slow_steps_over_1s_in_window": int(rows[0][3])},
            query.literal(), "check the XID in NVIDIA's table; drain and reset or replace the GPU", float(len(rows))))
    return findings
