"""Long prefills read from the steps: runs of consecutive steps that each carry one request's budget-sized chunk.

`requests` holds finished requests only, so a long prefill still running when the window ends (the very state
of an incident) is not there. Its steps are: a run of consecutive iterations, each with one prefilling request
whose chunk takes most of the token budget. The run names the prefill by what it has done so far.

Only the window's tail is read step by step: a prefill still running at the window's end began after the engine's
last decode-only step (one with no prefill tokens breaks every run), which the steps' per-minute projection
finds; a prefill that ended earlier finished, and is in `requests`. A day's window reads minutes, then a few
minutes of steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from stepline.diagnosis.baseline import LONG_CHUNK_SHARE, LONG_PROMPT_CHUNKS, budgets
from stepline.diagnosis.common import config_int, engine_configs, number, utc
from stepline.diagnosis.findings import Window
from stepline.diagnosis.rollup import Agg, rolled
from stepline.queries.query import Query, Spans, param, which_span
from stepline.queries.window import EACH_ENGINE
from stepline.store.reads import Reads


# A chunk is long from LONG_CHUNK_SHARE of the engine's budget (of its long_prefill_token_threshold when that is
# smaller: chunks are bounded by it); a run is a long prefill from LONG_PROMPT_CHUNKS budgets in all. Iteration
# numbers less their rank number a run: consecutive iterations share it. Over the steps of `spans` (the engines'
# tails).
def _runs(spans: Spans) -> str:
    return f"""
SELECT engine, min(ts) AS first_step, max(ts) AS last_step, count() AS steps, sum(num_ctx_tokens) AS tokens,
       argMin(elapsed_ms, ts) AS first_step_ms, max(num_ctx_tokens) AS chunk_tokens
FROM (SELECT engine, engine_index, ts, elapsed_ms, num_ctx_tokens,
             toInt64(step) - toInt64(row_number() OVER (PARTITION BY engine, engine_index ORDER BY step)) AS run
      FROM steps
      WHERE ({spans.inside}) AND num_ctx_requests = 1
        AND num_ctx_tokens >= transform(toString(engine), {param('budget_engines', 'Array(String)')},
                                        {param('min_chunk', 'Array(UInt64)')}, {param('unknown', 'UInt64')}))
GROUP BY engine, engine_index, run
HAVING tokens >= transform(toString(engine), {param('budget_engines', 'Array(String)')},
                           {param('min_tokens', 'Array(UInt64)')}, {param('unknown', 'UInt64')})
ORDER BY engine, tokens DESC
LIMIT 5 BY engine
"""


# Per engine, the start of the last minute with a decode-only step (none: the window's start).
_TAIL_AGGS = (Agg("steps", "count()", "sum({})"), Agg("prefill_steps", "countIf(num_ctx_tokens > 0)", "sum({})"))


@dataclass(frozen=True)
class PrefillRun:
    """A long prefill seen in the steps: its first and last chunk's steps and the tokens it prefilled in them."""

    start: datetime
    end: datetime
    steps: int
    tokens: int
    chunk_tokens: int
    first_chunk_ran: timedelta
    min_tokens: int  # what made it long on its engine


def prefill_runs(reader: Reads, window: Window) -> dict[str, list[PrefillRun]]:
    """engine -> its longest runs of long single-request chunks in the window, most tokens first."""
    known = budgets(reader, window)
    configs = engine_configs(reader, window)
    names = sorted(known)
    if not names:
        return {}
    chunk: dict[str, int] = {}
    for e in names:
        threshold = config_int(configs.get(e, {}), "long_prefill_token_threshold") or 0
        bound = min(known[e][0], threshold) if threshold > 0 else known[e][0]
        chunk[e] = max(1, round(LONG_CHUNK_SHARE * bound))
    total = {e: round(LONG_PROMPT_CHUNKS * known[e][0]) for e in names}
    tails = _tails(reader, window)
    spans = which_span([(e, max(window.start, tails.get(e, window.start)), window.end) for e in names])
    rows = Query(_runs(spans), **spans.parameters, budget_engines=names, min_chunk=[chunk[e] for e in names],
                 min_tokens=[total[e] for e in names], unknown=2**63).rows(reader)
    out: dict[str, list[PrefillRun]] = {}
    for engine, first, last, steps, tokens, first_ms, biggest in rows:
        out.setdefault(str(engine), []).append(PrefillRun(
            utc(first), utc(last), int(steps), int(tokens), int(biggest), timedelta(milliseconds=number(first_ms)),
            total[str(engine)]))
    return out


def _tails(reader: Reads, window: Window) -> dict[str, datetime]:
    """engine -> where its window's tail starts: the minute of its last decode-only step (on any engine index)."""
    sql, bounds = rolled(_TAIL_AGGS, EACH_ENGINE, window.start, window.end,
                         keys=(("engine", "engine"), ("engine_index", "engine_index"),
                               ("t", "toStartOfMinute(bucket)")))
    rows = Query(f"SELECT engine, min(tail) FROM (SELECT engine, engine_index, maxIf(t, steps > prefill_steps) AS "
                 f"tail, countIf(steps > prefill_steps) AS decoded FROM ({sql}) GROUP BY engine, engine_index "
                 f"HAVING decoded > 0) GROUP BY engine", engine=window.engine, **bounds).rows(reader)
    return {str(engine): utc(tail) for engine, tail in rows}
