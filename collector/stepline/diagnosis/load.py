"""Overload: requests arrive faster than the engine serves them, with no single prompt to blame.

The engine is busy (it steps back to back), its queue holds MIN_QUEUED or more across several buckets of the
window, requests that arrived then waited OVERLOAD_QUEUE_STEPS of its own decode-only steps (p50) or more, and
long prefills took no more than OWN_STEPS_SHARE of that time (a queue that forms behind one prefill is
head-of-line blocking). The evidence sets the arrival rate against the rate the engine served at.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, NamedTuple

from stepline.diagnosis.baseline import (
    BUSY_SHARE,
    LONG_CHUNK_SHARE,
    MIN_QUEUED,
    NO_BASELINE,
    OVERLOAD_BUCKETS,
    OVERLOAD_MIN_BUCKETS,
    OVERLOAD_QUEUE_STEPS,
    OWN_STEPS_SHARE,
    baselines,
    budgets,
)
from stepline.diagnosis.common import clip, engines, number, utc, window_summary
from stepline.diagnosis.findings import Finding, Window
from stepline.diagnosis.rollup import Agg, rolled
from stepline.queries.query import Query, moment, param
from stepline.queries.requests import MERGED
from stepline.queries.window import EACH_ENGINE, ENGINE
from stepline.store.reads import Reads

# Per bucket of the window, from the steps' projections (a day of steps is read as its minutes): how long the engine
# stepped and how many waited. Then, over the loaded span only, the raw steps (_SPAN).
_BUCKET_AGGS = (Agg("steps", "count()", "sum({})"), Agg("busy_ms", "sum(elapsed_ms)", "sum({})"),
                Agg("waiting_max", "max(waiting)", "max({})"), Agg("last", "max(ts)", "max({})"),
                Agg("waiting_last", "argMax(waiting, ts)", "argMax({}, p_last)"))
_SPAN = f"""
SELECT sum(waiting * elapsed_ms) / 1000 AS queued_request_s,
       sumIf(elapsed_ms, num_ctx_requests = 1 AND num_ctx_tokens >= {param('long_chunk', 'UInt64')}) / 1000
           AS long_prefill_s
FROM steps
WHERE {ENGINE} AND ts >= {moment('lo')} AND ts < {moment('hi')}
"""
# Requests that arrived in the overloaded span (their queue time), and those the engine finished in it.
_ARRIVED = f"arrival_ts >= {moment('lo')} AND arrival_ts < {moment('hi')}"
_RATES = f"""
SELECT countIf({_ARRIVED}) AS requests_arrived,
       countIf(ts >= {moment('lo')} AND ts < {moment('hi')}) AS finished,
       quantileExactIf(0.5)(queue_seconds, {_ARRIVED}) AS queue_p50_s,
       maxIf(queue_seconds, {_ARRIVED}) AS queue_max_s,
       sumIf(queue_seconds, {_ARRIVED}) AS queue_total_s
FROM {MERGED}
WHERE {ENGINE} AND ts >= {moment('lo')} AND arrival_ts < {moment('hi')}
"""


class _Bucket(NamedTuple):
    """An engine's steps in one bucket of the window."""

    t: Any
    steps: Any
    busy_s: float
    waiting_max: Any
    waiting_last: Any


def _span(rows: list[_Bucket], bucket_s: float) -> list[_Bucket]:
    """The longest run of consecutive buckets in which the engine was busy with MIN_QUEUED or more waiting."""
    best: list[_Bucket] = []
    run: list[_Bucket] = []
    for row in rows:
        t, steps, busy, waiting_max = row.t, int(row.steps), number(row.busy_s, bucket_s), int(row.waiting_max)
        loaded = steps > 0 and waiting_max >= MIN_QUEUED and busy >= BUSY_SHARE * bucket_s
        adjacent = bool(run) and utc(t) - utc(run[-1].t) <= timedelta(seconds=bucket_s * 1.5)
        if loaded and (adjacent or not run):
            run.append(row)
        elif loaded:
            run = [row]
        else:
            run = []
        if len(run) > len(best):
            best = list(run)
    return best


