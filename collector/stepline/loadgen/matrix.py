"""`stepline matrix`: the interference test of the design's diagnosis matrix, against any OpenAI-compatible server.

Runs, each `repeat` times: (a) N decode-only streams with short prompts; (b) the same plus one long
uncached prompt, sent once every stream has its first token so that its prefill lands among their
decodes; (c) the same with that long prompt again, now a prefix-cache hit (it is sent once more to
warm the cache first). Every token is stamped on the client as its SSE line arrives, so the figures
are what a user sees: TTFT and inter-token latency (ITL) percentiles and the worst gap of the
decode streams, and the long prompt's own TTFT. An engine may send several tokens in one SSE event: the matrix
asks for vLLM's running usage in every event, so each event's gap is shared by the tokens it carried, and it says
how many tokens the events carried. The long prompt is sized to the model's `max_model_len` from /v1/models
(counted by the engine's /tokenize where it has one), leaving room for its output.

The runs are stored as `matrix_run` events: through the running collector that holds the store (its events
endpoint, with the token from its runtime file), else straight into the store.

For `--sweep NAME=v1,v2` alone the user restarts the engine with each value when asked, and the value only
labels the runs. With `--launch COMMAND` the sweep starts the engine itself, once per value (sweep.py). The
options and the output of the command are cli/matrix.py's.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from clickhouse_connect.driver.exceptions import ClickHouseError

from stepline.core.stats import percentile
from stepline.endpoints.events import EventsRefused, post_events
from stepline.loadgen.client import (
    LONG_MAX_TOKENS,
    Endpoint,
    MatrixError,
    StreamResult,
    long_prompt,
    prompt_text,
    size_long_prompt,
)
from stepline.model.rows import Event, micros
from stepline.store.discovery import collector_for, locate_store, store_without_password
from stepline.store.errors import StoreError
from stepline.store.reads import scalar
from stepline.store.store import Store
from stepline.store.url import parse_store_url

RUNS = (("a", "decode-only"), ("b", "+ uncached long prompt"), ("c", "+ cached long prompt"))
# Events closer than this came out of the server together (one write, one read), not from separate steps.
BUNCHED_GAP_S = 0.001
BUNCHED_SHARE_NOTED = 0.25
NEW_STORE_RETENTION_DAYS = 30  # the collector's default, for a store the matrix is the first to open


@dataclass(frozen=True, slots=True)
class RunStats:
    """One kind of run, pooled over its repeats; latencies in seconds."""

    key: str
    label: str
    tokens_expected: int
    tokens_received: int
    ttft_p50: float
    ttft_p95: float
    ttft_p99: float
    itl_p50: float
    itl_p95: float
    itl_p99: float
    worst_gap: float
    long_ttft: float | None
    finished_ts: float
    events_received: int = 0  # SSE events that carried tokens
    tokens_per_event_max: int = 1
    events_counted: bool = True  # every event's token count came from the engine's running usage
    bunched_share: float = 0.0  # share of event gaps under BUNCHED_GAP_S

    @property
    def tokens_per_event(self) -> float:
        """Mean tokens per SSE event."""
        return self.tokens_received / self.events_received if self.events_received else 0.0

    def figures(self) -> dict[str, float]:
        """The latency figures by name, in seconds."""
        names = ("ttft_p50", "ttft_p95", "ttft_p99", "itl_p50", "itl_p95", "itl_p99", "worst_gap")
        return {name: float(getattr(self, name)) for name in names}


@dataclass(frozen=True, slots=True)
class MatrixResult:
    """The matrix's runs (a, b, c) and what they were run with."""

    engine_url: str
    model: str
    streams: int
    prompt_tokens: int
    max_tokens: int
    long_prompt_tokens: int
    repeat: int
    runs: tuple[RunStats, ...]
    sweep: str | None = None
    max_model_len: int | None = None
    long_prompt_note: str = ""  # how the long prompt's length was chosen

    def run(self, key: str) -> RunStats:
        """The run called `key` ("a", "b" or "c")."""
        return next(r for r in self.runs if r.key == key)


