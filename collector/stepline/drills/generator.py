"""Generated diagnosis cases: `generate(seed)` draws 1-3 engines with random traffic and hardware, and at most one
injected cause on one of them; `run_case` replays the case into a store and `judge` scores a diagnosis of it.

Every size is set relative to the engine it lands on (its speed, token budget and KV cache): a monster is a
prompt whose prefill takes tens of seconds on that engine, an overload is arrivals above what it serves, and
ordinary traffic stays well below that, with no prompt long enough to stall it. The cause is the seed modulo
the number of causes, so any run of consecutive seeds covers them evenly.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from stepline.diagnosis.findings import Finding, Window
from stepline.drills.scenarios import PowerCap, Scenario, ScenarioRun, run_engines
from stepline.sim.config import EngineConfig, SpecDecode
from stepline.sim.costmodel import CostModel
from stepline.sim.traffic import (
    Mix,
    arrivals,
    bursts,
    capacity_rps,
    concurrency,
    decode_step_seconds,
    prefill_seconds,
    tokens_for_prefill,
)
from stepline.sim.workloads import Arrival, compose, one_request

# cause -> the finding kind a correct diagnosis ranks first (None: nothing above info may appear).
CAUSES: dict[str, str | None] = {
    "healthy": None,
    "legitimately_slow": None,
    "monster_finished": "prefill_interference",
    "monster_in_flight": "prefill_interference",
    "head_of_line": "head_of_line_blocking",
    "overload": "overload",
    "kv_pressure": "kv_pressure",
    "gpu_throttling": "gpu_throttling",
    "prefix_cache_collapse": "prefix_cache_collapse",
    "wedge": "wedged_engine",
    "config_not_in_effect": "config_not_in_effect",
    "spec_decode_shift": "spec_decode_acceptance_shift",
    "gpu_xid": "gpu_xid",
}
CAUSE_NAMES = tuple(CAUSES)
ENGINE_NAMES = ("engine-a", "engine-b", "engine-c")
SPEED_RANGE = (0.1, 10.0)  # step costs from a tenth to ten times the reference 8B model's: a 100x spread
# Ordinary traffic: load as a share of the engine's capacity, and no prompt whose uncached part takes longer
# than this to prefill on the engine (nor more than ORDINARY_MAX_CHUNKS of its token budget).
ORDINARY_LOAD = (0.15, 0.45)
ORDINARY_PEAK_LOAD = 0.8
ORDINARY_MAX_PREFILL_S = 0.5
ORDINARY_MAX_CHUNKS = 2
SEVERITIES_ALARMING = ("warning", "critical")
# Launches, sampling and output handling do not shrink with the model: a decode step costs at least this.
MIN_STEP_OVERHEAD_S = 4.5e-3
# Replay cost is per step and per request: fast engines get shorter windows and ordinary traffic is capped.
MAX_ORDINARY_REQUESTS = 700
# Engines replay one after another, all stamped to end together: ending this far ahead of the clock keeps every
# engine's start-up event (stamped on receipt) inside the window and ends the window where the data ends, not
# when the last replay happened to finish (the collector takes rows up to 300 s ahead).
REPLAY_LEAD_S = 120.0


@dataclass(frozen=True)
class Case:
    """One generated case: its engines (name, scenario) and what a correct diagnosis says about them."""

    seed: int
    cause: str
    truth_kind: str | None
    truth_engine: str | None
    description: str
    engines: tuple[tuple[str, Scenario], ...]
    facts: dict[str, Any] = field(default_factory=dict)  # what was injected, for tests to check in the store

    @property
    def speeds(self) -> dict[str, float]:
        """Each engine's per-token cost factor against the reference model."""
        return {name: s.config.cost.prefill_token_s / CostModel().prefill_token_s for name, s in self.engines}


@dataclass(frozen=True)
class Verdict:
    """How a diagnosis of a case fared."""

    seed: int
    cause: str
    truth_kind: str | None
    truth_engine: str | None
    correct: bool
    top_kind: str | None
    top_engine: str | None
    top_severity: str | None
    right_engine: bool  # the top finding names the truth engine (for a cause), else nothing alarming
    false_alarms: tuple[str, ...]  # "severity kind@engine" above info on an engine nothing was injected into


