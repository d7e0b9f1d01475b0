"""`stepline whatif` on runs recorded through the normal path (plugin, OTLP, /metrics) into the embedded store."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace

import pytest

from stepline.cli.main import main
from stepline.diagnosis.findings import Window
from stepline.drills.scenarios import Scenario, run_engines
from stepline.sim import costmodel
from stepline.sim.config import EngineConfig
from stepline.sim.workloads import Arrival, Workload, chat_arrivals, compose, short_burst
from stepline.store.reader import open_reader
from stepline.whatif.core import WhatIf, lanes, whatif
from stepline.whatif.figures import Objectives
from stepline.whatif.fit import FitError, fit
from stepline.whatif.levers import Lever, baseline_config, candidates
from stepline.whatif.render import envelope, html_section, render, seconds
from stepline.whatif.trace import EngineTrace, Steps, TracedRequest, load

OBJECTIVES = Objectives(ttft_s=10.0, tpot_s=0.1)


@dataclass
class Recorded:
    store_url: str
    window: Window
    traces: list[EngineTrace]


def _record(store_url: str, config: EngineConfig, workload: Workload | None = None) -> Recorded:
    scenario = Scenario("whatif", None, workload or short_burst(), config)
    _, window = run_engines([("whatif", scenario)], store_url)
    reader = open_reader(store_url)
    try:
        return Recorded(store_url, window, load(reader.client, window))
    finally:
        reader.close()


@pytest.fixture(scope="module")
def recorded(chdb_dir: object) -> Recorded:
    return _record(f"chdb://{chdb_dir}?database=t_whatif_a", EngineConfig())


@pytest.fixture(scope="module")
def result(recorded: Recorded) -> WhatIf:
    return whatif(recorded.traces, OBJECTIVES, jobs=1)


def test_the_fit_recovers_the_engines_step_cost(recorded: Recorded) -> None:
    f = fit(recorded.traces[0])
    assert f.cost.step_overhead_s == pytest.approx(costmodel.STEP_OVERHEAD_S, rel=0.05)
    assert f.cost.prefill_token_s == pytest.approx(costmodel.PREFILL_TOKEN_S, rel=0.05)
    assert f.cost.prefill_attention_pair_s == pytest.approx(costmodel.PREFILL_ATTENTION_PAIR_S, rel=0.05)
    assert f.held_out > 0 and f.median_error < 0.02 and abs(f.total_error) < 0.02


def test_the_fit_of_an_asynchronously_scheduling_engine_recovers_the_same_cost(chdb_dir: object) -> None:
    """vLLM 0.33 on a GPU: its elapsed_ms is the core's wait, here the step less 7 of its 9 ms fixed cost. The fit
    reads each step's period (from the previous step's end, where that one left work in flight: whatif/fit.py), not
    vLLM's reading, and finds the cost model the engine runs in both modes."""
    recorded = _record(f"chdb://{chdb_dir}?database=t_whatif_async",
                       EngineConfig(async_scheduling=True, host_overhead_s=0.007))
    f = fit(recorded.traces[0])
    assert f.cost.step_overhead_s == pytest.approx(costmodel.STEP_OVERHEAD_S, rel=0.05)
    assert f.cost.prefill_token_s == pytest.approx(costmodel.PREFILL_TOKEN_S, rel=0.05)
    assert f.held_out > 0 and f.median_error < 0.02 and abs(f.total_error) < 0.02


def test_the_replayed_baseline_reproduces_the_recording(result: WhatIf) -> None:
    assert result.recorded.requests == result.baseline.figures.requests > 100
    assert result.reproduces, result.calibration_errors
    assert "the replay reproduces the recording within 15%" in render(result)


def test_a_lever_predicts_a_run_under_that_setting(recorded: Recorded, result: WhatIf) -> None:
    """The simulator's ground truth: the same workload really run under the lever, through the normal path."""
    lever = next(p for p in result.levers if p.lever.name == "long_prefill_token_threshold=1024")
    assert lever.replay is not None
    actual = _record(f"{recorded.store_url.rsplit('=', 1)[0]}=t_whatif_b",
                     EngineConfig(long_prefill_token_threshold=1024))
    truth = whatif(actual.traces, OBJECTIVES, levers=[], jobs=1).recorded
    predicted = lever.replay.figures
    for name in ("ttft_p99_s", "itl_p99_s", "goodput_rps"):
        assert getattr(predicted, name) == pytest.approx(getattr(truth, name), rel=0.15), name
    # The run under the lever lies inside the lever's intervals (a truth of the fit's own form).
    bands = lever.bands()
    outside = {name: (getattr(truth, name), bands[name]) for name in ("ttft_p50_s", "ttft_p99_s", "itl_p99_s",
                                                                        "goodput_rps")
               if not bands[name].low <= getattr(truth, name) <= bands[name].high}
    assert outside == {}, outside
    # and the lever changed what it does in vLLM: capped, the queue prefills beside the monster instead of behind it
    assert predicted.ttft_p50_s < 0.1 * result.baseline.figures.ttft_p50_s