def run_matrix(
    base_url: str,
    *,
    streams: int,
    prompt_tokens: int,
    max_tokens: int,
    long_prompt_tokens: int | None,
    repeat: int,
    timeout_s: float,
    model: str | None = None,
    sweep: str | None = None,
) -> MatrixResult:
    """Run the matrix against `base_url`; raise MatrixError with one line when the engine cannot be measured.

    `long_prompt_tokens` None: the default, or less where the model's max_model_len is smaller."""
    for name, value in (("streams", streams), ("prompt_tokens", prompt_tokens), ("max_tokens", max_tokens),
                        ("long_prompt_tokens", long_prompt_tokens), ("repeat", repeat), ("timeout_s", timeout_s)):
        if value is not None and value <= 0:
            raise MatrixError(f"{name} must be positive, got {value}")
    endpoint = Endpoint(base_url, timeout_s)
    listed = endpoint.models()
    model = model or next(iter(listed))
    max_model_len = listed.get(model)
    if max_model_len is not None and prompt_tokens + max_tokens > max_model_len:
        raise MatrixError(f"a decode stream needs {prompt_tokens} prompt + {max_tokens} output tokens, over "
                          f"{model}'s max_model_len {max_model_len}: lower --prompt-tokens or --max-tokens")
    sized = size_long_prompt(endpoint, model, long_prompt_tokens, max_model_len)
    decode: dict[str, list[StreamResult]] = {key: [] for key, _ in RUNS}
    long: dict[str, list[StreamResult]] = {key: [] for key, _ in RUNS}
    finished: dict[str, float] = {}
    for _ in range(repeat):
        nonce = uuid.uuid4().hex[:16]
        prompt = long_prompt(sized.size, nonce)
        for key, _ in RUNS:
            if key == "c":
                endpoint.stream(model, prompt, 1)  # (b) prefilled it already; make sure it is cached
            results, long_result = _one_run(endpoint, model, streams, prompt_tokens, max_tokens,
                                            prompt if key != "a" else None, f"stepline-matrix-{nonce}-{key}")
            decode[key].extend(results)
            if long_result is not None:
                long[key].append(long_result)
            finished[key] = time.time()
    runs = tuple(_stats(key, label, decode[key], long[key], max_tokens, finished[key]) for key, label in RUNS)
    return MatrixResult(endpoint.url, model, streams, prompt_tokens, max_tokens, sized.tokens, repeat, runs,
                        sweep, max_model_len, sized.note)


def _one_run(endpoint: Endpoint, model: str, streams: int, prompt_tokens: int, max_tokens: int,
             long_prompt: str | None, nonce: str) -> tuple[list[StreamResult], StreamResult | None]:
    results: list[StreamResult | None] = [None] * streams
    long_result: list[StreamResult] = []
    errors: list[MatrixError] = []
    lock = threading.Lock()
    started = [0]
    all_started = threading.Event()

    def first_token(n: int) -> None:
        if n == 1:
            with lock:
                started[0] += 1
                if started[0] == streams:
                    all_started.set()

    def decode(i: int) -> None:
        try:
            results[i] = endpoint.stream(model, prompt_text(prompt_tokens, f"{nonce}-{i}"), max_tokens, first_token)
        except MatrixError as exc:
            errors.append(exc)
            all_started.set()

    def send_long(prompt: str) -> None:
        try:
            long_result.append(endpoint.stream(model, prompt, LONG_MAX_TOKENS))
        except MatrixError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=decode, args=(i,), name=f"matrix-stream-{i}", daemon=True)
               for i in range(streams)]
    for thread in threads:
        thread.start()
    if long_prompt is not None:
        # The long prompt arrives once every stream decodes, so its prefill shares their steps.
        all_started.wait(endpoint.timeout_s)
        if not errors:
            threads.append(threading.Thread(target=send_long, args=(long_prompt,), name="matrix-long", daemon=True))
            threads[-1].start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return [r for r in results if r is not None], (long_result[0] if long_result else None)


