"""A short per-minute summary of an engine's timeline, from SQL over `engine_samples`."""

from __future__ import annotations

import math
import textwrap
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from stepline.model.rows import micros
from stepline.queries.window import ENGINE, SINCE
from stepline.store.reads import Reads, named

# A bucket whose upper bound is at least this many times its lower bound: a figure interpolated inside it may be
# off by half of itself, so it is printed with its bucket (vLLM's TTFT buckets double from 10 s to 160 s).
COARSE_BUCKET_RATIO = 2.0


@dataclass(frozen=True)
class Quantile:
    """A quantile of histogram buckets: Prometheus' figure, and the bucket (lower, upper] it lies in."""

    value: float
    lower: float
    upper: float  # inf: past the last finite bucket, and `value` is that bucket's bound (a floor, not a figure)

    @property
    def capped(self) -> bool:
        return math.isinf(self.upper)

    @property
    def coarse(self) -> bool:
        """Interpolated inside a bucket too wide for the figure to stand alone."""
        return self.lower < self.upper < math.inf and (self.lower <= 0
                                                        or self.upper >= COARSE_BUCKET_RATIO * self.lower)


def bucket_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> Quantile | None:
    """The q-quantile (0..1) of cumulative (upper bound, count) buckets, as Prometheus' histogram_quantile computes
    it (promql/quantile.go, bucketQuantile); None where it would return NaN.

    Buckets of one bound are merged and counts made monotonic; without a +Inf bucket, with fewer than two buckets
    or no observations there is no answer. The rank q*total is found in the first bucket whose count reaches it and
    interpolated linearly inside it, from 0 for the first bucket when its bound is positive (else that bound is the
    answer). A rank in the +Inf bucket answers the last finite bound.
    """
    if not 0 <= q <= 1:  # Prometheus: NaN for NaN, -Inf below 0, +Inf above 1; none of them is a latency
        return None
    ordered = _monotonic(_coalesced(sorted(buckets)))
    if len(ordered) < 2 or not math.isinf(ordered[-1][0]) or ordered[-1][1] <= 0:
        return None
    rank = q * ordered[-1][1]
    b = next(i for i, (_, count) in enumerate(ordered) if i == len(ordered) - 1 or count >= rank)
    if b == len(ordered) - 1:
        bound = ordered[-2][0]
        return Quantile(bound, bound, math.inf)
    end, count = ordered[b]
    if b == 0 and end <= 0:
        return Quantile(end, end, end)  # no lower bound is known: the bound is the answer
    start = 0.0
    if b > 0:
        start, below = ordered[b - 1]
        count -= below
        rank -= below
    if count <= 0:  # q = 0 in an empty first bucket: 0/0 in Prometheus too
        return None
    return Quantile(start + (end - start) * (rank / count), start, end)


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """The q-quantile of cumulative (upper bound, count) buckets, as Prometheus computes it; None for its NaN."""
    found = bucket_quantile(q, buckets)
    return None if found is None else found.value


