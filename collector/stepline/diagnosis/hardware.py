"""Scheduling or silicon: decode rates under load against the engine alone, GPU throttling, XID errors."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

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
from stepline.queries.baselines import ALONE_EXACT, ALONE_TOKENS_PER_STEP, alone_approximate
from stepline.queries.query import Query, moment, param
from stepline.queries.requests import MERGED, PROMPT_BAND
from stepline.queries.steps import OF_ENGINE, OF_ENGINES
from stepline.queries.window import EACH_ENGINE, ENGINE, ENGINES, IN_WINDOW, between
from stepline.store.reads import Reads, Row, rows_of

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


class _Band(NamedTuple):
    """An engine's requests of one prompt band under load: decode rates (tokens/s) p1 and p50."""

    name: str
    least_prompt: int
    requests: int
    rate_p1: Any
    rate_p50: Any


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
        for r in Query(ALONE_EXACT, engines=small, start=window.start, end=window.end).rows(reader):
            rate_p10, rate_p50, rate_p90 = (number(v) for v in r.rates)
            out[str(r.engine)] = (counts[r.engine][1], (rate_p10, rate_p50, rate_p90), number(r.step_ms), "")

    def read_span(over: Span, engines: list[str]) -> list[Row]:
        # The hours' projection keeps no sums: tokens a step come from the minutes of the same span.
        tokens = {r.engine: r.tokens for r in
                  Query(ALONE_TOKENS_PER_STEP, engines=engines, lo=over.lo, hi=over.hi).rows(reader)}
        return rows_of(("engine", "step_ms", "tokens"), [
            (r.engine, r.step_ms, number(tokens.get(r.engine), 1.0))
            for r in Query(over.reads(alone_approximate), engines=engines, lo=over.lo, hi=over.hi).rows(reader)])

    for engine, (r, over) in approximate_rows(read_span, big, window.start, window.end).items():
        tokens = r.tokens
        p10, p50, p90 = (number(v) for v in r.step_ms)
        rates = tuple(tokens * 1000 / v if v > 0 else 0.0 for v in (p90, p50, p10))
        says = over.says if tokens == 1 else f"{over.says}; x{tokens:.2f} tokens a decoding request gets a step"
        rate_p10, rate_p50, rate_p90 = rates
        out[engine] = (counts[engine][1], (rate_p10, rate_p50, rate_p90), p50, says)
    return out


def _bands(reader: Reads, window: Window) -> dict[str, tuple[list[_Band], bool]]:
    """engine -> its bands under load (name, least prompt, requests, rate p1, rate p50), and whether approximate:
    exact (merged requests) up to the exact budget (common.exact_and_approximate, requests for steps), from the
    requests' per-minute projection beyond it. There, each engine's rates are one source's reports: the plugin's
    where it reports the engine (it reports every request once), else the spans', never both (a request both
    report would count twice until merged)."""
    minutes = whole_minutes(window.start, window.end)
    approximate: dict[str, dict[str, list[_Band]]] = {}
    if minutes is not None:
        m0, m1 = minutes
        for r in Query(_BANDS_APPROXIMATE, engine=window.engine, m0=m0, m1=m1).rows(reader):
            if int(r.n):
                approximate.setdefault(str(r.engine), {}).setdefault(str(r.source), []).append(_band(r, int(r.n)))
    chosen = {engine: by_source.get("plugin") or by_source.get("otlp") or [] for engine, by_source in
              approximate.items()}
    small, big = exact_and_approximate({e: sum(b.requests for b in bands) for e, bands in chosen.items()}, True)
    # Engines whose requests all finished in the window's partial minutes are not in the projection's answer.
    exact = sorted(set(small) | (set(engines(reader, window)) - set(chosen)))
    out: dict[str, tuple[list[_Band], bool]] = {e: (sorted(chosen[e], key=lambda b: int(b.least_prompt)), True)
                                                for e in big}
    if exact:
        for r in Query(_BANDS_BY_ENGINE, engines=exact, start=window.start, end=window.end).rows(reader):
            bands, _ = out.setdefault(str(r.engine), ([], False))
            bands.append(_band(r, r.n))
    return out


