"""A short per-minute summary of an engine's timeline, from SQL over `engine_samples`."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from stepline.rows import micros


class Reads(Protocol):
    """Anything that answers a query with rows: a clickhouse-connect client or the Store."""

    def query(self, sql: str, parameters: dict[str, Any] | None = None) -> Any: ...


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """The q-quantile of cumulative (upper bound, count) buckets, interpolated as Prometheus does."""
    ordered = sorted(buckets)
    if not ordered or ordered[-1][1] <= 0:
        return None
    rank = q * ordered[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in ordered:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound  # the quantile lies past the last finite bucket: its bound is all we know
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return None


@dataclass(frozen=True)
class MinuteSummary:
    """One minute of one engine."""

    minute: datetime
    generation_tokens_per_s: float
    prompt_tokens_per_s: float
    requests_finished: int
    itl_p99_s: float | None
    ttft_p99_s: float | None
    waiting_max: float
    running_max: float
    kv_usage_max: float
    preemptions: int


# Counter deltas and gauges per minute. Deltas are reset-safe, so sums never go negative.
_PER_MINUTE = """
SELECT toStartOfMinute(ts) AS minute,
       sumIf(delta, metric = 'vllm:generation_tokens_total') AS gen,
       sumIf(delta, metric = 'vllm:prompt_tokens_total') AS prompt,
       sumIf(delta, metric = 'vllm:request_success_total') AS finished,
       maxIf(value, metric = 'vllm:num_requests_waiting') AS waiting,
       maxIf(value, metric = 'vllm:num_requests_running') AS running,
       maxIf(value, metric = 'vllm:kv_cache_usage_perc') AS kv,
       sumIf(delta, metric = 'vllm:num_preemptions_total') AS preempted,
       dateDiff('millisecond', min(ts), max(ts)) / 1000.0 AS covered_s
FROM engine_samples
WHERE engine = {engine:String} AND ts >= fromUnixTimestamp64Micro({since:Int64}, 'UTC')
GROUP BY minute ORDER BY minute
"""

_BUCKETS = """
SELECT toStartOfMinute(ts) AS minute, metric, toFloat64(labels['le']) AS le, sum(delta) AS n
FROM engine_samples
WHERE engine = {engine:String} AND kind = 'bucket' AND ts >= fromUnixTimestamp64Micro({since:Int64}, 'UTC')
  AND metric IN ('vllm:inter_token_latency_seconds_bucket', 'vllm:time_to_first_token_seconds_bucket')
GROUP BY minute, metric, le
"""


def per_minute(reader: Reads, engine: str, since: float = 0.0) -> list[MinuteSummary]:
    """Generation rate, latency tails and queue depth per minute for one engine, from `since` on."""
    params = {"engine": engine, "since": micros(since)}
    buckets: dict[tuple[datetime, str], list[tuple[float, float]]] = defaultdict(list)
    for minute, metric, le, n in reader.query(_BUCKETS, parameters=params).result_rows:
        buckets[(minute, metric)].append((le, n))
    out = []
    for minute, gen, prompt, finished, waiting, running, kv, preempted, covered_s in reader.query(
        _PER_MINUTE, parameters=params
    ).result_rows:
        # A partly covered minute (the first and last) is rated over the time it covers.
        seconds = max(1.0, min(60.0, covered_s + 1.0))
        out.append(MinuteSummary(
            minute, gen / seconds, prompt / seconds, int(finished),
            histogram_quantile(0.99, buckets.get((minute, "vllm:inter_token_latency_seconds_bucket"), [])),
            histogram_quantile(0.99, buckets.get((minute, "vllm:time_to_first_token_seconds_bucket"), [])),
            waiting, running, kv, int(preempted),
        ))
    return out


def trim_idle(summary: Sequence[MinuteSummary]) -> list[MinuteSummary]:
    """Without the idle minutes after the last one that saw any work."""
    busy = [i for i, m in enumerate(summary) if m.generation_tokens_per_s or m.running_max or m.waiting_max]
    return list(summary[: busy[-1] + 1]) if busy else []


def render(summary: Sequence[MinuteSummary]) -> str:
    """The summary as an 80-column table."""
    lines = [f"{'minute (UTC)':<12} {'gen tok/s':>9} {'done':>5} {'ITL p99':>8} {'TTFT p99':>9} "
             f"{'waiting':>7} {'running':>7} {'KV max':>6} {'preempt':>7}"]
    for m in summary:
        lines.append(
            f"{m.minute:%H:%M}{'':<7} {m.generation_tokens_per_s:>9.1f} {m.requests_finished:>5d} "
            f"{_seconds(m.itl_p99_s):>8} {_seconds(m.ttft_p99_s):>9} {m.waiting_max:>7.0f} {m.running_max:>7.0f} "
            f"{m.kv_usage_max:>6.0%} {m.preemptions:>7d}"
        )
    return "\n".join(lines)


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f}ms" if value < 1 else f"{value:.1f}s"
