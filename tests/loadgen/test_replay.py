"""`stepline replay` against the simulator: the recorded shape is what the engine counts, on the recorded clock.

The simulator counts token-id prompts exactly and reports a prefix-cache hit only for a prompt it saw before,
whole; the replay's prompts share a prefix and never a whole prompt, so it shows no hit. That the shared
prefixes make a block cache hit the recorded tokens is checked against a small model of vLLM's block hashing.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence

import pytest
from prometheus_client.parser import text_string_to_metric_families

from stepline.loadgen import replay
from stepline.loadgen.client import Endpoint
from stepline.model.rows import Request, micros
from stepline.sim.config import EngineConfig
from stepline.sim.vllm_server import SimServer, idle_workload, serve
from stepline.store.store import Store
from stepline.testing.storeserver import StoreServer

MODEL = "test/model"
T0 = time.time() - 600  # the recording: ten minutes ago


@pytest.fixture
def server() -> Iterator[SimServer]:
    handle = serve(idle_workload(), EngineConfig(model=MODEL), port=0, speed=1.0)
    yield handle
    handle.stop()


def recorded(rid: str, arrival: float, prompt: int, cached: int, generated: int, engine: str = "rec") -> Request:
    return Request(micros(arrival + 1), "h", engine, 0, "m", rid, "plugin", "length", micros(arrival), 0.01, 0.1,
                   0.5, 0.6, 0.61, 0.11, 0.01, prompt, cached, generated, generated, 0)


# (offset s, prompt, cached, generated): a short chat, a repeated long prompt (a hit), more short ones.
SHAPE = [(0.0, 40, 0, 8), (0.3, 300, 0, 4), (0.5, 300, 288, 4), (0.9, 64, 0, 16), (1.2, 1000, 512, 2)]


def fill(store: Store, shape: Sequence[tuple[float, int, int, int]] = SHAPE, start: float = T0,
         engine: str = "rec") -> None:
    store.insert("requests", [recorded(f"{engine}-{i}", start + t, p, c, g, engine)
                              for i, (t, p, c, g) in enumerate(shape)], Request._fields)


def parse_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    replay.add_arguments(parser)
    return parser.parse_args(list(argv))


def counters(server: SimServer) -> dict[str, float]:
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(server.metrics().decode()):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def window_args(store_url: str, *extra: str) -> list[str]:
    return ["--store", store_url, "--from", str(T0 - 1), "--to", str(T0 + 60), *extra]


def test_the_engine_counts_the_recorded_prompt_and_generation_tokens(
        server: SimServer, store: Store, store_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    fill(store)
    fill(store, [(0.1, 5000, 0, 50)], engine="other")  # another engine's request: left out by --source-engine
    args = parse_args("--engine", server.url, *window_args(store_url, "--source-engine", "rec", "--speed", "4",
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
    m = counters(server)  # the engine's own counters: the recording, plus the one warm-up request
    assert m["vllm:prompt_tokens_total"] == prompt + 512
    assert m["vllm:generation_tokens_total"] == generated + 1
    assert m["vllm:request_success_total"] == 5 + 1


def test_arrivals_keep_their_recorded_spacing_divided_by_the_speed(server: SimServer) -> None:
    shape = [replay.Recorded("e", f"r{i}", T0 + t, 16, 0, 2, "length") for i, t in enumerate((0.0, 0.4, 1.2, 1.3))]
    for speed in (1.0, 2.0):
        report = replay.replay(Endpoint(server.url, 10), replay.plan(shape, speed=speed), max_seconds=30)
        sent = [s.sent_s for s in report.sends]
        assert [s.scheduled_s for s in report.sends] == pytest.approx([t / speed for t in (0.0, 0.4, 1.2, 1.3)])
        for got, due in zip(sent, (0.0, 0.4, 1.2, 1.3), strict=True):
            assert due / speed <= got + 1e-6 < due / speed + 0.1, (speed, sent)
        assert report.span_s == pytest.approx(1.3 / speed) and report.send_lag_max_s < 0.1
        assert report.duration_s >= 1.3 / speed and report.completed == 4


def test_max_requests_sends_the_first_n(server: SimServer, store: Store, store_url: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    fill(store)
    assert replay.run(parse_args("--engine", server.url, *window_args(store_url, "--max-requests", "2"))) == 0
    out = capsys.readouterr().out
    assert "5 recorded requests (left out: 3 past --max-requests)" in out
    assert "sent 2 of 2" in out and "completed 2, failed 0, abandoned 0" in out
    # The first two carry no cached tokens: no warm-up either.
    assert counters(server)["vllm:prompt_tokens_total"] == 40 + 300
    assert "prompt tokens: recorded 340, sent 340 (0 of them shared prefix; warm-up 0 more" in out


def test_max_seconds_stops_sending_and_abandons_what_is_in_flight(server: SimServer) -> None:
    shape = [replay.Recorded("e", "long", T0, 16, 0, 5000, "length"),  # ~5000 steps: still decoding at the deadline
             replay.Recorded("e", "late", T0 + 5, 16, 0, 2, "length")]
    started = time.monotonic()
    report = replay.replay(Endpoint(server.url, 10), replay.plan(shape), max_seconds=1.0)
    assert time.monotonic() - started < 3
    assert (report.sent, report.completed, report.abandoned, report.stopped_by) == (1, 0, 1, "max-seconds")
    assert "stopped by --max-seconds" in replay.render(report)


def test_requests_that_generated_nothing_are_left_out_and_counted(server: SimServer) -> None:
    shape = [replay.Recorded("e", "ok", T0, 16, 0, 2, "length"), replay.Recorded("e", "aborted", T0, 16, 0, 0, "abort")]
    report = replay.replay(Endpoint(server.url, 10), replay.plan(shape), max_seconds=30)
    assert (report.recorded, report.skipped, report.sent, report.completed) == (2, 1, 1, 1)
    assert "left out: 1 that generated no token" in replay.render(report)


def _block_cache_hits(prompts: Sequence[list[int]], block: int) -> list[int]:
    """What a vLLM-like prefix cache serves of each prompt in turn: whole blocks, chained by hash, never the last
    token; every full block of a prompt is cached once it ran."""
    cached: set[tuple[int, ...]] = set()
    hits = []
    for prompt in prompts:
        n = 0
        while (n + 1) * block <= len(prompt) - 1 and tuple(prompt[:(n + 1) * block]) in cached:
            n += 1
        hits.append(n * block)
        cached.update(tuple(prompt[:(i + 1) * block]) for i in range(len(prompt) // block))
    return hits


@pytest.mark.parametrize("block", [16, 128])
def test_shared_prefixes_make_a_block_cache_hit_what_was_recorded(block: int) -> None:
    # Cached counts as vLLM reports them: whole blocks of the recording engine's size.
    shape = [(0, 200, 0), (1, 200, block), (2, 700, 5 * block), (3, 700, 0), (4, 1100, 8 * block), (5, 50, 0)]
    rows = [replay.Recorded("e", f"r{i}", T0 + t, p, c, 4, "length") for i, (t, p, c) in enumerate(shape)]
    plan = replay.plan(rows, nonce="fixed")
    prompts = [plan.prompt(p) for p in plan.requests]
    assert [len(p) for p in prompts] == [p for _, p, _ in shape]
    assert len(plan.corpus) == 8 * block and all(0 <= t < replay.DEFAULT_VOCAB for p in prompts for t in p)
    hits = _block_cache_hits([list(plan.corpus), *prompts], block)[1:]  # the warm-up first
    assert hits == [c for _, _, c in shape]
    # The same nonce gives the same prompts; another replay's suffixes differ, its shared prefixes do not.
    assert [plan.prompt(p) for p in plan.requests] == prompts
    other = replay.plan(rows, nonce="another")
    assert other.prompt(other.requests[2])[:5 * block] == prompts[2][:5 * block]
    assert other.prompt(other.requests[2])[5 * block:] != prompts[2][5 * block:]


def test_an_unaligned_cached_count_rounds_up_to_a_block_short_of_the_prompt() -> None:
    assert replay.shared_prefix_tokens(0, 100) == 0
    assert replay.shared_prefix_tokens(100, 1000) == 112
    assert replay.shared_prefix_tokens(128, 1000) == 128
    assert replay.shared_prefix_tokens(999, 1000) == 999
    assert replay.shared_prefix_tokens(1000, 1000) == 999


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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
        case: str, message: str, server: SimServer, store: Store, store_url: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    fill(store)
    argv = ["--engine", server.url, *window_args(store_url)]
    if case == "empty":
        argv = ["--engine", server.url, "--store", store_url, "--since", "1m"]  # the recording is 10 minutes old
    elif case == "unreachable":
        argv[1] = f"http://127.0.0.1:{_free_port()}"
    elif case == "no store":
        argv = ["--engine", server.url, "--store", "chdb:///nonexistent/stepline"]
    elif case == "inverted":
        argv = ["--engine", server.url, "--store", store_url, "--from", str(T0), "--to", str(T0 - 5)]
    elif case == "bad url":
        argv[1] = "localhost:8000"
    elif case == "speed":
        argv += ["--speed", "0"]
    assert replay.run(parse_args(*argv)) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith(message), captured.err
    assert counters(server).get("vllm:prompt_tokens_total", 0) == 0  # nothing was sent


def test_ctrl_c_stops_sending_abandons_streams_and_still_reports(server: SimServer, store_server: StoreServer) -> None:
    database = f"t_{uuid.uuid4().hex[:12]}"
    store = Store.open(store_server.store_url(database))
    try:
        store.ensure_schema(30)
        # One stream that decodes for ~20 s, then a request every 2 s: Ctrl-C lands while the first decodes.
        fill(store, [(0.0, 32, 0, 4000), *((2.0 * i, 32, 0, 2) for i in range(1, 10))])
    finally:
        store.close()
    process = subprocess.Popen(
        [sys.executable, "-m", "stepline", "replay", "--engine", server.url, "--store",
         store_server.store_url(database), "--from", str(T0 - 1), "--to", str(T0 + 60)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "STEPLINE_STORE": ""})
    try:
        deadline = time.monotonic() + 60
        while counters(server).get("vllm:generation_tokens_total", 0) < 20:  # the first request decodes
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


def test_a_stop_event_ends_the_replay_as_ctrl_c_does(server: SimServer) -> None:
    shape = [replay.Recorded("e", f"r{i}", T0 + i, 16, 0, 2, "length") for i in range(10)]
    stop = threading.Event()
    threading.Timer(1.5, stop.set).start()
    report = replay.replay(Endpoint(server.url, 10), replay.plan(shape), max_seconds=30, stop=stop)
    assert report.stopped_by == "stopped" and 1 <= report.sent <= 3 and report.duration_s < 3
