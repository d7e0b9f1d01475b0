"""Scheduling or silicon: decode rates under load against the engine alone, GPU throttling, XID errors."""

from __future__ import annotations

import math
from typing import Any

from stepline.diagnosis.baseline import NO_BASELINE, SLOW_STEP, baselines
from stepline.diagnosis.common import (
    clip,
    engines,
    exact_and_approximate,
    hms,
    number,
    utc,
    window_summary,
)
from stepline.diagnosis.findings import Finding, Window
from stepline.diagnosis.rollup import Span, approximate_rows, approximate_span, whole_minutes
from stepline.model.schema import DECODED, PROMPT_BAND_INDEX, PROMPT_BANDS
from stepline.queries.baselines import ALONE_APPROXIMATE, ALONE_EXACT, ALONE_TOKENS_PER_STEP
from stepline.queries.query import Query, moment, param
from stepline.queries.requests import MERGED, PROMPT_BAND
from stepline.queries.steps import OF_ENGINE, OF_ENGINES
from stepline.queries.window import EACH_ENGINE, ENGINE, ENGINES, IN_WINDOW, between
from stepline.store.reads import Reads

LOAD_SLOWDOWN = 5.0  # alone rate over loaded rate before decode is called starved

# One quantilesExact for both levels (two quantileExact copy every value twice).
_RATES = """min(prompt_tokens) AS lo, count() AS n, quantilesExact(0.01, 0.5)(1 / mean_tpot_seconds) AS rates"""
_BANDS = f"""
SELECT {PROMPT_BAND} AS band,
       {_RATES}
FROM {MERGED}
WHERE {ENGINE} AND {IN_WINDOW} AND {DECODED}
GROUP BY band ORDER BY lo
"""
# Some engines' bands at once, grouped by the band's index: over a day of 64 engines (16.6M requests) 0.70 s with
# two quantileExact per string band, 0.52 s so.
_BANDS_BY_ENGINE = f"""
SELECT engine, {PROMPT_BAND_INDEX} AS band, {_RATES}
FROM {MERGED}
WHERE {ENGINES} AND {IN_WINDOW} AND {DECODED}
GROUP BY engine, band ORDER BY engine, lo
"""
# The same per minute of the requests' projection (schema.REQUESTS_PER_MINUTE; its aggregates written as it has
# them), by source: over a day of 64 engines 0.2 s instead of 0.55 s. Whole minutes only: quantiles of the minutes
# cannot combine with the rows at the window's edges.
_BANDS_APPROXIMATE = f"""
WITH toStartOfMinute(ts) AS bucket
SELECT engine, source, {PROMPT_BAND_INDEX} AS band, minIf(prompt_tokens, {DECODED}) AS lo, countIf({DECODED}) AS n,
       quantilesBFloat16If(0.01, 0.5)(1 / mean_tpot_seconds, {DECODED}) AS rates
FROM requests
WHERE {EACH_ENGINE} AND bucket >= {moment('m0')} AND bucket < {moment('m1')}
GROUP BY engine, source, band ORDER BY engine, source, lo
"""
RATES_APPROXIMATE = ("per-minute projection of the requests, bfloat16 (within ~1%), whole minutes; the plugin's "
                     "reports (vLLM's own TPOT) where it reports the engine, else the spans'")


