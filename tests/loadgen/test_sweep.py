"""The sweep's engine per value: launched in a process group of its own, measured, stopped, its counters read."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from stepline.diagnosis.findings import Window
from stepline.loadgen import replay, sweep
from stepline.loadgen.client import MatrixError
from stepline.loadgen.matrix import MatrixResult
from stepline.loadgen.replay import ReplayReport
from stepline.sim.config import EngineConfig
from stepline.sim.vllm_server import SimServer, idle_workload, serve
from stepline.testing.alertstack import free_port

MODEL = "test/model"


@pytest.fixture
def server() -> Iterator[SimServer]:
    handle = serve(idle_workload(), EngineConfig(model=MODEL), port=0, speed=1.0)
    yield handle
    handle.stop()


def test_each_value_is_measured_on_the_engine_launched_with_it(capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    command = (f"{sys.executable} -m stepline sim --workload idle --port {port} --model {MODEL} "
               "--max-num-seqs {max_num_seqs}")
    measured: list[tuple[str, int]] = []

    def measure(label: str, repeat: int) -> tuple[MatrixResult | None, ReplayReport | None]:
        assert repeat == 0
        counted = sweep.engine_counters(f"http://127.0.0.1:{port}")
        measured.append((label, -1 if counted is None else counted.requests))
        return None, None

    values = list(sweep.launch_each(command, "max_num_seqs", ["4", "8"], f"http://127.0.0.1:{port}", measure, 60))
    assert [(v.label, v.value, v.error, v.failed) for v in values] == [
        ("max_num_seqs=4", "4", "", False), ("max_num_seqs=8", "8", "", False)]
    assert measured == [("max_num_seqs=4", 0), ("max_num_seqs=8", 0)]  # a fresh engine each, its counters read
    assert all(v.counters == sweep.EngineCounters(0, 0, 0, 0) and v.log.exists() for v in values)
    out = capsys.readouterr().out
    assert out.count("the engine stopped (exit code 0)") == 2 and "--max-num-seqs 8" in out


def test_an_engine_that_exits_is_a_failed_value_and_the_next_is_launched(capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    command = f"{sys.executable} -c \"import sys; print('bad', sys.argv[1]); sys.exit(3)\" {{n}}"

    def measure(label: str, repeat: int) -> tuple[MatrixResult | None, ReplayReport | None]:
        raise AssertionError(f"{label} was measured on an engine that never answered")

    values = list(sweep.launch_each(command, "n", ["1", "2"], f"http://127.0.0.1:{port}", measure, 60))
    assert [v.value for v in values] == ["1", "2"] and all(v.failed for v in values)
    assert values[0].error.startswith(f"n=1: the launched engine exited with code 3 before it answered at "
                                      f"http://127.0.0.1:{port}; its log ends: bad 1 (all of it: ")
    assert len(capsys.readouterr().err.splitlines()) == 2
    assert not sweep.SweepValue("n=3", "3", Path("log"), error=sweep.INTERRUPTED).failed


# A recorded window: a short chat, a long prompt and its rerun served mostly from the cache (so the replay sends a
# shared prefix and warms it first), another chat.
RECORDED = [replay.Recorded("rec", f"r{i}", 1000.0 + t, p, c, g, "length")
            for i, (t, p, c, g) in enumerate([(0.0, 40, 0, 6), (0.2, 400, 0, 4), (0.4, 400, 384, 4), (0.6, 64, 0, 8)])]


def test_each_engine_replays_the_window_n_times_each_run_counted_and_the_runs_given_a_mean(
        capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = (f"{sys.executable} -m stepline sim --workload idle --port {port} --model {MODEL} "
               "--max-num-seqs {max_num_seqs}")
    window = Window(replay_start(), replay_start())
    labels: list[str] = []

    def measure(label: str, repeat: int) -> tuple[MatrixResult | None, ReplayReport | None]:
        labels.append(label)
        return None, replay.replay_window(url, RECORDED, window, speed=4,
                                          corpus_seed=replay.repeat_corpus_seed(repeat))

    values = list(sweep.launch_each(command, "max_num_seqs", ["4", "8"], url, measure, 60, repeat=3))
    assert labels == [f"max_num_seqs={v} (run {k} of 3)" for v in ("4", "8") for k in (1, 2, 3)]
    for v in values:
        assert not v.error and len(v.replays) == 3
        for run in v.replays:
            r = run.report
            assert r.completed == 4 and r.warmup_prompt_tokens == 384
            # Each run's own increase of the engine's counters: what it sent, its warm-up included. The simulator
            # counts a hit only for a whole prompt it saw before: a warm-up of the same shared prefix as the run
            # before would be one. Each run draws its own, so none is.
            assert run.counters == sweep.EngineCounters(r.prompt_tokens_sent + 384, r.generation_tokens_received + 1,
                                                        0, 5)
        assert v.counters == sweep.EngineCounters(*(sum(getattr(run.counters, k) for run in v.replays)
                                                    for k in sweep.COUNTERS))
    table = sweep.render_sweep(values, "max_num_seqs")
    assert all(f"\n{v} #{k} " in table for v in ("4", "8") for k in (1, 2, 3)), table
    means = table[table.index("mean [95% confidence interval of the mean"):].splitlines()
    ttfts = [run.report.ttft_p50_s * 1e3 for run in values[0].replays]
    mean = sum(ttfts) / 3
    assert means[2].split()[:3] == ["4", "3", f"{mean:.1f}"], means
    events = sweep.sweep_events(values, "e", "h")
    assert [(e.attributes["sweep"], e.attributes["run"]) for e in events] == [
        (f"max_num_seqs={v}", f"{k}/3") for v in ("4", "8") for k in (1, 2, 3)]
    assert capsys.readouterr().out.count("the engine stopped (exit code 0)") == 2


def replay_start() -> datetime:
    return datetime.fromtimestamp(1000.0, UTC)


def test_launch_words_put_the_value_in_its_place() -> None:
    assert sweep.launch_words("vllm serve m --max-num-seqs {n} --name 'a b'", "n", "8") == [
        "vllm", "serve", "m", "--max-num-seqs", "8", "--name", "a b"]
    with pytest.raises(MatrixError, match=r"--launch must hold \{n\}"):
        sweep.launch_words("vllm serve m", "n", "8")


def test_stop_kills_a_group_that_ignores_sigint(tmp_path: Path) -> None:
    # The shell ignores SIGINT, and so do the children it leaves behind: SIGKILL after the grace ends them all.
    engine = sweep.LaunchedEngine(["bash", "-c", "trap '' INT; sleep 60 & sleep 60 & wait"], tmp_path / "log")
    time.sleep(0.3)
    assert sweep._group_alive(engine.process.pid)
    started = time.monotonic()
    assert engine.stop(grace_s=0.5) == -9
    assert time.monotonic() - started < 5
    deadline = time.monotonic() + 5
    while sweep._group_alive(engine.process.pid):
        assert time.monotonic() < deadline, "a child of the launched command outlived the stop"
        time.sleep(0.05)


def test_engine_counters_are_read_from_its_metrics(server: SimServer) -> None:
    counted = sweep.engine_counters(server.url)
    assert counted == sweep.EngineCounters(0, 0, 0, 0)
    assert sweep.engine_counters(f"http://127.0.0.1:{free_port()}") is None
