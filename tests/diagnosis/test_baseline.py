"""Each engine's own baseline: its decode-only steps' time and ITL, its token budget and where that came from, the
hour before the window standing in for a window inside a long prefill, and the limits derived from them."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from stepline.diagnosis.baseline import (
    BASELINE_LOOKBACK,
    LONG_PROMPT_CHUNKS,
    NO_BASELINE,
    Baseline,
    baselines,
    budgets,
    times,
)
from stepline.diagnosis.findings import Window
from stepline.model.rows import Event, Step, micros
from stepline.store.store import Store

T0 = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=30)


def _step(engine: str, at: timedelta, elapsed_ms: float, *, prefill: int = 0, n: int = 1) -> Step:
    return Step(micros((T0 + at).timestamp()), "h", engine, 0, "m", n, elapsed_ms, 1 if prefill else 0, prefill,
                4, 4, 4, 0, 0, 0.3, 0, 0, 0, 0, 0, 0, [], [elapsed_ms / 1000] * 4, False)


def _window(minutes: float = 5) -> Window:
    return Window(T0, T0 + timedelta(minutes=minutes))


def test_an_engines_figures_are_its_own_decode_only_steps_and_budget(store: Store) -> None:
    steps = [_step("fast", timedelta(seconds=i), 10.0 + i % 3, n=i) for i in range(30)]  # p50 11 ms
    steps += [_step("fast", timedelta(seconds=40), 900.0, prefill=6000, n=99)]  # a prefill: not in the baseline
    steps += [_step("slow", timedelta(seconds=i), 30.0, n=i) for i in range(10)]
    store.insert("steps", steps, Step._fields)
    config = Event(micros((T0 - timedelta(hours=3)).timestamp()), "h", "slow", "plugin", "engine_config", "info",
                   "configured", {"max_num_batched_tokens": "8192"})  # reported at start-up, long before
    store.insert("events", [config], Event._fields)
    found = baselines(store, _window(), ["fast", "slow", "absent"])
    fast, slow = found["fast"], found["slow"]
    assert (fast.decode_step_ms, fast.budget_tokens, fast.budget_from) == (11.0, 6000, "largest chunk seen")
    assert fast.itl_p50_s == pytest.approx(0.011, rel=0.01) and fast.itl_p99_s == pytest.approx(0.012, rel=0.01)
    assert (slow.decode_step_ms, slow.budget_tokens, slow.budget_from) == (30.0, 8192, "engine_config")
    assert found["absent"] == Baseline(0.0, 0.0, 0.0, 0, "unknown")
    assert budgets(store, _window()) == {"fast": (6000, "largest chunk seen"), "slow": (8192, "engine_config")}


def test_a_window_inside_a_long_prefill_takes_the_hour_before_it(store: Store) -> None:
    before = [_step("e", timedelta(minutes=-20, seconds=i), 8.0, n=i) for i in range(10)]
    inside = [_step("e", timedelta(seconds=i), 2000.0, prefill=8192, n=100 + i) for i in range(5)]
    store.insert("steps", before + inside, Step._fields)
    (baseline,) = baselines(store, _window(), ["e"]).values()
    assert baseline.decode_step_ms == 8.0 and baseline.before_window
    assert baseline.evidence()["baseline_from"] == f"decode-only steps in the {BASELINE_LOOKBACK} before the window"


def test_evidence_and_limits_are_relative_to_the_baseline() -> None:
    baseline = Baseline(12.34, 0.012, 0.05, 2048, "engine_config", approximate="per-minute projection")
    assert baseline.evidence() == {"baseline_decode_step_p50_ms": 12.3, "token_budget": 2048,
                                   "token_budget_from": "engine_config", "baseline_quantiles": "per-minute projection"}
    assert baseline.long_prompt_tokens == round(LONG_PROMPT_CHUNKS * 2048)
    assert NO_BASELINE.long_prompt_tokens == 0
    assert times(400.0, 12.34) == "32.4x" and times(400.0, 0.0) == "n/a (no baseline)"
