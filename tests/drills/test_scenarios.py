"""Diagnosis scenarios: each simulated incident shows its one cause, and diagnosis names it first."""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stepline.diagnosis.findings import Window
from stepline.drills.scenarios import SCENARIO_NAMES, ScenarioRun, make_scenario, run_scenario, simulate
from stepline.sim.gpu import BOOST_MHZ, SW_POWER_CAP
from stepline.sim.records import StepRecord
from stepline.store.reader import open_reader
from stepline.store.store import Store

END_AT = 1_700_000_000.0


def _run(name: str) -> ScenarioRun:
    return simulate(make_scenario(name), end_at=END_AT)


def _between(run: ScenarioRun, lo: float, hi: float) -> list[StepRecord]:
    return [s for s in run.steps if lo <= s.ts - run.start_ts < hi]


def _hit_rate(steps: list[StepRecord]) -> float:
    return sum(s.prefix_cache_hits for s in steps) / max(1, sum(s.prefix_cache_queries for s in steps))


def _itls(steps: list[StepRecord]) -> list[float]:
    return [itl for s in steps for itl in s.inter_token_latencies_iter]


def test_registry_names_every_scenario_once() -> None:
    assert len(set(SCENARIO_NAMES)) == len(SCENARIO_NAMES) == 8
    assert {make_scenario(n).name for n in SCENARIO_NAMES} == set(SCENARIO_NAMES)
    with pytest.raises(ValueError, match="unknown scenario"):
        make_scenario("nope")


def test_healthy_is_uneventful() -> None:
    run = _run("healthy")
    assert run.drained
    assert max(s.elapsed_ms for s in run.steps) < 100
    assert max(s.num_waiting_reqs for s in run.steps) < 10
    assert not any(s.num_preempted_reqs for s in run.steps)
    assert statistics.quantiles(_itls(run.steps), n=100)[98] < 0.05
    assert _hit_rate(run.steps) > 0.85


def test_monster_prefill_slows_decoding_with_an_empty_queue() -> None:
    run = _run("monster_prefill")
    during = [s for s in run.steps if s.num_ctx_tokens >= 4096 and s.num_generation_requests >= 40]
    before = _between(run, 10, 30)
    assert len(during) > 20
    assert statistics.median(s.elapsed_ms for s in during) > 20 * statistics.median(s.elapsed_ms for s in before)
    assert max(s.num_waiting_reqs for s in during) <= 1  # nobody queues: the decoders are already running


def test_head_of_line_queues_short_requests_behind_the_monster() -> None:
    run = _run("head_of_line")
    assert max(s.num_waiting_reqs for s in run.steps) > 50
    shorts = [r for s in run.steps for r in s.finished_requests if r.request_id.startswith("short-")]
    assert len(shorts) > 50
    assert statistics.median(r.queued_time for r in shorts) > 10


def test_prefix_cache_hit_rate_collapses_without_monsters() -> None:
    run = _run("prefix_cache_collapse")
    assert _hit_rate(_between(run, 0, 75)) > 0.95
    assert _hit_rate(_between(run, 90, 150)) < 0.08
    assert max(s.num_ctx_tokens for s in run.steps) <= 8192
    assert all(r.num_prompt_tokens <= 16_384 for s in run.steps for r in s.finished_requests)


def test_leaked_slots_wedge_the_engine_with_requests_waiting() -> None:
    run = _run("leaked_slot_wedge")
    last = run.steps[-1]
    assert run.end_ts - last.ts > 60  # no step for the rest of the run
    assert last.num_running_reqs == 16  # every slot held by a leaked abort
    assert not run.drained
    idle_after = [r for ts, r in run.readings if ts >= last.ts]
    assert idle_after[-1].power_w < 700


def test_power_cap_window_lowers_clocks_and_slows_steps() -> None:
    run = _run("gpu_power_cap")
    cap = make_scenario("gpu_power_cap").power_cap
    assert cap is not None
    inside = _between(run, cap.start_s + 5, cap.end_s)
    before = _between(run, 20, cap.start_s)
    slowdown = statistics.mean(s.elapsed_ms for s in inside) / statistics.mean(s.elapsed_ms for s in before)
    assert slowdown > 1.3
    clocks = [r for ts, r in run.readings if cap.start_s + 5 <= ts - run.start_ts < cap.end_s]
    assert statistics.mean(r.sm_clock_mhz for r in clocks) < 0.8 * BOOST_MHZ
    assert all(r.reasons & SW_POWER_CAP for r in clocks)


