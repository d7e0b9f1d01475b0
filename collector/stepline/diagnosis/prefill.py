"""Long prefills: decode starvation beside them, requests queued behind them, and chunking settings not in effect."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from stepline.diagnosis.common import (
    APPROXIMATE,
    EACH_ENGINE,
    EXACT_MAX_STEPS,
    Query,
    clip,
    config_int,
    engine_configs,
    engines,
    number,
    utc,
    window_summary,
)
from stepline.diagnosis.findings import Finding, Window
from stepline.diagnosis.rollup import whole_minutes
from stepline.summary import Reads

# A prompt this many uncached tokens long spans several default (8192-token) chunks: worth a look.
MIN_UNCACHED_TOKENS = 16384
SLOWDOWN = 5.0  # prefill-window step p50 over decode-only step p50 before it counts as interference
MIN_SLOW_STEP_MS = 100.0
MIN_QUEUED = 10  # requests queued behind one prefill before it counts as head-of-line blocking

# The largest uncached prompts of every engine (the window's engine only, when it names one).
_LONG_PREFILLS = f"""
SELECT engine, request_id, prompt_tokens, cached_tokens,
       arrival_ts + toIntervalMicrosecond(toInt64(queue_seconds * 1e6)) AS prefill_start,
       arrival_ts + toIntervalMicrosecond(toInt64(ttft_seconds * 1e6)) AS prefill_end
FROM requests FINAL
WHERE {EACH_ENGINE} AND ts >= {{start:DateTime64(6)}} AND arrival_ts <= {{end:DateTime64(6)}}
  AND isFinite(queue_seconds) AND isFinite(ttft_seconds)
  AND prompt_tokens - least(cached_tokens, prompt_tokens) >= {{min_uncached:UInt32}}
ORDER BY engine, prompt_tokens DESC, request_id
LIMIT 5 BY engine
"""

# Steps inside the prefill interval against the window's decode-only steps (those carrying no prefill chunk, so
# none of the prefill's), in the diagnosis window: what a finding shows. What runs reads the same figures in
# fewer rows: _INSIDE, and the baselines once per engine.
_INTERFERENCE = """
SELECT countIf(inside) AS steps_inside,
       quantileExactIf(0.5)(elapsed_ms, inside) AS step_p50_inside_ms,
       quantileExactIf(0.5)(elapsed_ms, num_ctx_tokens = 0 AND num_generation_requests > 0)
           AS step_p50_decode_only_outside_ms,
       maxIf(num_ctx_tokens, inside) AS chunk_tokens,
       sumIf(length(itl_seconds), inside) AS itl_samples_inside,
       quantilesExactArrayIf(0.5, 0.99)(itl_seconds, inside) AS itl_inside_s,
       quantilesExactArrayIf(0.5, 0.99)(itl_seconds, num_ctx_tokens = 0) AS itl_outside_s,
       sumIf(elapsed_ms * (num_generation_requests + waiting), inside) / 1000 AS delayed_request_s,
       maxIf(waiting, inside) AS waiting_max_inside
FROM (SELECT *, ts >= {prefill_start:DateTime64(6)} AND ts <= {prefill_end:DateTime64(6)} AS inside
      FROM steps
      WHERE engine = {engine:String} AND ts >= {start:DateTime64(6)} AND ts <= {end:DateTime64(6)})
"""

# Requests queued while the prefill ran: what a finding shows (what runs is _QUEUED_BEHIND_EACH).
_QUEUED_BEHIND = """
SELECT count() AS queued, sum(queue_seconds) AS queue_total_s, max(queue_seconds) AS queue_max_s,
       arraySlice(arrayReverseSort(x -> x.2, groupArray((request_id, queue_seconds))), 1, 3) AS worst
FROM requests FINAL
WHERE engine = {engine:String} AND request_id != {request_id:String} AND queue_seconds >= 1
  AND arrival_ts < {prefill_end:DateTime64(6)}
  AND arrival_ts + toIntervalMicrosecond(toInt64(queue_seconds * 1e6)) > {prefill_start:DateTime64(6)}