def test_levers_the_build_does_not_accept_are_shown_unavailable(recorded: Recorded) -> None:
    trace = recorded.traces[0]
    config, _ = baseline_config(trace)
    older = replace(trace, config={k: v for k, v in trace.config.items() if k != "prefill_schedule_interval"})
    levers = {lv.name: lv for lv in candidates([older], [config], 0.05)}
    assert "no such setting" in levers["prefill_schedule_interval=2"].unavailable
    assert levers["shard at " + next(n.split("at ")[1] for n in levers if n.startswith("shard"))].unavailable
    small = replace(config, num_gpu_blocks=1024)  # 16k tokens of KV: a 32k budget cannot fit
    tight = {lv.name: lv for lv in candidates([trace], [small], 0.05)}
    assert "exceed the KV cache" in tight["max_num_batched_tokens=32768"].unavailable
    assert not tight["max_num_batched_tokens=4096"].unavailable
    assert "Concurrent Partial Prefill is not supported" in tight["max_num_partial_prefills=2"].unavailable
    unchunked = replace(trace, config={**trace.config, "enable_chunked_prefill": "False"})
    gated = {lv.name: lv for lv in candidates([unchunked], [config], 0.05)}
    assert gated["long_prefill_token_threshold=1024"].unavailable.startswith("gated: chunked prefill is off")
    assert not tight["long_prefill_token_threshold=1024"].unavailable
    # prefill_schedule_interval does something only in a data-parallel engine core
    assert "only in data-parallel engine cores" in tight["prefill_schedule_interval=2"].unavailable
    parallel = replace(trace, config={**trace.config, "data_parallel_size": "2"})
    assert not {lv.name: lv for lv in candidates([parallel], [config], 0.05)}["prefill_schedule_interval=2"].unavailable


def _request(i: int, prompt: int) -> TracedRequest:
    return TracedRequest(f"r{i}", 100.0 + i, 101.0 + i, 0.0, 0.5, 0.5, prompt, 0, 8, "length", 8)


def test_shape_sharding_sends_long_prompts_to_one_lane() -> None:
    traces = [EngineTrace(f"e{k}", {}, [_request(2 * i + k, 50_000 if i % 5 == 0 else 500) for i in range(20)],
                          Steps()) for k in range(3)]
    configs = [EngineConfig(num_gpu_blocks=10_000 + k) for k in range(3)]
    plan = lanes(traces, configs, Lever("shard", "shard", shard_tokens=10_000), 0.0)
    long_lane = max(plan, key=lambda lane: lane.config.kv_capacity_tokens)
    assert {a.prompt_tokens for a in long_lane.arrivals} == {50_000}
    assert all(a.prompt_tokens == 500 for lane in plan if lane is not long_lane for a in lane.arrivals)
    assert sum(len(lane.arrivals) for lane in plan) == 60


def test_priority_lever_orders_shorter_prompts_first() -> None:
    traces = [EngineTrace("e", {}, [_request(0, 200_000), _request(1, 300)], Steps())]
    plan = lanes(traces, [EngineConfig()], Lever("p", "policy", {"policy": "priority"}, priority_by_band=True), 0.0)
    priorities = {a.prompt_tokens: a.priority for a in plan[0].arrivals}
    assert priorities[300] < priorities[200_000]
    assert plan[0].config.policy == "priority"


