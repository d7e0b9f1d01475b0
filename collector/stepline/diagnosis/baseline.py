"""Each engine's own baseline, and every detector limit as a multiple of it, in one place (STYLE rule 14).

A limit is a fact about the engine in front of you: a CPU engine with 7 ms decode steps and 1,024-token chunks
and an H200 with 30 ms steps and 8,192-token chunks, each slowed 30x by a long prefill, are found the same way.
The figures, per engine over the diagnosis window:
- its decode-only steps (no prefill token, something decoding): step time p50, ITL p50 and p99; when the
  window holds none (it lies inside a long prefill), those of the BASELINE_LOOKBACK before it;
- its token budget: max_num_batched_tokens from its engine_config event, else the largest chunk it ran.
Findings print the figures they compared (`Baseline.evidence`), and the limit they were compared with.
Quantiles are exact up to `common.EXACT_MAX_STEPS` steps an engine and `common.EXACT_MAX_QUERY_STEPS` steps of all
the engines one query reads (the engines with the fewest steps first); beyond, they come from the steps' per-minute
projection, or over a window of `rollup.HOURS_FROM` whole hours or more from the per-hour one (its whole hours), and
the evidence says which (`baseline_quantiles`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from stepline.diagnosis.common import (
    config_int,
    engine_configs,
    exact_and_approximate,
    number,
    rows_by_engine,
    window_summary,
)
from stepline.diagnosis.findings import Window
from stepline.diagnosis.rollup import Span, approximate_rows, approximate_span
from stepline.queries.baselines import DECODE_EXACT, decode_approximate
from stepline.store.reads import Reads, Row

# prefill_interference and head_of_line_blocking
# An uncached prompt of at least this many token budgets (chunks) is a long prefill: four steps that each hold the
# whole budget. Two is an ordinary long prompt on many engines (16k tokens on an 8192 budget).
LONG_PROMPT_CHUNKS = 4.0
SLOWDOWN = 5.0  # step p50 while the prefill ran over the decode-only step p50: interference from here
# Severity: ITL p99 while the prefill ran over the decode-only ITL p99. Critical from SEVERE_SLOWDOWN on any engine,
# or from CRITICAL_SLOWDOWN when a stream's reader sees stalls: ITL_STALL_S is the one absolute figure here,
# because it is a fact about the reader (a token a second or worse), not about the engine.
CRITICAL_SLOWDOWN = 10.0
SEVERE_SLOWDOWN = 100.0
ITL_STALL_S = 1.0
# A prefill's own steps: at least this share of the steps in its span carry no other prefill (in an overload every
# step carries several, and the span of any prompt is slow for reasons of its own).
OWN_STEPS_SHARE = 0.5
# Head-of-line blocking: the queue grew by MIN_QUEUED or more while the prefill ran, and had drained by at least
# HOL_DRAINED of that growth within one prefill's length after it.
HOL_DRAINED = 0.5
MIN_QUEUED = 10  # requests queued behind one prefill (or in an overload) before the queue counts
HOL_QUEUE_STEPS = 100.0  # a request queued this many decode-only steps (p50) behind a prefill was held up by it
# gpu_throttling: the throttled samples' SM clock at most (1 - CLOCK_DROP) of the GPU's own maximum, on at least
# THROTTLED_SHARE of the samples in which the GPU was busy (schema.GPU_BUSY: the throttling projection counts them).
CLOCK_DROP = 0.10
THROTTLED_SHARE = 0.10
# overload: requests waited OVERLOAD_QUEUE_STEPS of the engine's decode-only steps (p50) or more, the queue held
# MIN_QUEUED or more, for OVERLOAD_MIN_BUCKETS buckets of the window (a 1/OVERLOAD_BUCKETS share each) in which the
# engine was busy (stepping at least BUSY_SHARE of the time), and no more than OWN_STEPS_SHARE of that time went to
# long prefills (those are head-of-line blocking).
OVERLOAD_QUEUE_STEPS = 100.0
OVERLOAD_BUCKETS = 30
OVERLOAD_MIN_BUCKETS = 3
BUSY_SHARE = 0.8
# legitimately_slow and gpu_xid
SLOW_STEP = 10.0  # a step this many decode-only step p50s long is slow for this engine
# prefix_cache_collapse, against the engine's usual hit rate (its earliest buckets in the window, per request): a
# bucket below COLLAPSE_SHARE of it is low; MIN_LOW_BUCKETS such buckets of MIN_BUCKET_REQUESTS requests each are
# a collapse; an engine whose usual rate is below MIN_USUAL_HIT_RATE has no cache to lose.
COLLAPSE_SHARE = 0.5
MIN_BUCKET_REQUESTS = 5
MIN_LOW_BUCKETS = 2
MIN_USUAL_HIT_RATE = 0.3
# `stepline requests` tok·pf: a step carrying at least this share of the engine's token budget in prefill
# tokens carries a long prefill chunk
LONG_CHUNK_SHARE = 0.5
# leaked slots (a wedge on its way): over the window's last LEAK_RECENT_SHARE, in MIN_LEAK_STEPS or more steps with
# requests waiting and half the token budget unused, the median step left IDLE_SLOT_SHARE of its running requests
# unscheduled.
LEAK_RECENT_SHARE = 0.25
MIN_LEAK_STEPS = 20
IDLE_SLOT_SHARE = 0.25
# Not a fact about the engine but about its telemetry: the plugin delivers an engine's last steps within about a
# second (it flushes when the engine goes idle), and the queue gauge is read once a scrape, so a stall shorter than
# WEDGE_LAG_SCRAPES of the engine's own scrape intervals (measured in the window), plus WEDGE_DELIVERY_S, can be
# delivery lag. The wedge budget is the larger of that and WEDGE_STEP_MULTIPLE times the slowest of the engine's
# last WEDGE_LAST_STEPS steps (the work in flight when it stopped). WEDGE_UNKNOWN_LAG_S stands in for the lag of an
# engine whose scrapes the window does not show.
WEDGE_LAG_SCRAPES = 2.0
WEDGE_DELIVERY_S = 1.0
WEDGE_UNKNOWN_LAG_S = 30.0
WEDGE_LAST_STEPS = 8
WEDGE_STEP_MULTIPLE = 10.0

BASELINE_LOOKBACK = timedelta(hours=1)


@dataclass(frozen=True)
class Baseline:
    """One engine's own figures over the window; 0 where it had no such steps (nothing to compare with)."""

    decode_step_ms: float  # p50 of its decode-only steps
    itl_p50_s: float  # ITL p50 and p99 of the steps that carried no prefill token
    itl_p99_s: float
    budget_tokens: int  # max_num_batched_tokens, else the largest chunk seen; 0 when neither is known
    budget_from: str  # "engine_config", "largest chunk seen", "largest step seen" or "unknown"
    approximate: str = ""  # where approximate quantiles came from (rollup.Span.says); "" for exact ones
    before_window: bool = False  # the window had no decode-only step: figures from the BASELINE_LOOKBACK before it

    def evidence(self) -> dict[str, Any]:
        """The baseline figures a finding was compared with, as evidence."""
        out: dict[str, Any] = {"baseline_decode_step_p50_ms": round(self.decode_step_ms, 1),
                               "token_budget": self.budget_tokens, "token_budget_from": self.budget_from}
        if self.approximate:
            out["baseline_quantiles"] = self.approximate
        if self.before_window:
            out["baseline_from"] = f"decode-only steps in the {BASELINE_LOOKBACK} before the window"
        return out

    @property
    def long_prompt_tokens(self) -> int:
        """Uncached prompt tokens from which a prompt is a long prefill on this engine (0: budget unknown)."""
        return round(LONG_PROMPT_CHUNKS * self.budget_tokens)


