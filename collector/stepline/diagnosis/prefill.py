"""Long prefills: decode starvation beside them, requests queued behind them, and chunking settings not in effect."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from stepline.diagnosis.baseline import (
    CRITICAL_SLOWDOWN,
    HOL_DRAINED,
    HOL_QUEUE_STEPS,
    ITL_STALL_S,
    LONG_PROMPT_CHUNKS,
    MIN_QUEUED,
    NO_BASELINE,
    OWN_STEPS_SHARE,
    SEVERE_SLOWDOWN,
    SLOWDOWN,
    Baseline,
    baselines,
    budgets,
    times,
)
from stepline.diagnosis.common import (
    clip,
    config_int,
    engine_configs,
    engines,
    number,
    utc,
    window_summary,
)
from stepline.diagnosis.findings import Finding, Window
from stepline.diagnosis.runs import PrefillRun, prefill_runs
from stepline.queries.baselines import DECODE_STEP_P50, ITL_P50_P99
from stepline.queries.query import Query, Spans, moment, param, which_span
from stepline.queries.requests import FIRST_TOKEN, SCHEDULED, merged_matching
from stepline.queries.steps import OF_ENGINE, of_engine
from stepline.queries.window import EACH_ENGINE, ENGINES, between
from stepline.store.reads import Reads, Row

# The largest uncached prompts of every engine (the window's engine only, when it names one): long on that engine
# when their uncached tokens span LONG_PROMPT_CHUNKS of its token budget (an engine of unknown budget has none).
# Their span runs from the end of their queue time to their first token, then narrows to the steps (_carried_sql).
_REQUEST_FIELDS = ("ts", "arrival_ts", "prompt_tokens", "cached_tokens", "queue_seconds", "ttft_seconds")
_FINISHED_LARGE = (f"{EACH_ENGINE} AND ts >= {moment('start')} AND arrival_ts <= {moment('end')} "
                   f"AND prompt_tokens >= {param('least_uncached', 'UInt64')}")
_LONG_PREFILLS = f"""
SELECT engine, request_id, prompt_tokens, cached_tokens, {SCHEDULED} AS prefill_start, {FIRST_TOKEN} AS prefill_end
FROM {merged_matching(_FINISHED_LARGE, _REQUEST_FIELDS)}
WHERE isFinite(queue_seconds) AND isFinite(ttft_seconds)
  AND prompt_tokens - least(cached_tokens, prompt_tokens) >= transform(toString(engine),
      {param('budget_engines', 'Array(String)')}, {param('min_uncached', 'Array(UInt64)')},
      {param('unknown', 'UInt64')})
ORDER BY engine, prompt_tokens DESC, request_id
LIMIT 5 BY engine
"""


# The steps that carried each candidate's prefill: those with prefill tokens between the end of its queue time and
# its first token. vLLM's queue time leaves out tokenisation, so the first chunk runs a little after the queue time
# ends (0.13 s on a CPU engine): the span starts at the first chunk, not at the queue's end, and so holds no
# decode-only step of before the prefill.
def _carried_sql(spans: Spans) -> str:
    return f"""
SELECT k, min(ts) AS first, max(ts) AS last, argMin(elapsed_ms, ts) AS first_ms
FROM (SELECT ts, elapsed_ms, {spans.every} AS spans FROM steps PREWHERE num_ctx_tokens > 0 AND {spans.inside})
ARRAY JOIN spans AS k
GROUP BY k
"""


# The steps inside each prefill's span (its steps in the window), all prefills at once (few steps), for their figures
# against the engine's decode-only steps (baseline.baselines, once per engine). `spans` are the prefills' (engine,
# interval) spans (queries.query.which_span); k numbers them from 0.
def _inside_sql(spans: Spans) -> str:
    return f"""
SELECT k, count() AS steps_inside, quantileExact(0.5)(elapsed_ms) AS step_p50_inside_ms,
       max(num_ctx_tokens) AS chunk_tokens, sum(length(itl_seconds)) AS itl_samples_inside,
       quantilesExactArray(0.5, 0.99)(itl_seconds) AS itl_inside_s,
       sum(elapsed_ms * num_generation_requests) / 1000 AS delayed_request_s, max(waiting) AS waiting_max_inside,
       countIf(num_ctx_requests = 1) / count() AS own_steps_share