class Judged(Protocol):
    """What `judge` reads of a case: a Case, or a generated gateway case (drills/gateway.py)."""

    @property
    def seed(self) -> int: ...
    @property
    def cause(self) -> str: ...
    @property
    def truth_kind(self) -> str | None: ...
    @property
    def truth_engine(self) -> str | None: ...
    @property
    def engines(self) -> Sequence[tuple[str, Any]]: ...


def judge(case: Judged, findings: Sequence[Finding]) -> Verdict:
    """Top-1: for a cause, the first (ranked) finding has the truth kind and engine; else nothing above info."""
    top = findings[0] if findings else None
    alarming = [f for f in findings if f.severity in SEVERITIES_ALARMING]
    healthy_engines = {name for name, _ in case.engines} - {case.truth_engine}
    false_alarms = tuple(f"{f.severity} {f.kind}@{f.engine or '*'}" for f in alarming
                         if case.truth_kind is None or f.engine in healthy_engines)
    if case.truth_kind is None:
        correct = right_engine = not alarming
    else:
        right_engine = top is not None and top.engine == case.truth_engine
        correct = right_engine and top is not None and top.kind == case.truth_kind
    return Verdict(case.seed, case.cause, case.truth_kind, case.truth_engine, correct,
                   top.kind if top else None, top.engine if top else None, top.severity if top else None,
                   right_engine, false_alarms)


def run_case(case: Case, store_url: str, *, end_at: float | None = None) -> Window:
    """Replay `case` into `store_url`; returns the window to diagnose (all its engines)."""
    return replay_case(case, store_url, end_at=end_at)[1]


def replay_case(case: Case, store_url: str, *, end_at: float | None = None) -> tuple[list[ScenarioRun], Window]:
    """Replay `case` into `store_url`; returns each engine's run and the window to diagnose."""
    end_at = end_at if end_at is not None else time.time() + REPLAY_LEAD_S
    _, window = runs_window = run_engines(case.engines, store_url, end_at=end_at)
    return runs_window[0], replace(window, engine="")


@dataclass
class DrawnEngine:
    """One engine being drawn: its settings, traffic mix and what it will be sent."""

    name: str
    speed: float
    config: EngineConfig
    mix: Mix
    duration_s: float
    drain_s: float = 30.0
    parts: list[list[Arrival]] = field(default_factory=list)
    power_cap: PowerCap | None = None
    xid_at_s: float | None = None

    @property
    def cost(self) -> CostModel:
        return self.config.cost

    @property
    def budget(self) -> int:
        return self.config.max_num_batched_tokens

    def capacity(self, mix: Mix | None = None, batch: int | None = None) -> float:
        return capacity_rps(self.cost, mix or self.mix, self.budget,
                            min(self.config.max_num_seqs, batch or 64))

    def scenario(self, seed: int) -> Scenario:
        workload = compose(f"{self.name}-{seed}", self.duration_s, self.drain_s, *self.parts)
        return Scenario(self.name, None, workload, self.config, power_cap=self.power_cap, xid_at_s=self.xid_at_s)


