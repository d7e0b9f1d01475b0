"""Generated diagnosis cases: deterministic per seed, every cause produced, each injection visible in the store,
and diagnosis names the cause (seeds the detectors still miss are xfail, listed once in KNOWN_MISSES)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from stepline.diagnosis.detectors import diagnose
from stepline.diagnosis.findings import Finding, Window
from stepline.drills.generator import CAUSE_NAMES, CAUSES, Case, generate, judge, replay_case
from stepline.drills.scenarios import ScenarioRun
from stepline.sim.gpu import BOOST_MHZ
from stepline.store.reader import open_reader
from stepline.store.store import Store

# Each seed's case is replayed once per process that asks for it: the suite's workers share the seeds out.
pytestmark = pytest.mark.unit_per("seed")

SAMPLE = tuple(range(40))
# Seeds of SAMPLE whose top finding is wrong with today's detectors: shrink this as they improve.
KNOWN_MISSES: frozenset[int] = frozenset({
    30,  # head_of_line on a slow (x8.8) engine: ranked as prefill_interference (the light chat's ITL) first
})


# One case of each cause on engines that schedule asynchronously (vLLM 0.33's default on GPUs): their elapsed_ms is
# the engine core's wait, not the step (generator.scheduled_async). The 240-case table, beside synchronous
# scheduling, is in benchmarks/RESULTS.md.
ASYNC_SAMPLE = tuple(range(len(CAUSE_NAMES)))


@dataclass(frozen=True)
class Outcome:
    """One replayed case: what the store showed of the injection (None: all of it) and the ranked findings."""

    case: Case
    window: Window
    injection_error: str | None
    findings: list[Finding]


@pytest.fixture(scope="module")
def replayed(chdb_dir: Path) -> Callable[..., Outcome]:
    """seed -> Outcome, each case replayed once, on first use, checked and diagnosed, then its database dropped
    (parts left behind keep merging and slow every later case)."""

    @cache
    def replay(seed: int, async_scheduling: bool = False) -> Outcome:
        case = generate(seed, async_scheduling)
        url = f"chdb://{chdb_dir}?database=gen_{seed}{'_async' if async_scheduling else ''}"
        runs, window = replay_case(case, url)
        try:
            try:
                _check_injection(case, runs, window, url)
                error = None
            except AssertionError as exc:
                error = f"{case.description}: {exc}"
            reader = open_reader(url)
            try:
                findings = sorted(diagnose(reader.client, window), key=Finding.rank_key)
            finally:
                reader.close()
        finally:
            store = Store.open(url)
            store.client.command(f"DROP DATABASE IF EXISTS `{store.database}`")
            store.close()
        return Outcome(case, window, error, findings)

    return replay


def _query(url: str, sql: str, **params: Any) -> list[tuple[Any, ...]]:
    store = Store.open(url)
    try:
        return [tuple(r) for r in store.query(sql, parameters=params).result_rows]
    finally:
        store.close()


def test_generate_is_deterministic_per_seed() -> None:
    for seed in (0, 7, 123):
        assert generate(seed) == generate(seed)
    assert generate(1).engines != generate(14).engines  # same cause, other draw


def test_every_cause_is_produced_evenly() -> None:
    assert {generate(seed).cause for seed in SAMPLE} == set(CAUSE_NAMES)
    counts = Counter(generate(seed).cause for seed in range(200))
    assert min(counts.values()) >= 12
    for seed in range(26):
        case = generate(seed)
        assert case.truth_kind == CAUSES[case.cause]
        assert (case.truth_engine is None) == (case.truth_kind is None)
        assert case.truth_engine in (None, *(name for name, _ in case.engines))
        speeds = case.speeds.values()
        assert all(0.1 <= s <= 10.0 for s in speeds) and 60 <= case.engines[0][1].workload.duration_s <= 180


def test_speeds_span_a_hundredfold() -> None:
    speeds = [s for seed in range(200) for s in generate(seed).speeds.values()]
    assert min(speeds) < 0.15 and max(speeds) > 7


def _check_injection(case: Case, runs: list[ScenarioRun], window: Window, url: str) -> None:
    """The store shows what was injected into the case's target engine."""
    engine = case.facts["target"]
    run = runs[[name for name, _ in case.engines].index(engine)]
    facts = case.facts
    p = {"engine": engine, "start": window.start, "end": window.end}
    where = "engine = {engine:String} AND ts >= {start:DateTime64(6)} AND ts <= {end:DateTime64(6)}"
    match case.cause:
        case "gpu_throttling":
            lo, hi = run.start_ts + facts["cap_start_s"] + 2, run.start_ts + min(facts["cap_end_s"], 1e6) - 1
            (clock, capped, power), = _query(url, f"SELECT quantileExact(0.5)(sm_clock_mhz), "
                                             f"countIf(has(clock_event_flags, 'sw_power_cap')) / count(), max(power_w) "
                                             f"FROM gpu_samples WHERE {where} AND util_gpu_pct > 0 "
                                             f"AND toFloat64(ts) BETWEEN {lo} AND {hi}", **p)
            assert clock < 0.8 * BOOST_MHZ and capped > 0.5 and power <= facts["cap_w"] + 1
        case "wedge":
            (waiting, scrapes), = _query(url, f"SELECT max(value), count() FROM engine_samples WHERE {where} AND "
                                         "metric = 'vllm:num_requests_waiting' AND ts > (SELECT max(ts) FROM steps "
                                         f"WHERE {where})", **p)
            assert waiting > 10 and scrapes * 5 >= 30  # waiting, and no step for 30 s and more
        case "monster_in_flight" | "monster_finished":
            prompts = [r[0] for r in _query(url, f"SELECT prompt_tokens FROM requests FINAL WHERE {where}", **p)]
            finished = facts["monster_prompt_tokens"] in prompts
            assert finished == (case.cause == "monster_finished")
            if not finished:
                (ctx,), = _query(url, f"SELECT argMax(num_ctx_tokens, ts) FROM steps WHERE {where}", **p)
                assert ctx > 0 and run.in_flight >= 1  # still prefilling when the window ends
        case "head_of_line":
            (queued,), = _query(url, f"SELECT countIf(queue_seconds > 2) FROM requests FINAL WHERE {where}", **p)
            assert queued >= 20
        case "overload":
            (waiting,), = _query(url, f"SELECT argMax(waiting, ts) FROM steps WHERE {where}", **p)
            assert waiting >= 50 and run.in_flight > 50
        case "kv_pressure":
            (kv, preempted), = _query(url, f"SELECT max(kv_cache_usage), sum(preempted) FROM steps WHERE {where}", **p)
            assert kv >= 0.95 and preempted >= 5
        case "prefix_cache_collapse":
            cut = run.start_ts + facts["collapse_at_s"]
            rates = _query(url, f"SELECT toFloat64(ts) >= {cut} AS after, sum(prefix_cache_hits) / "
                           f"sum(prefix_cache_queries) FROM steps WHERE {where} GROUP BY after ORDER BY after", **p)
            assert rates[0][1] > 0.8 and rates[1][1] < 0.3
        case "config_not_in_effect":
            (over,), = _query(url, f"SELECT countIf(num_ctx_tokens > {facts['threshold']}) FROM steps WHERE {where}",
                              **p)
            assert over >= 3
        case "spec_decode_shift":
            cut = run.start_ts + facts["shift_at_s"]
            rates = _query(url, f"SELECT toFloat64(ts) >= {cut} AS after, sum(spec_num_accepted_tokens) / "
                           f"sum(spec_num_draft_tokens) FROM steps WHERE {where} GROUP BY after ORDER BY after", **p)
            assert rates[0][1] > 2 * rates[1][1]
        case "gpu_xid":
            assert _query(url, f"SELECT count() FROM events WHERE {where} AND kind = 'gpu_xid'", **p)[0][0] == 1
        case "legitimately_slow":
            (steps, waiting), = _query(url, f"SELECT count(), max(waiting) FROM steps WHERE {where}", **p)
            assert steps > 0 and waiting == 0
    if case.cause in ("healthy", "legitimately_slow"):
        for name, _ in case.engines:
            (waiting, preempted), = _query(url, "SELECT max(waiting), sum(preempted) FROM steps WHERE engine = "
                                           "{engine:String}", engine=name)
            assert waiting < 20 and preempted == 0