def _stats(key: str, label: str, results: list[StreamResult], long: list[StreamResult], max_tokens: int,
           finished_ts: float) -> RunStats:
    ttfts = [r.ttft_s for r in results if r.ttft_s is not None]
    itls = [itl for r in results for itl in r.itls_s]
    gaps = [gap for r in results for gap in r.event_gaps_s]
    long_ttfts = [r.ttft_s for r in long if r.ttft_s is not None]
    return RunStats(
        key, label, len(results) * max_tokens, sum(r.tokens for r in results),
        percentile(ttfts, 50), percentile(ttfts, 95), percentile(ttfts, 99),
        percentile(itls, 50), percentile(itls, 95), percentile(itls, 99), max(gaps, default=0.0),
        percentile(long_ttfts, 50) if long_ttfts else None, finished_ts,
        sum(len(r.event_ns) for r in results), max((n for r in results for n in r.event_tokens), default=1),
        all(r.counted for r in results), sum(gap < BUNCHED_GAP_S for gap in gaps) / len(gaps) if gaps else 0.0,
    )


def render(result: MatrixResult) -> str:
    """The matrix as a table in milliseconds, with the deltas of (b) and (c) against (a)."""
    sweep = f", {result.sweep}" if result.sweep else ""
    lines = [
        f"engine {result.engine_url}, model {result.model}{sweep}: {result.streams} decode streams x "
        f"{result.max_tokens} tokens (prompts ~{result.prompt_tokens} tokens), long prompt "
        f"{result.long_prompt_tokens} tokens, {result.repeat} repeat(s); milliseconds, client-side",
        f"{'run':<27}{'tokens':>12}{'TTFT p50':>10}{'p95':>8}{'p99':>8}{'ITL p50':>9}{'p95':>8}{'p99':>8}"
        f"{'worst':>8}{'long TTFT':>11}",
    ]
    for run in result.runs:
        f = run.figures()
        long = f"{run.long_ttft * 1e3:.1f}" if run.long_ttft is not None else "-"
        lines.append(f"{run.key + ' ' + run.label:<27}{f'{run.tokens_received}/{run.tokens_expected}':>12}"
                     + "".join(f"{v * 1e3:>{w}.1f}" for v, w in zip(f.values(), (10, 8, 8, 9, 8, 8, 8), strict=True))
                     + f"{long:>11}")
    base = result.run("a")
    for run in result.runs[1:]:
        deltas = {k: v - base.figures()[k] for k, v in run.figures().items()}
        lines.append(f"{run.key + ' - a':<27}{'':>12}"
                     + "".join(f"{v * 1e3:>+{w}.1f}" for v, w in zip(deltas.values(), (10, 8, 8, 9, 8, 8, 8),
                                                                      strict=True)))
    ratios = ", ".join(f"{run.key} {run.itl_p99 / base.itl_p99:.1f}x" for run in result.runs[1:]
                       if base.itl_p99 > 0)
    lines.append(f"ITL p99 against decode-only: {ratios}")
    return "\n".join(lines + per_event_notes(result))


def per_event_notes(result: MatrixResult) -> list[str]:
    """How the long prompt was sized, the tokens per SSE event, and what that means for the ITL figures."""
    lines = [f"long prompt: {result.long_prompt_note}"] if result.long_prompt_note else []
    lines.append("tokens per SSE event (mean/max): " + ", ".join(
        f"{run.key} {run.tokens_per_event:.2f}/{run.tokens_per_event_max if run.events_counted else '?'}"
        for run in result.runs))
    most = max(run.tokens_per_event_max for run in result.runs)
    if not all(run.events_counted for run in result.runs):
        if any(run.tokens_received > run.events_received for run in result.runs):
            lines.append("the engine did not say how many tokens each SSE event carried (no "
                         "stream_options.continuous_usage_stats), and it sent more tokens than events: the ITL "
                         "figures are gaps between events, not between tokens")
    elif most > 1:
        lines.append(f"SSE events carried up to {most} tokens each: ITL is each event's gap divided by the tokens "
                     "it carried (read per event, several tokens in one event would show 0.0 between them); "
                     "'worst' is the longest gap between events")
    bunched = [f"{run.key} {run.bunched_share:.0%}" for run in result.runs if run.bunched_share >= BUNCHED_SHARE_NOTED]
    if bunched:
        lines.append(f"SSE events less than {BUNCHED_GAP_S * 1e3:g} ms after the one before: {', '.join(bunched)} of "
                     "the gaps: the server wrote them together, so those ITL figures show how it writes, not how "
                     "long its steps take")
    return lines


