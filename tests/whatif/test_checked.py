"""whatif's prediction of each sweep value beside the runs of it: the runs' figures by whatif's own definitions, their
mean and interval, and where it falls against whatif's interval."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stepline.core.stats import MeanInterval
from stepline.loadgen import replay
from stepline.loadgen.client import Endpoint, MatrixError
from stepline.loadgen.sweep import Repeat, SweepValue
from stepline.sim.config import EngineConfig
from stepline.sim.vllm_server import SimServer, idle_workload, serve
from stepline.whatif.checked import (
    Check,
    checks,
    recorded_again,
    render_checks,
    render_predicted,
    run_figures,
    sweep_levers,
)
from stepline.whatif.core import Priced, Replay, WhatIf
from stepline.whatif.figures import Figures, Objectives, quantile
from stepline.whatif.intervals import Band
from stepline.whatif.levers import Lever

MODEL = "test/model"
OBJECTIVES = Objectives(ttft_s=0.05, tpot_s=0.1)


@pytest.fixture(scope="module")
def server() -> Iterator[SimServer]:
    handle = serve(idle_workload(), EngineConfig(model=MODEL), port=0, speed=1.0)
    yield handle
    handle.stop()


def _replay(server: SimServer) -> replay.ReplayReport:
    shape = [replay.Recorded("e", f"r{i}", 1000.0 + 0.15 * i, 32 + 8 * i, 0, 4 + i, "length") for i in range(6)]
    return replay.replay(Endpoint(server.url, 30.0), replay.plan(shape, speed=1.0), model=MODEL)


def test_a_run_is_measured_with_whatifs_own_figures(server: SimServer) -> None:
    report = _replay(server)
    f = run_figures(report, OBJECTIVES)
    results = [s.result for s in report.sends if s.result is not None]
    ttfts = sorted(r.ttft_s for r in results if r.ttft_s is not None)
    itls = sorted(x for r in results for x in r.itls_s)
    assert f.requests == report.completed == 6 and f.unfinished == 0
    assert f.ttft_p50_s == pytest.approx(quantile(ttfts, 0.5)) and f.ttft_p99_s == pytest.approx(quantile(ttfts, 0.99))
    assert f.itl_p99_s == pytest.approx(quantile(itls, 0.99))
    good = sum(1 for r in results if r.ttft_s is not None and r.ttft_s <= OBJECTIVES.ttft_s
               and sum(r.itls_s) / (r.tokens - 1) <= OBJECTIVES.tpot_s)
    assert f.good == good and f.goodput_rps == pytest.approx(good / max(report.span_s, 1.0))


def test_each_value_is_a_lever_of_the_setting_it_sweeps() -> None:
    assert sweep_levers("max_num_batched_tokens", ["512", "2048"]) == [
        Lever("max_num_batched_tokens=512", "max_num_batched_tokens", {"max_num_batched_tokens": 512}),
        Lever("max_num_batched_tokens=2048", "max_num_batched_tokens", {"max_num_batched_tokens": 2048})]
    assert sweep_levers("policy", ["priority"])[0].settings == {"policy": "priority"}
    with pytest.raises(MatrixError, match=r"--whatif prices the settings the simulator models .*; not gpu_memory"):
        sweep_levers("gpu_memory_utilization", ["0.9"])
    with pytest.raises(MatrixError, match="max_num_seqs=many is not a whole number"):
        sweep_levers("max_num_seqs", ["many"])


def test_a_mean_inside_overlapping_or_apart_from_whatifs_interval() -> None:
    band = Band(1.0, 0.8, 1.2)
    inside = Check("512", "ttft_p99_s", band, MeanInterval(1.1, 0.9, 1.3, 3))
    overlaps = Check("512", "ttft_p99_s", band, MeanInterval(1.3, 1.1, 1.5, 3))
    apart = Check("512", "ttft_p99_s", band, MeanInterval(0.4, 0.35, 0.45, 3))
    assert (inside.inside, inside.verdict) == (True, "inside")
    assert (overlaps.inside, overlaps.overlaps, overlaps.verdict) == (False, True, "overlaps (above)")
    assert (apart.overlaps, apart.verdict) == (False, "apart: 50% below")
    assert apart.apart_by == pytest.approx(0.5)
    # One run has no interval of its own: outside whatif's, it is apart.
    assert Check("512", "itl_p99_s", band, MeanInterval(1.3, math.nan, math.nan, 1)).verdict == "apart: 8% above"
    assert Check("512", "itl_p99_s", Band(math.nan, math.nan, math.nan), MeanInterval(1.0, 1, 1, 2)).verdict \
        == "no figure"


def _figures(ttft: float) -> Figures:
    return Figures(10, 0, ttft / 2, ttft, 0.01, {}, 10, 1.0)


def test_the_check_sets_every_measured_value_beside_its_levers_interval(server: SimServer) -> None:
    reports = [_replay(server) for _ in range(3)]
    measured = [run_figures(r, OBJECTIVES) for r in reports]
    lever = Lever("max_num_seqs=4", "max_num_seqs", {"max_num_seqs": 4})
    predicted = Priced(lever, Replay(_figures(0.02), [], 100), [Replay(_figures(0.01), [], 100),
                                                                 Replay(_figures(0.04), [], 100)])
    result = WhatIf(0.0, 1.0, OBJECTIVES, ["e"], {}, {}, [], {}, _figures(0.02), [], Replay(_figures(0.02), [], 100),
                    [predicted], baseline_spread=[Replay(_figures(0.02), [], 100)] * 2)
    now = time.time()
    values = [SweepValue("max_num_seqs=4", "4", Path("log"), replays=tuple(Repeat(r, None, now) for r in reports)),
              SweepValue("max_num_seqs=8", "8", Path("log"), error="the launched engine exited")]
    found = checks(result, values, OBJECTIVES)
    assert [(c.value, c.figure) for c in found] == [("4", f) for f in
                                                    ("ttft_p50_s", "ttft_p99_s", "itl_p99_s", "goodput_rps")]
    ttft_p99 = found[1]
    assert ttft_p99.predicted == Band(0.02, 0.01, 0.04)
    assert ttft_p99.measured.n == 3
    assert ttft_p99.measured.mean == pytest.approx(sum(f.ttft_p99_s for f in measured) / 3)
    text = render_checks(found, result)
    assert "its interval (nominal 50%)" in text and "3 runs a value" in text
    inside = sum(c.inside for c in found)
    assert text.splitlines()[-1].startswith(f"{inside} of 4 runs' means inside whatif's intervals")
    assert render_checks([], result) == "whatif against the runs: no value was measured"
    # Before the launches: the recording and the replayed baseline above each value's interval; the lever's
    # replays span TTFT p99 0.01-0.04 s, four times: a knife-edge, said in full below the table.
    before = render_predicted(result, "max_num_seqs").splitlines()
    assert before[0].startswith("whatif, before the launches: each max_num_seqs value replayed") and "3 replays" \
        in before[0]
    rows = {line.split("  ")[0]: line for line in before[3:]}
    assert "20.0 [20.0-20.0]" in rows["replayed at its own settings"]
    assert "20.0 [10.0-40.0]" in rows["max_num_seqs=4"]
    assert before[-1] == "max_num_seqs=4: knife-edge: TTFT p99 spans 0.01-0.04 s over 3 replays"


def test_the_recorded_setting_run_again_shows_how_far_the_runs_lie_from_the_recording(server: SimServer) -> None:
    reports = [_replay(server) for _ in range(2)]
    measured = [run_figures(r, OBJECTIVES) for r in reports]
    recorded = _figures(0.02)
    levers = [Priced(Lever(f"max_num_seqs={n}", "max_num_seqs", {"max_num_seqs": n}), Replay(recorded, [], 100))
              for n in (4, 8)]
    result = WhatIf(0.0, 1.0, OBJECTIVES, ["e"], {}, {}, [], {"e": EngineConfig(max_num_seqs=4)}, recorded, [],
                    Replay(recorded, [], 100), levers)
    now = time.time()
    four = SweepValue("max_num_seqs=4", "4", Path("log"), replays=tuple(Repeat(r, None, now) for r in reports))
    line = recorded_again(result, checks(result, [four], OBJECTIVES), "max_num_seqs")
    mean = sum(f.ttft_p99_s for f in measured) / 2
    assert line.startswith("the recorded setting (max_num_seqs=4) run again, its runs' mean against the recording: ")
    assert f"TTFT p99 {mean * 1e3:.1f} against 20.0 ({mean / 0.02 - 1:+.0%})" in line, line
    eight = SweepValue("max_num_seqs=8", "8", Path("log"), replays=four.replays)
    assert recorded_again(result, checks(result, [eight], OBJECTIVES), "max_num_seqs").startswith(
        "no value is the recorded setting (max_num_seqs=4)")
    # Engines recorded at different values have no one setting to run again.
    two = WhatIf(0.0, 1.0, OBJECTIVES, ["a", "b"], {}, {}, [], {"a": EngineConfig(max_num_seqs=4),
                 "b": EngineConfig(max_num_seqs=8)}, recorded, [], Replay(recorded, [], 100))
    assert recorded_again(two, checks(result, [four], OBJECTIVES), "max_num_seqs") == ""

