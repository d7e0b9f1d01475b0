"""Deterministic request streams: steady chat, a reported production burst, one isolated long request."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from stepline.sim.records import FinishReason

WORKLOAD_NAMES = ("steady", "burst", "short-burst", "isolated")

STEADY_DURATION_S = 300.0
BURST_DURATION_S = 600.0
ISOLATED_DURATION_S = 60.0

# The burst's shape, as fractions of its duration: a quiet lead-in, the burst, a recovery tail.
BURST_LEAD_IN = (0.0, 0.2)
BURST_PEAK = (0.2, 0.6)
BURST_TAIL = (0.6, 0.75)
# Request counts at the nominal duration: 30 + 616 + 4 monsters + 8 = 658, as reported.
BURST_LEAD_IN_REQUESTS = 30
BURST_PEAK_REQUESTS = 616
BURST_TAIL_REQUESTS = 8
# (fraction of the duration, prompt tokens): uncached monsters, the first the reported 359k-token prompt.
BURST_MONSTERS = ((0.22, 359_000), (0.32, 150_000), (0.42, 240_000), (0.5, 110_000))

# The burst's incident in a minute and a quarter. Rescaling the burst to that length keeps its proportions
# but loses its story: a 359k-token prefill takes ~50 s at any scale, and the rescaled monster arrives before
# anything decodes beside it. Here arrivals last SHORT_BURST_DURATION_S; the monster comes at the fraction
# below, while ~5 cached chat answers stream, and its prefill ends, and the queue behind it drains, within
# SHORT_BURST_DRAIN_S of the last arrival.
SHORT_BURST_DURATION_S = 30.0
SHORT_BURST_DRAIN_S = 45.0
SHORT_BURST_CHAT_PER_S = 5.0
SHORT_BURST_DOCUMENTS_PER_S = 1.5
SHORT_BURST_DOCUMENTS_FROM = 0.13
SHORT_BURST_MONSTER = (0.27, 359_000)


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request as it reaches the engine, `offset_s` after the workload starts."""

    offset_s: float
    request_id: str
    prompt_tokens: int
    output_tokens: int
    cached_fraction: float
    finish_reason: FinishReason
    max_tokens: int
    priority: int = 0  # lower is served first under EngineConfig.policy="priority", as in vLLM


@dataclass(frozen=True, slots=True)
class Workload:
    """A named, time-ordered list of arrivals over `duration_s`, plus time allowed to drain."""

    name: str
    duration_s: float
    drain_s: float
    arrivals: tuple[Arrival, ...]


def _lognormal_int(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return min(high, max(low, round(rng.lognormvariate(math.log(median), sigma))))


def _spread(rng: random.Random, count: int, start: float, end: float) -> list[float]:
    """Arrival offsets of a Poisson process on [start, end) conditioned on `count` arrivals."""
    return sorted(rng.uniform(start, end) for _ in range(count))


def _ending(rng: random.Random, output_tokens: int, stop_share: float, abort_share: float) -> tuple[FinishReason, int]:
    """Finish reason and max_tokens: "length" hits max_tokens, "stop"/"abort" end before it."""
    draw = rng.random()
    if draw < abort_share:
        return "abort", max(output_tokens * 4, 256)
    if draw < abort_share + stop_share:
        return "stop", max(output_tokens * 4, 256)
    return "length", output_tokens


def _finalize(name: str, duration_s: float, drain_s: float, arrivals: list[Arrival]) -> Workload:
    arrivals.sort(key=lambda a: a.offset_s)
    return Workload(name, duration_s, drain_s, tuple(arrivals))


def steady(seed: int = 0, duration_s: float = STEADY_DURATION_S, rate_per_s: float = 4.0) -> Workload:
    """Chat traffic: Poisson arrivals, ~1.2k-token prompts with ~90% prefix hits, ~150-token answers."""
    rng = random.Random(f"steady-{seed}")
    arrivals: list[Arrival] = []
    t = rng.expovariate(rate_per_s)
    while t < duration_s:
        output = _lognormal_int(rng, 150, 0.7, 1, 2048)
        reason, max_tokens = _ending(rng, output, stop_share=0.8, abort_share=0.01)
        arrivals.append(
            Arrival(
                offset_s=t,
                request_id=f"steady-{len(arrivals):06d}",
                prompt_tokens=_lognormal_int(rng, 1200, 0.6, 16, 32_768),
                output_tokens=output,
                cached_fraction=min(0.99, max(0.0, rng.gauss(0.9, 0.05))),
                finish_reason=reason,
                max_tokens=max_tokens,
            )
        )
        t += rng.expovariate(rate_per_s)
    return _finalize("steady", duration_s, 60.0, arrivals)


def burst(seed: int = 0, duration_s: float = BURST_DURATION_S) -> Workload:
    """A reported production incident: quiet cached chat, then ~620 mostly uncached requests plus monsters."""
    rng = random.Random(f"burst-{seed}")
    scale = duration_s / BURST_DURATION_S
    arrivals: list[Arrival] = []

    def add(offset: float, prompt: int, output: int, cached: float) -> None:
        reason, max_tokens = _ending(rng, output, stop_share=0.55, abort_share=0.02)
        request_id = f"burst-{len(arrivals):06d}"
        arrivals.append(Arrival(offset, request_id, prompt, output, cached, reason, max_tokens))

    def regular(offset: float, cached: float) -> None:
        # p50 ~3,000 prompt / ~37 output tokens, long right tails.
        add(offset, _lognormal_int(rng, 3000, 1.0, 32, 65_536), _lognormal_int(rng, 37, 0.9, 1, 2048), cached)

    def phase(bounds: tuple[float, float]) -> tuple[float, float]:
        return bounds[0] * duration_s, bounds[1] * duration_s

    for offset in _spread(rng, max(1, round(BURST_LEAD_IN_REQUESTS * scale)), *phase(BURST_LEAD_IN)):
        regular(offset, min(0.995, rng.uniform(0.96, 1.0)))
    for offset in _spread(rng, max(1, round(BURST_PEAK_REQUESTS * scale)), *phase(BURST_PEAK)):
        # Fresh documents: most share nothing; a few reuse part of a recent prompt (~4% overall).
        regular(offset, rng.uniform(0.0, 0.5) if rng.random() < 0.2 else 0.0)
    monsters = BURST_MONSTERS[: max(1, round(len(BURST_MONSTERS) * scale))]
    for at, prompt in monsters:
        add(at * duration_s, prompt, _lognormal_int(rng, 124, 0.1, 64, 256), 0.0)
    for offset in _spread(rng, max(1, round(BURST_TAIL_REQUESTS * scale)), *phase(BURST_TAIL)):
        regular(offset, min(0.995, rng.uniform(0.85, 1.0)))
    return _finalize("burst", duration_s, max(60.0, 0.25 * duration_s), arrivals)


def isolated(
    seed: int = 0,
    duration_s: float = ISOLATED_DURATION_S,
    prompt_tokens: int = 524_288,
    output_tokens: int | None = None,
    cached_fraction: float = 1.0,
) -> Workload:
    """One long-context request decoding alone: the baseline of the diagnosis matrix."""
    # ~1,500 tokens at ~40 tok/s fill about two thirds of the nominal minute.
    output = output_tokens if output_tokens is not None else max(16, round(1500 * duration_s / 60.0))
    arrival = Arrival(
        offset_s=min(0.5, 0.01 * duration_s),
        request_id=f"isolated-{seed:06d}",
        prompt_tokens=prompt_tokens,
        output_tokens=output,
        cached_fraction=cached_fraction,
        finish_reason="length",
        max_tokens=output,
    )
    return Workload("isolated", duration_s, 30.0, (arrival,))


def make_workload(name: str, seed: int = 0, duration_s: float | None = None) -> Workload:
    """The workload called `name`, at its nominal duration unless `duration_s` rescales it."""
    if duration_s is not None and duration_s <= 0:
        raise ValueError(f"duration must be positive, got {duration_s}")
    match name:
        case "steady":
            return steady(seed, duration_s or STEADY_DURATION_S)
        case "burst":
            return burst(seed, duration_s or BURST_DURATION_S)
        case "short-burst":
            return short_burst(seed, duration_s or SHORT_BURST_DURATION_S)
        case "isolated":
            return isolated(seed, duration_s or ISOLATED_DURATION_S)
    raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOAD_NAMES)}")


