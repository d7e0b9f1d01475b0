"""Per-request figures vLLM does not give, from joining `requests` with the `steps` around each one.

Each decoding request gets one token per engine step, so the steps that ran while a request decoded
are its inter-token latencies: their tail is the request's ITL tail, and the worst of them is the
longest stall it saw. Steps that carried prefill tokens while it waited or decoded say how much of
its time went to someone else's prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from stepline.diagnosis.baseline import LONG_CHUNK_SHARE, budgets
from stepline.diagnosis.findings import Window
from stepline.queries.query import param
from stepline.queries.requests import FIRST_TOKEN, MERGED, PROMPT_BAND, SCHEDULED
from stepline.queries.window import EACH_ENGINE, ENGINE, SINCE
from stepline.store.reads import Reads, first_or_none, named

ORDER_BY = {
    "e2e": "e2e_seconds",
    "ttft": "ttft_seconds",
    "tpot": "mean_tpot_seconds",
    "queue": "queue_seconds",
}

def _slowest(column: str) -> str:
    """The slowest requests by `column` first, then only the steps of their engines and time span: the join stays
    small."""
    return f"""
WITH slow AS (
    SELECT host, engine, request_id, finish_reason, ts, arrival_ts, queue_seconds, ttft_seconds,
           mean_tpot_seconds, e2e_seconds, prompt_tokens, cached_tokens, generation_tokens,
           toUnixTimestamp64Micro(arrival_ts) AS arrival_us,
           toUnixTimestamp64Micro(ts) AS finish_us,
           arrival_us + toInt64(queue_seconds * 1e6) AS scheduled_us,
           arrival_us + toInt64(ttft_seconds * 1e6) AS first_token_us
    FROM {MERGED}
    WHERE {SINCE} AND {EACH_ENGINE} AND isFinite({column})
    ORDER BY {column} DESC
    LIMIT {param('limit', 'UInt32')}
),
near AS (
    SELECT host, engine, toUnixTimestamp64Micro(ts) AS step_us, elapsed_ms, num_ctx_tokens
    FROM steps
    WHERE (host, engine) GLOBAL IN (SELECT host, engine FROM slow)
      AND ts >= (SELECT min(arrival_ts) FROM slow) AND ts <= (SELECT max(ts) FROM slow)
)
SELECT slow.ts AS finished, slow.engine AS engine, slow.request_id AS request_id,
       slow.finish_reason AS finish_reason, slow.prompt_tokens AS prompt_tokens, slow.cached_tokens AS cached_tokens,
       slow.generation_tokens AS generation_tokens, slow.queue_seconds AS queue_s, slow.ttft_seconds AS ttft_s,
       slow.mean_tpot_seconds AS mean_tpot_s, slow.e2e_seconds AS e2e_s,
       sumIf(near.elapsed_ms, near.num_ctx_tokens > 0 AND near.step_us > slow.arrival_us
             AND near.step_us <= slow.scheduled_us) / 1000 AS queued_during_prefill_s,
       countIf(near.num_ctx_tokens >= transform(toString(slow.engine), {param('budget_engines', 'Array(String)')},
                                                {param('long_chunk', 'Array(UInt64)')}, {param('unknown', 'UInt64')})
               AND near.step_us > slow.first_token_us
               AND near.step_us <= slow.finish_us) AS tokens_beside_long_prefill,
       quantileExactIf(0.99)(near.elapsed_ms, near.step_us > slow.first_token_us
                             AND near.step_us <= slow.finish_us) AS step_p99_ms,
       maxIf(near.elapsed_ms, near.step_us > slow.first_token_us AND near.step_us <= slow.finish_us) AS worst_step_ms
FROM slow
GLOBAL LEFT JOIN near ON near.host = slow.host AND near.engine = slow.engine
GROUP BY slow.ts, slow.engine, slow.request_id, slow.finish_reason, slow.prompt_tokens, slow.cached_tokens,
         slow.generation_tokens, slow.queue_seconds, slow.ttft_seconds, slow.mean_tpot_seconds, slow.e2e_seconds
