"""Scheduling or silicon: decode rates under load against the engine alone, and GPU XID errors."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest

from stepline.diagnosis import common
from stepline.diagnosis.findings import Window
from stepline.diagnosis.hardware import RATES_APPROXIMATE, _alone, gpu_xid, scheduler_vs_hardware
from stepline.drills.scenarios import Scenario, ScenarioRun, run_engines
from stepline.model.rows import Event, Request, Step
from stepline.sim.config import EngineConfig, SpecDecode
from stepline.sim.records import StepRecord
from stepline.sim.workloads import chat_arrivals, compose, one_request
from stepline.store.store import Store
from tests.diagnosis.conftest import Timelines
from tests.diagnosis.test_detectors import ENGINE, WINDOW, _ts, insert, request, steady, step


def loaded(decode_s: float) -> list[Any]:
    """A healthy engine (10 ms decode-only steps: 100 tok/s alone), plus 2,000-token requests that each took
    `decode_s` to generate their 100 tokens under load."""
    rows = [r for r in steady() if not isinstance(r, Request)]
    return rows + [request(f"loaded{i}", 10.0 + i, 0.0, 0.05, decode_s, 2000) for i in range(50)]


def speculative_run(store_url: str, end_at: float | None = None) -> tuple[ScenarioRun, Window]:
    """Three long answers decoding mostly alone beside a little chat, on an engine drafting 3 tokens a step (each
    accepted at 70%), recorded through the collector from what the plugin hears (vLLM's scheduled tokens)."""
    pool = [one_request(f"long-{i}", 0.2 * i, 1000, 500, 0.9) for i in range(3)]
    chat = chat_arrivals("chat", 2, 12, 1.0, output_median=80)
    config = EngineConfig(speculative=SpecDecode(3, 0.7, seed=7))
    [run], window = run_engines([("spec", Scenario("spec", None, compose("spec", 15, 30, pool, chat), config))],
                                store_url, end_at=end_at)
    assert run.drained and not any(s.num_preempted_reqs for s in run.steps)  # a token past the first is a decode's
    return run, window


def decode_tokens(step: StepRecord) -> int:
    """The tokens the simulated engine gave its requests past their first token in `step` (what it knows)."""
    return step.num_output_tokens - len(step.time_to_first_tokens_iter)


def test_the_alone_rate_of_a_drafting_engine_is_what_its_requests_got(store_url: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # Ended 5 minutes ago: every step falls in the whole minutes a long window reads from the projection.
    run, window = speculative_run(store_url, end_at=time.time() - 300)
    alone = sorted(decode_tokens(s) / s.num_generation_requests * 1000 / s.elapsed_ms for s in run.steps
                   if s.num_ctx_tokens == 0 and 1 <= s.num_generation_requests <= 4 and s.elapsed_ms > 0)
    truth = [alone[int(q * len(alone))] for q in (0.1, 0.5, 0.9)]  # as quantilesExact picks them
    store = Store.open(store_url)
    try:
        [(steps, rates, _, approximate)] = _alone(store, window).values()
        assert (steps, approximate) == (len(alone), "")
        # About 2.5 tokens a request a step: one token a step would be 1000 / elapsed_ms, 2.5x too slow.
        assert rates == pytest.approx(tuple(truth), rel=1e-4)
        monkeypatch.setattr(common, "EXACT_MAX_STEPS", 10)  # as if the window held a busy day of the engine
        [(_, rates, _, approximate)] = _alone(store, Window(window.start - timedelta(hours=3), window.end,
                                                            window.engine)).values()
        assert rates[1] == pytest.approx(truth[1], rel=0.03)
        assert approximate.endswith("tokens a decoding request gets a step")
    finally:
        store.client.command(f"DROP DATABASE IF EXISTS `{store.database}`")
        store.close()


def test_a_decode_rate_far_below_the_engine_alone_is_told(timelines: Timelines) -> None:
    window = timelines.add("starved", loaded(decode_s=100.0))  # 1 tok/s against 100 alone
    [found] = scheduler_vs_hardware(timelines.store, window)
    assert (found.kind, found.severity) == ("scheduler_vs_hardware", "info")
    assert found.evidence["alone_tok_s"] == "100.0..100.0 (p50 100.0)"
    assert found.evidence["under_load_by_band"] == {"1k-8k": "1.0..1.0 tok/s (p1..p50, 50 req)"}
    assert found.title == "1.0..1.0 tok/s under load (1k-8k) vs 100 alone"
    # The SQL is the engine's bands: pasted into the store it answers them.
    assert [r[0] for r in timelines.store.query(found.sql).result_rows] == ["1k-8k"]


def test_a_rate_within_five_times_the_engine_alone_is_quiet(timelines: Timelines) -> None:
    window = timelines.add("fine", loaded(decode_s=2.0))  # 50 tok/s against 100 alone
    assert scheduler_vs_hardware(timelines.store, window) == []


def test_without_quiet_steps_there_is_nothing_to_compare_with(timelines: Timelines) -> None:
    # Every step carries eight decoders: none shows what one request gets alone.
    busy = [s._replace(num_generation_requests=8) if isinstance(s, Step) else s for s in loaded(decode_s=100.0)]
    window = timelines.add("never_alone", busy)
    assert scheduler_vs_hardware(timelines.store, window) == []


def _xid(t: float, xid: str, engine: str = ENGINE) -> Event:
    return Event(_ts(t), "h", engine, "nvml", "gpu_xid", "critical", f"XID {xid} on GPU 0", {"xid": xid, "gpu": "0"})


def test_an_xid_is_critical_and_counts_steps_slow_for_this_engine(timelines: Timelines) -> None:
    slow = [step(300 + i, 500.0, n=9000 + i) for i in range(3)]  # 50x its 10 ms decode-only steps
    window = timelines.add("xid", [*steady(), *slow, _xid(200, "79"), _xid(250, "48"), _xid(260, "79")])
    [found] = gpu_xid(timelines.store, window)
    assert (found.kind, found.severity, found.score) == ("gpu_xid", "critical", 3.0)
    e = found.evidence
    assert (e["xid_events"], e["xids"], e["first_message"]) == (3, ["48", "79"], "XID 79 on GPU 0")
    assert (e["slow_step_from_ms"], e["slow_steps_in_window"], e["baseline_decode_step_p50_ms"]) == (100.0, 3, 10.0)
    assert found.title.startswith("3 GPU XID error(s) 48, 79 from ")
    assert len(timelines.store.query(found.sql).result_rows) == 3


def test_no_xid_no_finding(timelines: Timelines) -> None:
    assert gpu_xid(timelines.store, timelines.add("no_xid", steady())) == []


def test_an_xid_of_a_gpu_no_engine_was_seen_on_concerns_every_engine(store: Store) -> None:
    # A store of its own: the unattributed XID would reach every engine of a shared one.
    insert(store, [*steady(), _xid(200, "79", engine="")])
    [found] = gpu_xid(store, WINDOW)
    assert (found.engine, found.evidence["xids"]) == (ENGINE, ["79"])
    assert [f.engine for f in gpu_xid(store, Window(WINDOW.start, WINDOW.end))] == [ENGINE]


@pytest.mark.parametrize("engine", ["", ENGINE])
def test_steps_of_an_engine_without_decode_only_steps_are_never_slow(store: Store, engine: str) -> None:
    insert(store, [step(10.0 + i, 500.0, prefill=512, n=i) for i in range(30)] + [_xid(20, "31")])
    [found] = gpu_xid(store, Window(WINDOW.start, WINDOW.end, engine))
    assert (found.evidence["slow_step_from_ms"], found.evidence["slow_steps_in_window"]) == (None, 0)


def test_beyond_the_exact_budget_rates_come_from_the_projection_of_one_source(timelines: Timelines,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # Each loaded request also reported by a span that gives another rate (2 tok/s): the plugin's reports are read,
    # and each request once.
    rows = loaded(decode_s=100.0)
    spans = [r._replace(source="otlp", mean_tpot_seconds=0.5, finish_reason="") for r in rows if isinstance(r, Request)]
    window = timelines.add("starved_long", rows)
    insert(timelines.store, [r._replace(engine="starved_long", host="starved_long") for r in spans])
    monkeypatch.setattr(common, "EXACT_MAX_STEPS", 10)  # as if the window held a busy day of the engine
    long = Window(window.start - timedelta(hours=2), window.end, window.engine)
    [found] = scheduler_vs_hardware(timelines.store, long)
    assert found.evidence["under_load_by_band"] == {"1k-8k": "1.0..1.0 tok/s (p1..p50, 50 req)"}
    assert found.evidence["under_load_quantiles"] == RATES_APPROXIMATE
    # Without the budget, the merged requests (the larger TPOT of the two reports: the plugin's) give the same.
    monkeypatch.setattr(common, "EXACT_MAX_STEPS", 100_000)
    [exact] = scheduler_vs_hardware(timelines.store, long)
    assert exact.evidence["under_load_by_band"] == found.evidence["under_load_by_band"]
    assert "under_load_quantiles" not in exact.evidence