# Building blocks for diagnosis scenarios (sim/scenarios.py): arrival lists combined into one workload.


def chat_arrivals(
    prefix: str,
    start_s: float,
    end_s: float,
    rate_per_s: float,
    *,
    seed: int = 0,
    prompt_median: int = 1200,
    output_median: int = 150,
    cached: tuple[float, float] = (0.85, 0.95),
    abort_share: float = 0.0,
    max_prompt: int = 32_768,
) -> list[Arrival]:
    """Poisson chat arrivals on [start_s, end_s); each prompt's cached share is drawn uniformly from `cached`."""
    rng = random.Random(f"{prefix}-{seed}")
    arrivals: list[Arrival] = []
    t = start_s + rng.expovariate(rate_per_s)
    while t < end_s:
        output = _lognormal_int(rng, output_median, 0.5, 1, 4 * output_median)
        reason, max_tokens = _ending(rng, output, stop_share=0.7, abort_share=abort_share)
        prompt = _lognormal_int(rng, prompt_median, 0.6, 16, max_prompt)
        arrivals.append(Arrival(t, f"{prefix}-{len(arrivals):06d}", prompt, output, rng.uniform(*cached), reason,
                                max_tokens))
        t += rng.expovariate(rate_per_s)
    return arrivals


def one_request(
    request_id: str,
    offset_s: float,
    prompt_tokens: int,
    output_tokens: int,
    cached_fraction: float = 0.0,
    *,
    priority: int = 0,
) -> Arrival:
    """A single request that runs to its max_tokens."""
    return Arrival(offset_s, request_id, prompt_tokens, output_tokens, cached_fraction, "length", output_tokens,
                   priority)


def compose(name: str, duration_s: float, drain_s: float, *parts: list[Arrival]) -> Workload:
    """One workload from several arrival lists, in time order."""
    return _finalize(name, duration_s, drain_s, [a for part in parts for a in part])


def short_burst(seed: int = 0, duration_s: float = SHORT_BURST_DURATION_S) -> Workload:
    """The burst's story in about 75 s: cached chat decoding, fresh documents, and the 359k-token monster among them."""
    chat = chat_arrivals("chat", 0.0, duration_s, SHORT_BURST_CHAT_PER_S, seed=seed, prompt_median=3000,
                         output_median=120, cached=(0.96, 1.0), abort_share=0.02, max_prompt=16_384)
    documents = chat_arrivals("doc", SHORT_BURST_DOCUMENTS_FROM * duration_s, duration_s,
                              SHORT_BURST_DOCUMENTS_PER_S, seed=seed, prompt_median=3000, output_median=37,
                              cached=(0.0, 0.05), abort_share=0.02)
    at, prompt = SHORT_BURST_MONSTER
    monster = [one_request(f"monster-{prompt // 1000}k", at * duration_s, prompt, 124)]
    return compose("short-burst", duration_s, SHORT_BURST_DRAIN_S, chat, documents, monster)
