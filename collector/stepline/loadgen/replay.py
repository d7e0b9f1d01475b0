"""`stepline replay`: send a recorded window's request shape to an OpenAI-compatible engine and say what it saw.

It reads the window's finished requests from the store (merged: stepline.queries.requests) and sends one streamed
`POST /v1/completions` per request, at the recorded arrival offsets divided by `--speed`, with the recorded
prompt length (the prompt is a list of token ids, so the engine counts exactly that many) and output length
(`max_tokens` = `min_tokens` = the recorded generation tokens, with `ignore_eos`). Requests that generated no
token (aborted before their first) are left out and counted.

Prefix-cache hits are made to recur without the recorded text. Every prompt is drawn from one deterministic
corpus sequence of token ids: a request the engine served `c` prompt tokens of from its cache begins with the
first `c` corpus tokens, rounded up to whole KV blocks of 16 tokens (vLLM's cached counts are whole blocks
already: 16 on GPUs, 128 on its CPU build, both multiples of 16) and capped one token short of its prompt; the
rest is a suffix of ids drawn from a generator seeded by the replay's nonce and the request's index, so that no
two requests (and no two replays) share more than their corpus prefix. A request with no cached tokens is all
suffix. Before the first request, one warm-up request (not counted) holds the longest shared prefix, so the
first recorded hits are hits here too; its prompt tokens are reported on their own. The prefix structure is
therefore one shared trunk: the replay reproduces how many tokens hit, not which requests shared what.

Token ids are drawn from [0, --vocab): 1000 by default, inside the vocabulary of any production tokenizer
(tens of thousands of ids) and of most small ones; which ids they are does not matter, only how many and what
they share. A toy model with a smaller vocabulary needs --vocab at most its size: vLLM refuses a prompt with an
id past its vocabulary (HTTP 400, counted as a failed request with its error text).

It stops at --max-requests sends or after --max-seconds (in-flight streams then abandoned), and on Ctrl-C
(no new sends, in-flight streams abandoned); it reports in every case. Figures are client-side: every SSE
event is stamped on arrival, with vLLM's running usage in each so tokens per event are known (as the matrix
does).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from stepline.analysis.window import describe
from stepline.core.stats import percentile
from stepline.diagnosis.findings import Window
from stepline.loadgen.client import Endpoint, MatrixError, StreamResult
from stepline.loadgen.replay_plan import (
    BLOCK_TOKENS,
    CORPUS_SEED,
    DEFAULT_MAX_REQUESTS,
    DEFAULT_VOCAB,
    Plan,
    Planned,
    Recorded,
    ReplayError,
    corpus_tokens,
    load_window,
    plan,
    read_window,
    repeat_corpus_seed,
    shared_prefix_tokens,
    suffix_tokens,
)

# The plan's names too: `stepline.loadgen.replay` is the one module its users import.
__all__ = [
    "BLOCK_TOKENS",
    "CORPUS_SEED",
    "DEFAULT_MAX_REQUESTS",
    "DEFAULT_VOCAB",
    "Plan",
    "Planned",
    "Recorded",
    "ReplayError",
    "ReplayReport",
    "Sent",
    "corpus_tokens",
    "load_window",
    "plan",
    "read_window",
    "render",
    "repeat_corpus_seed",
    "replay",
    "replay_window",
    "shared_prefix_tokens",
    "suffix_tokens",
]

DEFAULT_MAX_SECONDS = 600.0
DEFAULT_TIMEOUT_S = 300.0
MAX_IN_FLIGHT = 256  # one thread per stream in flight
_POLL_S = 0.1  # how often a wait looks at the deadline and the stop flag


@dataclass(slots=True)
class Sent:
    """One request as it went: when it was due and sent (seconds after the start) and how it ended."""

    index: int
    scheduled_s: float
    sent_s: float
    prompt_tokens: int
    max_tokens: int
    result: StreamResult | None = None
    error: str | None = None
    done: bool = False


@dataclass(frozen=True, slots=True)
class ReplayReport:
    """What the replay sent and what came back; latencies in seconds, client-side."""

    engine_url: str
    model: str
    window: str
    speed: float
    recorded: int
    skipped: int
    bounded: int
    planned: int
    sent: int
    completed: int
    failed: int
    abandoned: int  # in flight when it stopped
    first_error: str
    prompt_tokens_recorded: int  # of the planned requests
    generation_tokens_recorded: int
    cached_tokens_recorded: int
    prompt_tokens_sent: int
    shared_prefix_tokens_sent: int
    warmup_prompt_tokens: int  # sent once before the requests, not in the other figures
    generation_tokens_asked: int
    prompt_tokens_received: int  # as the engine's usage counted them, completed requests
    generation_tokens_received: int
    cached_tokens_reported: int | None  # None where the engine's usage does not say
    duration_s: float
    span_s: float  # the planned arrivals' span, after the speed
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p50_s: float
    itl_p99_s: float
    send_lag_max_s: float  # the latest a request left after it was due
    stopped_by: str  # "" (everything sent and finished), "max-seconds", "interrupted" or "stopped"
    sends: tuple[Sent, ...] = field(default=(), repr=False, compare=False)

    def as_dict(self) -> dict[str, Any]:
        """The report's figures by name (without the per-request sends)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "sends"}


