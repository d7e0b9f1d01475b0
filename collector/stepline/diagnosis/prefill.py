"""Long prefills: decode starvation beside them, requests queued behind them, and chunking settings not in effect."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from stepline.diagnosis.common import Query, clip, config_int, engine_config, engines, number, utc
from stepline.diagnosis.findings import Finding, Window
from stepline.summary import Reads

# A prompt this many uncached tokens long spans several default (8192-token) chunks: worth a look.
MIN_UNCACHED_TOKENS = 16384
SLOWDOWN = 5.0  # prefill-window step p50 over decode-only step p50 before it counts as interference
MIN_SLOW_STEP_MS = 100.0
MIN_QUEUED = 10  # requests queued behind one prefill before it counts as head-of-line blocking

_LONG_PREFILLS = """
SELECT request_id, prompt_tokens, cached_tokens,
       arrival_ts + toIntervalMicrosecond(toInt64(queue_seconds * 1e6)) AS prefill_start,
       arrival_ts + toIntervalMicrosecond(toInt64(ttft_seconds * 1e6)) AS prefill_end
FROM requests
WHERE engine = {engine:String} AND ts >= {start:DateTime64(6)} AND arrival_ts <= {end:DateTime64(6)}
  AND isFinite(queue_seconds) AND isFinite(ttft_seconds)
  AND prompt_tokens - least(cached_tokens, prompt_tokens) >= {min_uncached:UInt32}
ORDER BY prompt_tokens DESC
LIMIT 5
"""

# Steps inside the prefill interval against decode-only steps outside it, in the diagnosis window.
_INTERFERENCE = """
SELECT countIf(inside) AS steps_inside,
       quantileExactIf(0.5)(elapsed_ms, inside) AS step_p50_inside_ms,
       quantileExactIf(0.5)(elapsed_ms, NOT inside AND num_ctx_tokens = 0 AND num_generation_requests > 0)
           AS step_p50_decode_only_outside_ms,
       maxIf(num_ctx_tokens, inside) AS chunk_tokens,
       sumIf(length(itl_seconds), inside) AS itl_samples_inside,
       quantilesExactArrayIf(0.5, 0.99)(itl_seconds, inside) AS itl_inside_s,
       quantilesExactArrayIf(0.5, 0.99)(itl_seconds, NOT inside AND num_ctx_tokens = 0) AS itl_outside_s,
       sumIf(elapsed_ms * (num_generation_requests + waiting), inside) / 1000 AS delayed_request_s,
       maxIf(waiting, inside) AS waiting_max_inside
FROM (SELECT *, ts >= {prefill_start:DateTime64(6)} AND ts <= {prefill_end:DateTime64(6)} AS inside
      FROM steps
      WHERE engine = {engine:String} AND ts >= {start:DateTime64(6)} AND ts <= {end:DateTime64(6)})
"""

_QUEUED_BEHIND = """
SELECT count() AS queued, sum(queue_seconds) AS queue_total_s, max(queue_seconds) AS queue_max_s,
       arraySlice(arrayReverseSort(x -> x.2, groupArray((request_id, queue_seconds))), 1, 3) AS worst
FROM requests
WHERE engine = {engine:String} AND request_id != {request_id:String} AND queue_seconds >= 1
  AND arrival_ts < {prefill_end:DateTime64(6)}
  AND arrival_ts + toIntervalMicrosecond(toInt64(queue_seconds * 1e6)) > {prefill_start:DateTime64(6)}