"""

# _INTERFERENCE split: the steps inside every prefill at once (few), and the baselines once per engine, read from
# the steps up to EXACT_MAX_STEPS of them, from the per-minute projection beyond. INSIDE_ANY and WHICH are the
# prefills' (engine, interval) conditions joined with OR, and as multiIf cases numbering them.
_INSIDE = """
SELECT k, count(), quantileExact(0.5)(elapsed_ms), max(num_ctx_tokens), sum(length(itl_seconds)),
       quantilesExactArray(0.5, 0.99)(itl_seconds), sum(elapsed_ms * (num_generation_requests + waiting)) / 1000,
       max(waiting)
FROM (SELECT *, multiIf(WHICH, -1) AS k FROM steps WHERE INSIDE_ANY)
WHERE k >= 0
GROUP BY k
"""
_BASELINES_EXACT = """
SELECT engine, quantileExactIf(0.5)(elapsed_ms, num_ctx_tokens = 0 AND num_generation_requests > 0),
       quantilesExactArrayIf(0.5, 0.99)(itl_seconds, num_ctx_tokens = 0)
FROM steps
WHERE engine IN {engines:Array(String)} AND ts >= {start:DateTime64(6)} AND ts <= {end:DateTime64(6)}
GROUP BY engine
"""
_BASELINES_APPROXIMATE = """
WITH toStartOfMinute(ts) AS bucket
SELECT engine, quantilesBFloat16If(0.5)(elapsed_ms, num_ctx_tokens = 0 AND num_generation_requests > 0)[1],
       quantilesBFloat16ArrayIf(0.5, 0.99)(itl_seconds, num_ctx_tokens = 0)
FROM steps
WHERE engine IN {engines:Array(String)} AND bucket >= {lo:DateTime64(6)} AND bucket < {hi:DateTime64(6)}
GROUP BY engine
"""
# Every request queued behind any long prefill of its engine, once per prefill it waited behind (k, 1-based).
_QUEUED_BEHIND_EACH = """
SELECT k, count(), sum(queue_seconds), max(queue_seconds),
       arraySlice(arrayReverseSort(x -> x.2, groupArray((request_id, queue_seconds))), 1, 3)
FROM requests FINAL
ARRAY JOIN arrayFilter(i -> engine = {engines:Array(String)}[i] AND request_id != {ids:Array(String)}[i]
    AND arrival_ts < fromUnixTimestamp64Micro({ends:Array(Int64)}[i], 'UTC')
    AND arrival_ts + toIntervalMicrosecond(toInt64(queue_seconds * 1e6))
        > fromUnixTimestamp64Micro({starts:Array(Int64)}[i], 'UTC'), arrayEnumerate({ids:Array(String)})) AS k
WHERE engine IN {engines:Array(String)} AND queue_seconds >= 1 AND arrival_ts < {hi:DateTime64(6)}
  AND ts > {lo:DateTime64(6)}
