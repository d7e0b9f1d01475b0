"""Simulator additions for generated cases: speculative decoding, a speed scale, several engines, in-flight windows."""

from __future__ import annotations

from pathlib import Path

import pytest

from stepline.drills.scenarios import Scenario, run_engines, simulate
from stepline.sim.config import EngineConfig, SpecDecode
from stepline.sim.costmodel import CostModel
from stepline.sim.engine import Simulation
from stepline.sim.records import StepRecord
from stepline.sim.telemetry import engine_config, scheduler_stats
from stepline.sim.workloads import Arrival, chat_arrivals, compose, one_request
from stepline.store.store import Store

END_AT = 1_700_000_000.0


def _steps(config: EngineConfig, *parts: list[Arrival], duration_s: float = 30.0) -> list[StepRecord]:
    steps: list[StepRecord] = []
    sim = Simulation(compose("t", duration_s, 60.0, *parts), config, on_step=steps.append)
    sim.advance_to(duration_s + 3600.0)
    assert sim.is_done()
    return steps


def _pool(count: int = 8, output: int = 400) -> list[Arrival]:
    return [one_request(f"r{i}", 0.1 * i, 1000, output, 0.9) for i in range(count)]


def test_spec_decode_emits_one_to_k_plus_one_tokens_per_request_and_counts_drafts() -> None:
    k = 4
    steps = _steps(EngineConfig(speculative=SpecDecode(k, 0.7, seed=1)), _pool())
    decode = [s for s in steps if s.num_ctx_tokens == 0 and s.num_generation_requests]
    assert sum(s.num_output_tokens for s in steps) == 8 * 400  # every request gets exactly its tokens
    for s in decode:
        assert s.num_generation_requests <= s.num_output_tokens <= (k + 1) * s.num_generation_requests
        assert s.spec_num_accepted_tokens <= s.spec_num_draft_tokens <= k * s.spec_num_drafts
        assert s.num_output_tokens == s.num_generation_requests + s.spec_num_accepted_tokens
        assert s.num_generation_tokens == s.num_generation_requests + s.spec_num_draft_tokens
        assert sum(s.spec_accepted_per_pos) == s.spec_num_accepted_tokens
    rate = sum(s.spec_num_accepted_tokens for s in decode) / sum(s.spec_num_draft_tokens for s in decode)
    expected = sum(0.7**i for i in range(1, k + 1)) / k  # accepted position by position up to the first rejection
    assert rate == pytest.approx(expected, abs=0.05)
    # Fewer steps than one token at a time would take.
    assert len(decode) < 0.6 * len(_steps(EngineConfig(), _pool()))


def test_spec_decode_acceptance_shifts_at_its_time() -> None:
    spec = SpecDecode(3, 0.9, shift_at_s=20.0, acceptance_after=0.1, seed=2)
    config = EngineConfig(cost=CostModel().scaled(5), speculative=spec)
    steps = _steps(config, _pool(16, 3000))
    t0 = steps[0].ts - steps[0].elapsed_ms / 1000

    def rate(lo: float, hi: float) -> float:
        chosen = [s for s in steps if lo <= s.ts - t0 < hi]
        return sum(s.spec_num_accepted_tokens for s in chosen) / sum(s.spec_num_draft_tokens for s in chosen)

    assert rate(2, 19) > 0.6 and rate(21, 40) < 0.1


def test_spec_decode_off_by_default_and_reported_like_vllm() -> None:
    steps = _steps(EngineConfig(), _pool(2, 50))
    assert all(s.spec_num_drafts == s.spec_num_draft_tokens == 0 for s in steps)
    assert scheduler_stats(steps[-1]).spec_decoding_stats is None
    assert engine_config(EngineConfig())["speculative_decoding"] is False
    on = EngineConfig(speculative=SpecDecode(3, 0.5))
    assert engine_config(on).items() >= {"speculative_decoding": True, "num_speculative_tokens": 3}.items()
    drafted = next(s for s in _steps(on, _pool(2, 50)) if s.spec_num_drafts)
    stats = scheduler_stats(drafted).spec_decoding_stats
    assert stats is not None and stats.num_draft_tokens == drafted.spec_num_draft_tokens
    sim = Simulation(compose("t", 5, 30, _pool(2, 50)), on)
    sim.advance_to(30)
    body = sim.render_metrics().decode()
    assert "vllm:spec_decode_num_draft_tokens_total" in body and "vllm:spec_decode_num_accepted_tokens_total" in body
    assert "spec_decode" not in Simulation(compose("t", 5, 30, _pool(2, 50)), EngineConfig()).render_metrics().decode()
    with pytest.raises(ValueError, match="go together"):
        SpecDecode(3, 0.5, shift_at_s=10.0)


def test_speed_scale_multiplies_every_step() -> None:
    base = CostModel()
    assert base.scaled(10).step_seconds(8192, 1e9, 32, 100_000) == pytest.approx(
        10 * base.step_seconds(8192, 1e9, 32, 100_000))
    alone = [one_request("alone", 0.0, 3000, 200)]  # nothing to batch with: the same steps at any speed
    fast = _steps(EngineConfig(cost=base.scaled(0.1)), alone)
    slow = _steps(EngineConfig(cost=base.scaled(10)), alone)
    assert len(fast) == len(slow)
    ratio = sum(s.elapsed_ms for s in slow) / sum(s.elapsed_ms for s in fast)
    assert ratio == pytest.approx(100, rel=0.01)
    with pytest.raises(ValueError, match="positive"):
        base.scaled(0)


