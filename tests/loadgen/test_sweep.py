"""`stepline matrix --sweep --launch`: the simulator launched once per value, measured, stopped, one table."""

from __future__ import annotations

import argparse
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stepline.loadgen import matrix, sweep
from stepline.sim.config import EngineConfig
from stepline.sim.vllm_server import SimServer, idle_workload, serve
from stepline.store.store import Store
from tests.loadgen.test_replay import SHAPE, T0, fill

MODEL = "test/model"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def sim_command(port: int) -> str:
    return (f"{sys.executable} -m stepline sim --workload idle --port {port} --model {MODEL} "
            "--max-num-batched-tokens {max_num_batched_tokens}")


def parse_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    matrix.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_each_value_runs_on_an_engine_launched_with_it(store: Store, store_url: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    port = _free_port()
    args = parse_args("--engine", f"sim=http://127.0.0.1:{port}", "--sweep", "max_num_batched_tokens=512,8192",
                      "--launch", sim_command(port), "--launch-timeout", "60", "--streams", "2", "--prompt-tokens",
                      "16", "--max-tokens", "24", "--long-prompt-tokens", "16384", "--repeat", "1", "--store",
                      store_url)
    assert sweep.run(args) == 0
    out = capsys.readouterr().out
    print(out)
    for value in ("512", "8192"):
        assert f"launching {sys.executable} -m stepline sim" in out
        assert f"--max-num-batched-tokens {value}\n" in out
        assert f"max_num_batched_tokens={value}: the engine stopped (exit code 0)" in out
    table = out[out.index("sweep of max_num_batched_tokens: one engine launched per value"):]
    assert "\n512 " in table and "\n8192 " in table and table.count("b + uncached long prompt") == 2
    rows = store.query("SELECT attributes['sweep'], attributes['run'], toFloat64(attributes['worst_gap_ms']) "
                       "FROM events WHERE kind = 'matrix_run' ORDER BY attributes['sweep'], attributes['run']"
                       ).result_rows
    assert [(r[0], r[1]) for r in rows] == [(f"max_num_batched_tokens={v}", k) for v in ("512", "8192") for k in "abc"]
    worst = {(r[0].split("=")[1], r[1]): r[2] for r in rows}
    # Each engine ran with its own budget: 16384 prompt tokens in 8192-token chunks stall the decoding streams
    # for a whole chunk's step; in 512-token chunks, for a small one.
    assert worst["8192", "b"] > 3 * worst["512", "b"], worst


def test_a_replay_per_value_and_the_engines_counters_beside_it(store: Store, store_url: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    fill(store)
    port = _free_port()
    args = parse_args("--engine", f"http://127.0.0.1:{port}", "--sweep", "max_num_batched_tokens=512,2048",
                      "--launch", sim_command(port), "--replay", "--from", str(T0 - 1), "--to", str(T0 + 60),
                      "--speed", "4", "--store", store_url)
    assert sweep.run(args) == 0
    out = capsys.readouterr().out
    print(out)
    prompt, generated = sum(s[1] for s in SHAPE), sum(s[3] for s in SHAPE)
    table = out[out.index("sweep of max_num_batched_tokens"):]
    for value in ("512", "2048"):
        assert f"max_num_batched_tokens={value}:\nreplay of " in out
        line = next(line for line in table.splitlines() if line.startswith(f"{value} "))
        assert f" {prompt + 512}/{prompt + 512} " in line and f" {generated}/{generated + 1} " in line, line
    rows = store.query("SELECT attributes['sweep'], attributes['completed'], attributes['prompt_tokens_sent'], "
                       "attributes['engine_prompt_tokens'], attributes['warmup_prompt_tokens'] FROM events "
                       "WHERE kind = 'replay_run' ORDER BY attributes['sweep']").result_rows
    assert rows == [(f"max_num_batched_tokens={v}", "5", str(prompt), str(prompt + 512), "512")
                    for v in ("2048", "512")]
    assert "stored 2 replay_run events" in out


@pytest.fixture
def server() -> Iterator[SimServer]:
    handle = serve(idle_workload(), EngineConfig(model=MODEL), port=0, speed=1.0)
    yield handle
    handle.stop()


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("no placeholder", "stepline matrix: --launch must hold {max_num_batched_tokens} where each --sweep value "
                           "goes, e.g. '... --max-num-batched-tokens {max_num_batched_tokens}'"),
        ("no sweep", "stepline matrix: --launch needs --sweep NAME=V1,V2,..."),
        ("replay alone", "stepline matrix: --replay runs with --sweep NAME=V1,V2 --launch COMMAND"),
        ("no program", "stepline matrix: cannot launch /nonexistent/engine 512: No such file or directory"),
        ("answering", "stepline matrix: something already answers at http://127.0.0.1:"),
    ],
)
def test_launch_errors_are_one_line_and_exit_2(case: str, message: str, request: pytest.FixtureRequest,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    port = _free_port()
    argv = ["--engine", f"http://127.0.0.1:{port}", "--sweep", "max_num_batched_tokens=512,2048", "--launch",
            sim_command(port), "--no-store"]
    if case == "no placeholder":
        argv[5] = f"{sys.executable} -m stepline sim --port {port}"
    elif case == "no sweep":
        argv = argv[:2] + argv[4:]
    elif case == "replay alone":
        argv = ["--engine", f"http://127.0.0.1:{port}", "--replay", "--no-store"]
    elif case == "no program":
        argv[5] = "/nonexistent/engine {max_num_batched_tokens}"
    elif case == "answering":
        argv[1] = request.getfixturevalue("server").url
    assert sweep.run(parse_args(*argv)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(message), err


def test_an_engine_that_exits_is_named_with_its_log_and_the_sweep_goes_on(capsys: pytest.CaptureFixture[str]) -> None:
    port = _free_port()
    script = "import sys; print('starting with', sys.argv[1]); print('boom: bad budget'); sys.exit(3)"
    args = parse_args("--engine", f"http://127.0.0.1:{port}", "--sweep", "max_num_batched_tokens=1,2", "--launch",
                      f"{sys.executable} -c \"{script}\" {{max_num_batched_tokens}}", "--no-store")
    started = time.monotonic()
    assert sweep.run(args) == 2
    assert time.monotonic() - started < 20
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 2
    for value, line in zip("12", lines, strict=True):
        assert line.startswith(f"stepline matrix: max_num_batched_tokens={value}: the launched engine exited with "
                               f"code 3 before it answered at http://127.0.0.1:{port}; its log ends: starting with "
                               f"{value} | boom: bad budget (all of it: "), line
    assert "\n1       not measured: max_num_batched_tokens=1: the launched engine exited" in captured.out


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
    assert sweep.engine_counters(f"http://127.0.0.1:{_free_port()}") is None