GROUP BY k
"""
# A request queued behind a prefill finished after the prefill started: its row lies after that (with slack for
# clocks that disagree), which bounds what _QUEUED_BEHIND_EACH reads.
FINISH_SLACK = timedelta(minutes=1)


@dataclass(frozen=True)
class LongPrefill:
    """One finished request whose uncached prompt took many steps to prefill."""

    request_id: str
    prompt_tokens: int
    cached_tokens: int
    start: datetime
    end: datetime


def long_prefills(reader: Reads, window: Window) -> dict[str, list[LongPrefill]]:
    """engine -> the largest uncached prompts prefilled in the window, largest first, none overlapping a larger one."""
    found: dict[str, list[LongPrefill]] = {}
    for engine, rid, prompt, cached, start, end in Query(
            _LONG_PREFILLS, engine=window.engine, start=window.start, end=window.end,
            min_uncached=MIN_UNCACHED_TOKENS).rows(reader):
        big = LongPrefill(str(rid), int(prompt), int(cached), utc(start), utc(end))
        others = found.setdefault(str(engine), [])
        if not any(big.start <= other.end and other.start <= big.end for other in others):
            others.append(big)
    return found


def _baselines(reader: Reads, window: Window, names: list[str]) -> dict[str, tuple[float, Any, bool]]:
    """engine -> (decode-only step p50 ms, decode-only ITL [p50, p99] s, approximate?) over the whole window."""
    summary = window_summary(reader, window)
    minutes = whole_minutes(window.start, window.end)
    big = sorted(e for e in names if summary.get(e, {}).get("steps", 0) > EXACT_MAX_STEPS and minutes is not None)
    small = sorted(set(names) - set(big))
    out: dict[str, tuple[float, Any, bool]] = {}
    if small:
        for engine, step_ms, itl in Query(_BASELINES_EXACT, engines=small, start=window.start,
                                          end=window.end).rows(reader):
            out[str(engine)] = (number(step_ms), itl, False)
    if big and minutes is not None:
        for engine, step_ms, itl in Query(_BASELINES_APPROXIMATE, engines=big, lo=minutes[0],
                                          hi=minutes[1]).rows(reader):
            out[str(engine)] = (number(step_ms), itl, True)
    return out


def _inside(reader: Reads, window: Window, prefills: dict[str, list[LongPrefill]]
            ) -> dict[tuple[str, int], tuple[Any, ...]]:
    """(engine, k) -> the inside columns of _INTERFERENCE for prefills[engine][k], when it has steps in the window."""
    spans = [(engine, k, max(window.start, big.start), min(window.end, big.end))
             for engine, bigs in sorted(prefills.items()) for k, big in enumerate(bigs)]
    spans = [span for span in spans if span[2] <= span[3]]
    if not spans:
        return {}
    conditions = [f"engine = {{e{i}:String}} AND ts >= {{lo{i}:DateTime64(6)}} AND ts <= {{hi{i}:DateTime64(6)}}"
                  for i in range(len(spans))]
    sql = (_INSIDE.replace("WHICH", ", ".join(f"{c}, {i}" for i, c in enumerate(conditions)))
           .replace("INSIDE_ANY", " OR ".join(f"({c})" for c in conditions)))
    params: dict[str, Any] = {}
    for i, (engine, _k, lo, hi) in enumerate(spans):
        params.update({f"e{i}": engine, f"lo{i}": lo, f"hi{i}": hi})
    return {(spans[int(r[0])][0], spans[int(r[0])][1]): tuple(r[1:]) for r in Query(sql, **params).rows(reader)}


def prefill_interference(reader: Reads, window: Window) -> list[Finding]:
    """Steps carrying a long prefill are slow, and every decoding request's ITL becomes that step time."""
    findings = []
    configs = engine_configs(reader, window)
    prefills = long_prefills(reader, window)
    inside = _inside(reader, window, prefills)
    baselines = _baselines(reader, window, sorted({engine for engine, _ in inside})) if inside else {}
    for engine in engines(reader, window):
        config = configs.get(engine, {})
        for k, big in enumerate(prefills.get(engine, [])):
            query = Query(_INTERFERENCE, engine=engine, start=window.start, end=window.end,
                          prefill_start=big.start, prefill_end=big.end)
            if (engine, k) not in inside or not inside[engine, k][0]:
                continue
            _n, step_in, chunk, itl_n, itl_in, delayed, waiting = inside[engine, k]
            step_out, itl_out, approximate = baselines.get(engine, (0.0, [], False))
            step_in, step_out = number(step_in), number(step_out)
            if itl_n == 0 or step_in < MIN_SLOW_STEP_MS or step_in < SLOWDOWN * step_out:
                continue
            itl50_in, itl99_in = number(itl_in[0]), number(itl_in[1])
            itl50_out, itl99_out = (number(itl_out[0]), number(itl_out[1])) if itl_out else (0.0, 0.0)
            critical = itl99_in > 1.0 and itl99_in > 10 * itl99_out
            uncached = big.prompt_tokens - min(big.cached_tokens, big.prompt_tokens)
            evidence = {
                "request_id": big.request_id, "prompt_tokens": big.prompt_tokens,
                "cached_tokens": big.cached_tokens, "uncached_tokens": uncached, "chunk_tokens": int(chunk),
                "prefill_s": round((big.end - big.start).total_seconds(), 1),
                "step_p50_inside_ms": round(step_in, 1), "step_p50_decode_only_outside_ms": round(step_out, 1),
                "itl_p50_inside_s": round(itl50_in, 3), "itl_p99_inside_s": round(itl99_in, 3),
                "itl_p50_outside_s": round(itl50_out, 3), "itl_p99_outside_s": round(itl99_out, 3),
                "itl_over_step_inside": round(itl50_in * 1000 / step_in, 2) if step_in else None,
                "waiting_max_inside": int(waiting), "delayed_request_s": round(number(delayed), 1)}
            if approximate:
                evidence["outside_quantiles"] = APPROXIMATE
            findings.append(Finding(
                "prefill_interference", "critical" if critical else "warning", engine, big.start, big.end,
                clip(f"{big.request_id} ({uncached // 1000}k uncached) prefill: ITL p99 {itl99_in:.2f}s vs "
                     f"{itl99_out * 1000:.0f}ms"),
                evidence, query.literal(), _chunk_lever(config, int(chunk)), number(delayed)))
    return findings


