"""What one simulated step and one finished request leave behind, named after vLLM's stats.

`StepRecord` merges vLLM's `SchedulerStats`, `SchedulerIterationDetails` and `IterationStats`
for one engine step; `FinishedRequest` mirrors `FinishedRequestStats`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """One request's life, as vLLM's `FinishedRequestStats` reports it (seconds, tokens)."""

    request_id: str
    finish_reason: FinishReason
    arrival_ts: float
    finished_ts: float
    e2e_latency: float
    queued_time: float
    prefill_time: float
    decode_time: float
    inference_time: float
    time_to_first_token: float
    mean_time_per_output_token: float
    num_prompt_tokens: int
    num_cached_tokens: int
    num_generation_tokens: int
    max_tokens_param: int
    num_preemptions: int


@dataclass(frozen=True, slots=True)
class StepWork:
    """One request's part of one step, as the scheduler gave it: the simulator's ground truth of who a step
    carried, which no vLLM report holds (stepline infers it from the requests' phases)."""

    request_id: str
    prefill_start: int  # context position its prefill chunk starts at
    prefill_tokens: int  # its prefill (or recompute) chunk; 0 when it only decoded
    decode_context: int  # tokens in context of its decode, the new one included; 0 when it did not decode
    draft_tokens: int = 0  # speculative draft tokens it carried for verification


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One engine step: what was scheduled, how long it took, and what came out of it."""

    # Wall-clock end of the step, when its outputs exist (IterationStats.iteration_timestamp).
    ts: float
    iteration_index: int
    elapsed_ms: float
    # SchedulerIterationDetails: prefill ("context") and decode ("generation") work scheduled.
    num_ctx_requests: int
    num_ctx_tokens: int
    num_generation_requests: int
    num_generation_tokens: int
    # SchedulerStats, taken after the step's outputs were processed.
    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float
    prefix_cache_requests: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    # IterationStats: prompts count once, on the step that completes their prefill.
    num_preempted_reqs: int
    num_prompt_tokens: int
    num_prompt_tokens_computed: int
    num_prompt_tokens_cached: int
    # Tokens sampled this step (IterationStats.num_generation_tokens), first tokens included.
    num_output_tokens: int
    time_to_first_tokens_iter: tuple[float, ...]
    inter_token_latencies_iter: tuple[float, ...]
    finished_requests: tuple[FinishedRequest, ...]
    # SpecDecodingStats: drafts proposed (one per decoding request that drafted), their tokens, and how many of
    # those the target model accepted (also by draft position); all zero without speculative decoding.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    # Under async scheduling, what vLLM's SchedulerIterationDetails.elapsed_ms reads: the engine core's wait for
    # the step, launched before the previous one's outputs were processed (elapsed_ms stays the step's true
    # duration, which the simulator knows and a real engine does not report). None: the engine steps synchronously.
    wait_ms: float | None = None
    # Who the step carried and what each cost it (StepWork): the truth a benchmark checks attribution against.
    # Never reported through the plugin, OTLP or /metrics.
    work: tuple[StepWork, ...] = ()
