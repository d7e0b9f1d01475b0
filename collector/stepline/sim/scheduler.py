"""vLLM-style continuous batching with chunked prefill, a prefix cache and recompute preemption.

Each step: every running decoding request gets one token; then the one partial prefill continues;
then, unless the step preempted someone, waiting requests are admitted first come, first served
while the token budget, max_num_seqs and free KV blocks allow. At most one prefill is left
unfinished at a time. When a request needs a KV block and none is free, the most recently
admitted running request is preempted: its KV is freed and it goes back to the front of the
queue to be recomputed.

With long_prefill_token_threshold set, the step is vLLM v1's (vllm/v1/core/sched/scheduler.py, read from the
0.32.0 CPU build that tests/realvllm installs; measured in benchmarks/RESULTS.md#whatif): every prefill chunk is
capped at the threshold, several prompts may be partway through prefill at once (each continues, oldest first,
and waiting ones are admitted capped beside them), and the cap is dropped for a step when the engine holds only
one request (nobody to starve).

With speculative decoding (EngineConfig.speculative), each decoding request also carries up to k draft
tokens in the step's token budget; when the step ends, drafts are accepted position by position up to the
first rejection and the request gains the accepted tokens plus one.

Three levers, each off by default (then the schedule is exactly the one above):

- prefill_schedule_interval = N: steps are numbered by the scheduler (`Scheduler.step_index`: 0 for the
  first batch, +1 for every non-empty batch `schedule` returns; an empty batch gets no number). Waiting
  requests, preempted ones included, are admitted only on steps whose number is a multiple of N; decodes
  and the partial prefill run every step. A step that would otherwise compute nothing admits anyway: an
  idle engine has no steps to wait out.
- policy = "priority": the waiting queue is kept in (Request.priority, arrival) order, lower first, as
  vLLM's priority scheduler keeps it; a new request goes behind its equals, a preempted one back to its
  place ahead of them. Only the queue order is modelled: vLLM's priority policy also preempts the
  lowest-priority running request (not the newest) when KV runs short, and its v0 scheduler preempted
  lower-priority running requests for higher-priority waiting ones; here victims are still the most
  recently admitted and waiting requests never preempt.
- deadline_tpot_s = D (research, not in vLLM): in a step with decodes, every prefill chunk (the partial's
  and each admission's) is also cut to the largest one whose predicted step (CostModel.step_seconds of the
  decodes plus the chunks so far) ends within max(D, least slack of the step's decodes), where a decode's
  slack is first_token + D * generated - now: how far ahead of a D-per-token schedule its next token is.
  A chunk is never cut below one KV block, so a prefill always progresses.
"""

from __future__ import annotations

import random
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from stepline.sim.config import EngineConfig
from stepline.sim.costmodel import attention_pairs
from stepline.sim.records import FinishReason


class Request:
    """One request's state inside the engine; times are simulated seconds."""

    __slots__ = (
        "arrival",
        "blocks",
        "cached_fraction",
        "computed",
        "drafted",
        "finish_reason",
        "finished",
        "first_scheduled",
        "first_token",
        "generated",
        "last_token",
        "leaked",
        "max_tokens",
        "num_cached_tokens",
        "num_preemptions",
        "output_tokens",
        "priority",
        "prompt_tokens",
        "request_id",
    )

    def __init__(
        self,
        request_id: str,
        arrival: float,
        prompt_tokens: int,
        output_tokens: int,
        cached_fraction: float = 0.0,
        finish_reason: FinishReason = "length",
        max_tokens: int | None = None,
        priority: int = 0,
    ) -> None:
        if prompt_tokens < 1 or output_tokens < 1:
            raise ValueError(f"{request_id}: prompt and output need at least one token")
        self.request_id = request_id
        self.arrival = arrival
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        self.cached_fraction = min(1.0, max(0.0, cached_fraction))
        self.finish_reason: FinishReason = finish_reason
        self.max_tokens = max_tokens if max_tokens is not None else output_tokens
        self.priority = priority  # lower first under EngineConfig.policy="priority"
        self.computed = 0  # tokens whose KV is in the cache
        self.drafted = 0  # draft tokens it carries in the current step (speculative decoding)
        self.generated = 0
        self.blocks = 0
        self.num_cached_tokens = -1  # set on first admission, as vLLM does
        self.num_preemptions = 0
        self.first_scheduled: float | None = None
        self.first_token: float | None = None
        self.last_token = 0.0
        self.finished = False
        self.leaked = False  # finished, yet holding its slot and KV (EngineConfig.leak_aborted_slots)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return self.prompt_tokens + self.generated

    @property
    def is_decoding(self) -> bool:
        """True when only the newest sampled token lacks KV."""
        return self.generated > 0 and self.computed == self.prompt_tokens + self.generated - 1


