"""The recorded window as the replay needs it: each engine's finished requests, its steps and its settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime

from stepline.diagnosis.common import engine_configs, number
from stepline.diagnosis.findings import Window
from stepline.queries.query import Query
from stepline.queries.requests import MERGED
from stepline.queries.steps import OF_EACH_ENGINE
from stepline.queries.window import EACH_ENGINE, between
from stepline.store.reads import Reads


@dataclass(frozen=True, slots=True)
class TracedRequest:
    """One finished request, times in epoch seconds."""

    request_id: str
    arrival: float
    finished: float
    queue_s: float
    ttft_s: float
    decode_s: float
    prompt_tokens: int
    cached_tokens: int
    generation_tokens: int
    finish_reason: str
    max_tokens: int

    @property
    def scheduled(self) -> float:
        return self.arrival + self.queue_s

    @property
    def first_token(self) -> float:
        return self.arrival + self.ttft_s


@dataclass(slots=True)
class Steps:
    """An engine's steps in time order, one list per column."""

    ts: list[float] = field(default_factory=list)
    elapsed_s: list[float] = field(default_factory=list)
    ctx_tokens: list[int] = field(default_factory=list)
    gen_requests: list[int] = field(default_factory=list)
    gen_tokens: list[int] = field(default_factory=list)
    in_flight_after: list[int] = field(default_factory=list)  # running + waiting after the step
    itls: list[tuple[float, ...]] = field(default_factory=list)  # each step's inter-token latencies

    def __len__(self) -> int:
        return len(self.ts)


@dataclass(slots=True)
class EngineTrace:
    """One engine's share of the window."""

    engine: str
    config: dict[str, str]
    requests: list[TracedRequest]
    steps: Steps

    @property
    def has_iteration_details(self) -> bool:
        """False when vLLM ran without --enable-logging-iteration-details: no step composition to fit."""
        return any(e == e for e in self.steps.elapsed_s)  # NaN != NaN


_REQUESTS = (
    "SELECT engine, request_id, toUnixTimestamp64Micro(arrival_ts) AS arrival_us, toUnixTimestamp64Micro(ts) AS "
    "finished_us, queue_seconds, ttft_seconds, decode_seconds, prompt_tokens, cached_tokens, generation_tokens, "
    "finish_reason, max_tokens "
    f"FROM {MERGED} WHERE {between(column='arrival_ts')} AND {EACH_ENGINE} ORDER BY engine, arrival_ts, request_id"
)
_STEPS = (
    "SELECT engine, toUnixTimestamp64Micro(ts) AS ts_us, elapsed_ms, num_ctx_tokens, num_generation_requests, "
    f"num_generation_tokens, running + waiting AS in_flight_after, itl_seconds FROM steps WHERE {OF_EACH_ENGINE} "
    "AND NOT is_dummy ORDER BY engine, ts, step"
)


def load(reader: Reads, window: Window) -> list[EngineTrace]:
    """Every engine with finished requests that arrived in the window. Steps are read up to the last of those
    requests' finish, so the replay and the recording cover the same work."""
    requests: dict[str, list[TracedRequest]] = {}
    for row in Query(_REQUESTS, start=window.start, end=window.end, engine=window.engine).rows(reader):
        requests.setdefault(str(row.engine), []).append(TracedRequest(
            request_id=str(row.request_id), arrival=int(row.arrival_us) / 1e6, finished=int(row.finished_us) / 1e6,
            queue_s=number(row.queue_seconds), ttft_s=number(row.ttft_seconds), decode_s=number(row.decode_seconds),
            prompt_tokens=int(row.prompt_tokens), cached_tokens=int(row.cached_tokens),
            generation_tokens=int(row.generation_tokens), finish_reason=str(row.finish_reason),
            max_tokens=int(row.max_tokens)))
    if not requests:
        return []
    last = max(r.finished for rs in requests.values() for r in rs)
    steps: dict[str, Steps] = {}
    end = max(window.end, datetime.fromtimestamp(last, UTC))
    for row in Query(_STEPS, start=window.start, end=end, engine=window.engine).rows(reader):
        s = steps.setdefault(str(row.engine), Steps())
        s.ts.append(int(row.ts_us) / 1e6)
        s.elapsed_s.append(float(row.elapsed_ms) / 1e3)
        s.ctx_tokens.append(int(row.num_ctx_tokens))
        s.gen_requests.append(int(row.num_generation_requests))
        s.gen_tokens.append(int(row.num_generation_tokens))
        s.in_flight_after.append(int(row.in_flight_after))
        s.itls.append(tuple(float(v) for v in row.itl_seconds))
    configs = engine_configs(reader, window)
    return [EngineTrace(engine, configs.get(engine, {}), rs, steps.get(engine, Steps()))
            for engine, rs in sorted(requests.items())]
