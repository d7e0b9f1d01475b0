"""Random request traffic for generated diagnosis cases: bursty arrivals, heavy-tailed prompts, and what an
engine of a given speed can serve of them (so that loads are set relative to the engine, not in absolute rates)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from stepline.sim.costmodel import CostModel
from stepline.sim.records import FinishReason
from stepline.sim.workloads import Arrival

# A decoding batch this large is where capacity is reckoned for ordinary load (the overload cases use the
# engine's own max_num_seqs, the most it can batch).
NOMINAL_BATCH = 64


@dataclass(frozen=True)
class Mix:
    """What ordinary requests look like: log-normal prompts (median, sigma: the tail) capped at `max_prompt`,
    each prompt's cached share uniform in `cached`, log-normal outputs, and a share of client aborts."""

    prompt_median: int
    prompt_sigma: float
    max_prompt: int
    cached: tuple[float, float]
    output_median: int
    output_sigma: float = 0.6
    abort_share: float = 0.0

    @property
    def mean_prompt(self) -> float:
        """Expected prompt tokens (the cap ignored beyond clipping the mean)."""
        return min(self.prompt_median * math.exp(self.prompt_sigma**2 / 2), self.max_prompt)

    @property
    def mean_output(self) -> float:
        return min(self.output_median * math.exp(self.output_sigma**2 / 2), 4 * self.output_median)

    @property
    def mean_cached(self) -> float:
        return sum(self.cached) / 2

    def with_cached(self, cached: tuple[float, float]) -> Mix:
        return Mix(self.prompt_median, self.prompt_sigma, self.max_prompt, cached, self.output_median,
                   self.output_sigma, self.abort_share)


@dataclass(frozen=True)
class Burst:
    """Arrivals `factor` times as frequent from `start_s` to `end_s`."""

    start_s: float
    end_s: float
    factor: float


def prefill_seconds(cost: CostModel, tokens: int, budget: int, start: int = 0) -> float:
    """How long `tokens` prompt tokens from context position `start` take to prefill alone, in budget-sized chunks."""
    if tokens <= 0:
        return 0.0
    chunks = math.ceil(tokens / budget)
    # Attention pairs of all chunks together: tokens x (start + tokens / 2), whatever the chunking.
    return (chunks * cost.step_overhead_s + cost.prefill_token_s * tokens
            + cost.prefill_attention_pair_s * tokens * (start + tokens / 2))


def tokens_for_prefill(cost: CostModel, seconds: float, budget: int, cap: int) -> int:
    """The uncached prompt that takes about `seconds` to prefill alone, at most `cap` tokens."""
    lo, hi = 1, cap
    if prefill_seconds(cost, hi, budget) <= seconds:
        return cap
    while hi - lo > 256:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if prefill_seconds(cost, mid, budget) < seconds else (lo, mid)
    return hi


def decode_step_seconds(cost: CostModel, batch: int, context: float) -> float:
    """One decode-only step of `batch` requests of mean `context` tokens."""
    return cost.step_seconds(0, 0.0, batch, round(batch * context))


def capacity_rps(cost: CostModel, mix: Mix, budget: int, batch: int = NOMINAL_BATCH) -> float:
    """Requests per second the engine completes at most, decoding `batch` at a time, for this mix."""
    prompt = mix.mean_prompt
    uncached = prompt * (1 - mix.mean_cached)
    prefill = prefill_seconds(cost, round(uncached), budget, round(prompt - uncached)) - cost.step_overhead_s
    output = mix.mean_output
    per_token = decode_step_seconds(cost, batch, prompt + output / 2) / batch
    return 1.0 / (max(prefill, 0.0) + output * per_token)


def concurrency(cost: CostModel, mix: Mix, rate: float) -> float:
    """Requests decoding at once at `rate` (Little's law, with the step time growing with the batch)."""
    context = mix.mean_prompt + mix.mean_output / 2
    fixed = cost.step_overhead_s
    per_request = cost.decode_request_s + cost.decode_context_token_s * context
    load = rate * mix.mean_output * per_request
    return rate * mix.mean_output * fixed / max(1e-3, 1 - load)


def bursts(rng: random.Random, start_s: float, end_s: float, count: int, max_factor: float) -> list[Burst]:
    """Up to `count` bursts of 5-15 s inside [start_s, end_s), each at most `max_factor` the base rate."""
    found: list[Burst] = []
    if max_factor <= 1.2 or end_s - start_s < 20:
        return found
    for _ in range(count):
        length = rng.uniform(5.0, 15.0)
        at = rng.uniform(start_s, end_s - length)
        found.append(Burst(at, at + length, rng.uniform(1.2, max_factor)))
    return found


def arrivals(rng: random.Random, prefix: str, start_s: float, end_s: float, rate: float, mix: Mix,
             burst_list: tuple[Burst, ...] | list[Burst] = ()) -> list[Arrival]:
    """Poisson arrivals at `rate` on [start_s, end_s), faster inside bursts (thinning), drawn from `mix`."""
    peak = rate * max([1.0, *(b.factor for b in burst_list)])
    found: list[Arrival] = []
    if rate <= 0:
        return found
    t = start_s
    while True:
        t += rng.expovariate(peak)
        if t >= end_s:
            return found
        here = rate * max([1.0, *(b.factor for b in burst_list if b.start_s <= t < b.end_s)])
        if rng.random() * peak > here:
            continue
        found.append(request(rng, f"{prefix}-{len(found):05d}", t, mix))


def request(rng: random.Random, request_id: str, at: float, mix: Mix) -> Arrival:
    """One request drawn from `mix`."""
    prompt = min(mix.max_prompt, max(16, round(rng.lognormvariate(math.log(mix.prompt_median), mix.prompt_sigma))))
    output = min(4 * mix.output_median, max(1, round(rng.lognormvariate(math.log(mix.output_median),
                                                                         mix.output_sigma))))
    reason: FinishReason = "stop"
    max_tokens = output * 2
    if rng.random() < mix.abort_share:
        reason, output = "abort", max(1, round(output * rng.uniform(0.1, 0.9)))
    elif rng.random() < 0.3:
        reason, max_tokens = "length", output
    return Arrival(at, request_id, prompt, output, rng.uniform(*mix.cached), reason, max_tokens)