NO_BASELINE = Baseline(0.0, 0.0, 0.0, 0, "unknown")


def budgets(reader: Reads, window: Window) -> dict[str, tuple[int, str]]:
    """engine -> (token budget, where it came from), for every engine with a configuration or steps."""
    out: dict[str, tuple[int, str]] = {}
    for engine, s in window_summary(reader, window).items():
        chunk, step = int(s.get("max_single_prefill") or 0), int(s.get("max_step_tokens") or 0)
        if chunk > 0:
            out[engine] = (chunk, "largest chunk seen")
        elif step > 0:
            out[engine] = (step, "largest step seen")
    for engine, config in engine_configs(reader, window).items():
        budget = config_int(config, "max_num_batched_tokens")
        if budget:
            out[engine] = (budget, "engine_config")
    return out


def baselines(reader: Reads, window: Window, names: list[str]) -> dict[str, Baseline]:
    """engine -> its Baseline, for each of `names` (NO_BASELINE's figures where it has none)."""
    summary = window_summary(reader, window)
    span = approximate_span(window.start, window.end)
    small, big = exact_and_approximate({e: int(summary.get(e, {}).get("steps", 0)) for e in names},
                                       span is not None)
    figures: dict[str, tuple[float, Any, str]] = {}
    if small:
        for r in rows_by_engine(reader, DECODE_EXACT, small, start=window.start, end=window.end).values():
            figures[str(r.engine)] = (number(r.step_ms), r.itl, "")

    def read_span(over: Span, engines: list[str]) -> Iterable[Row]:
        return rows_by_engine(reader, over.reads(decode_approximate), engines, lo=over.lo, hi=over.hi).values()

    for engine, (r, over) in approximate_rows(read_span, big, window.start, window.end).items():
        figures[engine] = (number(r.step_ms), r.itl, over.says)
    # A window inside a long prefill has no decode-only step: the engine's figures from just before it.
    missing = sorted(e for e in names if e not in figures or figures[e][0] <= 0)
    earlier: set[str] = set()
    if missing:
        before = window.start - BASELINE_LOOKBACK
        for r in rows_by_engine(reader, DECODE_EXACT, missing, start=before, end=window.start).values():
            if number(r.step_ms) > 0:
                figures[str(r.engine)] = (number(r.step_ms), r.itl, "")
                earlier.add(str(r.engine))
    known = budgets(reader, window)
    out = {}
    for engine in names:
        step_ms, itl, approximate = figures.get(engine, (0.0, [], ""))
        budget, source = known.get(engine, (0, "unknown"))
        itl50, itl99 = (number(q) for q in itl) if itl else (0.0, 0.0)  # [ITL p50, ITL p99]
        out[engine] = Baseline(step_ms, itl50, itl99, budget, source, approximate, engine in earlier)
    return out


def times(value: float, baseline: float) -> str:
    """value / baseline as evidence reads it: '32.4x'; 'n/a' without a baseline."""
    return f"{value / baseline:.1f}x" if baseline > 0 else "n/a (no baseline)"
