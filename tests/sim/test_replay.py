"""Fast replay: scrapes stamped as if live, ending at end_at, with monotonic counters."""

from __future__ import annotations

import itertools
import math
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from stepline.sim.config import EngineConfig
from stepline.sim.replay import replay
from stepline.sim.workloads import make_workload

END_AT = 1_800_000_000.0


def test_scrapes_are_spaced_by_the_interval_and_end_at_end_at() -> None:
    workload = make_workload("burst", duration_s=60.0)
    stamps: list[float] = []
    result = replay(workload, EngineConfig(), 7.0, lambda ts, _: stamps.append(ts), end_at=END_AT)
    span = workload.duration_s + workload.drain_s
    assert stamps[-1] == END_AT == result.end_ts
    assert stamps[0] == result.start_ts
    assert len(stamps) == math.ceil(span / 7.0) + 1 == result.scrapes
    assert END_AT - stamps[0] >= span
    assert all(b - a == pytest.approx(7.0) for a, b in itertools.pairwise(stamps))
    assert result.drained
    assert all(result.start_ts < s.ts <= END_AT for s in result.steps)
    assert len(result.finished) == len(workload.arrivals)


def test_end_at_defaults_to_now() -> None:
    stamps: list[float] = []
    before = time.time()
    replay(make_workload("isolated", duration_s=5.0), None, 1.0, lambda ts, _: stamps.append(ts))
    assert before <= stamps[-1] <= time.time()


def test_counters_never_go_back_across_scrapes() -> None:
    previous: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    grew: set[str] = set()

    def check(ts: float, exposition: bytes) -> None:
        for family in text_string_to_metric_families(exposition.decode()):
            if family.type not in ("counter", "histogram"):
                continue
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                key = (sample.name, tuple(sorted(sample.labels.items())))
                before = previous.get(key, 0.0)
                assert sample.value >= before, f"{sample.name} fell at {ts}"
                if sample.value > before:
                    grew.add(sample.name)
                previous[key] = sample.value

    replay(make_workload("burst", duration_s=60.0), EngineConfig(), 2.0, check, end_at=END_AT)
    assert {
        "vllm:generation_tokens_total",
        "vllm:prompt_tokens_total",
        "vllm:prefix_cache_hits_total",
        "vllm:inter_token_latency_seconds_count",
        "vllm:request_success_total",
    } <= grew


def test_full_burst_replays_quickly_and_drains() -> None:
    scrapes: list[bytes] = []
    started = time.process_time()
    result = replay(make_workload("burst"), EngineConfig(), 5.0, lambda _, body: scrapes.append(body), end_at=END_AT)
    assert time.process_time() - started < 20.0
    assert result.drained and result.rejected == 0
    assert len(result.finished) == 658
    assert max(s.num_waiting_reqs for s in result.steps) >= 50, "the burst queues requests up"
    assert max(s.elapsed_ms for s in result.steps) >= 1500, "a monster's deep chunks make slow steps"
    assert len(scrapes) == result.scrapes


def test_records_can_be_streamed_instead_of_kept() -> None:
    seen: list[float] = []
    result = replay(
        make_workload("steady", duration_s=10.0),
        None,
        1.0,
        lambda *_: None,
        end_at=END_AT,
        on_step=lambda step: seen.append(step.ts),
        keep_records=False,
    )
    assert seen and result.steps == [] and result.finished == []


def test_bad_intervals_are_refused() -> None:
    with pytest.raises(ValueError, match="scrape_interval_s"):
        replay(make_workload("isolated"), None, 0.0, lambda *_: None)