FROM (SELECT *, {spans.which} AS k FROM steps PREWHERE {spans.inside})
GROUP BY k
"""


# What a finding shows: its prefill's row of what runs (_inside_sql over its one span), beside the decode-only figures
# of its engine's steps in the window that its baseline is read from when exact (queries.baselines.DECODE_EXACT).
def _interference_sql(spans: Spans) -> str:
    return f"""
SELECT inside.* EXCEPT (k), outside.*
FROM ({_inside_sql(spans)}) AS inside
CROSS JOIN (SELECT {DECODE_STEP_P50} AS step_p50_decode_only_outside_ms, {ITL_P50_P99} AS itl_outside_s
            FROM steps WHERE {OF_ENGINE}) AS outside
"""


# Every request that arrived while a long prefill of its engine ran and queued at least that prefill's min_queue_s
# (HOL_QUEUE_STEPS of its engine's decode-only steps), once per prefill (k, 1-based): a request already waiting
# when the prefill started was queued for another reason.
_QUEUED_LONG = (f"{ENGINES} AND queue_seconds >= {param('least_queue_s', 'Float64')} AND queue_seconds > 0 "
                f"AND arrival_ts < {moment('hi')} AND ts > {moment('lo')}")
_QUEUED_BEHIND_EACH = f"""
SELECT k, count() AS queued_requests, sum(queue_seconds) AS queue_total_s, max(queue_seconds) AS queue_max_s,
       arraySlice(arrayReverseSort(x -> x.2, groupArray((request_id, queue_seconds))), 1, 3) AS worst
FROM {merged_matching(_QUEUED_LONG, ("ts", "arrival_ts", "queue_seconds"))}
ARRAY JOIN arrayFilter(i -> engine = {param('engines', 'Array(String)')}[i]
    AND request_id != {param('ids', 'Array(String)')}[i]
    AND queue_seconds >= {param('min_queue_s', 'Array(Float64)')}[i]
    AND arrival_ts < fromUnixTimestamp64Micro({param('ends', 'Array(Int64)')}[i], 'UTC')
    AND arrival_ts >= fromUnixTimestamp64Micro({param('starts', 'Array(Int64)')}[i], 'UTC'),
    arrayEnumerate({param('ids', 'Array(String)')})) AS k
GROUP BY k
"""
# The finished request behind each run of long chunks (runs.prefill_runs; k, 1-based), when there is one: on the
# run's engine, arrived before its first chunk, first token at or after its last, with at least the run's tokens
# uncached; the largest such. A run no finished request explains is a prefill still running (or never finished).
_FINISHED_LARGE_AROUND = (f"{ENGINES} AND prompt_tokens >= {param('least_tokens', 'UInt64')} "
                          f"AND ts >= {moment('lo')} AND arrival_ts <= {moment('hi')}")
_RUN_REQUESTS = f"""
SELECT k, argMax((request_id, prompt_tokens, cached_tokens, {SCHEDULED}), prompt_tokens) AS request
FROM {merged_matching(_FINISHED_LARGE_AROUND, _REQUEST_FIELDS)}
ARRAY JOIN arrayFilter(i -> engine = {param('engines', 'Array(String)')}[i]
    AND arrival_ts <= fromUnixTimestamp64Micro({param('starts', 'Array(Int64)')}[i], 'UTC')
    AND {FIRST_TOKEN} >= fromUnixTimestamp64Micro({param('ends', 'Array(Int64)')}[i], 'UTC')
    AND prompt_tokens - least(cached_tokens, prompt_tokens) >= {param('tokens', 'Array(UInt64)')}[i],
    arrayEnumerate({param('engines', 'Array(String)')})) AS k
WHERE isFinite(ttft_seconds) AND isFinite(queue_seconds)
GROUP BY k
"""
# The first token comes with the step of the last chunk (both stamped with vLLM's iteration timestamp), but arrival
# plus TTFT, in float seconds, can land a microsecond or so before that step's stamp.
ROUNDING = timedelta(milliseconds=1)
# A request queued behind a prefill finished after the prefill started: its row lies after that (with slack for
# clocks that disagree), which bounds what _QUEUED_BEHIND_EACH reads.
FINISH_SLACK = timedelta(minutes=1)


@dataclass(frozen=True)
class LongPrefill:
    """One finished request whose uncached prompt took many steps to prefill, over the steps that carried it."""

    request_id: str
    prompt_tokens: int
    cached_tokens: int
    start: datetime  # its first chunk's step (the end of its queue time when no step carried it)
    end: datetime  # its last chunk's step (its first token when no step carried it)
    queue_end: datetime  # arrival + queue time, as the engine reports it
    min_uncached_tokens: int  # what made it long on its engine (LONG_PROMPT_CHUNKS token budgets)
    first_chunk_ran: timedelta = timedelta(0)  # the first chunk's step time: it started that long before `start`
    in_flight: bool = False  # seen in the steps only: no finished request in the window was it (yet)

    @property
    def began(self) -> datetime:
        """When its first chunk's step began."""
        return self.start - self.first_chunk_ran

    @property
    def name(self) -> str:
        """How a title names it: its request, or what it has prefilled so far."""
        if self.in_flight:
            return f"a prefill of {self.prompt_tokens // 1000}k tokens so far"
        uncached = self.prompt_tokens - min(self.cached_tokens, self.prompt_tokens)
        return f"{self.request_id} ({uncached // 1000}k uncached)"