@dataclass(slots=True)
class Batch:
    """What one step computes; `prefills` holds (request, chunk start, chunk tokens)."""

    start: float
    decodes: list[Request] = field(default_factory=list)
    prefills: list[tuple[Request, int, int]] = field(default_factory=list)
    prefill_tokens: int = 0
    prefill_pairs: float = 0.0
    decode_context_tokens: int = 0
    draft_tokens: int = 0  # speculative draft tokens the decodes carry, verified beside them
    num_preempted: int = 0
    prefix_cache_requests: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0

    @property
    def is_empty(self) -> bool:
        """True when the step would compute nothing."""
        return not self.decodes and not self.prefills


@dataclass(slots=True)
class Outcome:
    """What a completed step produced."""

    ttfts: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    prompt_tokens_cached: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)


class Scheduler:
    """Waiting and running queues, KV blocks, and the per-step scheduling decision."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_blocks = config.num_gpu_blocks
        self.partials: list[Request] = []  # prompts partway through prefill, oldest first
        self._cap = 0  # this step's long_prefill_token_threshold (0: none)
        self.num_preemptions = 0
        self.step_index = 0  # the number the next non-empty batch gets (see prefill_schedule_interval)
        spec = config.speculative
        self._spec_rng = random.Random(f"spec-{config.engine}-{spec.seed}") if spec is not None else None
        self._interval = config.prefill_schedule_interval
        self._by_priority = config.policy == "priority"
        self._deadline = config.deadline_tpot_s

    def add(self, request: Request) -> None:
        """Queue an arrived request."""
        if self._by_priority:
            self._queue_in_order(request, bisect_right)
        else:
            self.waiting.append(request)

    def _queue_in_order(self, request: Request, place: Callable[..., int]) -> None:
        """Insert into the (priority, arrival)-ordered queue; `place` says whether ahead of equals or behind."""
        key = (request.priority, request.arrival)
        self.waiting.insert(place(self.waiting, key, key=_queue_key), request)

    def has_work(self) -> bool:
        """True when anything is running or waiting."""
        return bool(self.running or self.waiting)

    @property
    def kv_cache_usage(self) -> float:
        """Share of KV blocks held by running requests (0-1)."""
        return 1.0 - self.free_blocks / self.config.num_gpu_blocks

    def fits(self, prompt_tokens: int, output_tokens: int) -> bool:
        """True when a request's whole KV fits the cache; vLLM refuses longer ones at the API."""
        return self._blocks_for(prompt_tokens + output_tokens) <= self.config.num_gpu_blocks

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.config.block_size)

    def _cache_hit(self, request: Request) -> int:
        """Cached prompt tokens, in whole blocks; vLLM always recomputes at least the last token."""
        if not self.config.enable_prefix_caching:
            return 0
        block = self.config.block_size
        hit = int(request.prompt_tokens * request.cached_fraction) // block * block
        return min(hit, (request.num_tokens - 1) // block * block)

    def _grow(self, request: Request, tokens: int, batch: Batch) -> bool:
        """Give `request` KV for `tokens` more, preempting from the tail; False if it was preempted."""
        need = self._blocks_for(request.computed + tokens) - request.blocks
        while need > self.free_blocks:
            victim = self.running.pop()
            if victim is not request and victim in batch.decodes:
                # Only the partial prefill, grown after the decodes, can reach an already
                # scheduled decode at the tail; that decode loses its token this step.
                batch.decodes.remove(victim)
                batch.decode_context_tokens -= victim.computed
                batch.draft_tokens -= victim.drafted
                victim.drafted = 0
            self._preempt(victim)
            batch.num_preempted += 1
            if victim is request:
                return False
        self.free_blocks -= need
        request.blocks += need
        return True

    def _preempt(self, request: Request) -> None:
        self.free_blocks += request.blocks
        request.blocks = 0
        request.computed = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        if request in self.partials:
            self.partials.remove(request)
        if self._by_priority:
            self._queue_in_order(request, bisect_left)
        else:
            self.waiting.appendleft(request)

    def _chunk(self, remaining: int, budget: int) -> int:
        threshold = self._cap
        return min(remaining, budget, threshold) if threshold > 0 else min(remaining, budget)

    def _add_prefill(self, batch: Batch, request: Request, tokens: int) -> None:
        start = request.computed
        batch.prefills.append((request, start, tokens))
        batch.prefill_tokens += tokens
        batch.prefill_pairs += attention_pairs(start, tokens)
        request.computed += tokens
        # A request is a partial prefill while prompt (or recompute) tokens remain.
        if request.computed < request.num_tokens:
            if request not in self.partials:
                self.partials.append(request)
        elif request in self.partials:
            self.partials.remove(request)

    def schedule(self, now: float) -> Batch:
        """Decide the next step's batch; KV is allocated and progress recorded immediately."""
        batch = Batch(start=now)
        budget = self.config.max_num_batched_tokens
        running = self.running
        threshold = 0 if self.config.ignore_long_prefill_token_threshold else self.config.long_prefill_token_threshold
        # vLLM drops the cap while the engine holds a single request: there is nobody for it to starve.
        self._cap = threshold if len(running) + len(self.waiting) > 1 else 0
        partials = self.partials
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            i += 1
            if not request.is_decoding or request.leaked or (partials and request in partials):
                continue
            spec = self.config.speculative
            if spec is not None:
                # KV slots for the drafts are reserved up front, as vLLM's lookahead slots are.
                drafts = min(spec.num_tokens, budget - 1, request.output_tokens - request.generated - 1)
                if not self._grow(request, 1 + max(0, drafts), batch):
                    break
                request.drafted = max(0, drafts)
                batch.draft_tokens += request.drafted
                budget -= request.drafted
            elif request.computed % self.config.block_size == 0 and not self._grow(request, 1, batch):
                break
            request.computed += 1
            batch.decodes.append(request)
            batch.decode_context_tokens += request.computed
            budget -= 1

        allowed = self._allowance(batch, now) if self._deadline is not None and batch.decodes else None
        for partial in list(partials):
            if budget <= 0 or partial not in self.partials:  # preempted by an earlier one's growth
                break
            tokens = self._chunk(partial.num_tokens - partial.computed, budget)
            if allowed is not None:
                tokens = self._fit(batch, partial.computed, tokens, allowed)
            if self._grow(partial, tokens, batch):
                self._add_prefill(batch, partial, tokens)
                budget -= tokens

        # As in vLLM, a step that had to preempt admits nobody: the KV it freed is not spare.
        interval = self._interval
        if not batch.num_preempted and (
            interval == 1 or self.step_index % interval == 0 or not (batch.decodes or batch.prefills)
        ):
            self._admit(batch, budget, now, allowed)
        if batch.decodes or batch.prefills:
            self.step_index += 1
        return batch

    def _allowance(self, batch: Batch, now: float) -> float:
        """Seconds this step may take under deadline_tpot_s: the objective, or more while every decode is ahead."""
        deadline = self._deadline
        assert deadline is not None
        decodes = batch.decodes
        due = min((r.first_token + deadline * r.generated for r in decodes if r.first_token is not None), default=now)
        return max(deadline, due - now)

    def _fit(self, batch: Batch, start: int, tokens: int, allowed: float) -> int:
        """The largest chunk up to `tokens`, starting at `start`, whose step ends within `allowed` seconds."""
        floor = self.config.block_size
        if tokens <= floor:
            return tokens
        step_seconds = self.config.cost.step_seconds
        carried = batch.prefill_tokens + batch.draft_tokens
        decodes = len(batch.decodes)

        def fits(chunk: int) -> bool:
            pairs = batch.prefill_pairs + attention_pairs(start, chunk)
            return step_seconds(carried + chunk, pairs, decodes, batch.decode_context_tokens) <= allowed

        if fits(tokens):
            return tokens
        # Step time grows with the chunk: bisect [floor, tokens) for the last chunk that fits.
        low, high = floor, tokens
        if not fits(low):
            return floor
        while high - low > 1:
            middle = (low + high) // 2
            if fits(middle):
                low = middle
            else:
                high = middle
        return low

    def _admit(self, batch: Batch, budget: int, now: float, allowed: float | None) -> None:
        waiting = self.waiting
        while waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = waiting[0]
            hit = self._cache_hit(request)
            remaining = request.num_tokens - hit
            tokens = self._chunk(remaining, budget)
            if allowed is not None:
                tokens = self._fit(batch, hit, tokens, allowed)
            if tokens < remaining and self.partials and not self._cap:
                break  # uncapped, only one prefill may stay unfinished; nobody overtakes the head of the queue
            need = self._blocks_for(hit + tokens)
            if need > self.free_blocks:
                break  # waiting requests never preempt running ones
            waiting.popleft()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = hit
                # vLLM counts re-admissions of preempted requests apart, not in these counters.
                batch.prefix_cache_requests += 1
                batch.prefix_cache_queries += request.num_tokens
                batch.prefix_cache_hits += hit
            if request.first_scheduled is None:
                request.first_scheduled = now
            request.computed = hit
            request.blocks = need
            self.free_blocks -= need
            self.running.append(request)
            self._add_prefill(batch, request, tokens)
            budget -= tokens

    def complete(self, batch: Batch, now: float) -> Outcome:
        """Sample tokens for a finished step at time `now` and retire finished requests."""
        outcome = Outcome()
        spec = self.config.speculative
        for request in batch.decodes:
            outcome.itls.append(now - request.last_token)
            accepted = 0
            if spec is not None and request.drafted:
                accepted = self._accept(request.drafted, spec.acceptance_at(batch.start), outcome)
                request.drafted = 0
                request.computed += accepted  # the accepted drafts' KV was written by this step
            self._sample(request, now, outcome, 1 + accepted)
        for request, _, _ in batch.prefills:
            if request.computed < request.num_tokens:
                continue  # a chunk in the middle of a prompt samples nothing
            if request.first_token is None:
                request.first_token = now
                outcome.ttfts.append(now - request.arrival)
                outcome.prompt_tokens += request.prompt_tokens
                outcome.prompt_tokens_cached += max(0, request.num_cached_tokens)
            else:
                outcome.itls.append(now - request.last_token)  # resumed after a preemption
            self._sample(request, now, outcome)
        if outcome.finished:
            self.running = [r for r in self.running if not r.finished or r.leaked]
        return outcome

    def release_leaked(self) -> int:
        """Give back every leaked slot and its KV (what restarting a wedged lane does); returns how many."""
        leaked = [r for r in self.running if r.leaked]
        for request in leaked:
            self.free_blocks += request.blocks
            request.blocks = 0
            request.leaked = False
        self.running = [r for r in self.running if not r.finished]
        return len(leaked)

    def _accept(self, drafts: int, acceptance: float, outcome: Outcome) -> int:
        """Draft tokens the target model accepts: position by position, up to the first rejection."""
        assert self._spec_rng is not None
        accepted = 0
        while accepted < drafts and self._spec_rng.random() < acceptance:
            accepted += 1
        per_pos = outcome.spec_accepted_per_pos
        per_pos.extend([0] * (drafts - len(per_pos)))
        for position in range(accepted):
            per_pos[position] += 1
        outcome.spec_accepted_tokens += accepted
        return accepted

    def _sample(self, request: Request, now: float, outcome: Outcome, tokens: int = 1) -> None:
        request.generated += tokens
        request.last_token = now
        outcome.output_tokens += tokens
        if request.generated >= request.output_tokens:
            request.finished = True
            outcome.finished.append(request)
            if self.config.leak_aborted_slots and request.finish_reason == "abort":
                request.leaked = True  # reported finished, but its slot and blocks are never given back
                return
            self.free_blocks += request.blocks
            request.blocks = 0


def _queue_key(request: Request) -> tuple[int, float]:
    return request.priority, request.arrival