def _alone(reader: Reads, window: Window) -> dict[str, tuple[int, tuple[float, float, float], float, str]]:
    """engine -> (quiet steps, their decode rates p10/p50/p90, their step p50 ms, where approximate quantiles came
    from or ""), for the engines with at least 20 quiet steps; exact, or approximate beyond the exact budget
    (common.exact_and_approximate)."""
    counts = {e: (int(s["steps"]), int(s["alone_steps"])) for e, s in window_summary(reader, window).items()
              if s["alone_steps"] >= 20}
    span = approximate_span(window.start, window.end)
    small, big = exact_and_approximate({e: steps for e, (steps, _) in counts.items()}, span is not None)
    out: dict[str, tuple[int, tuple[float, float, float], float, str]] = {}
    if small:
        for engine, rate, step_ms in Query(ALONE_EXACT, engines=small, start=window.start,
                                           end=window.end).rows(reader):
            out[str(engine)] = (counts[engine][1], (number(rate[0]), number(rate[1]), number(rate[2])),
                                number(step_ms), "")

    def read_span(over: Span, engines: list[str]) -> list[tuple[Any, ...]]:
        # The hours' projection keeps no sums: tokens a step come from the minutes of the same span.
        tokens = dict(Query(ALONE_TOKENS_PER_STEP, engines=engines, lo=over.lo, hi=over.hi).rows(reader))
        return [(*row, number(tokens.get(row[0]), 1.0))
                for row in Query(over.reads(ALONE_APPROXIMATE), engines=engines, lo=over.lo, hi=over.hi).rows(reader)]

    for engine, ((_, ms, tokens), over) in approximate_rows(read_span, big, window.start, window.end).items():
        p10, p50, p90 = (number(v) for v in ms)
        rates = tuple(tokens * 1000 / v if v > 0 else 0.0 for v in (p90, p50, p10))
        says = over.says if tokens == 1 else f"{over.says}; x{tokens:.2f} tokens a decoding request gets a step"
        out[engine] = (counts[engine][1], (rates[0], rates[1], rates[2]), p50, says)
    return out


def _bands(reader: Reads, window: Window) -> dict[str, tuple[list[tuple[Any, ...]], bool]]:
    """engine -> its bands under load (name, least prompt, requests, rate p1, rate p50), and whether approximate:
    exact (merged requests) up to the exact budget (common.exact_and_approximate, requests for steps), from the
    requests' per-minute projection beyond it. There, each engine's rates are one source's reports: the plugin's
    where it reports the engine (it reports every request once), else the spans', never both (a request both
    report would count twice until merged)."""
    minutes = whole_minutes(window.start, window.end)
    approximate: dict[str, dict[str, list[tuple[Any, ...]]]] = {}
    if minutes is not None:
        for engine, source, band, lo, n, rates in Query(_BANDS_APPROXIMATE, engine=window.engine, m0=minutes[0],
                                                         m1=minutes[1]).rows(reader):
            if int(n):
                approximate.setdefault(str(engine), {}).setdefault(str(source), []).append(
                    (PROMPT_BANDS[int(band)][0], lo, int(n), rates[0], rates[1]))
    chosen = {engine: by_source.get("plugin") or by_source.get("otlp") or [] for engine, by_source in
              approximate.items()}
    small, big = exact_and_approximate({e: sum(b[2] for b in bands) for e, bands in chosen.items()}, True)
    # Engines whose requests all finished in the window's partial minutes are not in the projection's answer.
    exact = sorted(set(small) | (set(engines(reader, window)) - set(chosen)))
    out: dict[str, tuple[list[tuple[Any, ...]], bool]] = {e: (sorted(chosen[e], key=lambda b: int(b[1])), True)
                                                           for e in big}
    if exact:
        for engine, band, lo, n, rates in Query(_BANDS_BY_ENGINE, engines=exact, start=window.start,
                                                end=window.end).rows(reader):
            out.setdefault(str(engine), ([], False))[0].append((PROMPT_BANDS[int(band)][0], lo, n, rates[0], rates[1]))
    return out


def scheduler_vs_hardware(reader: Reads, window: Window) -> list[Finding]:
    """Per prompt band, decode rates under load against the engine alone; GPU counters say whether silicon slowed."""
    findings = []
    alone = _alone(reader, window)
    bands_by_engine = _bands(reader, window) if alone else {}
    for engine in engines(reader, window):
        if engine not in alone:
            continue  # without quiet steps there is nothing to compare with
        _steps, (alone_lo, alone_mid, alone_hi), _alone_step_ms, approximate = alone[engine]
        bands_q = Query(_BANDS, engine=engine, start=window.start, end=window.end)
        bands, rates_approximate = bands_by_engine.get(engine, ([], False))
        if not bands:
            continue
        worst = min(bands, key=lambda b: number(b[4], 1e9))
        if number(worst[4], 1e9) * LOAD_SLOWDOWN > alone_mid:
            continue
        by_band = {str(b[0]): f"{number(b[3]):.1f}..{number(b[4]):.1f} tok/s (p1..p50, {b[2]} req)" for b in bands}
        evidence: dict[str, object] = {
            "alone_tok_s": f"{alone_lo:.1f}..{alone_hi:.1f} (p50 {alone_mid:.1f})", "under_load_by_band": by_band,
            "alone_from": "steps without prefill and 1-4 decoding requests: tokens generated per decoding request "
                          "x 1000 / elapsed_ms",
            "slow_from": f"{LOAD_SLOWDOWN:g}x below the alone p50"}
        if approximate:
            evidence["alone_quantiles"] = approximate
        if rates_approximate:
            evidence["under_load_quantiles"] = RATES_APPROXIMATE
        rate = f"{number(worst[3]):.1f}..{number(worst[4]):.1f}"
        # What every cause looks like from the requests' side (or plain batching): information, folded into the
        # cause it overlaps (causes.EXPLAINED_BY); the GPU's side is gpu_throttling's.
        findings.append(Finding(
            "scheduler_vs_hardware", "info", engine, window.start, window.end,
            clip(f"{rate} tok/s under load ({worst[0]}) vs {alone_mid:.0f} alone"),
            evidence, bands_q.literal(),
            "the GPU can decode faster than requests get: the scheduler shares steps with prefill or too many "
            "sequences; see the other findings for why", 0.0))
    return findings