"""


@dataclass(frozen=True)
class LongPrefill:
    """One finished request whose uncached prompt took many steps to prefill."""

    request_id: str
    prompt_tokens: int
    cached_tokens: int
    start: datetime
    end: datetime


def long_prefills(reader: Reads, engine: str, window: Window) -> tuple[list[LongPrefill], Query]:
    """The largest uncached prompts prefilled in the window, largest first, none overlapping a larger one."""
    query = Query(_LONG_PREFILLS, engine=engine, start=window.start, end=window.end,
                  min_uncached=MIN_UNCACHED_TOKENS)
    found: list[LongPrefill] = []
    for rid, prompt, cached, start, end in query.rows(reader):
        big = LongPrefill(str(rid), int(prompt), int(cached), utc(start), utc(end))
        if not any(big.start <= other.end and other.start <= big.end for other in found):
            found.append(big)
    return found, query


def prefill_interference(reader: Reads, window: Window) -> list[Finding]:
    """Steps carrying a long prefill are slow, and every decoding request's ITL becomes that step time."""
    findings = []
    for engine in engines(reader, window):
        config = engine_config(reader, engine, window)
        prefills, _ = long_prefills(reader, engine, window)
        for big in prefills:
            query = Query(_INTERFERENCE, engine=engine, start=window.start, end=window.end,
                          prefill_start=big.start, prefill_end=big.end)
            rows = query.rows(reader)
            if not rows or not rows[0][0]:
                continue
            (_n, step_in, step_out, chunk, itl_n, itl_in, itl_out, delayed, waiting) = rows[0]
            step_in, step_out = number(step_in), number(step_out)
            if itl_n == 0 or step_in < MIN_SLOW_STEP_MS or step_in < SLOWDOWN * step_out:
                continue
            itl50_in, itl99_in = number(itl_in[0]), number(itl_in[1])
            itl50_out, itl99_out = (number(itl_out[0]), number(itl_out[1])) if itl_out else (0.0, 0.0)
            critical = itl99_in > 1.0 and itl99_in > 10 * itl99_out
            uncached = big.prompt_tokens - min(big.cached_tokens, big.prompt_tokens)
            findings.append(Finding(
                "prefill_interference", "critical" if critical else "warning", engine, big.start, big.end,
                clip(f"{big.request_id} ({uncached // 1000}k uncached) prefill: ITL p99 {itl99_in:.2f}s vs "
                     f"{itl99_out * 1000:.0f}ms"),
                {"request_id": big.request_id, "prompt_tokens": big.prompt_tokens,
                 "cached_tokens": big.cached_tokens, "uncached_tokens": uncached, "chunk_tokens": int(chunk),
                 "prefill_s": round((big.end - big.start).total_seconds(), 1),
                 "step_p50_inside_ms": round(step_in, 1), "step_p50_decode_only_outside_ms": round(step_out, 1),
                 "itl_p50_inside_s": round(itl50_in, 3), "itl_p99_inside_s": round(itl99_in, 3),
                 "itl_p50_outside_s": round(itl50_out, 3), "itl_p99_outside_s": round(itl99_out, 3),
                 "itl_over_step_inside": round(itl50_in * 1000 / step_in, 2) if step_in else None,
                 "waiting_max_inside": int(waiting), "delayed_request_s": round(number(delayed), 1)},
                query.literal(), _chunk_lever(config, int(chunk)), number(delayed)))
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


def head_of_line_blocking(reader: Reads, window: Window) -> list[Finding]:
    """Many requests waited in the queue while one long prefill held the engine."""
    findings = []
    for engine in engines(reader, window):
        prefills, _ = long_prefills(reader, engine, window)
        for big in prefills:
            query = Query(_QUEUED_BEHIND, engine=engine, request_id=big.request_id,
                          prefill_start=big.start, prefill_end=big.end)
            rows = query.rows(reader)
            if not rows or int(rows[0][0]) < MIN_QUEUED:
                continue
            queued, total, worst_s, worst = int(rows[0][0]), number(rows[0][1]), number(rows[0][2]), rows[0][3]
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
    for engine in engines(reader, window):
        config = engine_config(reader, engine, window)
        threshold = config_int(config, "long_prefill_token_threshold") or 0
        budget = config_int(config, "max_num_batched_tokens") or 0
        if not threshold and not budget:
            continue
        query = Query(_OVER_THRESHOLD, engine=engine, start=window.start, end=window.end,
                      threshold=threshold or 2**31, budget=budget or 2**31)
        rows = query.rows(reader)
        if not rows or not rows[0][5]:
            continue
        over, max_single, over_budget, max_step, waiting, _prefill_steps = (int(v or 0) for v in rows[0])
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