def long_prefills(reader: Reads, window: Window) -> dict[str, list[LongPrefill]]:
    """engine -> the largest uncached prompts prefilled in the window, largest first, none overlapping a larger one."""
    known = budgets(reader, window)
    names = sorted(known)
    minimums = {e: round(LONG_PROMPT_CHUNKS * known[e][0]) for e in names}
    candidates = [(str(r.engine), LongPrefill(str(r.request_id), int(r.prompt_tokens), int(r.cached_tokens),
                                              utc(r.prefill_start), utc(r.prefill_end), utc(r.prefill_start),
                                              minimums.get(str(r.engine), 0)))
                  for r in Query(_LONG_PREFILLS, engine=window.engine, start=window.start, end=window.end,
                                 budget_engines=names, min_uncached=[minimums[e] for e in names], unknown=2**63,
                                 least_uncached=min(minimums.values(), default=2**63)).rows(reader)]
    found: dict[str, list[LongPrefill]] = {}
    for engine, big in _carried(reader, candidates):
        others = found.setdefault(engine, [])
        if not any(big.start <= other.end and other.start <= big.end for other in others):
            others.append(big)
    # A long prefill still running (or never finished) is in the steps only: named by its tokens so far. A run a
    # finished request explains (one smaller than the largest few read above) is named by that request.
    runs = [(engine, run) for engine, each in prefill_runs(reader, window).items() for run in each
            if not any(run.start <= other.end and other.start <= run.end for other in found.get(engine, []))]
    for (engine, run), request in zip(runs, _run_requests(reader, runs), strict=True):
        others = found.setdefault(engine, [])
        if any(run.start <= other.end and other.start <= run.end for other in others):
            continue
        if request is None:
            others.append(LongPrefill("", run.tokens, 0, run.start, run.end, run.start, run.min_tokens,
                                      run.first_chunk_ran, in_flight=True))
        else:
            rid, prompt, cached, queue_end = request
            others.append(LongPrefill(str(rid), int(prompt), int(cached), run.start, run.end, utc(queue_end),
                                      run.min_tokens, run.first_chunk_ran))
    return {engine: bigs for engine, bigs in found.items() if bigs}


def _run_requests(reader: Reads, runs: list[tuple[str, PrefillRun]]) -> list[tuple[Any, ...] | None]:
    """Per run, the finished request that it was part of (_RUN_REQUESTS), or None."""
    if not runs:
        return []
    rows = Query(_RUN_REQUESTS, engines=[e for e, _ in runs],
                 starts=[round(r.start.timestamp() * 1e6) for _, r in runs],
                 ends=[round((r.end - ROUNDING).timestamp() * 1e6) for _, r in runs],
                 tokens=[r.tokens for _, r in runs], least_tokens=min(r.tokens for _, r in runs),
                 lo=min(r.end for _, r in runs) - ROUNDING, hi=max(r.start for _, r in runs)).rows(reader)
    found = {int(r.k) - 1: tuple(r.request) for r in rows}
    return [found.get(i) for i in range(len(runs))]


def _carried(reader: Reads, candidates: list[tuple[str, LongPrefill]]) -> list[tuple[str, LongPrefill]]:
    """The candidates, each span narrowed to the steps that carried prefill tokens within it (_carried_sql)."""
    if not candidates:
        return candidates
    which = which_span([(e, b.start, b.end + ROUNDING) for e, b in candidates])
    spans = {int(r.k): r for r in Query(_carried_sql(which), **which.parameters).rows(reader)}
    return [(engine, replace(big, start=utc(span.first), end=utc(span.last),
                             first_chunk_ran=timedelta(milliseconds=number(span.first_ms)))
             if (span := spans.get(i)) is not None else big) for i, (engine, big) in enumerate(candidates)]


