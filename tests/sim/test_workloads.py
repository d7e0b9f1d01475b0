"""Workload statistics: deterministic, and shaped like the reported production traffic."""

from __future__ import annotations

import statistics

import pytest

from stepline.sim.workloads import (
    BURST_LEAD_IN,
    BURST_PEAK,
    Arrival,
    Workload,
    burst,
    isolated,
    make_workload,
    steady,
)


def hit_rate(arrivals: list[Arrival]) -> float:
    """Token-weighted prefix-cache hit rate."""
    return sum(a.prompt_tokens * a.cached_fraction for a in arrivals) / sum(a.prompt_tokens for a in arrivals)


def within(workload: Workload, bounds: tuple[float, float]) -> list[Arrival]:
    start, end = bounds[0] * workload.duration_s, bounds[1] * workload.duration_s
    return [a for a in workload.arrivals if start <= a.offset_s < end]


def check_well_formed(workload: Workload) -> None:
    offsets = [a.offset_s for a in workload.arrivals]
    assert offsets == sorted(offsets)
    assert all(0 <= t < workload.duration_s for t in offsets)
    assert len({a.request_id for a in workload.arrivals}) == len(workload.arrivals)
    for a in workload.arrivals:
        assert a.prompt_tokens >= 1 and a.output_tokens >= 1
        assert 0.0 <= a.cached_fraction <= 1.0
        assert a.max_tokens >= a.output_tokens
        assert (a.max_tokens == a.output_tokens) == (a.finish_reason == "length")


@pytest.mark.parametrize("name", ["steady", "burst", "isolated"])
def test_workloads_are_deterministic_per_seed(name: str) -> None:
    assert make_workload(name, seed=3) == make_workload(name, seed=3)
    if name != "isolated":
        assert make_workload(name, seed=3).arrivals != make_workload(name, seed=4).arrivals
    check_well_formed(make_workload(name, seed=3))


def test_burst_matches_the_reported_incident() -> None:
    workload = burst()
    assert len(workload.arrivals) == 658
    regular = [a for a in workload.arrivals if a.prompt_tokens < 100_000]
    monsters = [a for a in workload.arrivals if a.prompt_tokens >= 100_000]
    assert 2600 <= statistics.median(a.prompt_tokens for a in regular) <= 3500
    assert 32 <= statistics.median(a.output_tokens for a in regular) <= 42
    assert 3 <= len(monsters) <= 6
    assert max(a.prompt_tokens for a in monsters) >= 350_000
    assert all(a.prompt_tokens <= 360_000 and 100 <= a.output_tokens <= 150 for a in monsters)
    assert {a.finish_reason for a in workload.arrivals} == {"stop", "length", "abort"}


def test_burst_hit_rate_falls_from_quiet_to_burst() -> None:
    workload = burst()
    assert hit_rate(within(workload, BURST_LEAD_IN)) >= 0.95
    assert 0.01 <= hit_rate(within(workload, BURST_PEAK)) <= 0.08
    assert len(within(workload, BURST_PEAK)) >= 10 * len(within(workload, BURST_LEAD_IN))


def test_short_burst_keeps_its_shape() -> None:
    workload = burst(duration_s=60.0)
    check_well_formed(workload)
    assert workload.duration_s == 60.0
    assert 50 <= len(workload.arrivals) <= 80
    assert any(a.prompt_tokens >= 100_000 for a in workload.arrivals)
    assert hit_rate(within(workload, BURST_LEAD_IN)) > hit_rate(within(workload, BURST_PEAK))


def test_steady_is_cached_chat_at_its_rate() -> None:
    workload = steady(duration_s=200.0, rate_per_s=4.0)
    assert 700 <= len(workload.arrivals) <= 900
    assert 0.85 <= hit_rate(list(workload.arrivals)) <= 0.95
    assert 900 <= statistics.median(a.prompt_tokens for a in workload.arrivals) <= 1500


def test_isolated_is_one_long_request_scaled_to_the_duration() -> None:
    (arrival,) = isolated().arrivals
    assert arrival.prompt_tokens == 524_288
    assert arrival.cached_fraction == 1.0
    assert isolated(duration_s=10.0).arrivals[0].output_tokens < arrival.output_tokens


def test_bad_names_and_durations_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown workload 'nope'"):
        make_workload("nope")
    with pytest.raises(ValueError, match="duration"):
        make_workload("steady", duration_s=-1)