def _coalesced(ordered: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for bound, count in ordered:
        if merged and merged[-1][0] == bound:
            merged[-1] = (bound, merged[-1][1] + count)
        else:
            merged.append((bound, count))
    return merged


def _monotonic(ordered: list[tuple[float, float]]) -> list[tuple[float, float]]:
    # Prometheus first evens out float noise (a relative change of at most 1e-12 is none), then takes the envelope:
    # a bucket never counts fewer than the one below it (per-minute sums of deltas can break that).
    out: list[tuple[float, float]] = []
    previous = ordered[0][1] if ordered else 0.0
    for i, (bound, count) in enumerate(ordered):
        if i and count != previous:
            if count != 0 and abs(count - previous) / count <= 1e-12:
                count = previous
            else:
                previous = count
        out.append((bound, count))
    highest = -math.inf
    return [(bound, highest := max(highest, count)) for bound, count in out]


@dataclass(frozen=True)
class MinuteSummary:
    """One minute of one engine."""

    minute: datetime
    generation_tokens_per_s: float
    prompt_tokens_per_s: float
    requests_finished: int
    itl_p99: Quantile | None
    ttft_p99: Quantile | None
    waiting_max: float
    running_max: float
    kv_usage_max: float
    preemptions: int


# Counter deltas and gauges per minute. Deltas are reset-safe, so sums never go negative.
_PER_MINUTE = f"""
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
WHERE {ENGINE} AND {SINCE}
GROUP BY minute ORDER BY minute
"""

_BUCKETS = f"""
SELECT toStartOfMinute(ts) AS minute, metric, toFloat64(labels['le']) AS le, sum(delta) AS n
FROM engine_samples
WHERE {ENGINE} AND kind = 'bucket' AND {SINCE}
  AND metric IN ('vllm:inter_token_latency_seconds_bucket', 'vllm:time_to_first_token_seconds_bucket')
GROUP BY minute, metric, le
"""


def per_minute(reader: Reads, engine: str, since: float = 0.0) -> list[MinuteSummary]:
    """Generation rate, latency tails and queue depth per minute for one engine, from `since` on."""
    params = {"engine": engine, "since": micros(since)}
    buckets: dict[tuple[datetime, str], list[tuple[float, float]]] = defaultdict(list)
    for b in named(reader.query(_BUCKETS, parameters=params)):
        buckets[(b.minute, b.metric)].append((b.le, b.n))
    out = []
    for r in named(reader.query(_PER_MINUTE, parameters=params)):
        # A partly covered minute (the first and last) is rated over the time it covers.
        seconds = max(1.0, min(60.0, r.covered_s + 1.0))
        out.append(MinuteSummary(
            r.minute, r.gen / seconds, r.prompt / seconds, int(r.finished),
            bucket_quantile(0.99, buckets.get((r.minute, "vllm:inter_token_latency_seconds_bucket"), [])),
            bucket_quantile(0.99, buckets.get((r.minute, "vllm:time_to_first_token_seconds_bucket"), [])),
            r.waiting, r.running, r.kv, int(r.preempted),
        ))
    return out


def trim_idle(summary: Sequence[MinuteSummary]) -> list[MinuteSummary]:
    """Without the idle minutes after the last one that saw any work."""
    busy = [i for i, m in enumerate(summary) if m.generation_tokens_per_s or m.running_max or m.waiting_max]
    return list(summary[: busy[-1] + 1]) if busy else []


def render(summary: Sequence[MinuteSummary]) -> str:
    """The summary as an 80-column table; a quantile that is only a bucket bound, or lies in a coarse bucket, is
    marked, and its bucket named below the table."""
    lines = [f"{'minute (UTC)':<12} {'gen tok/s':>9} {'done':>5} {'ITL p99':>8} {'TTFT p99':>9} "
             f"{'waiting':>7} {'running':>7} {'KV max':>6} {'preempt':>7}"]
    coarse: dict[str, dict[tuple[float, float], str]] = {"ITL": {}, "TTFT": {}}
    capped: list[str] = []
    for m in summary:
        for name, q in (("ITL", m.itl_p99), ("TTFT", m.ttft_p99)):
            if q is not None and q.coarse:
                coarse[name][(q.lower, q.upper)] = _span(q)
            elif q is not None and q.capped:
                capped.append(f"{m.minute:%H:%M} {name}")
        lines.append(
            f"{m.minute:%H:%M}{'':<7} {m.generation_tokens_per_s:>9.1f} {m.requests_finished:>5d} "
            f"{_quantile(m.itl_p99):>8} {_quantile(m.ttft_p99):>9} {m.waiting_max:>7.0f} {m.running_max:>7.0f} "
            f"{m.kv_usage_max:>6.0%} {m.preemptions:>7d}"
        )
    spans = "; ".join(f"{name} " + ", ".join(found[k] for k in sorted(found))
                      for name, found in coarse.items() if found)
    if spans:
        lines.extend(textwrap.wrap(
            "* interpolated inside a coarse bucket of vLLM's histogram, as Prometheus' histogram_quantile does: the "
            f"p99 lies somewhere in its bucket ({spans})", 80))
    if capped:
        lines.extend(textwrap.wrap(
            "> past the histogram's last finite bucket: the p99 is above that bound, not at it ("
            + ", ".join(capped) + ")", 80))
    return "\n".join(lines)


def _quantile(q: Quantile | None) -> str:
    if q is None:
        return "-"
    if q.capped:
        return ">" + _seconds(q.value)
    return _seconds(q.value) + ("*" if q.coarse else "")


def _span(q: Quantile) -> str:
    lower = max(0.0, q.lower)
    return f"{lower * 1000:g}-{q.upper * 1000:g}ms" if q.upper < 1 else f"{lower:g}-{q.upper:g}s"


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f}ms" if value < 1 else f"{value:.1f}s"