def _span(window: Window, big: LongPrefill) -> tuple[datetime, datetime]:
    """The part of the prefill in the window (empty, from > to, where they do not meet)."""
    return max(window.start, big.start), min(window.end, big.end)


def _inside(reader: Reads, window: Window, prefills: dict[str, list[LongPrefill]]
            ) -> dict[tuple[str, int], Row]:
    """(engine, k) -> the row of _inside_sql for prefills[engine][k], when it has steps in the window."""
    spans = [(engine, k, *_span(window, big))
             for engine, bigs in sorted(prefills.items()) for k, big in enumerate(bigs)]
    spans = [span for span in spans if span[2] <= span[3]]
    if not spans:
        return {}
    which = which_span([(engine, lo, hi) for engine, _k, lo, hi in spans])
    owners = [(engine, k) for engine, k, _lo, _hi in spans]
    return {owners[int(r.k)]: r for r in Query(_inside_sql(which), **which.parameters).rows(reader)}


def _interference(window: Window, engine: str, big: LongPrefill) -> Query:
    """What the finding on `big` shows (_interference_sql): the same figures as the read of every prefill at once."""
    which = which_span([(engine, *_span(window, big))])
    return Query(_interference_sql(which), **which.parameters, engine=engine, start=window.start, end=window.end)


def prefill_interference(reader: Reads, window: Window) -> list[Finding]:
    """Steps carrying a long prefill are slow, and every decoding request's ITL becomes that step time."""
    findings = []
    configs = engine_configs(reader, window)
    prefills = long_prefills(reader, window)
    inside = _inside(reader, window, prefills)
    base = baselines(reader, window, sorted({engine for engine, _ in inside})) if inside else {}
    for engine in engines(reader, window):
        config = configs.get(engine, {})
        b = base.get(engine, NO_BASELINE)
        for k, big in enumerate(prefills.get(engine, [])):
            row = inside.get((engine, k))
            if row is None or not row.steps_inside:
                continue
            step_in, chunk, itl_n, itl_in, delayed, waiting, own = (
                row.step_p50_inside_ms, row.chunk_tokens, row.itl_samples_inside, row.itl_inside_s,
                row.delayed_request_s, row.waiting_max_inside, row.own_steps_share)
            step_in = number(step_in)
            # Relative to this engine's own decode-only steps; without any there is nothing to compare with. Its
            # own steps: where most steps of the span carry other prefills too, the span is slow for their sake.
            if (itl_n == 0 or b.decode_step_ms <= 0 or step_in < SLOWDOWN * b.decode_step_ms
                    or number(own) < OWN_STEPS_SHARE):
                continue
            itl50_in, itl99_in = (number(q) for q in itl_in)  # [p50, p99]
            itl99_out = b.itl_p99_s
            critical = _critical(itl99_in, itl99_out)
            uncached = big.prompt_tokens - min(big.cached_tokens, big.prompt_tokens)
            evidence = _evidence(big, b, uncached, int(chunk), step_in, (itl50_in, itl99_in))
            evidence.update({"itl_over_step_inside": round(itl50_in * 1000 / step_in, 2) if step_in else None,
                             "waiting_max_inside": int(waiting), "delayed_request_s": round(number(delayed), 1),
                             "own_steps_share": round(number(own), 3),
                             "own_steps_from": f"{OWN_STEPS_SHARE:.0%} of the span's steps with no other prefill"})
            if big.in_flight:
                evidence["in_flight"] = (f"no finished request in the window was this prefill: {big.prompt_tokens} "
                                         f"tokens prefilled in the window's steps so far")
            findings.append(Finding(
                "prefill_interference", "critical" if critical else "warning", engine, big.start, big.end,
                clip(f"{big.name} prefill: ITL p99 {itl99_in:.2f}s vs {itl99_out * 1000:.0f}ms"),
                evidence, _interference(window, engine, big).literal(), _chunk_lever(config, int(chunk)),
                number(delayed)))
    return findings


def _critical(itl99_in: float, itl99_out: float) -> bool:
    """SEVERE_SLOWDOWN of the engine's own ITL p99 on any engine, or CRITICAL_SLOWDOWN where readers see stalls."""
    if itl99_out <= 0:
        return False
    slowdown = itl99_in / itl99_out
    return slowdown >= SEVERE_SLOWDOWN or (slowdown >= CRITICAL_SLOWDOWN and itl99_in >= ITL_STALL_S)


