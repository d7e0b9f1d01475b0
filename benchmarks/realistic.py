"""Realistic vLLM 0.33-shaped steps for the plugin and receiver benchmarks, built from the stand-ins."""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable

from stepline.testing.vllm_standins import (
    FinishedRequestStats,
    FinishReason,
    IterationStats,
    PrefixCacheStats,
    PromptTokenStats,
    SchedulerIterationDetails,
    SchedulerStats,
)

RUNNING = 32
CTX_TOKENS = 8192

Step = tuple[SchedulerStats, IterationStats]


def build_steps(count: int, finished_per_step: Callable[[int], int], seed: int = 1, *,
                running: int = RUNNING, base_ts: float | None = None) -> list[Step]:
    """Distinct, realistic steps (`running` requests: one 8192-token prefill chunk and the rest decoding, one TTFT
    and `running - 1` ITL samples), built once so that what is timed only records them."""
    rng = random.Random(seed)
    # Steps are 30 ms apart and end now by default: recent enough for the collector's clock rule.
    base_ts = time.time() - 0.03 * count if base_ts is None else base_ts
    steps: list[Step] = []
    for i in range(count):
        hits = rng.choice((0, 2048, 4096, 6144))
        sched = SchedulerStats(
            num_running_reqs=running,
            num_waiting_reqs=rng.randint(0, 12),
            num_skipped_waiting_reqs=rng.randint(0, 1),
            step_counter=i,
            kv_cache_usage=rng.uniform(0.3, 0.95),
            iteration_details=SchedulerIterationDetails(
                iteration_index=i, num_ctx_requests=1, num_ctx_tokens=CTX_TOKENS,
                num_generation_requests=running - 1, num_generation_tokens=running - 1,
                elapsed_ms=rng.uniform(25.0, 60.0),
            ),
            prefix_cache_stats=PrefixCacheStats(requests=1, queries=CTX_TOKENS, hits=hits),
        )
        finished = [_finished(rng) for _ in range(finished_per_step(i))]
        it = IterationStats(
            iteration_timestamp=base_ts + i * 0.03,
            num_generation_tokens=running,  # the decodes and the prefill's first token
            prompt_token_stats=PromptTokenStats(computed=CTX_TOKENS - hits, local_cache_hit=hits,
                                                cached_tokens=hits, total=CTX_TOKENS),
            finished_requests=finished,
            max_num_generation_tokens_iter=[f.num_generation_tokens for f in finished],
            n_params_iter=[1] * len(finished),
            time_to_first_tokens_iter=[rng.uniform(0.05, 0.8)],
            inter_token_latencies_iter=[rng.uniform(0.008, 0.06) for _ in range(running - 1)],
        )
        steps.append((sched, it))
    return steps


def _finished(rng: random.Random) -> FinishedRequestStats:
    prompt = rng.randint(200, 12_000)
    generated = rng.randint(16, 2048)
    queued = rng.uniform(0.0, 2.0)
    prefill = rng.uniform(0.05, 1.5)
    decode = generated * rng.uniform(0.01, 0.04)
    return FinishedRequestStats(
        finish_reason=FinishReason.STOP if rng.random() < 0.8 else FinishReason.LENGTH,
        request_id=f"cmpl-{uuid.UUID(int=rng.getrandbits(128), version=4)}-0",
        e2e_latency=queued + prefill + decode,
        num_prompt_tokens=prompt,
        num_generation_tokens=generated,
        max_tokens_param=rng.choice((None, 2048, 4096)),
        queued_time=queued,
        prefill_time=prefill,
        inference_time=prefill + decode,
        decode_time=decode,
        mean_time_per_output_token=decode / max(1, generated - 1),
        num_cached_tokens=rng.choice((0, 1024, 2048)),
    )