def test_steps_without_iteration_details_cannot_be_fitted() -> None:
    steps = Steps(ts=[1.0, 2.0], elapsed_s=[math.nan, math.nan], ctx_tokens=[0, 0], gen_requests=[0, 0],
                  gen_tokens=[1, 1], in_flight_after=[1, 1], itls=[(), ()])
    with pytest.raises(FitError, match="enable-logging-iteration-details"):
        fit(EngineTrace("e", {}, [_request(0, 10)], steps))


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """In this process: chDB serves one store path per process, and the test holds it."""
    code = main(["whatif", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_command_prints_the_calibration_and_ranked_levers(recorded: Recorded, result: WhatIf,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    window = ["--from", recorded.window.start.isoformat(), "--to", recorded.window.end.isoformat()]
    code, out, err = _cli(capsys, "--store", recorded.store_url, *window, "--json", "--jobs", "1", "--replays", "3")
    assert code == 0, err
    got = json.loads(out)
    assert got["reproduces"] is True
    available = [lv for lv in got["levers"] if lv["available"]]
    assert len(available) >= 8
    goodputs = [lv["figures"]["goodput_rps"] for lv in available]
    assert goodputs == sorted(goodputs, reverse=True)
    assert got["baseline"]["requests"] == result.recorded.requests
    # Every figure of every lever as {value, low, high}, and a knife-edge flag; how the intervals were made.
    assert got["intervals"]["replays"] == 4 and got["intervals"]["nominal_coverage"] == pytest.approx(0.6)
    for lever in available:
        assert isinstance(lever["knife_edge"], bool)
        for name in ("ttft_p50_s", "ttft_p99_s", "itl_p99_s", "goodput_rps"):
            band = lever["intervals"][name]
            assert band["low"] <= band["value"] <= band["high"], (lever["lever"], name, band)
            assert band["value"] == pytest.approx(lever["figures"][name], rel=1e-4)
    assert got["recommended"] in {lv["lever"] for lv in available} | {"the recorded settings", None}
    code, out, _ = _cli(capsys, "--store", recorded.store_url, *window, "--jobs", "1", "--replays", "0")
    assert code == 0 and "levers, ranked by goodput" in out and "held-out" in out
    assert "intervals: none (--replays 0)" in out and "[" not in out.split("levers, ranked by goodput")[1]


def test_every_figure_has_an_interval_that_holds_its_replays_and_the_recording(result: WhatIf) -> None:
    assert result.replays == 10
    for priced in [p for p in result.levers if p.replay is not None]:
        assert len(priced.spread) == 9
        for name, band in priced.bands().items():
            assert band.low <= band.value <= band.high, (priced.lever.name, name)
    # The truth here steps on the fit's own cost model: the recording lies inside the baseline's intervals.
    assert result.recorded_outside() == {}
    text = render(result)
    assert "nominal coverage 82%" in text and "the recorded figures fall inside" in text
    # Goodput +382% with an interval that clears every other plan's: a lever to recommend.
    assert result.verdict().recommended == result.ranked()[0].lever.name
    assert f"recommended: {result.ranked()[0].lever.name}" in text


def test_a_lever_whose_replays_disagree_on_the_queue_is_a_knife_edge(result: WhatIf) -> None:
    """A chunk threshold of 4096 on this burst sits at a cliff: in some replays the queue behind the monster
    drains before TTFT p99 passes 5 s, in others it does not (4.3 s to 35 s)."""
    edged = {p.lever.name: p.knife_edge for p in result.levers if p.knife_edge}
    assert "long_prefill_token_threshold=4096" in edged, edged
    assert edged["long_prefill_token_threshold=4096"].startswith("TTFT p99 spans ")
    assert "(knife-edge)" in render(result)


def test_an_empty_window_is_one_clear_line(recorded: Recorded, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _cli(capsys, "--store", recorded.store_url, "--from", "2001-01-01T00:00:00", "--to",
                        "2001-01-01T00:10:00")
    assert code == 2
    assert err.strip().count("\n") == 0 and "nothing to replay" in err


def test_arrivals_keep_their_recorded_shape(recorded: Recorded) -> None:
    trace = recorded.traces[0]
    plan = lanes([trace], [baseline_config(trace)[0]], None, trace.requests[0].arrival)
    arrivals: tuple[Arrival, ...] = plan[0].arrivals
    assert sum(a.prompt_tokens for a in arrivals) == sum(r.prompt_tokens for r in trace.requests)
    assert sum(a.output_tokens for a in arrivals) == sum(r.generation_tokens for r in trace.requests)
    assert arrivals[0].offset_s == 0.0


def test_the_reports_section_shows_the_bands_in_its_table_and_around_the_best_levers_line(result: WhatIf) -> None:
    page = html_section(result)
    best = result.ranked()[0]
    assert best.replay is not None
    band = best.bands()["ttft_p99_s"]
    assert f"{seconds(best.replay.figures.ttft_p99_s)} [{seconds(band.low)}-{seconds(band.high)}]" in page
    assert "(knife-edge)" in page and f"recommended: {best.lever.name}" in page
    assert "nominal coverage 82%" in page
    # The best lever's ITL p99 over time, between the lowest and the highest of its replays per bucket.
    assert "best lever, lowest of 10 replays" in page and "best lever, highest of 10 replays" in page
    low, high = (dict(e) for e in envelope([best.replay.timeline, *(r.timeline for r in best.spread)]))
    assert best.replay.timeline and all(low[t] <= v <= high[t] for t, v in best.replay.timeline)
    assert any(low[t] < high[t] for t in low)  # the replays differ somewhere


def _cliff_engines() -> list[tuple[str, Scenario]]:
    """Two engines under a step cost the fit's form misses, each serving cached chat and uncached documents: a
    shard bar above most documents sends the longest of both engines to one lane, near its capacity."""
    cost = costmodel.ShapedCostModel(prefill_tile=2048, chunk_overhead_s=0.02, context_knee_tokens=65_536,
                                     jitter=0.1, seed=1)
    out = []
    for k in range(2):
        chat = chat_arrivals(f"chat{k}", 0.0, 60.0, 4.0, seed=1, prompt_median=1200, output_median=150,
                             cached=(0.85, 0.95), max_prompt=8000)
        docs = chat_arrivals(f"doc{k}", 0.0, 60.0, 0.65, seed=1, prompt_median=6000, output_median=60,
                             cached=(0.0, 0.05), max_prompt=32_768)
        out.append((f"e{k}", Scenario(f"cliff-e{k}", None, compose("cliff", 60.0, 60.0, chat, docs),
                                      EngineConfig(cost=cost))))
    return out


@pytest.fixture(scope="module")
def cliff(chdb_dir: object) -> WhatIf:
    url = f"chdb://{chdb_dir}?database=t_whatif_cliff"
    _, window = run_engines(_cliff_engines(), url)
    reader = open_reader(url)
    try:
        traces = load(reader.client, window)
    finally:
        reader.close()
    levers = [Lever(f"shard at {bar:,} tokens", "shard", shard_tokens=bar) for bar in (4096, 16_384)]
    return whatif(traces, OBJECTIVES, levers=levers, jobs=1, replays=3)


def test_a_shard_lever_onto_a_lane_near_its_capacity_is_a_knife_edge_whose_interval_holds_it_dearer(
        cliff: WhatIf) -> None:
    """The 16k bar sends every long document to one lane: a step cost off by the fit's own error fills it, and its
    interval reaches the replay with every step that much dearer (or is open past the lane's capacity)."""
    edged = {p.lever.name: p for p in cliff.levers}["shard at 16,384 tokens"]
    assert edged.replay is not None and edged.dearer is not None
    assert [h.engine for h in edged.headroom], edged.replay.loads
    for h in edged.headroom:
        assert h.load == edged.replay.loads[h.engine] and h.error == cliff.fits[h.engine].model_error
        assert h.load * (1 - h.error) < 1 <= h.load * (1 + h.error)
        assert f"{h.engine} at {h.load:.0%} of its capacity" in edged.knife_edge
        assert f"its fit's error ({h.error:.0%} of the step cost)" in edged.knife_edge
        # Every step dearer by the fit's error: the lane carries more.
        assert edged.dearer.loads[h.engine] > h.load
    band, dearer = edged.bands(), edged.dearer.figures
    assert band["ttft_p99_s"].high >= dearer.ttft_p99_s and band["ttft_p50_s"].high >= dearer.ttft_p50_s
    assert band["goodput_rps"].low <= dearer.goodput_rps
    assert f"{edged.lever.name}: knife-edge: " in render(cliff)


def test_a_shard_lever_with_ample_headroom_is_not_flagged(cliff: WhatIf) -> None:
    ample = {p.lever.name: p for p in cliff.levers}["shard at 4,096 tokens"]
    assert ample.replay is not None
    assert ample.headroom == [] and ample.dearer is None, ample.replay.loads
    assert all(load * (1 + cliff.fits[e].model_error) < 1 for e, load in ample.replay.loads.items())
    assert "of its capacity" not in ample.knife_edge
