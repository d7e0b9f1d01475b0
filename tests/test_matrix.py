"""The diagnosis matrix against the simulator in real time, its SSE endpoint, errors and storage."""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from unittest import mock

import pytest

from stepline import matrix
from stepline.matrix import percentile, render, run_matrix
from stepline.matrix_client import MatrixError, prompt_text
from stepline.sim.config import EngineConfig
from stepline.sim.server import SimServer, idle_workload, serve
from stepline.store import Store, StoreLocked

MODEL = "test/model"


@pytest.fixture
def server() -> Iterator[SimServer]:
    handle = serve(idle_workload(), EngineConfig(model=MODEL), port=0, speed=1.0)
    yield handle
    handle.stop()


def post(server: SimServer, body: dict[str, Any]) -> tuple[int, str, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.getheader("Content-Type", ""), response.read()
    finally:
        conn.close()


def sse_events(raw: bytes) -> list[str]:
    assert raw.endswith(b"\n\n")
    events = raw.decode().split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events)
    return [e[len("data: "):] for e in events]


def parse_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    matrix.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_matrix_shows_long_prefill_interference_and_the_cache_hit_removing_it(server: SimServer) -> None:
    # 32768 tokens are four 8192-token chunks: four ~0.3 s steps among the streams' ~10 ms ones.
    result = run_matrix(server.url, streams=4, prompt_tokens=64, max_tokens=48, long_prompt_tokens=32768,
                        repeat=2, timeout_s=30)
    print("\n" + render(result))
    a, b, c = (result.run(k) for k in "abc")
    assert result.model == MODEL
    for run in result.runs:
        assert run.tokens_received == run.tokens_expected == 4 * 2 * 48
    assert a.itl_p99 < 0.05
    assert b.itl_p99 > 3 * a.itl_p99
    assert b.worst_gap > 0.2
    assert c.itl_p99 < b.itl_p99 / 3
    assert b.long_ttft is not None and c.long_ttft is not None and c.long_ttft < b.long_ttft / 5
    assert "ITL p99 against decode-only: b " in render(result)


def test_completions_stream_as_openai_server_sent_events(server: SimServer) -> None:
    status, content_type, raw = post(server, {"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 5,
                                              "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200 and content_type.startswith("text/event-stream")
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    tokens, usage = chunks[:-1], chunks[-1]
    assert len(tokens) == 5
    ids = {chunk["id"] for chunk in chunks}
    assert len(ids) == 1 and ids.pop().startswith("cmpl-")
    for i, chunk in enumerate(tokens):
        assert chunk["object"] == "text_completion" and chunk["model"] == MODEL and isinstance(chunk["created"], int)
        [choice] = chunk["choices"]
        assert choice["index"] == 0 and choice["text"]
        assert choice["finish_reason"] == ("length" if i == 4 else None)
    assert usage["choices"] == []
    assert usage["usage"]["prompt_tokens"] == 4 and usage["usage"]["completion_tokens"] == 5


def test_a_repeated_prompt_is_a_prefix_cache_hit_and_strings_count_four_chars_a_token(server: SimServer) -> None:
    body = {"prompt": "x" * 4001, "max_tokens": 2}
    first = json.loads(post(server, body)[2])
    again = json.loads(post(server, body)[2])
    told = json.loads(post(server, {**body, "prompt": "y" * 400, "cached_prompt_tokens": 64})[2])
    assert first["usage"]["prompt_tokens"] == 1001
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 1001
    assert told["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    assert first["choices"][0]["finish_reason"] == "length" and first["choices"][0]["text"]
    assert len(prompt_text(1000, "nonce-1")) == 4000
    assert prompt_text(50, "a") != prompt_text(50, "b")


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"model": "other", "prompt": "hi"}, 404, "The model `other` does not exist."),
        ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens must be a positive integer"),
        ({"prompt": ""}, 400, "prompt must be a non-empty string"),
        ({"prompt": [1], "max_tokens": 10**9}, 400, "KV cache"),
    ],
)
def test_bad_requests_get_vllm_errors(server: SimServer, body: dict[str, Any], status: int, message: str) -> None:
    got, content_type, raw = post(server, body)
    error = json.loads(raw)
    assert got == status and content_type == "application/json"
    assert error["object"] == "error" and error["code"] == status and message in error["message"]


def test_matrix_stores_one_event_per_run(server: SimServer, store: Store, store_url: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    args = parse_args("--engine", f"sim={server.url}", "--streams", "2", "--max-tokens", "8",
                      "--long-prompt-tokens", "8192", "--repeat", "1", "--store", store_url)
    assert matrix.run(args) == 0
    out = capsys.readouterr().out
    assert "a decode-only" in out and "stored 3 matrix_run events" in out
    rows = store.query("SELECT engine, source, kind, attributes['run'], attributes['itl_p99_ms'], "
                       "attributes['itl_p99_delta_ms'] FROM events ORDER BY attributes['run']").result_rows
    assert [r[:4] for r in rows] == [("sim", "matrix", "matrix_run", k) for k in "abc"]
    assert float(rows[1][4]) > 0 and rows[0][5] == "" and float(rows[1][5]) > 0


def test_a_locked_store_is_one_line_and_not_a_failure(server: SimServer, capsys: pytest.CaptureFixture[str]) -> None:
    args = parse_args("--engine", server.url, "--streams", "1", "--max-tokens", "2", "--long-prompt-tokens", "64",
                      "--repeat", "1")
    with mock.patch.object(matrix, "store_results", side_effect=StoreLocked("locked", None)):
        assert matrix.run(args) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "held by a running collector" in err


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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


@pytest.mark.parametrize(
    ("engine", "extra", "message"),
    [
        ("unreachable", (), "cannot reach http://127.0.0.1:"),
        ("json_only", (), "did not stream"),
        ("server", ("--model", "nope"), "answered HTTP 404: The model `nope` does not exist."),
        ("server", ("--long-prompt-tokens", "2000000"), "answered HTTP 400"),
        ("ftp://x", (), "must be http(s)://host:port"),
        ("server", ("--streams", "0"), "streams must be positive"),
    ],
)
def test_errors_are_one_clear_line_and_exit_2(
    request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str], engine: str, extra: tuple[str, ...],
    message: str,
) -> None:
    if engine == "unreachable":
        url = f"http://127.0.0.1:{_free_port()}"
    elif engine == "json_only":
        url = request.getfixturevalue("json_only")
    elif engine == "server":
        url = request.getfixturevalue("server").url
    else:
        url = engine
    args = parse_args("--engine", url, "--streams", "1", "--max-tokens", "2", "--long-prompt-tokens", "64",
                      "--repeat", "1", "--no-store", *extra)
    assert matrix.run(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("stepline matrix: ") and message in err


def test_sweep_labels_and_percentiles() -> None:
    assert matrix._sweep_labels("max_num_batched_tokens=2048, 8192") == [
        "max_num_batched_tokens=2048", "max_num_batched_tokens=8192"]
    with pytest.raises(MatrixError, match="NAME=V1,V2"):
        matrix._sweep_labels("nothing")
    assert percentile([], 99) == 0.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert percentile([0.0, 10.0], 95) == pytest.approx(9.5)
