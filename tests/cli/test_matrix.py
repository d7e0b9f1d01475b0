"""`stepline matrix`: its options, its errors in one line, where its events go, and `--sweep --launch`."""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from unittest import mock

import clickhouse_connect
import pytest

from stepline.app.collector import Collector
from stepline.cli import matrix
from stepline.config.settings import Settings
from stepline.loadgen import matrix as matrix_library
from stepline.loadgen.client import MatrixError
from stepline.sim.config import EngineConfig
from stepline.sim.vllm_server import SimServer, idle_workload, serve
from stepline.store.discovery import running
from stepline.store.errors import StoreLocked
from stepline.store.store import Store
from stepline.testing.alertstack import free_port
from stepline.testing.sink import wait_until
from tests.loadgen.test_replay import SHAPE, T0, fill

MODEL = "test/model"
OTLP_TOKEN = "the-otlp-token"


def parse_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    matrix.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_matrix_stores_one_event_per_run(engine: SimServer, store: Store, store_url: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    args = parse_args("--engine", f"sim={engine.url}", "--streams", "2", "--max-tokens", "8",
                      "--long-prompt-tokens", "8192", "--repeat", "1", "--store", store_url)
    assert matrix.run(args) == 0
    out = capsys.readouterr().out
    assert "a decode-only" in out and "stored 3 matrix_run events" in out
    rows = store.query("SELECT engine, source, kind, attributes['run'], attributes['itl_p99_ms'], "
                       "attributes['itl_p99_delta_ms'] FROM events ORDER BY attributes['run']").result_rows
    assert [r[:4] for r in rows] == [("sim", "matrix", "matrix_run", k) for k in "abc"]
    assert float(rows[1][4]) > 0 and rows[0][5] == "" and float(rows[1][5]) > 0


def test_a_locked_store_is_one_line_and_not_a_failure(engine: SimServer, capsys: pytest.CaptureFixture[str]) -> None:
    args = parse_args("--engine", engine.url, "--streams", "1", "--max-tokens", "2", "--long-prompt-tokens", "64",
                      "--repeat", "1")
    with mock.patch.object(matrix_library, "store_results", side_effect=StoreLocked("locked", None)):
        assert matrix.run(args) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "held by a running collector" in err


class _JsonOnly(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self._send(b'{"data": [{"id": "m"}]}')

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self._send(b'{"choices": []}')

    def _send(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def json_only() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _JsonOnly)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def small_engine() -> Iterator[SimServer]:
    """An engine whose model takes 512 tokens, prompt and output together."""
    handle = serve(idle_workload(), EngineConfig(model=MODEL), port=0, speed=1.0, max_model_len=512)
    yield handle
    handle.stop()


@pytest.mark.parametrize(
    ("target", "extra", "message"),
    [
        ("unreachable", (), "cannot reach http://127.0.0.1:"),
        ("json_only", (), "did not stream"),
        ("engine", ("--model", "nope"), "answered HTTP 404: The model `nope` does not exist."),
        ("small", ("--prompt-tokens", "500", "--max-tokens", "64"),
         "a decode stream needs 500 prompt + 64 output tokens, over test/model's max_model_len 512"),
        ("ftp://x", (), "must be http(s)://host:port"),
        ("engine", ("--streams", "0"), "streams must be positive"),
    ],
)
def test_errors_are_one_clear_line_and_exit_2(
    request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str], target: str, extra: tuple[str, ...],
    message: str,
) -> None:
    if target == "unreachable":
        url = f"http://127.0.0.1:{free_port()}"
    elif target == "json_only":
        url = request.getfixturevalue("json_only")
    elif target == "engine":
        url = request.getfixturevalue("engine").url
    elif target == "small":
        url = request.getfixturevalue("small_engine").url
    else:
        url = target
    args = parse_args("--engine", url, "--streams", "1", "--max-tokens", "2", "--long-prompt-tokens", "64",
                      "--repeat", "1", "--no-store", *extra)
    assert matrix.run(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("stepline matrix: ") and message in err


def test_sweep_labels() -> None:
    assert matrix.sweep_labels("max_num_batched_tokens=2048, 8192") == [
        "max_num_batched_tokens=2048", "max_num_batched_tokens=8192"]
    assert matrix.sweep_labels(None) == [None]
    with pytest.raises(MatrixError, match="NAME=V1,V2"):
        matrix.sweep_labels("nothing")


def test_the_long_prompt_cut_to_fit_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    handle = serve(idle_workload(), EngineConfig(model=MODEL), port=0, speed=1.0, max_model_len=2048)
    try:
        args = parse_args("--engine", handle.url, "--streams", "1", "--max-tokens", "4", "--long-prompt-tokens",
                          "100000", "--repeat", "1", "--no-store")
        assert matrix.run(args) == 0
    finally:
        handle.stop()
    out = capsys.readouterr().out
    assert (f"long prompt: cut to fit {MODEL}'s max_model_len 2048: --long-prompt-tokens 100000, 8 tokens kept for "
            "its output; counted by the engine's /tokenize") in out
    assert "stored" not in out


# --- the events go through a running collector --------------------------------------------------------------


@pytest.fixture
def collector(store_url: str, sock_dir: str) -> Iterator[Collector]:
    settings = Settings.from_env({}, store=store_url, engines=(), metrics_port=0, query_port=0, otlp_port=0,
                                 plugin_socket=f"{sock_dir}/p.sock", flush_interval_s=0.1, otlp_token=OTLP_TOKEN)
    handle = Collector(settings)
    handle.start()
    yield handle
    handle.stop()


def matrix_runs(collector: Collector) -> list[tuple[str, str, str]]:
    """The matrix_run events, read through the collector's query endpoint."""
    assert collector.query_endpoint is not None and collector.store is not None
    client = clickhouse_connect.get_client(host="127.0.0.1", port=collector.query_endpoint.port,
                                           database=collector.store.database)
    try:
        rows = client.query("SELECT engine, attributes['run'], attributes['tokens_per_event_mean'] FROM events "
                            "WHERE kind = 'matrix_run' ORDER BY attributes['run']").result_rows
        return [(str(engine), str(run), str(mean)) for engine, run, mean in rows]
    finally:
        client.close()


def test_runs_go_through_the_running_collector_found_by_its_runtime_file(
    engine: SimServer, collector: Collector, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    ((path, announced),), _ = running()
    ingest = collector.events_ingest
    assert ingest is not None and (announced.events_url, announced.events_token) == (ingest.url, ingest.token)
    assert path.stat().st_mode & 0o777 == 0o600  # the token is the user's alone
    # No --store, no $STEPLINE_STORE, no ./stepline-data: the runtime file names the collector and its store.
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("STEPLINE_STORE", raising=False)
    args = parse_args("--engine", f"sim={engine.url}", "--streams", "2", "--max-tokens", "8",
                      "--long-prompt-tokens", "2048", "--repeat", "1")
    assert matrix.run(args) == 0
    out, err = capsys.readouterr()
    assert (f"stepline matrix: handed 3 matrix_run events to the running collector (pid {announced.pid}), which "
            f"writes them into {announced.store}") in out, err
    wait_until(lambda: len(matrix_runs(collector)) == 3)
    assert matrix_runs(collector) == [("sim", k, "1.000") for k in "abc"]
    assert not (tmp_path / "stepline-data").exists()


def test_a_wrong_token_is_refused_in_one_line_and_nothing_is_stored(
    engine: SimServer, collector: Collector, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    assert collector.events_ingest is not None
    url = collector.events_ingest.url
    argv = ("--engine", f"sim={engine.url}", "--streams", "1", "--max-tokens", "2", "--long-prompt-tokens", "64",
            "--repeat", "1", "--collector", url)
    monkeypatch.setenv("STEPLINE_OTLP_TOKEN", "not-the-token")
    assert matrix.run(parse_args(*argv)) == 2
    err = capsys.readouterr().err
    assert err == (f"stepline matrix: not stored: the collector at {url} refused the events: HTTP 401: a valid "
                   "'Authorization: Bearer <token>' header is required (the token is in the collector's runtime "
                   "file, or $STEPLINE_OTLP_TOKEN)\n")
    monkeypatch.delenv("STEPLINE_OTLP_TOKEN")
    assert matrix.run(parse_args(*argv)) == 2
    assert capsys.readouterr().err == ("stepline matrix: not stored: --collector needs the token the collector runs "
                                       "with in $STEPLINE_OTLP_TOKEN\n")
    time.sleep(0.5)  # five flush intervals: anything accepted would be in the store by now
    assert matrix_runs(collector) == []
    # The collector's OTLP token, given with --collector, is taken.
    monkeypatch.setenv("STEPLINE_OTLP_TOKEN", OTLP_TOKEN)
    assert matrix.run(parse_args(*argv)) == 0
    assert f"handed 3 matrix_run events to the collector at {url}" in capsys.readouterr().out
    wait_until(lambda: len(matrix_runs(collector)) == 3)


# --- --sweep --launch: the simulator launched once per value, measured, stopped, one table ----------------------


def sim_command(port: int, speed: float = 1.0) -> str:
    return (f"{sys.executable} -m stepline sim --workload idle --port {port} --model {MODEL} --speed {speed} "
            "--max-num-batched-tokens {max_num_batched_tokens}")


# The engines run five times slower than real time: a full chunk's stall (~1.2 s) stays 2.5 times a small chunk's
# (~115 ms) even with the scheduling jitter of a machine whose every core is busy added to the small one (~450 ms
# seen with a load average of 9 on 2 cores).
SLOWED = 0.2


def test_each_value_runs_on_an_engine_launched_with_it(store: Store, store_url: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    args = parse_args("--engine", f"sim=http://127.0.0.1:{port}", "--sweep", "max_num_batched_tokens=512,8192",
                      "--launch", sim_command(port, SLOWED), "--launch-timeout", "60", "--streams", "2",
                      "--prompt-tokens", "16", "--max-tokens", "24", "--long-prompt-tokens", "16384", "--repeat", "1",
                      "--store", store_url)
    assert matrix.run(args) == 0
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
    assert worst["8192", "b"] > 2.5 * worst["512", "b"], worst


def test_a_replay_per_value_and_the_engines_counters_beside_it(store: Store, store_url: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    fill(store)
    port = free_port()
    args = parse_args("--engine", f"http://127.0.0.1:{port}", "--sweep", "max_num_batched_tokens=512,2048",
                      "--launch", sim_command(port), "--replay", "--from", str(T0 - 1), "--to", str(T0 + 60),
                      "--speed", "4", "--store", store_url)
    assert matrix.run(args) == 0
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
    port = free_port()
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
        argv[1] = request.getfixturevalue("engine").url
    assert matrix.run(parse_args(*argv)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(message), err


def test_an_engine_that_exits_is_named_with_its_log_and_the_sweep_goes_on(capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    script = "import sys; print('starting with', sys.argv[1]); print('boom: bad budget'); sys.exit(3)"
    args = parse_args("--engine", f"http://127.0.0.1:{port}", "--sweep", "max_num_batched_tokens=1,2", "--launch",
                      f"{sys.executable} -c \"{script}\" {{max_num_batched_tokens}}", "--no-store")
    started = time.monotonic()
    assert matrix.run(args) == 2
    assert time.monotonic() - started < 20
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 2
    for value, line in zip("12", lines, strict=True):
        assert line.startswith(f"stepline matrix: max_num_batched_tokens={value}: the launched engine exited with "
                               f"code 3 before it answered at http://127.0.0.1:{port}; its log ends: starting with "
                               f"{value} | boom: bad budget (all of it: "), line
    assert "\n1       not measured: max_num_batched_tokens=1: the launched engine exited" in captured.out