def _evidence(big: LongPrefill, b: Baseline, uncached: int, chunk: int, step_in: float,
              itl_in: tuple[float, float]) -> dict[str, Any]:
    """The figures compared first (a terminal shows the first eight), then what they were compared with."""
    itl50_in, itl99_in = itl_in
    return {
        "request_id": big.request_id, "uncached_tokens": uncached,
        "step_p50_inside_ms": round(step_in, 1), "step_p50_decode_only_outside_ms": round(b.decode_step_ms, 1),
        "step_slowdown": f"{times(step_in, b.decode_step_ms)} (interference from {SLOWDOWN:g}x)",
        "itl_p99_inside_s": round(itl99_in, 3), "itl_p99_outside_s": round(b.itl_p99_s, 3),
        "itl_p99_slowdown": f"{times(itl99_in, b.itl_p99_s)} (critical from {SEVERE_SLOWDOWN:g}x, or "
                            f"{CRITICAL_SLOWDOWN:g}x with ITL p99 >= {ITL_STALL_S:g}s)",
        "itl_p50_inside_s": round(itl50_in, 3), "itl_p50_outside_s": round(b.itl_p50_s, 3),
        "prompt_tokens": big.prompt_tokens, "cached_tokens": big.cached_tokens, "chunk_tokens": chunk,
        "long_from_uncached_tokens": big.min_uncached_tokens, **b.evidence(),
        "prefill_s": round((big.end - big.start).total_seconds(), 1),
        "first_chunk_after_queue_end_s": round((big.start - big.first_chunk_ran - big.queue_end).total_seconds(), 3),
    }