def _band(row: Row, requests: Any) -> _Band:
    """A band of _BANDS_BY_ENGINE or _BANDS_APPROXIMATE: its index named, its rates [p1, p50] apart."""
    name, _least = PROMPT_BANDS[int(row.band)]
    rate_p1, rate_p50 = row.rates
    return _Band(name, row.lo, requests, rate_p1, rate_p50)


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
        worst = min(bands, key=lambda b: number(b.rate_p50, 1e9))
        if number(worst.rate_p50, 1e9) * LOAD_SLOWDOWN > alone_mid:
            continue
        by_band = {str(b.name): f"{number(b.rate_p1):.1f}..{number(b.rate_p50):.1f} tok/s (p1..p50, "
                                f"{b.requests} req)" for b in bands}
        evidence: dict[str, object] = {
            "alone_tok_s": f"{alone_lo:.1f}..{alone_hi:.1f} (p50 {alone_mid:.1f})", "under_load_by_band": by_band,
            "alone_from": "steps without prefill and 1-4 decoding requests: tokens generated per decoding request "
                          "x 1000 / elapsed_ms",
            "slow_from": f"{LOAD_SLOWDOWN:g}x below the alone p50"}
        if approximate:
            evidence["alone_quantiles"] = approximate
        if rates_approximate:
            evidence["under_load_quantiles"] = RATES_APPROXIMATE
        rate = f"{number(worst.rate_p1):.1f}..{number(worst.rate_p50):.1f}"
        # What every cause looks like from the requests' side (or plain batching): information, folded into the
        # cause it overlaps (causes.EXPLAINED_BY); the GPU's side is gpu_throttling's.
        findings.append(Finding(
            "scheduler_vs_hardware", "info", engine, window.start, window.end,
            clip(f"{rate} tok/s under load ({worst.name}) vs {alone_mid:.0f} alone"),
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
                                      {param('slow_ms', 'Array(Float64)')}, inf)) AS slow_steps
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
    by_engine = {engine: [r for r in events if r.engine in (engine, "")] for engine in engines(reader, window)}
    affected = sorted(engine for engine, rows in by_engine.items() if rows)
    # Slow for each engine: SLOW_STEP of its own decode-only step p50 (none counted without one).
    base = baselines(reader, window, affected) if affected else {}
    slow_ms = {e: SLOW_STEP * base.get(e, NO_BASELINE).decode_step_ms or math.inf for e in affected}
    slow = {str(r.engine): int(r.slow_steps) for r in Query(
        _SLOW_STEPS, engines=affected, slow_ms=[slow_ms[e] for e in affected], start=window.start,
        end=window.end).rows(reader)} if affected else {}
    for engine in affected:
        rows = by_engine[engine]
        query = Query(_XID, engine=engine, start=window.start, end=window.end, slow_ms=slow_ms[engine])
        xids = sorted({str(r.xid) for r in rows if r.xid})
        first, last = rows[0], rows[-1]  # ordered by time
        findings.append(Finding(
            "gpu_xid", "critical", engine, utc(first.ts), utc(last.ts),
            clip(f"{len(rows)} GPU XID error(s) {', '.join(xids)} from {hms(first.ts)}"),
            {"xid_events": len(rows), "xids": xids, "first_message": str(first.message)[:200],
             "slow_steps_in_window": slow.get(engine, 0),
             "slow_step_from_ms": round(slow_ms[engine], 1) if math.isfinite(slow_ms[engine]) else None,
             "baseline_decode_step_p50_ms": round(base.get(engine, NO_BASELINE).decode_step_ms, 1)},
            query.literal(), "check the XID in NVIDIA's table; drain and reset or replace the GPU", float(len(rows))))
    return findings