def overload(reader: Reads, window: Window) -> list[Finding]:
    """Arrivals above what the engine serves: its queue grows while it steps flat out on ordinary prompts."""
    findings: list[Finding] = []
    summary = window_summary(reader, window)
    queued = sorted(e for e, s in summary.items() if int(s.get("waiting_max") or 0) >= MIN_QUEUED)
    if not queued:
        return findings
    bucket_s = max(1, round((window.end - window.start).total_seconds() / OVERLOAD_BUCKETS))
    known = budgets(reader, window)
    names = sorted(known)
    long_chunk = {e: round(LONG_CHUNK_SHARE * known[e][0]) for e in names}
    per_bucket = "toStartOfInterval(bucket, toIntervalSecond({bucket_s:UInt32}))"
    sql, bounds = rolled(_BUCKET_AGGS, EACH_ENGINE, window.start, window.end, minutes=bucket_s % 60 == 0,
                         keys=(("engine", "engine"), ("t", per_bucket)))
    by_engine: dict[str, list[_Bucket]] = {}
    for r in Query(sql, engine=window.engine, bucket_s=bucket_s, **bounds).rows(reader):
        by_engine.setdefault(str(r.engine), []).append(
            _Bucket(r.t, r.steps, number(r.busy_ms) / 1000, r.waiting_max, r.waiting_last))
    base = baselines(reader, window, queued)
    for engine in engines(reader, window):
        span = _span(by_engine.get(engine, []), bucket_s)
        if len(span) < OVERLOAD_MIN_BUCKETS:
            continue
        lo: datetime = max(window.start, utc(span[0].t))
        hi: datetime = min(window.end, utc(span[-1].t) + timedelta(seconds=bucket_s))
        # A long chunk is LONG_CHUNK_SHARE of the engine's budget (none counts on an engine of unknown budget).
        (spent,) = Query(_SPAN, engine=engine, lo=lo, hi=hi, long_chunk=long_chunk.get(engine, 2**63)).rows(reader)
        queued_s, long_prefill = number(spent.queued_request_s), number(spent.long_prefill_s)
        busy = sum(number(r.busy_s) for r in span)
        if busy > 0 and long_prefill / busy > OWN_STEPS_SHARE:
            continue
        rates_q = Query(_RATES, engine=engine, lo=lo, hi=hi)
        (rates,) = rates_q.rows(reader)
        arrived, finished, queue_p50, queue_max = (
            rates.requests_arrived, rates.finished, rates.queue_p50_s, rates.queue_max_s)
        b = base.get(engine, NO_BASELINE)
        long_wait_s = OVERLOAD_QUEUE_STEPS * b.decode_step_ms / 1000
        waiting_end = int(span[-1].waiting_last)
        if b.decode_step_ms <= 0 or number(queue_p50) < long_wait_s:
            continue
        span_s = (hi - lo).total_seconds()
        arrival_rate = (int(arrived) + waiting_end) / span_s
        served_rate = int(finished) / span_s
        evidence: dict[str, Any] = {
            "arrival_rate_per_s": round(arrival_rate, 2), "served_rate_per_s": round(served_rate, 2),
            "waiting_start": int(span[0].waiting_last), "waiting_max": max(int(r.waiting_max) for r in span),
            "waiting_end": waiting_end,
            "queue_p50_s": round(number(queue_p50), 2), "queue_max_s": round(number(queue_max), 1),
            "queued_request_s": round(queued_s, 1), "requests_arrived": int(arrived),
            "loaded_s": round(span_s, 1),
            "long_wait_from_s": f"{long_wait_s:.3f} ({OVERLOAD_QUEUE_STEPS:g} decode-only steps of "
                                f"{b.decode_step_ms:.1f} ms, p50)",
            "long_prefill_share": f"{long_prefill / busy:.0%} of the busy time (blamed on one prompt above "
                                  f"{OWN_STEPS_SHARE:.0%})" if busy > 0 else "n/a",
            "loaded_from": f"{MIN_QUEUED}+ waiting and stepping {BUSY_SHARE:.0%}+ of each {bucket_s} s bucket, "
                           f"for {OVERLOAD_MIN_BUCKETS}+ buckets",
            **b.evidence(),
        }
        findings.append(Finding(
            "overload", "warning", engine, lo, hi,
            clip(f"overload: {arrival_rate:.1f} req/s arrive, {served_rate:.1f} served; queue p50 "
                 f"{number(queue_p50):.1f}s"),
            evidence, rates_q.literal(),
            "add capacity (replicas, or a larger --max-num-seqs / --max-num-batched-tokens where the GPU has room), "
            "admission control at the router (rate-limit, shed or queue elsewhere), or route to less loaded engines",
            queued_s))
    return findings
