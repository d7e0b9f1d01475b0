"""The diagnosis matrix against the simulator in real time, its SSE endpoint, errors and storage."""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from stepline.loadgen import matrix
from stepline.loadgen.client import (
    LONG_MAX_TOKENS,
    prompt_text,
)
from stepline.loadgen.matrix import render, run_matrix
from stepline.sim.config import EngineConfig
from stepline.sim.vllm_server import SimServer, idle_workload, serve
from stepline.store.store import Store

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
        ({"prompt": [1], "max_tokens": 10**9}, 400, "This model's maximum context length is 771408 tokens. However, "
                                                   "you requested 1000000001 tokens"),
    ],
)
def test_bad_requests_get_vllm_errors(server: SimServer, body: dict[str, Any], status: int, message: str) -> None:
    got, content_type, raw = post(server, body)
    error = json.loads(raw)
    assert got == status and content_type == "application/json"
    assert error["object"] == "error" and error["code"] == status and message in error["message"]


def test_the_long_prompt_fits_max_model_len_with_room_for_its_output() -> None:
    handle = serve(idle_workload(), EngineConfig(model=MODEL), port=0, speed=1.0, max_model_len=2048)
    try:
        result = run_matrix(handle.url, streams=1, prompt_tokens=16, max_tokens=4, long_prompt_tokens=None,
                            repeat=1, timeout_s=30)
    finally:
        handle.stop()
    # The engine counted it (/tokenize), and it ran: prompt and output within 2048 tokens.
    assert 1900 < result.long_prompt_tokens <= 2048 - LONG_MAX_TOKENS
    assert result.max_model_len == 2048 and result.run("b").long_ttft is not None
    assert result.long_prompt_note == (f"cut to fit {MODEL}'s max_model_len 2048: default 100000, 8 tokens kept for "
                                       "its output; counted by the engine's /tokenize")
    assert f"long prompt {result.long_prompt_tokens} tokens" in render(result)


def test_completions_stream_several_tokens_per_event_with_running_usage() -> None:
    handle = serve(idle_workload(), EngineConfig(model=MODEL), port=0, speed=1.0, tokens_per_event=3)
    try:
        _, _, raw = post(handle, {"prompt": [1, 2], "max_tokens": 7, "stream": True,
                                  "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    finally:
        handle.stop()
    chunks = [json.loads(e) for e in sse_events(raw)[:-1]]
    assert [c["usage"]["completion_tokens"] for c in chunks] == [3, 6, 7, 7]
    assert [len(c["choices"]) for c in chunks] == [1, 1, 1, 0]
    assert chunks[0]["choices"][0]["text"] == " the engine steps"


def test_itl_with_several_tokens_per_sse_event_is_per_token_and_says_so() -> None:
    handle = serve(idle_workload(), EngineConfig(model=MODEL), port=0, speed=1.0, tokens_per_event=4)
    try:
        result = run_matrix(handle.url, streams=2, prompt_tokens=16, max_tokens=16, long_prompt_tokens=256,
                            repeat=1, timeout_s=30)
    finally:
        handle.stop()
    text = render(result)
    print("\n" + text)
    for run in result.runs:
        assert run.tokens_received == run.tokens_expected == 32
        assert (run.events_received, run.tokens_per_event, run.tokens_per_event_max) == (8, 4.0, 4)
        assert 0.002 < run.itl_p50 < run.worst_gap / 2  # a quarter of each event's gap, not 0.0 and not the gap
    assert "tokens per SSE event (mean/max): a 4.00/4, b 4.00/4, c 4.00/4" in text
    assert ("SSE events carried up to 4 tokens each: ITL is each event's gap divided by the tokens it carried"
            in text)
    row = matrix.events(result, "sim", "h")[0].attributes
    assert (row["tokens_per_event_mean"], row["tokens_per_event_max"], row["sse_events"]) == ("4.000", "4", "8")


class _Batched(BaseHTTPRequestHandler):
    """A server that sends three tokens per event and says so only in its closing usage."""

    def do_GET(self) -> None:
        self._send(200, "application/json", b'{"data": [{"id": "m"}]}')

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        if self.path != "/v1/completions":
            self._send(404, "application/json", b'{"detail": "Not Found"}')
            return
        events = [{"choices": [{"text": " a b c", "finish_reason": None}]},
                  {"choices": [{"text": " d e f", "finish_reason": "length"}]},
                  {"choices": [], "usage": {"completion_tokens": 6}}]
        body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
        self._send(200, "text/event-stream", body)

    def _send(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_an_engine_that_does_not_count_tokens_per_event_is_named_in_the_output() -> None:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Batched)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        result = run_matrix(f"http://127.0.0.1:{httpd.server_address[1]}", streams=1, prompt_tokens=8,
                            max_tokens=6, long_prompt_tokens=64, repeat=1, timeout_s=10)
    finally:
        httpd.shutdown()
        httpd.server_close()
    a = result.run("a")
    assert (a.tokens_received, a.events_received, a.events_counted) == (6, 2, False)
    text = render(result)
    assert "tokens per SSE event (mean/max): a 3.00/?" in text
    assert ("the engine did not say how many tokens each SSE event carried (no stream_options.continuous_usage_stats)"
            ", and it sent more tokens than events: the ITL figures are gaps between events, not between tokens"
            in text)


def test_events_that_arrive_together_are_named_in_the_output() -> None:
    def run(key: str, share: float) -> matrix.RunStats:
        return matrix.RunStats(key, key, 8, 8, 0.1, 0.1, 0.1, 0.0, 0.0, 0.01, 0.01, None, 0.0, 8, 1, True, share)

    result = matrix.MatrixResult("http://e", MODEL, 1, 8, 8, 64, 1, (run("a", 0.75), run("b", 0.1), run("c", 0.0)))
    text = render(result)
    assert ("SSE events less than 1 ms after the one before: a 75% of the gaps: the server wrote them together, so "
            "those ITL figures show how it writes, not how long its steps take") in text
    quiet = matrix.MatrixResult("http://e", MODEL, 1, 8, 8, 64, 1, (run("a", 0.2), run("b", 0.1), run("c", 0.0)))
    assert "after the one before" not in render(quiet)


def test_the_runs_are_stored_as_events_in_a_store_the_matrix_is_the_first_to_open(store_url: str) -> None:
    runs = tuple(matrix.RunStats(k, k, 8, 8, 0.1, 0.1, 0.1, 0.01, 0.02, 0.03, 0.04, None, time.time())
                 for k in "abc")
    result = matrix.MatrixResult("http://e", MODEL, 1, 8, 8, 64, 1, runs)
    said = matrix.store_results(store_url, matrix.events(result, "e", "h"))
    store = Store.open(store_url)
    try:
        assert said == f"stored 3 matrix_run events in {store.url.redacted()}"
        rows = store.query("SELECT attributes['run'], attributes['itl_p99_ms'] FROM events ORDER BY 1").result_rows
    finally:
        store.close()
    assert rows == [("a", "30.000"), ("b", "30.000"), ("c", "30.000")]
