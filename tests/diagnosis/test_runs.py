"""Long prefills read from the steps alone: runs of consecutive single-request chunks at the window's tail."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from stepline.diagnosis.runs import PrefillRun, prefill_runs
from stepline.model.rows import Step
from tests.diagnosis.conftest import Timelines
from tests.diagnosis.test_detectors import T0, config, step

BUDGET = 8192  # each engine's max_num_batched_tokens; a run is long from 4 budgets (LONG_PROMPT_CHUNKS)


def decode_only(start_s: float, end_s: float, n0: int = 0) -> list[Step]:
    """Decode-only steps every 0.5 s, numbered from n0."""
    return [step(start_s + 0.5 * i, n=n0 + i) for i in range(int((end_s - start_s) / 0.5))]


def chunks(start_s: float, count: int, n0: int, tokens: int = BUDGET) -> list[Step]:
    """`count` consecutive 1.2 s steps, each prefilling `tokens` of one request beside four decoding."""
    return [step(start_s + 1.2 * (i + 1), 1200.0, prefill=tokens, decoding=4, n=n0 + i) for i in range(count)]


def _at(offset_s: float) -> Any:
    return T0 + timedelta(seconds=offset_s)


def test_a_prefill_still_running_at_the_windows_end_is_a_run(timelines: Timelines) -> None:
    window = timelines.add("in_flight", [config(), *decode_only(0, 500), *chunks(520, 6, 1000)])
    assert prefill_runs(timelines.store, window) == {"in_flight": [PrefillRun(
        _at(521.2), _at(527.2), steps=6, tokens=6 * BUDGET, chunk_tokens=BUDGET,
        first_chunk_ran=timedelta(milliseconds=1200), min_tokens=4 * BUDGET)]}


def test_a_run_before_the_last_decode_only_step_is_not_read(timelines: Timelines) -> None:
    # It ended, so its request finished and is in `requests`: the steps' tail starts after it.
    rows = [config(), *decode_only(0, 100), *chunks(100, 6, 1000), *decode_only(110, 590, 2000)]
    window = timelines.add("ended", rows)
    assert prefill_runs(timelines.store, window) == {}


def test_one_decode_only_step_breaks_a_run(timelines: Timelines) -> None:
    halves = [*chunks(520, 3, 1000), step(524.0, n=1003), *chunks(524.0, 3, 1004)]
    window = timelines.add("broken", [config(), *decode_only(0, 500), *halves])
    assert prefill_runs(timelines.store, window) == {}  # two runs of three budgets: neither is long


def test_chunks_are_long_relative_to_the_long_prefill_threshold(timelines: Timelines) -> None:
    steps = [*decode_only(0, 500), *chunks(520, 20, 1000, tokens=2048)]
    capped = timelines.add("capped", [config(long_prefill_token_threshold=2048), *steps])
    [run] = prefill_runs(timelines.store, capped)["capped"]
    assert (run.steps, run.tokens, run.chunk_tokens) == (20, 20 * 2048, 2048)
    uncapped = timelines.add("uncapped", [config(), *steps])
    assert prefill_runs(timelines.store, uncapped) == {}  # 2,048 is a quarter of its budget: not a long chunk


@pytest.mark.parametrize("ctx_requests", [2, 3])
def test_chunks_shared_by_several_prefills_are_no_run(timelines: Timelines, ctx_requests: int) -> None:
    shared = [s._replace(num_ctx_requests=ctx_requests) for s in chunks(520, 6, 1000)]
    window = timelines.add(f"shared{ctx_requests}", [config(), *decode_only(0, 500), *shared])
    assert prefill_runs(timelines.store, window) == {}


def test_an_engine_of_unknown_budget_has_no_runs(timelines: Timelines) -> None:
    window = timelines.add("silent", [])
    assert prefill_runs(timelines.store, window) == {}
