"""An engine's own figures, read from its steps: what its detectors' limits are multiples of (STYLE rule 14).

Each read answers per engine, for the engines bound as {engines:Array(String)}: exactly over [start, end], or
from the steps' per-minute projection over whole minutes [lo, hi). The approximate reads write each aggregate as
the projection holds it (stepline.model.schema.STEP_BASELINES: the same function over the same expressions, the
quantile levels aside), or ClickHouse reads every step instead (it matches a projection's aggregates by
expression: https://clickhouse.com/docs/data-modeling/projections).
"""

from __future__ import annotations

from stepline.queries.query import moment
from stepline.queries.steps import GENERATED, OF_ENGINES
from stepline.queries.window import ENGINES

# Decode-only steps: no prefill token, something decoding. Alone: no prefill and 1-4 decoding requests, what one
# request gets from the engine with nobody in its way.
DECODE_ONLY = "num_ctx_tokens = 0 AND num_generation_requests > 0"
ALONE = "num_ctx_tokens = 0 AND num_generation_requests BETWEEN 1 AND 4 AND elapsed_ms > 0"
# The decode-only step time p50 (ms), and ITL p50 and p99 (s) of the steps that carried no prefill token.
DECODE_STEP_P50 = f"quantileExactIf(0.5)(elapsed_ms, {DECODE_ONLY})"
ITL_P50_P99 = "quantilesExactArrayIf(0.5, 0.99)(itl_seconds, num_ctx_tokens = 0)"
_WHOLE_MINUTES = f"{ENGINES} AND bucket >= {moment('lo')} AND bucket < {moment('hi')}"
MINUTE_BUCKET = "toStartOfMinute(ts)"  # the per-minute projection's key (model.schema.STEP_BASELINES)

# engine, decode-only step p50 (step_ms), [ITL p50, ITL p99] (itl)
DECODE_EXACT = f"""
SELECT engine, {DECODE_STEP_P50} AS step_ms,
       {ITL_P50_P99} AS itl
FROM steps
WHERE {OF_ENGINES}
GROUP BY engine
"""


# engine, decode-only step p50 (step_ms), [ITL p50, ITL p99] (itl), from the projection
def decode_approximate(bucket: str = MINUTE_BUCKET) -> str:
    """DECODE_EXACT's figures from the projection keyed by `bucket` (its minutes, or its hours over long windows:
    diagnosis.rollup.Span), over whole buckets [lo, hi)."""
    return f"""
WITH {bucket} AS bucket
SELECT engine, quantilesBFloat16If(0.5)(elapsed_ms, {DECODE_ONLY})[1] AS step_ms,
       quantilesBFloat16ArrayIf(0.5, 0.99)(itl_seconds, num_ctx_tokens = 0) AS itl
FROM steps
WHERE {_WHOLE_MINUTES}
GROUP BY engine
"""

# engine, [rate p10, p50, p90] (rates) of its steps alone (tokens generated/s per decoding request: with speculative
# decoding a request gets 1 + its accepted drafts a step), their step p50 (step_ms)
ALONE_EXACT = f"""
SELECT engine, quantilesExact(0.1, 0.5, 0.9)({GENERATED} / num_generation_requests * 1000 / elapsed_ms) AS rates,
       quantileExact(0.5)(elapsed_ms) AS step_ms
FROM steps
WHERE {OF_ENGINES}
  AND {ALONE}
GROUP BY engine
"""


# engine, [step time p10, p50, p90] (step_ms) of its steps alone: the caller inverts them into rates (p10 of rate =
# p90 of time), times ALONE_TOKENS_PER_STEP
def alone_approximate(bucket: str = MINUTE_BUCKET) -> str:
    """ALONE_EXACT's figures from the projection keyed by `bucket`, over whole buckets [lo, hi)."""
    return f"""
WITH {bucket} AS bucket
SELECT engine, quantilesBFloat16If(0.1, 0.5, 0.9)(elapsed_ms, {ALONE}) AS step_ms
FROM steps
WHERE {_WHOLE_MINUTES}
GROUP BY engine
"""

# engine, tokens generated per decoding request a step over whole minutes [lo, hi) of the per-minute projection (its
# sums): 1 + accepted drafts / decoding requests, the requests being the tokens scheduled less the drafts
# (queries.steps.GENERATED). 1 without speculative decoding. Over all the engine's steps, alone or not (the
# projection keeps no sums of the steps alone), and a mean: the approximate rates' spread is their step times'.
ALONE_TOKENS_PER_STEP = f"""
WITH toStartOfMinute(ts) AS bucket
SELECT engine, 1 + sum(spec_num_accepted_tokens)
                   / greatest(toInt64(sum(num_generation_tokens)) - sum(spec_num_draft_tokens), 1) AS tokens
FROM steps
WHERE {_WHOLE_MINUTES}
GROUP BY engine
"""
