"""`stepline replay`: a window of the store sent to an engine, the report printed, errors in one line, Ctrl-C."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

from stepline.cli import replay
from stepline.sim.vllm_server import SimServer
from stepline.store.store import Store
from stepline.testing.alertstack import free_port
from stepline.testing.storeserver import StoreServer
from tests.loadgen.test_replay import SHAPE, T0, counters, fill


def parse_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    replay.add_arguments(parser)
    return parser.parse_args(list(argv))


def window_args(store_url: str, *extra: str) -> list[str]:
    return ["--store", store_url, "--from", str(T0 - 1), "--to", str(T0 + 60), *extra]


def test_the_engine_counts_the_recorded_prompt_and_generation_tokens(
        engine: SimServer, store: Store, store_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    fill(store)
    fill(store, [(0.1, 5000, 0, 50)], engine="other")  # another engine's request: left out by --source-engine
    args = parse_args("--engine", engine.url, *window_args(store_url, "--source-engine", "rec", "--speed", "4",
                                                           "--json"))
    assert replay.run(args) == 0
    report = json.loads(capsys.readouterr().out)
    prompt, generated = sum(s[1] for s in SHAPE), sum(s[3] for s in SHAPE)
    assert (report["recorded"], report["planned"], report["sent"], report["completed"], report["failed"]) == (
        5, 5, 5, 5, 0)
    assert report["prompt_tokens_recorded"] == report["prompt_tokens_sent"] == prompt
    assert report["prompt_tokens_received"] == prompt
    assert report["generation_tokens_recorded"] == report["generation_tokens_asked"] == generated
    assert report["generation_tokens_received"] == generated
    assert report["warmup_prompt_tokens"] == 512  # the longest shared prefix, sent once first
    assert report["shared_prefix_tokens_sent"] == 288 + 512
    assert report["cached_tokens_recorded"] == 800 and report["stopped_by"] == "" and report["first_error"] == ""
    assert 0 < report["ttft_p50_s"] <= report["ttft_p99_s"] and 0 < report["itl_p50_s"] <= report["itl_p99_s"]
    m = counters(engine)  # the engine's own counters: the recording, plus the one warm-up request
    assert m["vllm:prompt_tokens_total"] == prompt + 512
    assert m["vllm:generation_tokens_total"] == generated + 1
    assert m["vllm:request_success_total"] == 5 + 1


def test_max_requests_sends_the_first_n(engine: SimServer, store: Store, store_url: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    fill(store)
    assert replay.run(parse_args("--engine", engine.url, *window_args(store_url, "--max-requests", "2"))) == 0
    out = capsys.readouterr().out
    assert "5 recorded requests (left out: 3 past --max-requests)" in out
    assert "sent 2 of 2" in out and "completed 2, failed 0, abandoned 0" in out
    # The first two carry no cached tokens: no warm-up either.
    assert counters(engine)["vllm:prompt_tokens_total"] == 40 + 300
    assert "prompt tokens: recorded 340, sent 340 (0 of them shared prefix; warm-up 0 more" in out


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("empty", "stepline replay: no finished request arrived in "),
        ("unreachable", "stepline replay: cannot reach http://127.0.0.1:"),
        ("no store", "stepline replay: no store at /nonexistent/stepline"),
        ("inverted", "stepline replay: the window start"),
        ("bad url", "stepline replay: engine URL 'localhost:8000' must be http(s)://host:port"),
        ("speed", "stepline replay: speed must be positive, got 0.0"),
    ],
)
def test_errors_are_one_clear_line_and_exit_2(
        case: str, message: str, engine: SimServer, store: Store, store_url: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    fill(store)
    argv = ["--engine", engine.url, *window_args(store_url)]
    if case == "empty":
        argv = ["--engine", engine.url, "--store", store_url, "--since", "1m"]  # the recording is 10 minutes old
    elif case == "unreachable":
        argv[1] = f"http://127.0.0.1:{free_port()}"
    elif case == "no store":
        argv = ["--engine", engine.url, "--store", "chdb:///nonexistent/stepline"]
    elif case == "inverted":
        argv = ["--engine", engine.url, "--store", store_url, "--from", str(T0), "--to", str(T0 - 5)]
    elif case == "bad url":
        argv[1] = "localhost:8000"
    elif case == "speed":
        argv += ["--speed", "0"]
    assert replay.run(parse_args(*argv)) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith(message), captured.err
    assert counters(engine).get("vllm:prompt_tokens_total", 0) == 0  # nothing was sent


def test_ctrl_c_stops_sending_abandons_streams_and_still_reports(engine: SimServer, store_server: StoreServer) -> None:
    database = f"t_{uuid.uuid4().hex[:12]}"
    store = Store.open(store_server.store_url(database))
    try:
        store.ensure_schema(30)
        # One stream that decodes for ~20 s, then a request every 2 s: Ctrl-C lands while the first decodes.
        fill(store, [(0.0, 32, 0, 4000), *((2.0 * i, 32, 0, 2) for i in range(1, 10))])
    finally:
        store.close()
    process = subprocess.Popen(
        [sys.executable, "-m", "stepline", "replay", "--engine", engine.url, "--store",
         store_server.store_url(database), "--from", str(T0 - 1), "--to", str(T0 + 60)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "STEPLINE_STORE": ""})
    try:
        deadline = time.monotonic() + 60
        while counters(engine).get("vllm:generation_tokens_total", 0) < 20:  # the first request decodes
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.1)
        sent_before = time.monotonic()
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert time.monotonic() - sent_before < 10
    assert process.returncode == 130, err
    assert "stopped by Ctrl-C" in out and "sent 1 of 10" in out and "abandoned 1" in out, out


def test_the_first_ctrl_c_asks_the_replay_to_stop_and_a_second_interrupts() -> None:
    stop = threading.Event()
    before = signal.getsignal(signal.SIGINT)
    with replay.ctrl_c_stops(stop):
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.wait(5)  # no KeyboardInterrupt: the replay stops at its next poll and reports
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
    assert signal.getsignal(signal.SIGINT) is before  # the handler before it, again
