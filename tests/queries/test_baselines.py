"""An engine's baseline from its own steps: decode-only and alone steps only, exact or from the projection."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from stepline.model.rows import Step, micros
from stepline.queries.baselines import (
    ALONE_EXACT,
    ALONE_TOKENS_PER_STEP,
    DECODE_EXACT,
    alone_approximate,
    decode_approximate,
)
from stepline.store.store import Store
from tests.queries.conftest import Rows

T0 = (datetime.now(UTC) - timedelta(hours=2)).replace(second=0, microsecond=0)  # a whole minute
EXACT = {"engines": ["e0", "e1"], "start": T0, "end": T0 + timedelta(minutes=2)}
MINUTES = {"engines": ["e0", "e1"], "lo": T0, "hi": T0 + timedelta(minutes=2)}
FORCED = {"force_optimize_projection": 1}  # the query fails unless the projection answers it


def _step(engine: str, t: float, n: int, elapsed_ms: float, *, prefill: int = 0, decoding: int = 2) -> Step:
    return Step(micros(T0.timestamp() + t), "h", engine, 0, "m", n, elapsed_ms, 1 if prefill else 0, prefill,
                decoding, decoding, decoding, 0, 0, 0.3, 0, 0, 0, 0, 0, 0, [], [elapsed_ms / 1000] * decoding, False)


def _fill(store: Store) -> None:
    """e0: 60 decode-only steps of 10 ms among 100 prefill steps of 500 ms. e1: 20 steps alone (one decoding request,
    5 ms) among 20 of eight decoding requests (50 ms)."""
    e0 = [_step("e0", i * 0.7, i, 500.0, prefill=4000) if i % 8 < 5 else _step("e0", i * 0.7, i, 10.0)
          for i in range(160)]
    e1 = [_step("e1", i * 2.5, i, 5.0, decoding=1) if i % 2 else _step("e1", i * 2.5, i, 50.0, decoding=8)
          for i in range(40)]
    store.insert("steps", e0 + e1, Step._fields)


def test_the_decode_baseline_leaves_prefill_steps_out(store: Store, rows: Rows) -> None:
    _fill(store)
    by_engine = {r[0]: r[1:] for r in rows(DECODE_EXACT, **EXACT)}
    assert by_engine["e0"] == (10.0, [pytest.approx(0.01), pytest.approx(0.01)])  # all steps: p50 500 ms, ITL 0.5 s


def test_the_approximate_decode_baseline_reads_the_projection(store: Store, rows: Rows) -> None:
    _fill(store)
    by_engine = {r[0]: r[1:] for r in rows(decode_approximate(), settings=FORCED, **MINUTES)}
    step_ms, (itl50, itl99) = by_engine["e0"]
    assert step_ms == pytest.approx(10.0, rel=0.01)
    assert (itl50, itl99) == (pytest.approx(0.01, rel=0.01), pytest.approx(0.01, rel=0.01))


def test_the_alone_baseline_counts_few_decoders_only(store: Store, rows: Rows) -> None:
    _fill(store)
    by_engine = {r[0]: r[1:] for r in rows(ALONE_EXACT, **EXACT)}
    # Eight decoding requests are not alone: with e1's 50 ms steps its rate p10 would be 20 tokens/s.
    assert by_engine == {"e0": ([100.0, 100.0, 100.0], 10.0), "e1": ([200.0, 200.0, 200.0], 5.0)}


def test_the_approximate_alone_baseline_reads_the_projection(store: Store, rows: Rows) -> None:
    _fill(store)
    by_engine = {r[0]: r[1] for r in rows(alone_approximate(), settings=FORCED, **MINUTES)}
    assert by_engine["e0"] == [pytest.approx(10.0, rel=0.01)] * 3
    assert by_engine["e1"] == [pytest.approx(5.0, rel=0.01)] * 3


def _fill_drafting(store: Store) -> None:
    """e2: 40 steps alone (two decoding requests, 10 ms), each request with three drafts of which it keeps two in
    even steps and none in odd ones: 3 or 1 tokens a request a step."""
    steps = [_step("e2", i * 2.5, i, 10.0)._replace(num_generation_tokens=8, spec_num_drafts=2, spec_num_draft_tokens=6,
                                                    spec_num_accepted_tokens=4 if i % 2 == 0 else 0)
             for i in range(40)]
    store.insert("steps", steps, Step._fields)


def test_the_alone_rate_counts_the_tokens_each_request_got(store: Store, rows: Rows) -> None:
    _fill_drafting(store)
    [(engine, rates, step_ms)] = rows(ALONE_EXACT, **{**EXACT, "engines": ["e2"]})
    # Not 1000 / 10 ms (one token a step), nor 4000 / 10 ms (the tokens scheduled per request).
    assert (engine, rates, step_ms) == ("e2", [100.0, 300.0, 300.0], 10.0)


def test_the_tokens_a_request_gets_a_step_read_the_projection(store: Store, rows: Rows) -> None:
    _fill(store)
    _fill_drafting(store)
    found = rows(ALONE_TOKENS_PER_STEP, settings=FORCED, **{**MINUTES, "engines": ["e0", "e2"]})
    by_engine = {r[0]: r[1] for r in found}
    assert by_engine == {"e0": 1.0, "e2": 2.0}  # 80 drafts accepted over 80 request-steps; none drafted