def test_config_threshold_reported_but_not_applied() -> None:
    scenario = make_scenario("config_not_in_effect")
    assert scenario.config.long_prefill_token_threshold == 2048
    run = simulate(scenario, end_at=END_AT)
    assert max(s.num_ctx_tokens for s in run.steps) == 8192


def test_legitimately_slow_work_keeps_stepping() -> None:
    run = _run("legitimately_slow")
    assert run.drained
    assert len(run.steps) > 2000
    gaps = [b.ts - a.ts for a, b in zip(run.steps, run.steps[1:], strict=False)]
    assert max(gaps) < 5  # slow, never stalled
    done = run.steps[-1].finished_requests
    assert done and done[0].e2e_latency > 90  # outlives a 90 s liveness probe


# -- through the collector into the store ----------------------------------------------------------

@pytest.fixture(scope="module")
def stored(chdb_dir: Path) -> Iterator[dict[str, tuple[str, Window]]]:
    """Every scenario replayed into a database of its own: name -> (store URL, window)."""
    runs: dict[str, tuple[str, Window]] = {}
    for name in SCENARIO_NAMES:
        url = f"chdb://{chdb_dir}?database=scn_{name}"
        engine, window = run_scenario(make_scenario(name), url)
        assert engine == name
        runs[name] = (url, window)
    yield runs
    for url, _ in runs.values():
        store = Store.open(url)
        store.client.command(f"DROP DATABASE IF EXISTS `{store.database}`")
        store.close()


def _rows(stored: dict[str, tuple[str, Window]], name: str, sql: str) -> list[tuple[Any, ...]]:
    url, window = stored[name]
    store = Store.open(url)
    try:
        params = {"engine": name, "start": round(window.start.timestamp() * 1e6)}
        where = "engine = {engine:String} AND ts >= fromUnixTimestamp64Micro({start:Int64}, 'UTC')"
        return [tuple(r) for r in store.query(sql.format(where=where), parameters=params).result_rows]
    finally:
        store.close()


def test_store_holds_steps_requests_samples_and_config(stored: dict[str, tuple[str, Window]]) -> None:
    for name in SCENARIO_NAMES:
        for table in ("steps", "requests", "engine_samples", "gpu_samples"):
            assert _rows(stored, name, f"SELECT count() FROM {table} WHERE {{where}}")[0][0] > 0, (name, table)
    config = _rows(stored, "config_not_in_effect",
                   "SELECT attributes FROM events WHERE {where} AND kind = 'engine_config'")
    assert config and config[0][0]["long_prefill_token_threshold"] == "2048"


def test_stored_wedge_shows_waiting_without_steps(stored: dict[str, tuple[str, Window]]) -> None:
    rows = _rows(stored, "leaked_slot_wedge", "SELECT max(value), count() FROM engine_samples WHERE {where} "
                 "AND metric = 'vllm:num_requests_waiting' AND ts > (SELECT max(ts) FROM steps WHERE {where})")
    assert rows[0][0] > 50 and rows[0][1] > 10  # scraped for a minute and more after the last step


def test_stored_power_cap_shows_low_clocks_and_the_reason(stored: dict[str, tuple[str, Window]]) -> None:
    rows = _rows(stored, "gpu_power_cap", "SELECT min(sm_clock_mhz), countIf(has(clock_event_flags, 'sw_power_cap')) "
                 "FROM gpu_samples WHERE {where}")
    assert rows[0][0] < 0.8 * BOOST_MHZ and rows[0][1] > 0


@pytest.mark.parametrize("name", SCENARIO_NAMES)
def test_diagnosis_names_the_known_cause(stored: dict[str, tuple[str, Window]], name: str) -> None:
    from stepline.diagnosis import detectors as engine_module

    url, window = stored[name]
    reader = open_reader(url)
    try:
        findings = engine_module.diagnose(reader.client, window)
    finally:
        reader.close()
    expected = make_scenario(name).expected_kind
    if expected is None:
        assert [f for f in findings if f.severity != "info"] == []
    else:
        assert findings and findings[0].kind == expected, [(f.kind, f.severity, f.title) for f in findings]
