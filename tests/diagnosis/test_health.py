"""Engine health against the engine's own figures: prefix-cache collapse, speculative acceptance, KV pressure, and
a wedge told apart from an engine that is only slow."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from stepline.diagnosis.baseline import MIN_USUAL_HIT_RATE, WEDGE_UNKNOWN_LAG_S
from stepline.diagnosis.findings import Window
from stepline.diagnosis.health import (
    WHOLE_MINUTES,
    _request_hits,
    kv_pressure,
    prefix_cache_collapse,
    spec_decode_acceptance_shift,
    wedged_engine,
)
from stepline.model.rows import EngineSample, Request
from tests.diagnosis.conftest import Timelines
from tests.diagnosis.test_detectors import _cached_chat, _ts, gpu, steady, step


def without_requests() -> list[Any]:
    return [r for r in steady() if not isinstance(r, Request)]


def test_a_prefix_cache_collapse_against_the_engines_usual_rate(timelines: Timelines) -> None:
    rows = without_requests() + _cached_chat(0, 400, 0.95, "cached") + _cached_chat(400, 590, 0.02, "fresh")
    window = timelines.add("collapse", rows)
    [found] = prefix_cache_collapse(timelines.store, window)
    e = found.evidence
    assert (found.kind, found.severity, e["bucket_s"]) == ("prefix_cache_collapse", "warning", 10)
    # The low rate may take in the bucket where cached gave way to fresh (how the 10 s buckets fall on the minute).
    assert e["hit_rate_usual"] == pytest.approx(0.95, abs=0.005) and 0.02 <= e["hit_rate_low"] < 0.05
    assert e["low_buckets"] >= 15 and e["requests_in_low_buckets"] == 5 * e["low_buckets"]  # 2 s apart, 10 s buckets
    assert found.title.startswith("prefix-cache hit rate ") and " vs 95." in found.title


def test_a_cache_that_never_hit_much_cannot_collapse(timelines: Timelines) -> None:
    usual = MIN_USUAL_HIT_RATE / 2
    rows = without_requests() + _cached_chat(0, 400, usual, "meh") + _cached_chat(400, 590, 0.0, "fresh")
    assert prefix_cache_collapse(timelines.store, timelines.add("never_cached", rows)) == []


def test_only_the_plugins_reports_carry_cached_tokens(timelines: Timelines) -> None:
    reported = _cached_chat(0, 400, 0.95, "cached") + _cached_chat(400, 590, 0.02, "fresh")
    rows = without_requests() + [r._replace(source="otlp") for r in reported]
    assert prefix_cache_collapse(timelines.store, timelines.add("otlp_only", rows)) == []


def _drafting(accepted_first: int, accepted_later: int, drafted: int = 40) -> list[Any]:
    return (without_requests()
            + [step(10 + i, drafts=10, drafted=drafted, accepted=accepted_first, n=7000 + i) for i in range(100)]
            + [step(400 + i, drafts=10, drafted=drafted, accepted=accepted_later, n=7200 + i) for i in range(100)])


@pytest.mark.parametrize(("name", "first", "later", "severity"), [
    ("spec_halved", 32, 12, "warning"),  # 80% then 30%
    ("spec_moved", 32, 20, "info"),  # 80% then 50%: moved, not halved
])
def test_speculative_acceptance_moving_across_the_window(timelines: Timelines, name: str, first: int, later: int,
                                                         severity: str) -> None:
    [found] = spec_decode_acceptance_shift(timelines.store, timelines.add(name, _drafting(first, later)))
    assert found.severity == severity
    assert (found.evidence["acceptance_max"], found.evidence["acceptance_min"]) == (first / 40, later / 40)


@pytest.mark.parametrize(("name", "rows"), [
    ("spec_steady", _drafting(32, 28)),  # 80% then 70%: within 15 points
    ("spec_thin", _drafting(32, 1, drafted=4)),  # buckets of under 100 drafted tokens are not read
    ("spec_none", without_requests()),
])
def test_acceptance_that_holds_or_is_too_thin_to_read_is_quiet(timelines: Timelines, name: str,
                                                               rows: list[Any]) -> None:
    assert spec_decode_acceptance_shift(timelines.store, timelines.add(name, rows)) == []


@pytest.mark.parametrize(("name", "kv", "preempted", "severity"), [
    ("kv_warning", 0.99, 3, "warning"), ("kv_critical", 0.99, 60, "critical"),
    ("kv_no_preemption", 0.99, 0, None), ("kv_room", 0.9, 60, None),
])
def test_kv_pressure_is_a_full_cache_with_preemptions(timelines: Timelines, name: str, kv: float, preempted: int,
                                                      severity: str | None) -> None:
    rows = without_requests() + [step(300 + i, kv=kv, n=8000 + i) for i in range(10)]
    rows.append(step(311, kv=kv, preempted=preempted, n=8100))
    found = kv_pressure(timelines.store, timelines.add(name, rows))
    assert [f.severity for f in found] == ([severity] if severity else [])
    if severity:
        assert found[0].evidence == {"kv_usage_max": kv, "preemptions": preempted, "steps_kv_over_95pct": 11}


def _stopped(util: float) -> list[Any]:
    """Steps every 0.5 s until 300 s, the last with 12 waiting, and the GPU at `util` all along."""
    rows: list[Any] = [step(i * 0.5, n=i) for i in range(600)]
    rows.append(step(300, waiting=12, n=700))
    return rows + [gpu(float(i), util=util) for i in range(600)]


def _scraped_waiting(every_s: float, value: float) -> list[EngineSample]:
    return [EngineSample(_ts(i * every_s), "h", "e0", "0", "m", "vllm:num_requests_waiting", "gauge", {}, value, 0.0)
            for i in range(int(600 / every_s))]


def test_a_wedge_without_scrapes_has_the_assumed_delivery_budget(timelines: Timelines) -> None:
    [found] = wedged_engine(timelines.store, timelines.add("wedged", _stopped(util=0.0)))
    assert (found.kind, found.severity) == ("wedged_engine", "critical")
    e = found.evidence
    assert (e["waiting"], e["progress_budget_s"], e["scrape_interval_s"]) == (12, WEDGE_UNKNOWN_LAG_S, None)
    assert e["seconds_since_last_step"] == 300.0  # the last step at 300 s of a window ending at 600 s


def test_the_budget_follows_the_engines_scrapes_and_the_scraped_queue_counts(timelines: Timelines) -> None:
    rows = [*_stopped(util=0.0), *_scraped_waiting(5.0, 20.0)]
    [found] = wedged_engine(timelines.store, timelines.add("wedged_scraped", rows))
    e = found.evidence
    assert (e["waiting"], e["scrape_interval_s"], e["progress_budget_s"]) == (20, 5.0, 11.0)  # 2 scrapes + 1 s


def test_a_wedge_says_gpus_idle_only_where_the_gpus_were_read(timelines: Timelines) -> None:
    # A CPU engine (the real-engine run's) has no GPU reading: its wedge must not claim idle GPUs.
    [cpu] = wedged_engine(timelines.store, timelines.add("wedged_cpu", _stopped(util=0.0)[:601]))
    assert cpu.title.endswith(", no GPU readings") and "GPUs idle" not in cpu.title, cpu.title
    assert cpu.evidence["gpu_util_pct"] is None
    [gpu_idle] = wedged_engine(timelines.store, timelines.add("wedged_gpu", _stopped(util=0.0)))
    assert gpu_idle.title.endswith(", GPUs idle"), gpu_idle.title


def test_a_busy_gpu_is_no_wedge(timelines: Timelines) -> None:
    assert wedged_engine(timelines.store, timelines.add("stopped_busy", _stopped(util=90.0))) == []


def test_slow_steps_that_still_progress_are_legitimately_slow(timelines: Timelines) -> None:
    rows: list[Any] = [step(i * 0.5, n=i) for i in range(1000)]
    rows += [step(560 + i * 2, 2000.0, waiting=5, decoding=1, n=2000 + i) for i in range(20)]
    [found] = wedged_engine(timelines.store, timelines.add("slow", rows))
    assert (found.kind, found.severity) == ("legitimately_slow", "info")
    assert (found.evidence["recent_step_p50_ms"], found.evidence["slowdown"]) == (2000.0, "200.0x (slow from 10x)")
    assert found.evidence["progress_budget_s"] == 30.0  # the assumed lag: 10x its 2 s steps is less


def test_over_a_long_window_the_hit_rate_is_read_per_whole_minute(timelines: Timelines) -> None:
    rows = without_requests() + _cached_chat(0, 400, 0.95, "cached") + _cached_chat(400, 590, 0.02, "fresh")
    window = timelines.add("collapse_long", rows)
    long = Window(window.end - timedelta(hours=3), window.end, window.engine)  # 180 s buckets: whole minutes
    query, whole_minutes = _request_hits(long, 180, window.engine)
    assert whole_minutes
    forced = timelines.store.client.query(query.literal(), settings={
        "force_optimize_projection_name": "requests_per_minute"}).result_rows
    assert forced == timelines.store.query(query.literal()).result_rows
    # Every plugin report that finished in the window's whole minutes, once.
    lo, hi = (t.replace(second=0, microsecond=0) for t in (long.start + timedelta(minutes=1), long.end))
    reported = [r for r in rows if isinstance(r, Request) and lo.timestamp() * 1e6 <= r.ts < hi.timestamp() * 1e6]
    assert sum(int(r[2]) for r in forced) == len(reported) > 200
    for found in prefix_cache_collapse(timelines.store, long):
        assert found.evidence["hit_rate_from"].endswith(f"over the {WHOLE_MINUTES}")
