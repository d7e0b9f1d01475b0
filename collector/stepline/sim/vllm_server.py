"""Real-time mode: a background thread advances the simulation with the clock; HTTP serves it.

Besides /metrics the server answers OpenAI-style `POST /v1/completions` (streamed as Server-Sent
Events, or whole): each request joins the same continuous batch as the workload's, and each token
is written to the client as the simulated step that samples it ends. The simulator has no
tokenizer: a string prompt counts as ceil(characters / 4) tokens (prose runs ~4 characters per
token, code ~3: send a list of token ids for an exact count). A prompt sent before, verbatim, is a
prefix-cache hit (the last few thousand prompts are remembered by hash); the extra field
`cached_prompt_tokens` sets the hit explicitly.

As vLLM does, /v1/models reports each model's `max_model_len` (default: what the KV cache holds) and a
request longer than that is refused with vLLM's 400; `POST /tokenize` answers the count. A stream can carry
several tokens per SSE event (`tokens_per_event`, as an engine that batches its output does), and with
`stream_options.continuous_usage_stats` every event carries the usage so far, as vLLM's do.
"""

from __future__ import annotations

import json
import queue
import socket
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any

from stepline.core import listener
from stepline.core.clock import Clock, SystemClock
from stepline.sim.completions import ApiError, Completion, parse_completion, parse_tokenize, token_text, usage
from stepline.sim.config import EngineConfig
from stepline.sim.engine import Simulation, StepCallback, Token
from stepline.sim.metrics import CONTENT_TYPE
from stepline.sim.workloads import Workload

PROMPT_CACHE_ENTRIES = 4096  # prompts remembered for prefix-cache hits
MAX_BODY_BYTES = 64 * 1024 * 1024
_MIN_WAIT_S = 0.0002


def idle_workload(duration_s: float = 60.0) -> Workload:
    """A workload with no arrivals: only HTTP clients' requests run."""
    return Workload("idle", duration_s, 0.0, ())


