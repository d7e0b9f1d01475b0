"""Engine health over the window: prefix cache, KV pressure, speculative acceptance, and wedged vs slow."""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any, NamedTuple

from stepline.diagnosis.baseline import (
    COLLAPSE_SHARE,
    MIN_BUCKET_REQUESTS,
    MIN_LOW_BUCKETS,
    MIN_USUAL_HIT_RATE,
    NO_BASELINE,
    SLOW_STEP,
    WEDGE_DELIVERY_S,
    WEDGE_LAG_SCRAPES,
    WEDGE_LAST_STEPS,
    WEDGE_STEP_MULTIPLE,
    WEDGE_UNKNOWN_LAG_S,
    baselines,
)
from stepline.diagnosis.common import clip, engines, number, utc, window_summary
from stepline.diagnosis.findings import Finding, Window
from stepline.diagnosis.rollup import MINUTE, Agg, parts, rolled
from stepline.queries.query import Query, moment, param
from stepline.queries.steps import OF_ENGINE
from stepline.queries.window import EACH_ENGINE, ENGINE, IN_WINDOW
from stepline.store.reads import Reads, Row

GPU_IDLE_PCT = 5.0  # a share of the GPU's time, the same on every GPU

_BUCKETS = f"""
SELECT toStartOfInterval(ts, toIntervalSecond({param('bucket_s', 'UInt32')})) AS t,
       sum(prefix_cache_hits) AS hits, sum(prefix_cache_queries) AS queries,
       sum(spec_num_accepted_tokens) AS accepted, sum(spec_num_draft_tokens) AS drafted, sum(spec_num_drafts) AS drafts
FROM steps
WHERE {OF_ENGINE}
GROUP BY t ORDER BY t
"""


_BUCKET_AGGS = tuple(Agg(alias, f"sum({column})", "sum({})") for alias, column in (
    ("hits", "prefix_cache_hits"), ("queries", "prefix_cache_queries"), ("accepted", "spec_num_accepted_tokens"),
    ("drafted", "spec_num_draft_tokens"), ("drafts", "spec_num_drafts")))


def _bucket_s(window: Window) -> int:
    return max(10, round((window.end - window.start).total_seconds() / 60))


def _buckets(reader: Reads, window: Window) -> dict[str, list[Row]]:
    """_BUCKETS for every engine at once (from the steps projections): engine -> rows in time order."""
    bucket_s = _bucket_s(window)
    per_bucket = "toStartOfInterval(bucket, toIntervalSecond({bucket_s:UInt32}))"
    sql, bounds = rolled(_BUCKET_AGGS, EACH_ENGINE, window.start, window.end, minutes=bucket_s % 60 == 0,
                         keys=(("engine", "engine"), ("t", per_bucket)))
    by_engine: dict[str, list[Row]] = {}
    for row in Query(sql, engine=window.engine, bucket_s=bucket_s, **bounds).rows(reader):
        by_engine.setdefault(str(row.engine), []).append(row)
    return by_engine


# Per request, unweighted: one uncached 300k-token prompt is one request, not the whole bucket's lookups. Only the
# plugin's reports carry vLLM's cached tokens (a request OTLP alone reported has none), and the collector writes the
# plugin's report of a request once (stepline.ingest.merge): its reports are read as they are, not merged. Over a
# window longer than an hour, per whole minute from the requests' projection (schema.REQUESTS_PER_MINUTE, whose
# aggregates these are): a day of 64 engines, 0.4 s merged, 0.03 s so. The partial minutes at the window's two ends
# are left out there: requests are not sorted by time, so reading them would read the day's finish times (0.2 s),
# and they only shorten the first and last buckets, which the window cuts anyway.
_REQUEST_HIT_AGGS = (
    Agg("requests", "countIf(prompt_tokens > 0)", "sum({})"),
    Agg("hit_sum", "sumIf(least(cached_tokens, prompt_tokens) / prompt_tokens, prompt_tokens > 0)", "sum({})"),
    Agg("prompt_sum", "sum(prompt_tokens)", "sum({})"),
)
WHOLE_MINUTES = "whole minutes of the window (the requests' per-minute projection)"


def _request_hits(window: Window, bucket_s: int, engine: str) -> tuple[Query, bool]:
    """Per engine and bucket: requests with a prompt, their mean cached share, their prompt tokens; and whether
    from the window's whole minutes only."""
    per_bucket = "toStartOfInterval(bucket, toIntervalSecond({bucket_s:UInt32}))"
    by_minute = bucket_s % 60 == 0
    sql, bounds = rolled(_REQUEST_HIT_AGGS, f"{EACH_ENGINE} AND source = 'plugin'", window.start, window.end,
                         minutes=by_minute, keys=(("engine", "engine"), ("t", per_bucket)), table="requests",
                         seconds=False, edges=False)
    query = Query(f"SELECT engine, t, requests, hit_sum / requests AS hit_share, prompt_sum\nFROM (\n{sql}\n)\n"
                  "WHERE requests > 0 ORDER BY engine, t", engine=engine, bucket_s=bucket_s, **bounds)
    first_part, *_ = parts(window.start, window.end, minutes=by_minute, seconds=False, edges=False)
    return query, first_part.bucket == MINUTE