ORDER BY slow.{column} DESC
"""


@dataclass(frozen=True)
class SlowRequest:
    """One finished request with what the steps around it say."""

    finished: datetime
    engine: str
    request_id: str
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    generation_tokens: int
    queue_s: float
    ttft_s: float
    mean_tpot_s: float
    e2e_s: float
    queued_during_prefill_s: float
    tokens_beside_long_prefill: int
    step_p99_ms: float
    worst_step_ms: float
    long_chunk: str = ""  # what a long prefill chunk was for tokens_beside_long_prefill, e.g. ">= 512 (1024 / 2)"


def slowest(reader: Reads, *, since: float, limit: int = 20, by: str = "e2e", engine: str = "",
            long_prefill_tokens: int | None = None) -> list[SlowRequest]:
    """The `limit` slowest requests finished since `since` (epoch seconds), slowest first.

    A long prefill chunk is a step carrying at least `long_prefill_tokens` prefill tokens; by default,
    LONG_CHUNK_SHARE of its engine's token budget (max_num_batched_tokens, else the largest chunk it ran).
    """
    if by not in ORDER_BY:
        raise ValueError(f"--by must be one of {', '.join(ORDER_BY)}, got {by!r}")
    # The column comes from ORDER_BY, never from the caller's text: safe to splice.
    sql = _slowest(ORDER_BY[by])
    chunks: dict[str, tuple[int, str]] = {}
    if long_prefill_tokens is None:
        window = Window(datetime.fromtimestamp(since, UTC), datetime.now(UTC), engine)
        for name, (budget, source) in budgets(reader, window).items():
            chunks[name] = (max(1, round(LONG_CHUNK_SHARE * budget)),
                            f"{LONG_CHUNK_SHARE:g} of its token budget {budget} ({source})")
    parameters = {"since": round(since * 1e6), "engine": engine, "limit": limit,
                  "budget_engines": sorted(chunks), "long_chunk": [chunks[e][0] for e in sorted(chunks)],
                  "unknown": long_prefill_tokens if long_prefill_tokens is not None else 2**63}
    rows = named(reader.query(sql, parameters=parameters))
    given = f">= {long_prefill_tokens} prefill tokens (as asked)"
    return [SlowRequest(**row.as_dict(), long_chunk=given if long_prefill_tokens is not None else
                        (f">= {chunks[row.engine][0]} prefill tokens: {chunks[row.engine][1]}" if row.engine in chunks
                         else "unknown (no token budget seen)")) for row in rows]


def render(requests: Sequence[SlowRequest]) -> str:
    """An aligned table that fits in a wide terminal."""
    head = (f"{'finished':<8} {'request':<22} {'prompt':>7} {'cached':>7} {'gen':>5} {'queue':>6} {'TTFT':>6} "
            f"{'TPOT':>7} {'e2e':>6} {'q·pf':>5} {'tok·pf':>6} {'p99 st':>7} {'worst':>7}")
    lines = [head]
    for r in requests:
        lines.append(
            f"{r.finished:%H:%M:%S} {_short(r.request_id, 22):<22} {r.prompt_tokens:>7} {r.cached_tokens:>7} "
            f"{r.generation_tokens:>5} {_s(r.queue_s):>6} {_s(r.ttft_s):>6} {r.mean_tpot_s * 1000:>5.0f}ms "
            f"{_s(r.e2e_s):>6} {_s(r.queued_during_prefill_s):>5} {r.tokens_beside_long_prefill:>6} "
            f"{_ms(r.step_p99_ms):>7} {_ms(r.worst_step_ms):>7}"
        )
    lines.append("q·pf: seconds of prefill steps while it queued; tok·pf: its tokens decoded beside a long prefill "
                 "chunk; p99 st / worst: step times while it decoded (its ITL tail).")
    for engine, long_chunk in sorted({(r.engine, r.long_chunk) for r in requests}):
        lines.append(f"long prefill chunk on {engine}: a step carrying {long_chunk}.")
    return "\n".join(lines)


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _s(seconds: float) -> str:
    return "-" if seconds != seconds else f"{seconds:.1f}"  # NaN when a source did not say


def _ms(ms: Any) -> str:
    return "-" if ms is None or ms != ms or ms == 0 else f"{ms:.0f}ms"


# Prompt-size bands: decode rates differ by workload class, so they are reported per band, never as one number.
_BANDS = f"""
SELECT {PROMPT_BAND} AS band,
       min(prompt_tokens) AS lo, count() AS n,
       quantileExact(0.5)(ttft_seconds) AS ttft_p50, quantileExact(0.99)(ttft_seconds) AS ttft_p99,
       quantileExactIf(0.5)(1 / mean_tpot_seconds, mean_tpot_seconds > 0) AS rate_p50,
       quantileExactIf(0.01)(1 / mean_tpot_seconds, mean_tpot_seconds > 0) AS rate_p1