@pytest.mark.parametrize("seed", SAMPLE)
def test_injected_cause_is_in_the_store(replayed: Callable[..., Outcome], seed: int) -> None:
    outcome = replayed(seed)
    assert outcome.window.engine == ""
    assert outcome.injection_error is None, outcome.injection_error


@pytest.mark.parametrize("seed", [pytest.param(s, marks=pytest.mark.xfail(
    strict=False, reason="the detectors miss this case today")) if s in KNOWN_MISSES else s for s in SAMPLE])
def test_diagnosis_names_the_injected_cause(replayed: Callable[..., Outcome], seed: int) -> None:
    outcome = replayed(seed)
    verdict = judge(outcome.case, outcome.findings)
    assert verdict.correct, (outcome.case.description,
                             [(f.severity, f.kind, f.engine, f.title) for f in outcome.findings[:4]])


@pytest.mark.parametrize("seed", ASYNC_SAMPLE)
def test_diagnosis_names_the_injected_cause_under_async_scheduling(replayed: Callable[..., Outcome],
                                                                   seed: int) -> None:
    outcome = replayed(seed, True)
    assert outcome.injection_error is None, outcome.injection_error
    verdict = judge(outcome.case, outcome.findings)
    assert verdict.correct, (outcome.case.description,
                             [(f.severity, f.kind, f.engine, f.title) for f in outcome.findings[:4]])
