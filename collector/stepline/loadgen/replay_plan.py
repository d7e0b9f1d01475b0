"""What `stepline replay` sends: the recorded window's requests read from the store, and the prompts that make
their prefix-cache hits recur (the scheme is told in replay.py's docstring)."""

from __future__ import annotations

import random
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from clickhouse_connect.driver.exceptions import ClickHouseError

from stepline.analysis.window import describe
from stepline.diagnosis.findings import Window
from stepline.loadgen.client import MatrixError
from stepline.queries.query import moment
from stepline.queries.requests import merged
from stepline.store.reads import named

DEFAULT_MAX_REQUESTS = 2000
DEFAULT_VOCAB = 1000
BLOCK_TOKENS = 16  # shared prefixes are whole blocks of this many tokens (a divisor of vLLM's block sizes)
CORPUS_SEED = "stepline-replay-corpus"


class ReplayError(MatrixError):
    """The replay cannot run: no store, an empty window, an engine that does not answer; one line."""


@dataclass(frozen=True, slots=True)
class Recorded:
    """One finished request as the store holds it; arrival_ts in epoch seconds."""

    engine: str
    request_id: str
    arrival_ts: float
    prompt_tokens: int
    cached_tokens: int
    generation_tokens: int
    finish_reason: str


@dataclass(frozen=True, slots=True)
class Planned:
    """One request to send: when (seconds after the first, already divided by the speed) and its shape."""

    index: int
    offset_s: float
    prompt_tokens: int
    shared_tokens: int  # how many of them are the corpus prefix
    max_tokens: int
    cached_tokens: int  # as recorded


@dataclass(frozen=True, slots=True)
class Plan:
    """What a replay sends, and what it leaves out of the window's requests."""

    requests: tuple[Planned, ...]
    corpus: tuple[int, ...]  # the shared sequence; the warm-up request is all of it
    vocab: int
    nonce: str
    speed: float
    recorded: int  # finished requests in the window
    skipped: int  # of those, ones that generated no token
    bounded: int  # replayable ones left out by max_requests

    def prompt(self, planned: Planned) -> list[int]:
        """The request's token ids: its corpus prefix, then its own suffix."""
        return list(self.corpus[:planned.shared_tokens]) + suffix_tokens(
            self.nonce, planned.index, planned.prompt_tokens - planned.shared_tokens, self.vocab)


def read_window(client: Any, window: Window, database: str = "") -> list[Recorded]:
    """The window's finished requests, by arrival; `client` is a clickhouse-connect client, `database` the store's
    (a server store's client has none of its own)."""
    parameters: dict[str, Any] = {"start": round(window.start.timestamp() * 1e6),
                                  "end": round(window.end.timestamp() * 1e6)}
    engine_filter = ""
    if window.engine:
        engine_filter = " AND engine = {engine:String}"
        parameters["engine"] = window.engine
    table = f"`{database}`.requests" if database else "requests"
    sql = ("SELECT engine, request_id, toUnixTimestamp64Micro(arrival_ts) AS arrival_us, prompt_tokens, cached_tokens, "
           f"generation_tokens, finish_reason FROM {merged(table)} "
           f"WHERE arrival_ts >= {moment('start')} "
           f"AND arrival_ts <= {moment('end')}"
           f"{engine_filter} ORDER BY arrival_ts, request_id")
    return [Recorded(engine=str(r.engine), request_id=str(r.request_id), arrival_ts=int(r.arrival_us) / 1e6,
                     prompt_tokens=int(r.prompt_tokens), cached_tokens=int(r.cached_tokens),
                     generation_tokens=int(r.generation_tokens), finish_reason=str(r.finish_reason))
            for r in named(client.query(sql, parameters=parameters))]


def load_window(store: str | None, window: Window) -> list[Recorded]:
    """The window's requests from the store --store names, else the one the CLI finds (discovery.locate_store).

    Raises StoreError (StoreLocked among them), StoreUrlError, or ReplayError for a window with no request."""
    from stepline.store.reader import open_located

    reader, _ = open_located(store)
    try:
        recorded = read_window(reader.client, window, reader.database)
    except ClickHouseError as exc:
        raise ReplayError(f"cannot read `requests` via {reader.via}: {' '.join(str(exc).split())[:300]}") from None
    finally:
        reader.close()
    if not recorded:
        raise ReplayError(f"no finished request arrived in {describe(window)} ({reader.via}): nothing to replay "
                          "(the plugin or OTLP fills `requests`; --since, --from/--to pick the window)")
    return recorded


def shared_prefix_tokens(cached_tokens: int, prompt_tokens: int) -> int:
    """The corpus prefix a request begins with: its cached tokens in whole blocks, one token short of its prompt."""
    if cached_tokens <= 0:
        return 0
    return max(0, min(-(-cached_tokens // BLOCK_TOKENS) * BLOCK_TOKENS, prompt_tokens - 1))


def corpus_tokens(length: int, vocab: int, seed: str = CORPUS_SEED) -> tuple[int, ...]:
    """The shared sequence's first `length` token ids: the same for every replay of the same `seed`."""
    rng = random.Random(seed)
    return tuple(rng.randrange(vocab) for _ in range(length))


def repeat_corpus_seed(repeat: int) -> str:
    """The shared sequence's seed for the `repeat`-th replay in a row on one engine (0: the first, CORPUS_SEED): each
    repeat's own, so that none finds an earlier one's prefix in the engine's cache."""
    return CORPUS_SEED if repeat == 0 else f"{CORPUS_SEED}-repeat-{repeat}"


def suffix_tokens(nonce: str, index: int, length: int, vocab: int) -> list[int]:
    """Request `index`'s own token ids, from a generator seeded by the replay's nonce and the index."""
    rng = random.Random(f"{nonce}-{index}")
    return [rng.randrange(vocab) for _ in range(length)]


def plan(recorded: Sequence[Recorded], *, speed: float = 1.0, vocab: int = DEFAULT_VOCAB,
         max_requests: int = DEFAULT_MAX_REQUESTS, nonce: str | None = None, corpus_seed: str = CORPUS_SEED) -> Plan:
    """The requests to send for `recorded`, in arrival order, the first `max_requests` of them; `corpus_seed`
    another shared sequence, so that a repeated replay on the same engine finds none of the last one's cached."""
    for name, value in (("speed", speed), ("max_requests", max_requests)):
        if not value > 0:
            raise ReplayError(f"{name} must be positive, got {value}")
    if vocab < 2:
        raise ReplayError(f"vocab must be at least 2 token ids, got {vocab}")
    ordered = sorted(recorded, key=lambda r: (r.arrival_ts, r.request_id))
    replayable = [r for r in ordered if r.prompt_tokens > 0 and r.generation_tokens > 0]
    chosen = replayable[:max_requests]
    first = chosen[0].arrival_ts if chosen else 0.0
    planned = tuple(Planned(i, (r.arrival_ts - first) / speed, r.prompt_tokens,
                            shared_prefix_tokens(r.cached_tokens, r.prompt_tokens), r.generation_tokens,
                            r.cached_tokens) for i, r in enumerate(chosen))
    longest = max((p.shared_tokens for p in planned), default=0)
    return Plan(planned, corpus_tokens(longest, vocab, corpus_seed), vocab, nonce or uuid.uuid4().hex[:12], speed,
                len(recorded), len(recorded) - len(replayable), len(replayable) - len(chosen))