class _Abandoned(Exception):
    """Raised in a stream's token callback once the replay stopped: the stream is closed where it is."""


class _Replayer:
    """Sends a plan's requests on time, one thread per request in flight, and collects how each went."""

    def __init__(self, endpoint: Endpoint, model: str, the_plan: Plan, max_in_flight: int,
                 clock: Callable[[], float]) -> None:
        self._endpoint = endpoint
        self._model = model
        self._plan = the_plan
        self._clock = clock
        self._slots = threading.BoundedSemaphore(max_in_flight)
        self._lock = threading.Lock()
        self._abandon = threading.Event()
        self.sends: list[Sent] = []
        self._threads: list[threading.Thread] = []
        self.start = 0.0

    def run(self, max_seconds: float, stop: threading.Event) -> str:
        """Send everything due before the deadline, then wait for the streams; returns why it stopped ("")."""
        self.start = self._clock()
        deadline = self.start + max_seconds
        try:
            for planned in self._plan.requests:
                due = self.start + planned.offset_s
                if due >= deadline:
                    return "max-seconds"
                if stop.wait(max(0.0, due - self._clock())):
                    return "stopped"
                if not self._take_slot(deadline, stop):
                    return "stopped" if stop.is_set() else "max-seconds"
                self._launch(planned)
            for thread in self._threads:
                while thread.is_alive():
                    if stop.is_set():
                        return "stopped"
                    left = deadline - self._clock()
                    if left <= 0:
                        return "max-seconds"
                    thread.join(min(left, _POLL_S))
            return ""
        except KeyboardInterrupt:
            return "interrupted"
        finally:
            self._abandon.set()

    def _take_slot(self, deadline: float, stop: threading.Event) -> bool:
        while not self._slots.acquire(timeout=_POLL_S):
            if stop.is_set() or self._clock() >= deadline:
                return False
        return True

    def _launch(self, planned: Planned) -> None:
        sent = Sent(planned.index, planned.offset_s, self._clock() - self.start, planned.prompt_tokens,
                    planned.max_tokens)
        self.sends.append(sent)
        thread = threading.Thread(target=self._send, args=(planned, sent), name=f"replay-{planned.index}",
                                  daemon=True)  # an abandoned stream must not hold the process
        self._threads.append(thread)
        thread.start()

    def _send(self, planned: Planned, sent: Sent) -> None:
        try:
            result = self._endpoint.stream(self._model, self._plan.prompt(planned), planned.max_tokens,
                                           self._on_token, extra={"min_tokens": planned.max_tokens})
            with self._lock:
                sent.result, sent.done = result, True
        except _Abandoned:
            pass
        except MatrixError as exc:
            self._failed(sent, str(exc))
        except Exception as exc:  # a failing request is a figure of the report, never a crash of the replay
            self._failed(sent, f"{type(exc).__name__}: {exc}")
        finally:
            self._slots.release()

    def _failed(self, sent: Sent, error: str) -> None:
        with self._lock:
            if not self._abandon.is_set():
                sent.error, sent.done = error, True

    def _on_token(self, events: int) -> None:
        if self._abandon.is_set():
            raise _Abandoned

    def snapshot(self) -> list[Sent]:
        """Copies of the sends as they stand (abandoned streams may still be closing)."""
        with self._lock:
            return [dataclasses.replace(s) for s in self.sends]


def replay(endpoint: Endpoint, the_plan: Plan, *, model: str | None = None, window: str = "",
           max_seconds: float = DEFAULT_MAX_SECONDS, max_in_flight: int = MAX_IN_FLIGHT,
           stop: threading.Event | None = None, clock: Callable[[], float] = time.monotonic) -> ReplayReport:
    """Warm the shared prefix, send the plan and report; ReplayError when the engine cannot be used at all.

    `stop` set ends it as Ctrl-C does (no new sends, in-flight streams abandoned)."""
    if not max_seconds > 0:
        raise ReplayError(f"max_seconds must be positive, got {max_seconds}")
    if not the_plan.requests:
        raise ReplayError(f"none of the {the_plan.recorded} recorded requests generated a token: nothing to replay")
    model = model or endpoint.first_model()
    stop = stop or threading.Event()
    replayer = _Replayer(endpoint, model, the_plan, max_in_flight, clock)
    stopped_by = ""
    if the_plan.corpus:
        try:
            endpoint.stream(model, list(the_plan.corpus), 1, extra={"min_tokens": 1})
        except MatrixError as exc:
            raise ReplayError(f"the warm-up request (the longest shared prefix, {len(the_plan.corpus)} tokens) "
                              f"failed: {exc}") from None
        except KeyboardInterrupt:
            stopped_by = "interrupted"
    if not stopped_by:
        stopped_by = replayer.run(max_seconds, stop)
    duration = clock() - replayer.start if replayer.start else 0.0
    return _report(endpoint.url, model, window, the_plan, replayer.snapshot(), stopped_by, duration)