def test_a_window_can_end_with_a_prefill_in_flight() -> None:
    pool = _pool(8, 2000)
    monster = [one_request("monster", 10.0, 400_000, 50)]
    run = simulate(Scenario("inflight", "prefill_interference", compose("inflight", 30.0, 0.0, pool, monster)),
                   end_at=END_AT)
    assert not run.drained and run.in_flight >= 1
    assert run.end_ts - run.start_ts == pytest.approx(30.0)
    assert run.steps[-1].num_ctx_tokens > 0  # still prefilling at the window's end
    assert not any(r.request_id == "monster" for s in run.steps for r in s.finished_requests)


def test_several_engines_replay_into_one_store(chdb_dir: Path) -> None:
    url = f"chdb://{chdb_dir}?database=sim_multi"
    chat = compose("chat", 20, 10, chat_arrivals("chat", 0, 20, 2.0, output_median=30))
    slow = EngineConfig(cost=CostModel().scaled(3), speculative=SpecDecode(3, 0.6))
    runs, window = run_engines([("fast", Scenario("fast", None, chat)),
                                ("slow", Scenario("slow", None, chat, slow, xid_at_s=5.0))], url)
    assert window.engine == "" and len(runs) == 2
    assert window.start.timestamp() == pytest.approx(min(r.start_ts for r in runs))
    store = Store.open(url)
    try:
        steps: dict[str, int] = {str(e): int(n) for e, n in
                                 store.query("SELECT engine, count() FROM steps GROUP BY engine").result_rows}
        assert set(steps) == {"fast", "slow"} and steps["slow"] < steps["fast"]
        spec = store.query("SELECT engine, sum(spec_num_draft_tokens) FROM steps GROUP BY engine").result_rows
        assert {e: int(n) > 0 for e, n in spec} == {"fast": False, "slow": True}
        gpus = store.query("SELECT engine, groupUniqArray(gpu_index) FROM gpu_samples WHERE engine != '' "
                           "GROUP BY engine").result_rows
        indexes = {e: sorted(g) for e, g in gpus}
        assert indexes == {"fast": [0, 1], "slow": [2, 3]}  # one host, each engine on GPUs of its own
        xids = store.query("SELECT engine FROM events WHERE kind = 'gpu_xid'").result_rows
        assert [r[0] for r in xids] == ["slow"]
        store.client.command(f"DROP DATABASE IF EXISTS `{store.database}`")
    finally:
        store.close()
    with pytest.raises(ValueError, match="differ"):
        run_engines([("a", Scenario("a", None, chat)), ("a", Scenario("a", None, chat))], url)


def _monster_diagnosed(chdb_dir: Path, async_scheduling: bool) -> dict[str, object]:
    """The evidence of the top finding of generated case 2 (a finished monster prefill, on an engine whose host
    overhead is drawn at 15.6 ms of its 20 ms fixed step cost when scheduling asynchronously)."""
    from stepline.diagnosis.detectors import diagnose
    from stepline.diagnosis.findings import Finding
    from stepline.drills.generator import generate, run_case
    from stepline.store.reader import open_reader

    case = generate(2, async_scheduling=async_scheduling)
    url = f"chdb://{chdb_dir}?database=monster_{'async' if async_scheduling else 'sync'}"
    window = run_case(case, url)
    reader = open_reader(url)
    try:
        top = sorted(diagnose(reader.client, window), key=Finding.rank_key)[0]
    finally:
        reader.close()
        store = Store.open(url)
        store.client.command(f"DROP DATABASE IF EXISTS `{store.database}`")
        store.close()
    assert (top.kind, top.engine) == ("prefill_interference", case.truth_engine)
    return top.evidence


def test_a_monsters_prefill_under_async_scheduling_reads_the_steps_as_they_ran(chdb_dir: Path) -> None:
    """Under async scheduling vLLM's elapsed_ms is the core's wait (here ~6 ms of a ~21 ms decode step): read as the
    step's time, the decoders' ITL no longer follows their steps and the engine's decode baseline is a third of
    what it is. The steps as stored last what they ran, as with synchronous scheduling, and the finding says so."""
    pipelined = _monster_diagnosed(chdb_dir, async_scheduling=True)
    synchronous = _monster_diagnosed(chdb_dir, async_scheduling=False)
    assert str(pipelined["step_time"]).startswith("time between the engine core's step ends")
    assert str(synchronous["step_time"]).startswith("vLLM's elapsed_ms (a synchronous engine core")
    # ITL follows step time, outside the prefill and inside it.
    outside_ms = float(pipelined["step_p50_decode_only_outside_ms"])  # type: ignore[arg-type]
    assert outside_ms == pytest.approx(float(pipelined["itl_p50_outside_s"]) * 1000, rel=0.15)  # type: ignore[arg-type]
    assert float(pipelined["itl_over_step_inside"]) == pytest.approx(1.0, abs=0.1)  # type: ignore[arg-type]
    # And the same engine scheduling synchronously has the same baseline.
    assert outside_ms == pytest.approx(float(synchronous["baseline_decode_step_p50_ms"]), rel=0.1)  # type: ignore[arg-type]
