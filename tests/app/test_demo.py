"""The default (real-time) demo tells the README's story: a monster prompt that starves decoding chat."""

from __future__ import annotations

import re

import pytest

from stepline.app import demo
from stepline.sim.records import FinishedRequest, StepRecord
from stepline.sim.replay import ReplayResult, replay
from stepline.sim.workloads import Workload


@pytest.fixture(scope="module")
def default_workload() -> Workload:
    return demo.workload_for()


@pytest.fixture(scope="module")
def default_replay(default_workload: Workload) -> ReplayResult:
    return replay(default_workload, None, 1.0, lambda ts, body: None, end_at=1_700_000_000.0)


def _monster(run: ReplayResult) -> FinishedRequest:
    return max(run.finished, key=lambda r: r.num_prompt_tokens)


def _prefill_steps(run: ReplayResult, monster: FinishedRequest) -> list[StepRecord]:
    start = monster.arrival_ts + monster.queued_time
    end = monster.arrival_ts + monster.time_to_first_token
    return [s for s in run.steps if start < s.ts <= end]


def test_default_demo_monster_prefills_while_chat_decodes(default_replay: ReplayResult) -> None:
    monster = _monster(default_replay)
    assert monster.num_prompt_tokens >= 350_000 and monster.num_cached_tokens == 0
    during = _prefill_steps(default_replay, monster)
    assert len(during) > 30
    # Every step of its prefill carries decodes, and each of them waits the whole (slow) step for its token.
    assert min(s.num_generation_requests for s in during) >= 2, [s.num_generation_requests for s in during]
    itls = sorted(itl for s in during for itl in s.inter_token_latencies_iter)
    assert len(itls) > 60 and itls[len(itls) // 2] > 1.0
    # And requests that arrive meanwhile queue behind it.
    queued = [r for r in default_replay.finished
              if r.request_id != monster.request_id and r.queued_time >= 1.0
              and r.arrival_ts < monster.arrival_ts + monster.time_to_first_token]
    assert len(queued) >= 50


def test_default_demo_ends_when_it_says(default_workload: Workload, default_replay: ReplayResult) -> None:
    assert default_replay.drained
    last = max(r.finished_ts for r in default_replay.finished) - default_replay.start_ts
    # The demo says it collects for duration + drain seconds; the engine must be idle a little before that.
    said = default_workload.duration_s + default_workload.drain_s
    assert said - 10 <= last <= said, (last, said)
    assert said <= 80


def test_default_demo_replayed_fast_diagnoses_prefill_interference(
        default_workload: Workload, store_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    # The session's embedded engine (chDB hosts one path per process), in a database of this test's own.
    workload = demo.workload_for(default_workload.name, fast=True, duration_s=default_workload.duration_s)
    assert workload == default_workload
    demo.run_demo(store_url, workload, fast=True)
    out = capsys.readouterr().out
    diagnosis = out.split("what stepline diagnose says about", 1)[1].splitlines()
    assert diagnosis[1].startswith("1. CRITICAL  prefill_interference"), "\n".join(diagnosis[:12])
    assert re.match(r"   \S+ \(359k uncached\) prefill: ITL p99 \d\.\d+s vs \d+ms$", diagnosis[2]), diagnosis[2]
    assert any("head_of_line_blocking" in line for line in diagnosis), "\n".join(diagnosis)

