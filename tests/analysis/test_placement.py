"""Placing requests on the steps they ran in, and the step cost that splits each step among them."""

from __future__ import annotations

import random

import pytest

from stepline.analysis.placement import PRIOR_WEIGHTS, SNAP_US, Phases, Rank, features, fit, pairs, place


def rank(steps: list[tuple[int, int, int]]) -> Rank:
    """Steps of 100 ms ending at 100, 200, ... ms: (prefill tokens, decoding requests, decode tokens) each."""
    return Rank([100_000 * (i + 1) for i in range(len(steps))], [100_000] * len(steps), [s[0] for s in steps],
                [s[1] for s in steps], [s[2] for s in steps])


def test_prefill_chunks_go_to_the_oldest_and_to_the_one_that_finishes() -> None:
    r = rank([(100, 0, 0), (100, 0, 0), (60, 1, 1), (0, 2, 2)])
    # a: 150 uncached tokens after 10 cached, scheduled at 0, first token at step 2 (200 ms); b: 50 tokens, scheduled
    # at 100 ms (3 us off, as Float32 seconds are), first token with step 3. Both decode to step 4.
    a = Phases(0, 0, 200_000, 400_000, 150, 10, 160)
    b = Phases(1, 100_003, 300_000 - 2, 400_000, 50, 0, 50)
    place(r, [a, b])
    assert r.chunks[0] == [(0, 100, 10)]
    assert r.chunks[1] == [(0, 50, 110), (1, 50, 0)]  # a finishes here: it goes first
    assert r.chunks[2] == []  # b had nothing left: step 3's 60 tokens are nobody's known
    assert r.decoders == [0, 0, 1, 2]
    # a decodes from step 3 with 161 in context, then 162; b joins at step 4 with 51.
    assert r.context == [0, 0, 161, 162 + 51]
    assert r.decodes[0] == (2, 4, 161 - 2)


def test_a_moment_snaps_to_a_step_end_within_the_tolerance_only() -> None:
    r = rank([(0, 1, 1)] * 3)
    assert r.after(200_000 - SNAP_US // 2) == 2 and r.after(200_000 + SNAP_US // 2) == 2
    assert r.after(200_000 - 3 * SNAP_US) == 1
    assert r.after(0) == 0 and r.after(10**9) == 3


def test_unplaced_work_is_estimated_in_the_steps_cost() -> None:
    r = rank([(300, 3, 3)])
    place(r, [Phases(0, -50_000, 0, 100_000, 10, 0, 10)])  # one decoder of three known, no prefill
    tokens, chunk_pairs, decoding, context = features(r, 0, fallback_context=1000.0)
    assert (tokens, chunk_pairs, decoding) == (300.0, pairs(0, 300), 3.0)
    assert context == 11 + 2 * 1000.0


def test_the_fit_recovers_an_engines_step_cost() -> None:
    rng = random.Random(4)
    truth = (7.0, 0.02, 4e-7, 0.2, 5e-5)
    rows = []
    for _ in range(200):
        work = (float(rng.choice([0, rng.randrange(1, 8192)])), rng.uniform(0, 3e7), float(rng.randrange(0, 64)),
                rng.uniform(0, 2e5))
        rows.append((work, truth[0] + sum(w * x for w, x in zip(truth[1:], work, strict=True))))
    w = fit(rows)
    assert w.fitted and w.steps == 200
    got = (w.overhead, w.prefill_token, w.attention_pair, w.decode_request, w.context_token)
    assert got == pytest.approx(truth, rel=1e-6)


def test_a_fit_that_explains_nothing_falls_back_to_the_prior() -> None:
    rng = random.Random(5)
    flat = [((float(rng.randrange(0, 100)), 0.0, float(rng.randrange(1, 8)), rng.uniform(0, 1e4)), 50.0)
            for _ in range(100)]
    assert fit(flat) == PRIOR_WEIGHTS
    assert fit(flat[:5]) == PRIOR_WEIGHTS  # too few steps