def _report(url: str, model: str, window: str, the_plan: Plan, sends: list[Sent], stopped_by: str,
            duration_s: float) -> ReplayReport:
    planned = the_plan.requests
    by_index = {p.index: p for p in planned}
    done = [s for s in sends if s.done and s.result is not None]
    failed = [s for s in sends if s.done and s.error is not None]
    results = [s.result for s in done if s.result is not None]
    ttfts = [r.ttft_s for r in results if r.ttft_s is not None]
    itls = [itl for r in results for itl in r.itls_s]
    cached = [r.cached_tokens for r in results if r.cached_tokens is not None]
    return ReplayReport(
        url, model, window, the_plan.speed, the_plan.recorded, the_plan.skipped, the_plan.bounded, len(planned),
        len(sends), len(done), len(failed), sum(not s.done for s in sends),
        next((s.error for s in failed if s.error), ""),
        sum(p.prompt_tokens for p in planned), sum(p.max_tokens for p in planned),
        sum(p.cached_tokens for p in planned),
        sum(s.prompt_tokens for s in sends), sum(by_index[s.index].shared_tokens for s in sends),
        len(the_plan.corpus), sum(s.max_tokens for s in sends),
        sum(r.prompt_tokens or 0 for r in results), sum(r.tokens for r in results),
        sum(cached) if cached else None, duration_s, planned[-1].offset_s if planned else 0.0,
        percentile(ttfts, 50), percentile(ttfts, 99), percentile(itls, 50), percentile(itls, 99),
        max((s.sent_s - s.scheduled_s for s in sends), default=0.0), stopped_by, tuple(sends),
    )


_STOPPED = {"": "", "max-seconds": "; stopped by --max-seconds", "interrupted": "; stopped by Ctrl-C",
            "stopped": "; stopped"}


def render(report: ReplayReport) -> str:
    """The report as a few lines; milliseconds for latencies."""
    r = report
    left = []
    if r.skipped:
        left.append(f"{r.skipped} that generated no token")
    if r.bounded:
        left.append(f"{r.bounded} past --max-requests")
    out = f" (left out: {', '.join(left)})" if left else ""
    cached = (f"the engine reported {r.cached_tokens_reported} cached" if r.cached_tokens_reported is not None
              else "the engine's usage does not report cached tokens (vLLM: --enable-prompt-tokens-details)")
    lines = [
        f"replay of {r.window}: {r.recorded} recorded requests{out}, x{r.speed:g} speed, against {r.engine_url} "
        f"(model {r.model})",
        f"sent {r.sent} of {r.planned} over {r.duration_s:.1f} s (arrivals span {r.span_s:.1f} s): completed "
        f"{r.completed}, failed {r.failed}, abandoned {r.abandoned}{_STOPPED.get(r.stopped_by, '')}",
        f"prompt tokens: recorded {r.prompt_tokens_recorded}, sent {r.prompt_tokens_sent} "
        f"({r.shared_prefix_tokens_sent} of them shared prefix; warm-up {r.warmup_prompt_tokens} more, not "
        f"counted), the engine counted {r.prompt_tokens_received} (completed requests)",
        f"generation tokens: recorded {r.generation_tokens_recorded}, asked {r.generation_tokens_asked}, received "
        f"{r.generation_tokens_received}",
        f"cached prompt tokens: recorded {r.cached_tokens_recorded}; {cached}",
        f"client-side: TTFT p50/p99 {r.ttft_p50_s * 1e3:.1f}/{r.ttft_p99_s * 1e3:.1f} ms, ITL p50/p99 "
        f"{r.itl_p50_s * 1e3:.1f}/{r.itl_p99_s * 1e3:.1f} ms; sends at most {r.send_lag_max_s * 1e3:.1f} ms "
        "after they were due",
    ]
    if r.first_error:
        lines.append(f"first error: {r.first_error}")
    return "\n".join(lines)


def replay_window(url: str, recorded: Sequence[Recorded], window: Window, *, speed: float = 1.0,
                  vocab: int = DEFAULT_VOCAB, max_requests: int = DEFAULT_MAX_REQUESTS,
                  max_seconds: float = DEFAULT_MAX_SECONDS, timeout_s: float = DEFAULT_TIMEOUT_S,
                  model: str | None = None, stop: threading.Event | None = None,
                  corpus_seed: str = CORPUS_SEED) -> ReplayReport:
    """Replay `recorded` against `url`, asking for `model` (default: the first one /v1/models lists); `corpus_seed`
    as replay_plan.plan takes it."""
    the_plan = plan(recorded, speed=speed, vocab=vocab, max_requests=max_requests, corpus_seed=corpus_seed)
    endpoint = Endpoint(url, timeout_s)
    listed = endpoint.models()  # an engine that does not answer fails here, before anything is sent
    return replay(endpoint, the_plan, model=model or next(iter(listed)), window=describe(window),
                  max_seconds=max_seconds, stop=stop)