FROM {MERGED}
WHERE {ENGINE} AND {SINCE} AND isFinite(ttft_seconds)
GROUP BY band ORDER BY lo
"""

# The steps around the largest prompt's prefill, in 5-second buckets.
_AROUND = f"""
WITH big AS (
    SELECT request_id, prompt_tokens, {SCHEDULED} AS start, {FIRST_TOKEN} AS first_token
    FROM {MERGED}
    WHERE {ENGINE} AND {SINCE} AND isFinite(ttft_seconds)
    ORDER BY prompt_tokens DESC LIMIT 1
)
SELECT toStartOfInterval(ts, INTERVAL 5 SECOND) AS t, count() AS steps, sum(num_ctx_tokens) AS prefill_tokens,
       round(avg(num_generation_requests)) AS decoding, quantileExact(0.5)(elapsed_ms) AS step_p50,
       max(elapsed_ms) AS step_max, (SELECT any(request_id) FROM big) AS request,
       (SELECT any(prompt_tokens) FROM big) AS prompt
FROM steps
WHERE {ENGINE}
  AND ts >= (SELECT any(start) FROM big) - INTERVAL 20 SECOND
  AND ts <= (SELECT any(first_token) FROM big) + INTERVAL 20 SECOND
GROUP BY t ORDER BY t
"""


def by_prompt_band(reader: Reads, engine: str, since: float) -> str:
    """TTFT tails and per-request decode rates (as ranges) for each prompt-size band."""
    rows = named(reader.query(_BANDS, parameters={"engine": engine, "since": round(since * 1e6)}))
    if not rows:
        return "no finished requests on the timeline yet"
    lines = [f"{'prompt':<9} {'requests':>8} {'TTFT p50':>9} {'TTFT p99':>9}   decode tok/s per request (p1 .. p50)"]
    for r in rows:
        lines.append(f"{r.band:<9} {r.n:>8} {_s(r.ttft_p50):>8}s {_s(r.ttft_p99):>8}s   {_rate(r.rate_p1):>6} .. "
                     f"{_rate(r.rate_p50)}")
    return "\n".join(lines)


def around_largest_prefill(reader: Reads, engine: str, since: float) -> str:
    """Step times in 5-second buckets from 20 s before the largest prompt's prefill to 20 s after it."""
    rows = named(reader.query(_AROUND, parameters={"engine": engine, "since": round(since * 1e6)}))
    if not rows:
        return "no steps around a prefill on the timeline yet"
    request, prompt = rows[0].request, rows[0].prompt
    lines = [f"steps around the largest prefill ({request}, {prompt} prompt tokens):",
             f"{'time':<8} {'steps':>5} {'prefill tok':>11} {'decoding':>8} {'step p50':>9} {'step max':>9}"
             f" {'decode tok/s':>12}"]
    for r in rows:
        t, steps, prefill, decoding, p50, step_max = r.t, r.steps, r.prefill_tokens, r.decoding, r.step_p50, r.step_max
        lines.append(f"{t:%H:%M:%S} {steps:>5} {prefill:>11} {decoding:>8.0f} {p50:>7.0f}ms {step_max:>7.0f}ms"
                     f" {1000 / p50 if p50 else 0:>12.1f}")
    return "\n".join(lines)


def _rate(value: Any) -> str:
    return "-" if value is None or value != value else f"{value:.1f}"


def largest_prefill_start(reader: Reads, engine: str, since: float) -> datetime | None:
    """When the largest prompt since `since` began its prefill (UTC), if there is one."""
    row = first_or_none(reader.query(
        f"SELECT {SCHEDULED} AS scheduled FROM {MERGED} WHERE {ENGINE} AND {SINCE} AND isFinite(queue_seconds) "
        "ORDER BY prompt_tokens DESC LIMIT 1",
        parameters={"engine": engine, "since": round(since * 1e6)}))
    if row is None:
        return None
    start: datetime = row.scheduled
    return start if start.tzinfo else start.replace(tzinfo=UTC)
