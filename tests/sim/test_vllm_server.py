"""Real-time mode: HTTP endpoints on an ephemeral port, and the `stepline sim` entry."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from stepline.cli import sim as cli
from stepline.sim.config import EngineConfig
from stepline.sim.vllm_server import SimServer, serve
from stepline.sim.workloads import make_workload
from tests.core.test_listener import needs_ipv6


@pytest.fixture
def server() -> Iterator[SimServer]:
    handle = serve(make_workload("steady", duration_s=30.0), EngineConfig(model="test/model"), port=0, speed=20.0)
    yield handle
    handle.stop()


def get(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.headers["Content-Type"], response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers["Content-Type"], error.read()


def generated(body: bytes) -> float:
    for family in text_string_to_metric_families(body.decode()):
        if family.name == "vllm:generation_tokens":
            return sum(s.value for s in family.samples if s.name.endswith("_total"))
    raise AssertionError("no vllm:generation_tokens family")


def test_metrics_are_served_and_advance_with_the_clock(server: SimServer) -> None:
    assert server.port > 0 and server.url == f"http://127.0.0.1:{server.port}"
    status, content_type, body = get(server.url + "/metrics")
    assert status == 200
    assert content_type == "text/plain; version=0.0.4; charset=utf-8"
    first = generated(body)
    deadline = time.monotonic() + 10
    while generated(get(server.url + "/metrics")[2]) <= first:
        assert time.monotonic() < deadline, "the simulation did not advance"
        time.sleep(0.05)


def test_health_models_and_unknown_paths(server: SimServer) -> None:
    assert get(server.url + "/health")[0] == 200
    status, content_type, body = get(server.url + "/v1/models")
    assert status == 200 and content_type == "application/json"
    assert [m["id"] for m in json.loads(body)["data"]] == ["test/model"]
    assert get(server.url + "/nope")[0] == 404


def _post_raw(server: SimServer, path: str, headers: str, body: bytes = b"") -> tuple[int, dict[str, object]]:
    """A request as a client that may leave out or lie about Content-Length sends it."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as connection:
        connection.sendall(f"POST {path} HTTP/1.0\r\n{headers}\r\n".encode() + body)
        answer = b"".join(iter(lambda: connection.recv(65536), b""))
    head, _, payload = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload)


def test_posts_are_refused_with_vllms_errors(server: SimServer) -> None:
    assert _post_raw(server, "/v1/nope", "Content-Length: 2\r\n", b"{}") == (404, {"detail": "Not Found"})
    status, error = _post_raw(server, "/v1/completions", "")
    assert (status, error["message"], error["type"], error["code"]) == (
        411, "Content-Length is required", "BadRequestError", 411)
    status, error = _post_raw(server, "/tokenize", f"Content-Length: {64 * 1024 * 1024 + 1}\r\n")
    assert (status, error["message"]) == (413, f"the body is over {64 * 1024 * 1024} bytes")
    status, error = _post_raw(server, "/v1/completions", "Content-Length: 13\r\n", b'{"prompt": 7}')
    assert (status, error["message"]) == (400, "prompt must be a non-empty string or list of token ids")
    body = json.dumps({"prompt": "hello", "max_tokens": 3}).encode()
    status, answer = _post_raw(server, "/v1/completions?x=1", f"Content-Length: {len(body)}\r\n", body)
    assert status == 200 and answer["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5,
                                                  "prompt_tokens_details": {"cached_tokens": 0}}


def test_models_report_max_model_len_and_tokenize_counts_as_completions_do() -> None:
    handle = serve(make_workload("isolated", duration_s=5.0), EngineConfig(model="m"), port=0, max_model_len=4096)
    try:
        [model] = json.loads(get(handle.url + "/v1/models")[2])["data"]
        request = urllib.request.Request(handle.url + "/tokenize", data=json.dumps({"prompt": "x" * 4001}).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=5) as response:
            counted = json.loads(response.read())
    finally:
        handle.stop()
    assert (model["id"], model["max_model_len"]) == ("m", 4096)
    assert counted == {"count": 1001, "max_model_len": 4096}
    # The default is what the KV cache holds, as vLLM never starts with a longer one.
    default = serve(make_workload("isolated", duration_s=5.0), port=0)
    try:
        [model] = json.loads(get(default.url + "/v1/models")[2])["data"]
    finally:
        default.stop()
    assert model["max_model_len"] == EngineConfig().kv_capacity_tokens
    with pytest.raises(ValueError, match="tokens_per_event must be at least 1, got 0"):
        serve(make_workload("isolated", duration_s=5.0), port=0, tokens_per_event=0)


def test_stop_closes_the_port_and_ends_the_threads() -> None:
    handle = serve(make_workload("isolated", duration_s=5.0), port=0)
    url = handle.url
    assert get(url + "/health")[0] == 200
    before = threading.active_count()
    handle.stop()
    handle.stop()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url + "/health", timeout=2)
    assert threading.active_count() <= before - 2


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_cli_defaults_follow_vllm() -> None:
    args = parse()
    assert (args.workload, args.host, args.port, args.speed) == ("steady", "127.0.0.1", 8000, 1.0)
    assert (args.max_num_batched_tokens, args.max_num_seqs, args.long_prefill_token_threshold) == (8192, 256, 0)
    assert args.duration is None and not args.once


def test_cli_refuses_bad_settings(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.run(parse("--max-num-seqs", "0", "--port", "0")) == 2
    assert "max_num_seqs must be at least 1, got 0" in capsys.readouterr().err
    assert cli.run(parse("--speed", "0", "--port", "0")) == 2


def test_cli_serves_until_sigterm(capsys: pytest.CaptureFixture[str]) -> None:
    previous = signal.getsignal(signal.SIGTERM)
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
    assert cli.run(parse("--workload", "burst", "--port", "0", "--duration", "30", "--speed", "5")) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("stepline sim: burst workload") and "/metrics" in line
    assert signal.getsignal(signal.SIGTERM) is previous


@needs_ipv6
def test_serves_on_ipv6_loopback_when_given_it() -> None:
    handle = serve(make_workload("steady"), EngineConfig(model="sim-ipv6"), host="::1", port=0)
    try:
        assert handle.url == f"http://[::1]:{handle.port}"
        with urllib.request.urlopen(f"{handle.url}/v1/models", timeout=10) as reply:
            assert json.loads(reply.read())["data"][0]["id"] == "sim-ipv6"
    finally:
        handle.stop()