def _log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def _ordinary_mix(rng: random.Random, cost: CostModel, budget: int) -> Mix:
    """A random chat/RAG mix whose longest prompt is still ordinary for this engine."""
    low = rng.random() < 0.25  # RAG-like: fresh documents, little prefix reuse
    hit = rng.uniform(0.0, 0.2) if low else rng.uniform(0.5, 0.95)
    cached = (max(0.0, hit - 0.05), min(0.99, hit + 0.05))
    uncached_cap = min(ORDINARY_MAX_CHUNKS * budget,
                       tokens_for_prefill(cost, ORDINARY_MAX_PREFILL_S, budget, 1 << 20))
    max_prompt = max(256, min(32_768, round(uncached_cap / max(0.05, 1 - cached[1]))))
    median = min(round(_log_uniform(rng, 300, 4000)), max_prompt // 3)
    return Mix(max(32, median), rng.uniform(0.6, 1.0), max_prompt, cached, round(_log_uniform(rng, 40, 400)))


def draw_engine(rng: random.Random, name: str, duration_s: float, seed: int,
                 speeds: tuple[float, float] = SPEED_RANGE) -> DrawnEngine:
    speed = _log_uniform(rng, *speeds)
    cost = CostModel().scaled(speed)
    cost = replace(cost, step_overhead_s=max(cost.step_overhead_s, MIN_STEP_OVERHEAD_S))
    budget = rng.choice((2048, 4096, 8192, 16384))
    spec = None
    if rng.random() < 0.25:
        spec = SpecDecode(rng.randint(2, 5), rng.uniform(0.55, 0.85), seed=seed)
    config = EngineConfig(max_num_batched_tokens=budget, max_num_seqs=rng.choice((64, 128, 256)), cost=cost,
                          speculative=spec)
    return DrawnEngine(name, speed, config, _ordinary_mix(rng, cost, budget), duration_s)


def ordinary_traffic(rng: random.Random, e: DrawnEngine, start_s: float, end_s: float, prefix: str = "chat",
              load: tuple[float, float] = ORDINARY_LOAD, mix: Mix | None = None) -> list[Arrival]:
    """Ordinary traffic at a random share of the engine's capacity, with bursts that stay below saturation."""
    mix = mix or e.mix
    share = rng.uniform(*load)
    rate = min(share * e.capacity(mix), MAX_ORDINARY_REQUESTS / e.duration_s)
    spikes = bursts(rng, start_s, end_s, rng.randint(0, 2), ORDINARY_PEAK_LOAD / share)
    return arrivals(rng, f"{e.name}-{prefix}", start_s, end_s, rate, mix, spikes)


def _pool_output(e: DrawnEngine, before_s: float, during_s: float, chunk_s: float) -> int:
    """Tokens an answer needs to keep decoding `before_s` at full speed, then `during_s` beside prefill chunks."""
    spec = e.config.speculative
    per_step = 1 + spec.num_tokens if spec is not None else 1  # at most, with every draft accepted
    alone_s = decode_step_seconds(e.cost, 32, 4000)
    return min(40_000, round(1.5 * per_step * (before_s / alone_s + during_s / chunk_s)))


def _decoding_pool(rng: random.Random, e: DrawnEngine, start_s: float, end_s: float, output: int) -> list[Arrival]:
    """16-48 cached requests arriving over [start_s, end_s), each answering `output` tokens."""
    count = rng.randint(16, 48)
    prompt = min(2000, e.mix.max_prompt)
    return [one_request(f"{e.name}-decode-{i:03d}", rng.uniform(start_s, end_s), prompt, output, 0.9)
            for i in range(count)]


def _monster(rng: random.Random, e: DrawnEngine, in_flight: bool) -> dict[str, Any]:
    """An uncached prompt whose prefill takes tens of seconds here, beside requests that keep decoding."""
    d = e.duration_s
    target = rng.uniform(40, 90) if in_flight else rng.uniform(12, 35)
    tokens = tokens_for_prefill(e.cost, target, e.budget, 1_000_000)
    prefill_s = prefill_seconds(e.cost, tokens, e.budget)
    chunk_s = e.cost.chunk_step_seconds(tokens // 2, e.budget, 32, 32 * 4000)
    output = _pool_output(e, 3.5, prefill_s + 5, chunk_s)
    # A deployment serving million-token prompts has the KV cache for them (and for what decodes beside).
    pool_tokens = 48 * (2000 + output)
    blocks = math.ceil((tokens + pool_tokens + 100_000) / 0.6 / e.config.block_size)
    e.config = replace(e.config, num_gpu_blocks=max(e.config.num_gpu_blocks, blocks))
    if in_flight:
        e.drain_s = 0.0
        at = d - prefill_s * rng.uniform(0.4, 0.7)
    else:
        at = rng.uniform(0.25, 0.4) * d
        at = min(at, d - 1.3 * prefill_s - 10)
    at = max(at, 15.0)
    e.parts.append(ordinary_traffic(rng, e, 0.0, at - 10, load=(0.15, 0.3)))
    e.parts.append(_decoding_pool(rng, e, at - 3, at - 0.5, output))
    e.parts.append([one_request(f"{e.name}-monster-{tokens // 1000}k", at, tokens, rng.randint(50, 200))])
    e.parts.append(ordinary_traffic(rng, e, at + prefill_s + 5, d, prefix="after", load=(0.15, 0.3)))
    return {"monster_prompt_tokens": tokens, "monster_at_s": round(at, 1), "monster_prefill_s": round(prefill_s, 1)}


def _head_of_line(rng: random.Random, e: DrawnEngine) -> dict[str, Any]:
    """A long prompt, then a burst of short requests that wait behind its prefill."""
    d = e.duration_s
    tokens = tokens_for_prefill(e.cost, rng.uniform(10, 30), e.budget, 400_000)
    prefill_s = prefill_seconds(e.cost, tokens, e.budget)
    at = rng.uniform(0.25, 0.45) * d
    light = replace(e.mix, output_median=min(e.mix.output_median, 60))
    e.parts.append(ordinary_traffic(rng, e, 0.0, at, load=(0.05, 0.15), mix=light))
    e.parts.append([one_request(f"{e.name}-long-{tokens // 1000}k", at, tokens, rng.randint(50, 200))])
    shorts = rng.randint(30, 100)
    span = min(0.6 * prefill_s, 15.0)
    short_mix = Mix(min(1500, e.mix.max_prompt // 2), 0.4, min(e.budget, e.mix.max_prompt), (0.4, 0.6),
                    rng.randint(20, 60))
    start = at + rng.uniform(0.5, 2.0)
    e.parts.append(arrivals(rng, f"{e.name}-short", start, start + span, shorts / span, short_mix))
    e.parts.append(ordinary_traffic(rng, e, at + prefill_s + 20, d, prefix="after", load=(0.05, 0.15), mix=light))
    return {"long_prompt_tokens": tokens, "long_at_s": round(at, 1), "long_prefill_s": round(prefill_s, 1),
            "shorts": shorts}


def _overload(rng: random.Random, e: DrawnEngine) -> dict[str, Any]:
    """Ordinary prompts arriving faster than the engine serves them, from part-way through to the end."""
    d = e.duration_s
    e.drain_s = 0.0
    per_request = e.mix.mean_prompt + e.mix.mean_output * 2
    # Batch only what the KV cache holds comfortably: the engine saturates on compute, not memory.
    seqs = max(16, min(e.config.max_num_seqs, int(0.4 * e.config.kv_capacity_tokens / per_request)))
    e.config = replace(e.config, max_num_seqs=seqs)
    onset = rng.uniform(0.2, 0.45) * d
    factor = rng.uniform(1.6, 3.0)
    e.parts.append(ordinary_traffic(rng, e, 0.0, onset, load=(0.25, 0.4)))
    rate = factor * e.capacity(batch=seqs)
    e.parts.append(arrivals(rng, f"{e.name}-surge", onset, d, rate, e.mix))
    return {"onset_s": round(onset, 1), "arrivals_over_capacity": round(factor, 2)}


def _kv_pressure(rng: random.Random, e: DrawnEngine) -> dict[str, Any]:
    """Too few KV blocks for the requests in flight: the engine preempts and recomputes."""
    mix = replace(e.mix, output_median=max(e.mix.output_median, 200), max_prompt=min(e.mix.max_prompt, 8192),
                  prompt_median=min(e.mix.prompt_median, 2730))
    e.mix = mix
    share = rng.uniform(0.25, 0.4)
    rate = share * e.capacity()
    running = max(4.0, concurrency(e.cost, mix, rate))
    need = running * (mix.mean_prompt + mix.mean_output / 2)
    fraction = rng.uniform(0.3, 0.5)
    largest = mix.max_prompt + 4 * mix.output_median
    tokens = max(round(fraction * need), 2 * largest)
    if tokens > fraction * need:
        # The cache must hold the largest request: send more at once instead, until it holds `fraction` of them.
        context = mix.mean_prompt + mix.mean_output / 2
        running = tokens / (fraction * context)
        rate = running / (mix.mean_output * decode_step_seconds(e.cost, round(running), context))
        need = running * context
    e.config = replace(e.config, num_gpu_blocks=math.ceil(tokens / e.config.block_size))
    e.parts.append(arrivals(rng, f"{e.name}-chat", 0.0, e.duration_s, rate, mix))
    return {"kv_capacity_tokens": e.config.kv_capacity_tokens, "expected_kv_demand_tokens": round(need)}


def _throttling(rng: random.Random, e: DrawnEngine) -> dict[str, Any]:
    d = e.duration_s
    watts = rng.uniform(120, 200)
    whole = rng.random() < 0.3
    start = 0.0 if whole else rng.uniform(0.25, 0.45) * d
    end = d + e.drain_s if whole else start + rng.uniform(0.3, 0.5) * d
    e.power_cap = PowerCap(start, end, watts)
    e.mix = replace(e.mix, output_median=max(e.mix.output_median, 150))
    e.parts.append(ordinary_traffic(rng, e, 0.0, d, load=(0.2, 0.35)))
    return {"cap_w": round(watts), "cap_start_s": round(start, 1), "cap_end_s": round(end, 1), "whole": whole}


def _prefix_collapse(rng: random.Random, e: DrawnEngine) -> dict[str, Any]:
    d = e.duration_s
    prompt_cap = tokens_for_prefill(e.cost, 0.5, e.budget, 8192)
    mix = Mix(max(64, min(3000, prompt_cap // 3)), 0.5, max(128, prompt_cap), (0.9, 0.99),
              min(e.mix.output_median, 100))
    fresh = mix.with_cached((0.0, 0.1))
    e.mix = mix
    at = rng.uniform(0.35, 0.55) * d
    rate = rng.uniform(0.25, 0.45) * e.capacity(fresh)
    e.parts.append(arrivals(rng, f"{e.name}-cached", 0.0, at, rate, mix))
    e.parts.append(arrivals(rng, f"{e.name}-fresh", at, d, rate, fresh))
    return {"collapse_at_s": round(at, 1), "rate_per_s": round(rate, 2)}


def _wedge(rng: random.Random, e: DrawnEngine) -> dict[str, Any]:
    """Clients that disconnect early leak their slots until max_num_seqs is used up; traffic keeps arriving."""
    d = e.duration_s
    seqs = rng.randint(8, 24)
    e.config = replace(e.config, max_num_seqs=seqs, leak_aborted_slots=True)
    e.drain_s = 0.0
    e.mix = replace(e.mix, output_median=min(e.mix.output_median, 100))
    e.parts.append(ordinary_traffic(rng, e, 0.0, d, load=(0.1, 0.25)))
    last = rng.uniform(0.1, 0.25) * d
    e.parts.append([Arrival(rng.uniform(0.05 * d, last), f"{e.name}-gone-{i:02d}", rng.randint(200, 1000),
                            rng.randint(1, 5), 0.5, "abort", 256) for i in range(seqs)])
    return {"max_num_seqs": seqs, "aborted": seqs, "last_abort_s": round(last, 1)}


def _config_not_in_effect(rng: random.Random, e: DrawnEngine) -> dict[str, Any]:
    """A long_prefill_token_threshold that is reported but not applied; documents prefill in full chunks."""
    budget = rng.choice((4096, 8192, 16384))
    threshold = budget // rng.choice((4, 8))
    e.config = replace(e.config, max_num_batched_tokens=budget, long_prefill_token_threshold=threshold,
                       ignore_long_prefill_token_threshold=True)
    chat = replace(e.mix, max_prompt=min(e.mix.max_prompt, threshold), output_median=min(e.mix.output_median, 80),
                   prompt_median=min(e.mix.prompt_median, threshold // 3))
    e.mix = chat
    d = e.duration_s
    docs = rng.randint(2, 3)
    # Chat pauses around each document, so its full-budget chunks slow nobody: the setting is all that is wrong.
    drain = 4 * chat.output_median * decode_step_seconds(e.cost, 8, chat.mean_prompt) + 3
    t, placed = 0.0, 0
    slot = d / docs
    for i in range(docs):
        tokens = round(budget * rng.uniform(2.0, 4.0))
        doc_s = prefill_seconds(e.cost, tokens, budget)
        at = t + rng.uniform(0.3, 0.5) * slot
        e.parts.append(ordinary_traffic(rng, e, t, at - drain, prefix=f"chat{i}", load=(0.1, 0.25)))
        e.parts.append([one_request(f"{e.name}-document-{i}", at, tokens, rng.randint(20, 100), 0.0)])
        placed += 1
        t = at + doc_s + 2
    e.parts.append(ordinary_traffic(rng, e, t, d, prefix="chat-end", load=(0.1, 0.25)))
    return {"threshold": threshold, "budget": budget, "documents": placed}


def _spec_shift(rng: random.Random, e: DrawnEngine, seed: int) -> dict[str, Any]:
    d = e.duration_s
    before, after = rng.uniform(0.7, 0.9), rng.uniform(0.1, 0.3)
    at = rng.uniform(0.35, 0.6) * d
    e.config = replace(e.config, speculative=SpecDecode(rng.randint(3, 5), before, at, after, seed=seed))
    e.mix = replace(e.mix, output_median=max(e.mix.output_median, 150))
    e.parts.append(ordinary_traffic(rng, e, 0.0, d, load=(0.25, 0.4)))
    return {"acceptance_before": round(before, 2), "acceptance_after": round(after, 2), "shift_at_s": round(at, 1)}


def _xid(rng: random.Random, e: DrawnEngine) -> dict[str, Any]:
    e.xid_at_s = rng.uniform(0.3, 0.7) * e.duration_s
    e.parts.append(ordinary_traffic(rng, e, 0.0, e.duration_s))
    return {"xid_at_s": round(e.xid_at_s, 1)}


def _legitimately_slow(rng: random.Random, e: DrawnEngine) -> dict[str, Any]:
    """One 700k-token request alone: a long prefill and a slow decode, and nothing wrong."""
    e.config = replace(e.config, speculative=None)
    e.parts.append([one_request(f"{e.name}-long-700k", 0.5, 700_000, rng.randint(500, 3000), 0.9)])
    return {"prompt_tokens": 700_000}


def _inject(rng: random.Random, cause: str, e: DrawnEngine, seed: int) -> dict[str, Any]:
    """Inject `cause` into engine `e` (its traffic and settings); returns what was injected ("healthy": nothing)."""
    match cause:
        case "monster_finished" | "monster_in_flight":
            return _monster(rng, e, cause == "monster_in_flight")
        case "head_of_line":
            return _head_of_line(rng, e)
        case "overload":
            return _overload(rng, e)
        case "kv_pressure":
            return _kv_pressure(rng, e)
        case "gpu_throttling":
            return _throttling(rng, e)
        case "prefix_cache_collapse":
            return _prefix_collapse(rng, e)
        case "wedge":
            return _wedge(rng, e)
        case "config_not_in_effect":
            return _config_not_in_effect(rng, e)
        case "spec_decode_shift":
            return _spec_shift(rng, e, seed)
        case "gpu_xid":
            return _xid(rng, e)
        case "legitimately_slow":
            return _legitimately_slow(rng, e)
    return {}


def scheduled_async(e: DrawnEngine, seed: int) -> None:
    """Make `e` schedule asynchronously, as vLLM 0.33 does on GPUs by default (sim.config.EngineConfig): its host
    overhead (what the engine core spends between steps, hidden behind the GPU's previous step) is drawn as half to
    all of the step's fixed overhead, so the waits vLLM reports run from a step less its fixed cost down to near 0
    for a decode-only step. Drawn from a generator of its own: the case is otherwise the one it is without."""
    rng = random.Random(f"stepline-async-{seed}-{e.name}")
    host = e.config.cost.step_overhead_s * rng.uniform(0.5, 1.0)
    e.config = replace(e.config, async_scheduling=True, host_overhead_s=host)


def generate(seed: int, async_scheduling: bool = False) -> Case:
    """The case of `seed`: deterministic, its cause CAUSE_NAMES[seed % len(CAUSE_NAMES)]; with
    `async_scheduling`, the same case on engines that schedule asynchronously (scheduled_async)."""
    rng = random.Random(f"stepline-case-{seed}")
    cause = CAUSE_NAMES[seed % len(CAUSE_NAMES)]
    duration = rng.uniform(60, 180)
    count = rng.choices((1, 2, 3), weights=(0.45, 0.35, 0.2))[0]
    engines = [draw_engine(rng, ENGINE_NAMES[i], duration, seed) for i in range(count)]
    # Fast engines step often: their windows are short (60-72 s at the fastest), so replays stay quick.
    duration = round(60 + (duration - 60) * min(1.0, min(e.speed for e in engines)))
    for e in engines:
        e.duration_s = duration
    target = rng.randrange(count)
    kind = CAUSES[cause]
    t = engines[target]
    facts = _inject(rng, cause, t, seed)
    for i, e in enumerate(engines):
        if i != target or cause == "healthy":
            e.parts = [ordinary_traffic(rng, e, 0.0, e.duration_s)]
        if async_scheduling:
            scheduled_async(e, seed)
    truth_engine = t.name if kind is not None else None
    where = f" on {t.name}" if cause != "healthy" else ""
    described = ", ".join(f"{e.name} x{e.speed:.2g} budget {e.budget}"
                          + (f" spec k={e.config.speculative.num_tokens}" if e.config.speculative else "")
                          + (f" async host {e.config.host_overhead_s * 1e3:.1f} ms" if async_scheduling else "")
                          for e in engines)
    description = f"{cause}{where} ({', '.join(f'{k}={v}' for k, v in facts.items())}); {described}"
    return Case(seed, cause, kind, truth_engine, description,
                tuple((e.name, e.scenario(seed)) for e in engines), {"target": t.name, **facts})


# Live cases (served in real time): causes, each with the scenario second it begins at (facts -> onset).
LIVE_CAUSES = ("monster_finished", "wedge", "gpu_throttling_lasting", "gpu_throttling_lifted", "overload",
               "kv_pressure", "prefix_cache_collapse", "gpu_xid", "healthy", "legitimately_slow")
# A simulator in real time steps as fast as the engine would: near the reference model's speed it keeps up on
# two cores (a tenfold faster engine would step hundreds of times a second).
LIVE_SPEEDS = (0.7, 1.5)
_ONSET_FACT = {"monster_finished": "monster_at_s", "wedge": "last_abort_s", "gpu_throttling": "cap_start_s",
               "overload": "onset_s", "prefix_cache_collapse": "collapse_at_s", "gpu_xid": "xid_at_s"}


def live_case(cause: str, seed: int = 0, duration_s: float = 75.0,
              async_scheduling: bool = False) -> tuple[Case, float | None]:
    """One engine near the reference speed, `duration_s` long, with `cause` (one of LIVE_CAUSES) injected as
    `generate` injects it; and its onset in scenario seconds (None: nothing injected; 0: from the start). A
    power cap comes on a third of the way in and stays (`gpu_throttling_lasting`) or is lifted a third later."""
    if cause not in LIVE_CAUSES:
        raise ValueError(f"unknown live cause {cause!r}; one of {', '.join(LIVE_CAUSES)}")
    rng = random.Random(f"stepline-live-{cause}-{seed}")
    e = draw_engine(rng, ENGINE_NAMES[0], duration_s, seed, LIVE_SPEEDS)
    e.config = replace(e.config, speculative=None)
    base = "gpu_throttling" if cause.startswith("gpu_throttling") else cause
    facts = _inject(rng, base, e, seed)
    if base == "gpu_throttling":
        start = round(duration_s / 3, 1)
        end = 1e9 if cause.endswith("lasting") else round(2 * duration_s / 3, 1)
        e.power_cap = PowerCap(start, end, facts["cap_w"])
        facts.update(cap_start_s=start, cap_end_s=end, whole=False)
    elif base == "healthy":
        e.parts = [ordinary_traffic(rng, e, 0.0, duration_s)]
    if async_scheduling:
        scheduled_async(e, seed)
    kind = CAUSES[base]
    onset = None if kind is None else float(facts.get(_ONSET_FACT.get(base, ""), 0.0))
    description = (f"{cause} ({', '.join(f'{k}={v}' for k, v in facts.items())}); {e.name} x{e.speed:.2g} "
                   f"budget {e.budget}" + (" async" if async_scheduling else ""))
    case = Case(seed, base, kind, e.name if kind else None, description, ((e.name, e.scenario(seed)),),
                {"target": e.name, **facts})
    return case, onset