def _chunk_lever(config: dict[str, str], chunk: int) -> str:
    threshold = config_int(config, "long_prefill_token_threshold")
    budget = config_int(config, "max_num_batched_tokens")
    now = ", ".join(f"{k}={v}" for k, v in (("long_prefill_token_threshold", threshold),
                                             ("max_num_batched_tokens", budget)) if v is not None)
    smaller = max(512, chunk // 4)
    return (f"bound each step's prefill: set --long-prefill-token-threshold (e.g. {smaller}) and/or lower "
            f"--max-num-batched-tokens (chunk size, {chunk} tokens seen in one step)"
            + (f"; configured now: {now}" if now else "")
            + "; or route monster prompts to an engine of their own")


def _queued_behind(reader: Reads, prefills: dict[str, list[LongPrefill]]) -> dict[tuple[str, int], tuple[Any, ...]]:
    """(engine, k) -> the row _QUEUED_BEHIND gives for prefills[engine][k], when any request queued behind it."""
    flat = [(engine, k, big) for engine, bigs in sorted(prefills.items()) for k, big in enumerate(bigs)]
    if not flat:
        return {}
    rows = Query(_QUEUED_BEHIND_EACH, engines=[e for e, _, _ in flat], ids=[b.request_id for _, _, b in flat],
                 starts=[round(b.start.timestamp() * 1e6) for _, _, b in flat],
                 ends=[round(b.end.timestamp() * 1e6) for _, _, b in flat],
                 lo=min(b.start for _, _, b in flat) - FINISH_SLACK, hi=max(b.end for _, _, b in flat)).rows(reader)
    return {flat[int(r[0]) - 1][:2]: tuple(r[1:]) for r in rows}


def head_of_line_blocking(reader: Reads, window: Window) -> list[Finding]:
    """Many requests waited in the queue while one long prefill held the engine."""
    findings = []
    prefills = long_prefills(reader, window)
    queued_behind = _queued_behind(reader, prefills)
    for engine in engines(reader, window):
        for k, big in enumerate(prefills.get(engine, [])):
            query = Query(_QUEUED_BEHIND, engine=engine, request_id=big.request_id,
                          prefill_start=big.start, prefill_end=big.end)
            row = queued_behind.get((engine, k))
            if row is None or int(row[0]) < MIN_QUEUED:
                continue
            queued, total, worst_s, worst = int(row[0]), number(row[1]), number(row[2]), row[3]
            findings.append(Finding(
                "head_of_line_blocking", "warning", engine, big.start, big.end,
                clip(f"{queued} requests queued behind {big.request_id} ({big.prompt_tokens // 1000}k "
                     f"prompt), up to {worst_s:.0f}s"),
                {"request_id": big.request_id, "prompt_tokens": big.prompt_tokens, "queued_requests": queued,
                 "queue_total_s": round(total, 1), "queue_max_s": round(worst_s, 1),
                 "longest_queued": [f"{rid} {q:.1f}s" for rid, q in worst]},
                query.literal(),
                "admit long prompts apart from short ones (a separate engine or a priority policy), and bound "
                "per-step prefill (--long-prefill-token-threshold) so short prompts are scheduled beside it",
                total))
    return findings


_OVER_THRESHOLD = """
SELECT countIf(num_ctx_requests = 1 AND num_ctx_tokens > {threshold:UInt32}) AS over_threshold,
       maxIf(num_ctx_tokens, num_ctx_requests = 1) AS max_single_prefill,
       countIf(num_ctx_tokens + num_generation_tokens > {budget:UInt32}) AS over_budget,
       max(num_ctx_tokens + num_generation_tokens) AS max_step_tokens,
       max(waiting) AS waiting_max, countIf(num_ctx_tokens > 0) AS prefill_steps
FROM steps
WHERE engine = {engine:String} AND ts >= {start:DateTime64(6)} AND ts <= {end:DateTime64(6)}
"""


def config_not_in_effect(reader: Reads, window: Window) -> list[Finding]:
    """The engine says it bounds per-step prefill or tokens, but its steps show otherwise."""
    findings = []
    configs = engine_configs(reader, window)
    summary = window_summary(reader, window)
    for engine in engines(reader, window):
        config = configs.get(engine, {})
        threshold = config_int(config, "long_prefill_token_threshold") or 0
        budget = config_int(config, "max_num_batched_tokens") or 0
        if not threshold and not budget:
            continue
        query = Query(_OVER_THRESHOLD, engine=engine, start=window.start, end=window.end,
                      threshold=threshold or 2**31, budget=budget or 2**31)
        if not summary.get(engine, {}).get("prefill_steps"):
            continue
        max_single, max_step, waiting = (int(summary[engine][k] or 0) for k in (
            "max_single_prefill", "max_step_tokens", "waiting_max"))
        over = over_budget = 0
        # A step over a limit exists exactly when the maximum is over it: only then count them, step by step.
        if (threshold and max_single > threshold) or (budget and max_step > budget):
            over, max_single, over_budget, max_step, waiting, _prefill_steps = (int(v or 0) for v in
                                                                                query.rows(reader)[0])
        if threshold and over:
            findings.append(Finding(
                "config_not_in_effect", "warning", engine, window.start, window.end,
                clip(f"long_prefill_token_threshold={threshold} but {over} steps prefilled up to {max_single}"),
                {"long_prefill_token_threshold": threshold, "steps_over_threshold": over,
                 "max_single_request_prefill_tokens": max_single},
                query.literal(), "check the engine's start-up log: the setting was accepted but does not bound "
                "the chunks; verify the vLLM version honours it", float(over)))
        if budget and over_budget:
            findings.append(Finding(
                "config_not_in_effect", "warning", engine, window.start, window.end,
                clip(f"max_num_batched_tokens={budget} but {over_budget} steps carried up to {max_step}"),
                {"max_num_batched_tokens": budget, "steps_over_budget": over_budget, "max_step_tokens": max_step},
                query.literal(), "the token budget is not what the engine runs with: check its start-up log",
                float(over_budget)))
        elif budget and waiting > 0 and max_step < budget // 2:
            findings.append(Finding(
                "config_not_in_effect", "info", engine, window.start, window.end,
                clip(f"max_num_batched_tokens={budget} never binds: steps carry at most {max_step}"),
                {"max_num_batched_tokens": budget, "max_step_tokens": max_step, "waiting_max": waiting},
                query.literal(), "requests wait while the token budget has room: the limit is elsewhere "
                "(max_num_seqs, KV blocks, prefill_schedule_interval)", 0.0))
    return findings