def prefix_cache_collapse(reader: Reads, window: Window) -> list[Finding]:
    """The requests' hit rate (each request's cached share, averaged) fell far below the engine's usual rate,
    its earliest buckets in the window."""
    findings = []
    bucket_s = _bucket_s(window)
    by_engine: dict[str, list[Row]] = {}
    every, whole_minutes_only = _request_hits(window, bucket_s, window.engine)
    for row in every.rows(reader):
        by_engine.setdefault(str(row.engine), []).append(row)
    hit_rate_from = "each request's cached share of its prompt, averaged per bucket (plugin reports)" + (
        f", over the {WHOLE_MINUTES}" if whole_minutes_only else "")
    for engine in engines(reader, window):
        query, _ = _request_hits(window, bucket_s, engine)
        rows = [r for r in by_engine.get(engine, []) if int(r.requests) >= MIN_BUCKET_REQUESTS]
        if len(rows) < 3:
            continue
        # The usual rate is the earliest fifth of the buckets, unweighted: a burst's many requests must not define it.
        first = rows[: max(1, len(rows) // 5)]
        usual = sum(number(r.hit_share) for r in first) / len(first)
        low = [r for r in rows[len(first):] if number(r.hit_share) < usual * COLLAPSE_SHARE]
        if usual < MIN_USUAL_HIT_RATE or len(low) < MIN_LOW_BUCKETS:
            continue
        low_rate = sum(number(r.hit_share) * int(r.requests) for r in low) / sum(int(r.requests) for r in low)
        missed = sum(int(r.prompt_sum) * (usual - number(r.hit_share)) for r in low)
        findings.append(Finding(
            "prefix_cache_collapse", "warning", engine, utc(low[0].t), utc(low[-1].t) + timedelta(seconds=bucket_s),
            clip(f"prefix-cache hit rate {low_rate:.1%} vs {usual:.1%} earlier (per request)"),
            {"hit_rate_usual": round(usual, 3), "hit_rate_low": round(low_rate, 3),
             "low_buckets": len(low), "requests_in_low_buckets": sum(int(r.requests) for r in low),
             "bucket_s": bucket_s,
             "tokens_recomputed_beyond_usual": round(missed),
             "low_from": f"below {COLLAPSE_SHARE:.0%} of the usual rate, in {MIN_LOW_BUCKETS}+ buckets of "
                         f"{MIN_BUCKET_REQUESTS}+ requests",
             "hit_rate_from": hit_rate_from},
            query.literal(),
            "the burst's prompts share little prefix (or evict each other): check KV headroom "
            "(num_gpu_blocks), cache-aware routing, and whether clients still send the shared system prompt",
            missed / 1e6))
    return findings


def spec_decode_acceptance_shift(reader: Reads, window: Window) -> list[Finding]:
    """Speculative acceptance, per bucket from step deltas (never lifetime counters), moved a lot."""
    findings = []
    buckets = _buckets(reader, window)
    for engine in engines(reader, window):
        query = Query(_BUCKETS, engine=engine, start=window.start, end=window.end, bucket_s=_bucket_s(window))
        rows = [r for r in buckets.get(engine, []) if int(r.drafts) > 0 and int(r.drafted) >= 100]
        if len(rows) < 2:
            continue
        rates = [int(r.accepted) / int(r.drafted) for r in rows]
        lo, hi = min(rates), max(rates)
        if hi - lo < 0.15:
            continue
        findings.append(Finding(
            "spec_decode_acceptance_shift", "warning" if hi >= 2 * lo else "info", engine,
            utc(rows[0].t), utc(rows[-1].t),
            clip(f"speculative acceptance ranged {lo:.0%}..{hi:.0%} across the window"),
            {"acceptance_min": round(lo, 3), "acceptance_max": round(hi, 3), "buckets": len(rows),
             "bucket_s": _bucket_s(window)},
            query.literal(),
            "acceptance depends on the traffic (code vs prose): tune num_speculative_tokens per workload, "
            "or disable speculation when acceptance stays low", hi - lo))
    return findings


_KV = f"""
SELECT max(kv_cache_usage) AS kv_max, sum(preempted) AS preempted, countIf(kv_cache_usage >= 0.95) AS steps_near_full,
       min(ts) AS first, max(ts) AS last
FROM steps
WHERE {OF_ENGINE}
"""


def kv_pressure(reader: Reads, window: Window) -> list[Finding]:
    """KV cache near full, with requests preempted (their work recomputed)."""
    findings = []
    summary = window_summary(reader, window)
    for engine in engines(reader, window):
        query = Query(_KV, engine=engine, start=window.start, end=window.end)
        if engine not in summary:
            continue
        s = summary[engine]
        kv_max, preempted, near = number(s["kv_max"]), int(s["preempted"] or 0), int(s["steps_kv_over_95pct"] or 0)
        first, last = s["first"], s["last"]
        if kv_max < 0.95 or preempted == 0:
            continue
        findings.append(Finding(
            "kv_pressure", "critical" if preempted >= 50 else "warning", engine, utc(first), utc(last),
            clip(f"KV cache {kv_max:.0%} full, {preempted} preemptions"),
            {"kv_usage_max": round(kv_max, 3), "preemptions": preempted, "steps_kv_over_95pct": near},
            query.literal(),
            "more KV room: raise --gpu-memory-utilization, lower --max-num-seqs or --max-model-len, or add replicas",
            float(preempted)))
    return findings


# The slowest of an engine's last {last_steps} steps, and the mean interval of its scrapes (NaN under two).
_SLOWEST_LAST = ("arrayMax(arrayMap(x -> x.2, arraySlice(arrayReverseSort(groupArray((ts, elapsed_ms))), 1, "
                 "{last_steps:UInt32})))")
_SCRAPE_INTERVAL = "if(count() > 1, (toFloat64(max(ts)) - toFloat64(min(ts))) / (count() - 1), nan)"
_PROGRESS = f"""
SELECT (SELECT max(ts) FROM steps WHERE {ENGINE} AND ts <= {moment('end')}) AS last_step,
       (SELECT argMax(waiting, ts) FROM steps WHERE {ENGINE} AND ts <= {moment('end')}) AS waiting_step,
       (SELECT argMax(value, ts) FROM engine_samples WHERE {ENGINE} AND metric = 'vllm:num_requests_waiting'
            AND {IN_WINDOW}) AS waiting_scraped,
       (SELECT {_SLOWEST_LAST} FROM steps WHERE {ENGINE} AND ts <= {moment('end')}
            AND ts >= {moment('end')} - INTERVAL 10 MINUTE) AS slowest_last_steps_ms,
       (SELECT quantileExact(0.5)(elapsed_ms) FROM steps WHERE {ENGINE}
            AND ts <= {moment('end')} AND ts >= {moment('end')} - INTERVAL 1 MINUTE) AS recent_p50_ms,
       (SELECT avg(util_gpu_pct) FROM gpu_samples WHERE {ENGINE}
            AND ts <= {moment('end')} AND ts >= {moment('end')} - INTERVAL 30 SECOND) AS gpu_util_pct,
       (SELECT {_SCRAPE_INTERVAL} FROM engine_samples WHERE {ENGINE} AND metric = 'vllm:num_requests_waiting'
            AND {IN_WINDOW}) AS scrape_interval_s
"""


# _PROGRESS for every engine at once: the last step (ever, up to the end) from the projections, the rest bounded.
_LAST_STEP_AGGS = (Agg("last_step", "max(ts)", "max({})"), Agg("waiting_step", "argMax(waiting, ts)",
                                                                "argMax({}, p_last_step)"))
_RECENT = f"""
SELECT engine, {_SLOWEST_LAST} AS slowest_last_steps_ms,
       quantileExactIf(0.5)(elapsed_ms, ts >= {moment('end')} - INTERVAL 1 MINUTE) AS recent_p50_ms
FROM steps
WHERE {EACH_ENGINE} AND ts <= {moment('end')} AND ts >= {moment('end')} - INTERVAL 10 MINUTE
GROUP BY engine
"""
_SCRAPED_WAITING = f"""
SELECT engine, argMax(value, ts) AS waiting_scraped, {_SCRAPE_INTERVAL} AS scrape_interval_s
FROM engine_samples
WHERE {EACH_ENGINE} AND metric = 'vllm:num_requests_waiting' AND {IN_WINDOW}
GROUP BY engine
"""
_GPU_UTIL = f"""
SELECT engine, avg(util_gpu_pct) AS gpu_util_pct FROM gpu_samples
WHERE {EACH_ENGINE} AND ts <= {moment('end')} AND ts >= {moment('end')} - INTERVAL 30 SECOND
GROUP BY engine
"""


class _Progress(NamedTuple):
    """What _PROGRESS answers for one engine (its columns' names)."""

    last_step: Any
    waiting_step: Any
    waiting_scraped: Any
    slowest_last_steps_ms: Any
    recent_p50_ms: Any
    gpu_util_pct: Any
    scrape_interval_s: Any


def _progress(reader: Reads, window: Window) -> dict[str, _Progress]:
    """engine -> the row _PROGRESS gives for it, for every engine that ever stepped before the window's end."""
    sql, bounds = rolled(_LAST_STEP_AGGS, EACH_ENGINE, None, window.end)
    last = Query(sql, engine=window.engine, **bounds).rows(reader)
    params = {"engine": window.engine, "start": window.start, "end": window.end}
    recent = {r.engine: r for r in Query(_RECENT, **params, last_steps=WEDGE_LAST_STEPS).rows(reader)}
    scraped = {r.engine: r for r in Query(_SCRAPED_WAITING, **params).rows(reader)}
    util = {r.engine: r.gpu_util_pct for r in Query(_GPU_UTIL, **params).rows(reader)}
    out = {}
    for r in last:
        engine = r.engine
        s, steps = scraped.get(engine), recent.get(engine)
        out[str(engine)] = _Progress(
            r.last_step, r.waiting_step, 0.0 if s is None else s.waiting_scraped,
            0.0 if steps is None else steps.slowest_last_steps_ms, None if steps is None else steps.recent_p50_ms,
            util.get(engine), math.nan if s is None else s.scrape_interval_s)
    return out


def wedged_engine(reader: Reads, window: Window) -> list[Finding]:
    """Requests wait, no step for longer than the work in flight explains, GPUs idle: a wedge pages; slow is not one."""
    findings = []
    progress = _progress(reader, window)
    base = baselines(reader, window, sorted(progress)) if progress else {}
    for engine in engines(reader, window):
        query = Query(_PROGRESS, engine=engine, start=window.start, end=window.end, last_steps=WEDGE_LAST_STEPS)
        if engine not in progress:
            continue
        last, waiting_step, waiting_scraped, slowest, recent_p50, util, scrape_s = progress[engine]
        last = utc(last)
        if last.year < 2000:  # max() over no rows is the epoch
            continue
        waiting = max(int(waiting_step or 0), int(number(waiting_scraped)))
        stalled_s = (window.end - last).total_seconds()
        scrape_s = number(scrape_s, math.nan)
        scrapes_seen = not math.isnan(scrape_s)
        lag_s = WEDGE_LAG_SCRAPES * scrape_s + WEDGE_DELIVERY_S if scrapes_seen else WEDGE_UNKNOWN_LAG_S
        budget_s = max(lag_s, WEDGE_STEP_MULTIPLE * number(slowest) / 1000)
        scrape = f"{scrape_s:.1f}s" if scrapes_seen else f"? s: {WEDGE_UNKNOWN_LAG_S:g}s assumed"
        gpu_util = None if util is None or number(util, -1) < 0 else number(util)
        evidence = {"waiting": waiting, "seconds_since_last_step": round(stalled_s, 1),
                    "progress_budget_s": round(budget_s, 1), "gpu_util_pct": gpu_util,
                    "slowest_last_steps_ms": round(number(slowest), 1),
                    "scrape_interval_s": round(scrape_s, 1) if scrapes_seen else None,
                    "budget_from": f"{WEDGE_STEP_MULTIPLE:g}x the slowest of the last {WEDGE_LAST_STEPS} steps, at "
                                   f"least {WEDGE_LAG_SCRAPES:g} scrapes (every {scrape}) + {WEDGE_DELIVERY_S:g}s"}
        if waiting > 0 and stalled_s > budget_s and (gpu_util is None or gpu_util < GPU_IDLE_PCT):
            # Idle GPUs only where there is a reading: a CPU engine, or one whose NVML is down, has none to say so.
            gpus = "no GPU readings" if gpu_util is None else "GPUs idle"
            findings.append(Finding(
                "wedged_engine", "critical", engine, last, window.end,
                clip(f"{waiting} waiting, no step for {stalled_s:.0f}s (budget {budget_s:.0f}s), {gpus}"),
                evidence, query.literal(),
                "the engine holds requests but schedules nothing: look for leaked slots (client disconnects), "
                "then restart the engine", stalled_s))
            continue
        # Slow for this engine: its last minute's step p50 against its own decode-only steps.
        usual_ms = base.get(engine, NO_BASELINE).decode_step_ms
        if stalled_s <= budget_s and usual_ms > 0 and number(recent_p50) >= SLOW_STEP * usual_ms:
            findings.append(Finding(
                "legitimately_slow", "info", engine, last - timedelta(minutes=1), last,
                clip(f"steps still progress, slowly: p50 {number(recent_p50) / 1000:.1f}s per step"),
                {**evidence, "recent_step_p50_ms": round(number(recent_p50), 1),
                 "baseline_decode_step_p50_ms": round(usual_ms, 1),
                 "slowdown": f"{number(recent_p50) / usual_ms:.1f}x (slow from {SLOW_STEP:g}x)"}, query.literal(),
                "not a fault: a huge prefill or long-context decode is in flight; watchdogs should budget for it",
                0.0))
    return findings