class SimServer:
    """A running simulated vLLM server: `/metrics`, `/health`, `/v1/models`, `/v1/completions`."""

    def __init__(self, simulation: Simulation, host: str, port: int, speed: float, clock: Clock, tick_s: float, *,
                 max_model_len: int | None = None, tokens_per_event: int = 1) -> None:
        if max_model_len is not None and max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        if tokens_per_event < 1:
            raise ValueError(f"tokens_per_event must be at least 1, got {tokens_per_event}")
        self.simulation = simulation
        self.max_model_len = max_model_len or simulation.config.kv_capacity_tokens
        self.tokens_per_event = tokens_per_event
        self._lock = threading.Lock()
        self._clock = clock
        self._speed = speed
        self._tick_s = tick_s
        self._started = clock.monotonic()
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self._seen_prompts: OrderedDict[str, None] = OrderedDict()
        self._httpd = _HttpServer((host, port), self)
        self.host = host
        self.port: int = self._httpd.server_address[1]
        self._http_thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.1}, name="stepline-sim-http", daemon=True
        )
        self._tick_thread = threading.Thread(target=self._tick, name="stepline-sim-engine", daemon=True)
        self._http_thread.start()
        self._tick_thread.start()

    @property
    def url(self) -> str:
        """Base URL, e.g. http://127.0.0.1:8000 (http://[::1]:8000 on IPv6)."""
        return listener.url(self.host, self.port)

    def metrics(self) -> bytes:
        """The exposition as of now."""
        with self._lock:
            self.simulation.advance_to(self._sim_now())
            return self.simulation.render_metrics()

    @property
    def stopping(self) -> bool:
        """True once `stop()` was called."""
        return self._stopping.is_set()

    def submit(self, request_id: str, completion: Completion, tokens: queue.Queue[Token]) -> int:
        """Start a client's request now; its tokens arrive on `tokens`. Returns its cached prompt tokens."""
        with self._lock:
            self.simulation.advance_to(self._sim_now())
            cached = completion.cached_prompt_tokens
            if cached is None:
                cached = completion.prompt_tokens if completion.prompt_key in self._seen_prompts else 0
            cached = min(cached, completion.prompt_tokens)
            try:
                self.simulation.submit(
                    request_id, completion.prompt_tokens, completion.max_tokens, tokens.put,
                    cached_tokens=cached, at=self._sim_now(),
                )
            except ValueError as exc:
                raise ApiError(400, "BadRequestError", str(exc)) from None
            self._seen_prompts[completion.prompt_key] = None
            self._seen_prompts.move_to_end(completion.prompt_key)
            while len(self._seen_prompts) > PROMPT_CACHE_ENTRIES:
                self._seen_prompts.popitem(last=False)
        self._wake.set()
        return cached

    def forget(self, request_id: str) -> None:
        """The client of `request_id` went away: drop its tokens."""
        with self._lock:
            self.simulation.forget(request_id)

    def release_leaked(self) -> int:
        """Give back the slots leaked requests hold (what restarting a wedged lane does); returns how many."""
        with self._lock:
            return self.simulation.scheduler.release_leaked()

    def stop(self) -> None:
        """Stop serving and the engine thread; idempotent."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._wake.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._http_thread.join()
        self._tick_thread.join()

    def _sim_now(self) -> float:
        return (self._clock.monotonic() - self._started) * self._speed

    def _tick(self) -> None:
        # Without scrapes the engine still moves, so on_step callbacks arrive in real time.
        wait = self._tick_s
        while True:
            self._wake.wait(wait)
            self._wake.clear()
            if self._stopping.is_set():
                return
            with self._lock:
                now = self._sim_now()
                self.simulation.advance_to(now)
                wait = self._next_wait(now)

    def _next_wait(self, now: float) -> float:
        """Seconds to sleep: till the step in flight ends while a client streams, else one tick."""
        end = self.simulation.next_step_end() if self.simulation.has_listeners else None
        if end is None:
            return self._tick_s
        # Streamed tokens leave when their step ends, not on the next tick.
        return min(self._tick_s, max(_MIN_WAIT_S, (end - now) / self._speed + _MIN_WAIT_S))


class _HttpServer(listener.HttpServer):
    """The HTTP side of one SimServer, IPv4 or IPv6 as its host says: its handlers reach it as `self.server.sim`."""

    def __init__(self, address: tuple[str, int], sim: SimServer) -> None:
        self.sim = sim
        super().__init__(address, _Handler)



_NOT_FOUND = b'{"detail":"Not Found"}'


class _Handler(BaseHTTPRequestHandler):
    """vLLM's routes over one SimServer: GET /metrics, /health, /v1/models; POST /v1/completions, /tokenize."""

    server: _HttpServer

    def do_GET(self) -> None:
        path = self._route()
        if path == "/metrics":
            self._reply(200, CONTENT_TYPE, self.server.sim.metrics())
        elif path == "/health":
            self._reply(200, "text/plain; charset=utf-8", b"")
        elif path == "/v1/models":
            self._reply(200, "application/json", json.dumps(self._models()).encode())
        else:
            self._reply(404, "application/json", _NOT_FOUND)

    def do_POST(self) -> None:
        path = self._route()
        if path == "/v1/completions":
            self._complete()
        elif path == "/tokenize":
            self._tokenize()
        else:
            self._reply(404, "application/json", _NOT_FOUND)

    def _route(self) -> str:
        return self.path.split("?", 1)[0].rstrip("/")

    @property
    def _model(self) -> str:
        return self.server.sim.simulation.config.model

    def _models(self) -> dict[str, Any]:
        sim = self.server.sim
        return {
            "object": "list",
            "data": [
                {
                    "id": self._model,
                    "object": "model",
                    "created": int(sim.simulation.start_ts),
                    "owned_by": "vllm",
                    "root": self._model,
                    "parent": None,
                    "max_model_len": sim.max_model_len,
                }
            ],
        }

    def _body(self) -> bytes:
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            raise ApiError(411, "BadRequestError", "Content-Length is required") from None
        if not 0 <= length <= MAX_BODY_BYTES:
            raise ApiError(413, "BadRequestError", f"the body is over {MAX_BODY_BYTES} bytes")
        return self.rfile.read(length)

    def _tokenize(self) -> None:
        try:
            count = parse_tokenize(self._body(), self._model)
        except ApiError as exc:
            self._error(exc)
            return
        # Only the count: the simulator has no tokenizer, so it has no token ids to give.
        self._reply(200, "application/json",
                    json.dumps({"count": count, "max_model_len": self.server.sim.max_model_len}).encode())

    def _complete(self) -> None:
        sim = self.server.sim
        request_id = f"cmpl-{uuid.uuid4().hex}"
        tokens: queue.Queue[Token] = queue.Queue()
        try:
            completion = parse_completion(self._body(), self._model, sim.max_model_len)
            cached = sim.submit(request_id, completion, tokens)
        except ApiError as exc:
            self._error(exc)
            return
        try:
            if completion.stream:
                self._stream(request_id, completion, cached, tokens)
            else:
                self._whole(request_id, completion, cached, tokens)
        except OSError:
            sim.forget(request_id)  # the client went away; the engine finishes the request unseen

    def _tokens(self, tokens: queue.Queue[Token]) -> Iterator[Token]:
        sim = self.server.sim
        while not sim.stopping:
            try:
                token = tokens.get(timeout=0.5)
            except queue.Empty:
                continue
            yield token
            if token.finished:
                return

    def _stream(self, request_id: str, completion: Completion, cached: int, tokens: queue.Queue[Token]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        # Small writes must leave at once: Nagle plus delayed ACKs would add ~40 ms to inter-token gaps.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        created = int(time.time())
        model, per_event = self._model, self.server.sim.tokens_per_event
        held: list[Token] = []
        for token in self._tokens(tokens):
            held.append(token)
            if len(held) < per_event and not token.finished:
                continue  # an engine that batches its output sends several tokens in one event
            choice = {"index": 0, "text": "".join(token_text(t.index) for t in held), "logprobs": None,
                      "finish_reason": "length" if token.finished else None, "stop_reason": None}
            chunk: dict[str, Any] = {"id": request_id, "object": "text_completion", "created": created,
                                     "model": model, "choices": [choice]}
            if completion.continuous_usage:
                chunk["usage"] = usage(completion, cached, token.index)
            self._event(chunk)
            held = []
            if token.finished:
                if completion.include_usage:
                    self._event({"id": request_id, "object": "text_completion", "created": created,
                                 "model": model, "choices": [], "usage": usage(completion, cached)})
                self.wfile.write(b"data: [DONE]\n\n")

    def _event(self, payload: dict[str, Any]) -> None:
        self.wfile.write(b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")

    def _whole(self, request_id: str, completion: Completion, cached: int, tokens: queue.Queue[Token]) -> None:
        text = "".join(token_text(token.index) for token in self._tokens(tokens))
        body = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": self._model,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length",
                             "stop_reason": None}],
                "usage": usage(completion, cached)}
        self._reply(200, "application/json", json.dumps(body).encode())

    def _error(self, exc: ApiError) -> None:
        body = {"object": "error", "message": str(exc), "type": exc.kind, "param": None, "code": exc.status}
        self._reply(exc.status, "application/json", json.dumps(body).encode())

    def _reply(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        """Silent: a scrape every few seconds would flood stderr."""


def serve(
    workload: Workload,
    config: EngineConfig | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    speed: float = 1.0,
    repeat: bool = True,
    clock: Clock | None = None,
    tick_s: float = 0.05,
    on_step: StepCallback | None = None,
    max_model_len: int | None = None,
    tokens_per_event: int = 1,
) -> SimServer:
    """Start serving a simulated engine; port 0 picks a free one. Call `.stop()` when done.

    `max_model_len` (default: what the KV cache holds) is reported and enforced as vLLM does; `tokens_per_event`
    tokens go in each streamed SSE event.
    """
    if speed <= 0:
        raise ValueError(f"speed must be positive, got {speed}")
    clock = clock or SystemClock()
    simulation = Simulation(workload, config, clock, repeat=repeat, on_step=on_step)
    return SimServer(simulation, host, port, speed, clock, tick_s, max_model_len=max_model_len,
                     tokens_per_event=tokens_per_event)