def _chunk_lever(config: dict[str, str], chunk: int) -> str:
    threshold = config_int(config, "long_prefill_token_threshold")
    budget = config_int(config, "max_num_batched_tokens")
    now = ", ".join(f"{k}={v}" for k, v in (("long_prefill_token_threshold", threshold),
                                             ("max_num_batched_tokens", budget)) if v is not None)
    smaller = max(1, chunk // 4)
    return (f"bound each step's prefill: set --long-prefill-token-threshold (e.g. {smaller}) and/or lower "
            f"--max-num-batched-tokens (chunk size, {chunk} tokens seen in one step)"
            + (f"; configured now: {now}" if now else "")
            + "; or route monster prompts to an engine of their own")


def _queued_behind_each(prefills: Sequence[tuple[str, LongPrefill]], min_queue_s: dict[str, float]) -> Query:
    """_QUEUED_BEHIND_EACH over `prefills` (engine, prefill), numbered from 1: what runs for them all, and what a
    finding shows for its one."""
    return Query(_QUEUED_BEHIND_EACH, engines=[e for e, _ in prefills], ids=[b.request_id for _, b in prefills],
                 min_queue_s=[min_queue_s.get(e, 0.0) for e, _ in prefills],
                 starts=[b.began for _, b in prefills], ends=[b.end for _, b in prefills],
                 lo=min(b.began for _, b in prefills) - FINISH_SLACK, hi=max(b.end for _, b in prefills),
                 # The row's own filter first: the per-prefill test runs on the few that queued that long.
                 least_queue_s=min(min_queue_s.get(e, 0.0) for e, _ in prefills))


def _queued_behind(reader: Reads, prefills: dict[str, list[LongPrefill]], min_queue_s: dict[str, float]
                   ) -> dict[tuple[str, int], Row]:
    """(engine, k) -> the row _QUEUED_BEHIND_EACH gives for prefills[engine][k], when any request queued behind
    it."""
    flat = [(engine, k, big) for engine, bigs in sorted(prefills.items()) for k, big in enumerate(bigs)]
    if not flat:
        return {}
    rows = _queued_behind_each([(e, b) for e, _, b in flat], min_queue_s).rows(reader)
    owners = [(engine, k) for engine, k, _ in flat]
    return {owners[int(r.k) - 1]: r for r in rows}


def head_of_line_blocking(reader: Reads, window: Window) -> list[Finding]:
    """Many requests waited in the queue while one long prefill held the engine."""
    findings = []
    prefills = long_prefills(reader, window)
    base = baselines(reader, window, sorted(prefills)) if prefills else {}
    # Held up by a prefill: queued for HOL_QUEUE_STEPS of the engine's own decode-only steps.
    min_queue_s = {engine: HOL_QUEUE_STEPS * b.decode_step_ms / 1000 for engine, b in base.items()}
    queued_behind = _queued_behind(reader, prefills, min_queue_s)
    for engine in engines(reader, window):
        for k, big in enumerate(prefills.get(engine, [])):
            row = queued_behind.get((engine, k))
            if row is None or int(row.queued_requests) < MIN_QUEUED:
                continue
            # The queue formed because of it: it grew while the prefill ran and drained after.
            shape = _queue_shape(reader, engine, big)
            if shape is None:
                continue
            queued, total, worst_s, worst = (int(row.queued_requests), number(row.queue_total_s),
                                             number(row.queue_max_s), row.worst)
            findings.append(Finding(
                "head_of_line_blocking", "warning", engine, big.start, big.end,
                clip(f"{queued} requests queued behind {big.name}, up to {worst_s:.0f}s"),
                {"request_id": big.request_id, "prompt_tokens": big.prompt_tokens, "queued_requests": queued,
                 "queue_total_s": round(total, 1), "queue_max_s": round(worst_s, 1),
                 "longest_queued": [f"{rid} {q:.1f}s" for rid, q in worst],
                 "counted_from_queue_s": round(min_queue_s.get(engine, 0.0), 3),
                 "counted_from": f"{HOL_QUEUE_STEPS:g} decode-only steps of "
                                 f"{base.get(engine, NO_BASELINE).decode_step_ms:.1f} ms (p50)",
                 "uncached_tokens": big.prompt_tokens - min(big.cached_tokens, big.prompt_tokens),
                 "long_from_uncached_tokens": big.min_uncached_tokens, **shape},
                _queued_behind_each([(engine, big)], min_queue_s).literal(),
                "admit long prompts apart from short ones (a separate engine or a priority policy), and bound "
                "per-step prefill (--long-prefill-token-threshold) so short prompts are scheduled beside it",
                total))
    return findings


# The waiting queue just before a prefill, at its peak while the prefill ran, and at its lowest within one prefill's
# length after it.
_QUEUE_SHAPE = f"""
SELECT argMaxIf(waiting, ts, ts < {moment('began')}) AS waiting_before,
       maxIf(waiting, {between("began", "end")}) AS waiting_peak_inside,
       minIf(waiting, ts > {moment('end')}) AS waiting_min_after,
       countIf(ts > {moment('end')}) AS steps_after
FROM steps
WHERE {of_engine(start="lo", end="hi")}
"""


def _queue_shape(reader: Reads, engine: str, big: LongPrefill) -> dict[str, Any] | None:
    """The queue's figures around the prefill when it grew by MIN_QUEUED while the prefill ran and drained by
    HOL_DRAINED of that after it; None otherwise (an overload's queue grows before and stays after)."""
    span = big.end - big.began
    (row,) = Query(_QUEUE_SHAPE, engine=engine, began=big.began, end=big.end, lo=big.began - span,
                   hi=big.end + span).rows(reader)
    before, peak, after, steps_after = (int(number(v)) for v in (
        row.waiting_before, row.waiting_peak_inside, row.waiting_min_after, row.steps_after))
    grew = peak - before
    if grew < MIN_QUEUED or steps_after == 0 or after > before + (1 - HOL_DRAINED) * grew:
        return None
    return {"waiting_before": before, "waiting_peak_inside": peak, "waiting_min_after": after,
            "queue_rule": f"grew by {MIN_QUEUED}+ during the prefill, drained by {HOL_DRAINED:.0%} of that within "
                          "one prefill's length after"}


_OVER_THRESHOLD = f"""
SELECT countIf(num_ctx_requests = 1 AND num_ctx_tokens > {param('threshold', 'UInt32')}) AS over_threshold,
       maxIf(num_ctx_tokens, num_ctx_requests = 1) AS max_single_prefill,
       countIf(num_ctx_tokens + num_generation_tokens > {param('budget', 'UInt32')}) AS over_budget,
       max(num_ctx_tokens + num_generation_tokens) AS max_step_tokens,
       max(waiting) AS waiting_max, countIf(num_ctx_tokens > 0) AS prefill_steps
FROM steps
WHERE {OF_ENGINE}
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
            (row,) = query.rows(reader)
            over, max_single, over_budget, max_step, waiting = (int(v or 0) for v in (
                row.over_threshold, row.max_single_prefill, row.over_budget, row.max_step_tokens, row.waiting_max))
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