def events(result: MatrixResult, engine: str, host: str) -> list[Event]:
    """One `matrix_run` event per run, its figures (milliseconds) and deltas against (a) as attributes."""
    base = result.run("a").figures()
    rows = []
    for run in result.runs:
        attributes = {
            "run": run.key, "label": run.label, "model": result.model, "engine_url": result.engine_url,
            "streams": str(result.streams), "prompt_tokens": str(result.prompt_tokens),
            "max_tokens": str(result.max_tokens), "long_prompt_tokens": str(result.long_prompt_tokens),
            "repeat": str(result.repeat), "tokens_received": str(run.tokens_received),
            "tokens_expected": str(run.tokens_expected), "sweep": result.sweep or "",
            "max_model_len": str(result.max_model_len or ""), "long_prompt_note": result.long_prompt_note,
            "sse_events": str(run.events_received), "tokens_per_event_mean": f"{run.tokens_per_event:.3f}",
            "tokens_per_event_max": str(run.tokens_per_event_max) if run.events_counted else "",
        }
        for name, value in run.figures().items():
            attributes[f"{name}_ms"] = f"{value * 1e3:.3f}"
            if run.key != "a":
                attributes[f"{name}_delta_ms"] = f"{(value - base[name]) * 1e3:.3f}"
        if run.long_ttft is not None:
            attributes["long_ttft_ms"] = f"{run.long_ttft * 1e3:.3f}"
        message = (f"matrix {run.key} {run.label}: ITL p50/p99 {run.itl_p50 * 1e3:.1f}/{run.itl_p99 * 1e3:.1f} ms, "
                   f"worst gap {run.worst_gap * 1e3:.1f} ms, TTFT p99 {run.ttft_p99 * 1e3:.1f} ms, "
                   f"{run.tokens_per_event:.2f} tokens per SSE event")
        rows.append(Event(micros(run.finished_ts), host, engine, "matrix", "matrix_run", "info", message, attributes))
    return rows


def store_results(store_url: str, rows: Sequence[Event]) -> str:
    """Insert the events into the store; the returned line says where they went. Raises StoreError."""
    store = Store.open(store_url)
    try:
        exists = scalar(store.query("SELECT count() FROM system.tables WHERE database = {db:String} AND "
                                    "name = 'events'", parameters={"db": store.database}))
        if not exists:
            store.ensure_schema(NEW_STORE_RETENTION_DAYS)
        store.insert("events", rows, Event._fields)
    except ClickHouseError as exc:
        raise StoreError(f"cannot store the results in {store.url.redacted()}: {' '.join(str(exc).split())[:300]}"
                         ) from None
    finally:
        store.close()
    return f"stored {len(rows)} {_kinds(rows)} events in {store.url.redacted()}"


def _kinds(rows: Sequence[Event]) -> str:
    return " and ".join(sorted({row.kind for row in rows})) or "matrix_run"


def deliver(rows: Sequence[Event], store: str | None, collector: str | None) -> str:
    """Store the events through the collector that holds the store (found by its runtime file, or `collector`),
    else straight into the store; the returned line says where they went.

    Raises EventsRefused (the collector did not take them), StoreError, StoreLocked, StoreUrlError."""
    if collector:
        token = os.environ.get("STEPLINE_OTLP_TOKEN", "")
        if not token:
            raise EventsRefused("--collector needs the token the collector runs with in $STEPLINE_OTLP_TOKEN")
        taken = post_events(collector, token, rows)
        return (f"handed {taken} {_kinds(rows)} events to the collector at {collector}, which writes them into its "
                "store")
    located = locate_store(store)
    running = located.collector or collector_for(store_without_password(parse_store_url(located.url)))
    if running is None or not running.events_url:
        return store_results(located.url, rows)
    taken = post_events(running.events_url, running.events_token, rows)
    return (f"handed {taken} {_kinds(rows)} events to the running collector (pid {running.pid}), which writes them "
            f"into {running.store}")