_XID = f"""
SELECT e.ts, e.message, e.attributes['xid'] AS xid,
       (SELECT count() FROM steps WHERE {OF_ENGINE} AND elapsed_ms > {param('slow_ms', 'Float64')})
           AS slow_steps_in_window
FROM events AS e
WHERE e.kind = 'gpu_xid' AND (e.engine = {param('engine', 'String')} OR e.engine = '')
  AND {between(column="e.ts")}
ORDER BY e.ts
"""


_XID_EVENTS = f"""
SELECT engine, ts, message, attributes['xid'] AS xid
FROM events
WHERE kind = 'gpu_xid' AND ({EACH_ENGINE} OR engine = '') AND {IN_WINDOW}
ORDER BY ts
"""
_SLOW_STEPS = f"""
SELECT engine,
       countIf(elapsed_ms > transform(toString(engine), {param('engines', 'Array(String)')},
                                      {param('slow_ms', 'Array(Float64)')}, inf))
FROM steps
WHERE {OF_ENGINES}
GROUP BY engine
"""


def gpu_xid(reader: Reads, window: Window) -> list[Finding]:
    """GPU XID errors: the driver saw the hardware fail; always critical."""
    findings: list[Finding] = []
    events = Query(_XID_EVENTS, engine=window.engine, start=window.start, end=window.end).rows(reader)
    if not events:
        return findings
    # An XID of a GPU no engine was seen on (engine '') concerns every engine.
    by_engine = {engine: [r[1:] for r in events if r[0] in (engine, "")] for engine in engines(reader, window)}
    affected = sorted(engine for engine, rows in by_engine.items() if rows)
    # Slow for each engine: SLOW_STEP of its own decode-only step p50 (none counted without one).
    base = baselines(reader, window, affected) if affected else {}
    slow_ms = {e: SLOW_STEP * base.get(e, NO_BASELINE).decode_step_ms or math.inf for e in affected}
    slow = {str(r[0]): int(r[1]) for r in Query(_SLOW_STEPS, engines=affected, slow_ms=[slow_ms[e] for e in affected],
                                                 start=window.start, end=window.end).rows(reader)} if affected else {}
    for engine in affected:
        rows = by_engine[engine]
        query = Query(_XID, engine=engine, start=window.start, end=window.end, slow_ms=slow_ms[engine])
        xids = sorted({str(r[2]) for r in rows if r[2]})
        findings.append(Finding(
            "gpu_xid", "critical", engine, utc(rows[0][0]), utc(rows[-1][0]),
            clip(f"{len(rows)} GPU XID error(s) {', '.join(xids)} from {hms(rows[0][0])}"),
            {"xid_events": len(rows), "xids": xids, "first_message": str(rows[0][1])[:200],
             "slow_steps_in_window": slow.get(engine, 0),
             "slow_step_from_ms": round(slow_ms[engine], 1) if math.isfinite(slow_ms[engine]) else None,
             "baseline_decode_step_p50_ms": round(base.get(engine, NO_BASELINE).decode_step_ms, 1)},
            query.literal(), "check the XID in NVIDIA's table; drain and reset or replace the GPU", float(len(rows))))
    return findings
