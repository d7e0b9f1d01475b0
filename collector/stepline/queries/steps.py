"""The steps of an engine, or of several, in a time window: the condition a read of `steps` starts from.

`steps` is sorted by (host, engine, engine_index, ts, step): a condition on the engine and the time prunes a day's
table to the granules of the window.

Decode tokens: `num_generation_tokens` is what vLLM scheduled for the requests past their prefill, draft tokens
included; `GENERATED` (a step's) and `generated()` (a sum's, as the steps' projections hold it) are what those
requests actually got. Every read of a decode rate or of decode tokens generated uses them; reads of what a step
spends of its token budget keep the scheduled tokens (drafts take budget whether accepted or not).
"""

from __future__ import annotations

from stepline.queries.window import EACH_ENGINE, ENGINES, IN_WINDOW, between, one_engine


def of_engine(engine: str = "engine", start: str = "start", end: str = "end") -> str:
    """The steps of the engine bound as `engine` in [start, end], each a parameter of that name."""
    return f"{one_engine(engine)} AND {between(start, end)}"


OF_ENGINE = of_engine()
OF_ENGINES = f"{ENGINES} AND {IN_WINDOW}"
OF_EACH_ENGINE = f"{EACH_ENGINE} AND {IN_WINDOW}"

# Tokens generated, not scheduled (read in the vllm==0.33.0 wheel). With iteration details the column is
# SchedulerIterationDetails.num_generation_tokens: compute_iteration_details sums num_scheduled_tokens of the requests
# past their prefill (vllm/v1/utils.py:835-867, built in vllm/v1/engine/core.py:617-628), and a decoding request is
# scheduled its one token plus its drafts (vllm/v1/core/sched/scheduler.py:839-843, num_tokens_with_spec,
# vllm/v1/request.py:299-300). The request samples 1 + the drafts accepted: the scheduler rolls the rest back and
# reports both counts in the same step's SpecDecodingStats (scheduler.py:2345-2372, num_accepted = len(generated) - 1,
# num_rejected = num_draft_tokens - num_accepted; 3305-3322; vllm/v1/spec_decode/metrics.py:41-44), which
# `_attach_iteration_details` puts beside that step's details (core.py:677-696). So generated = scheduled -
# (draft tokens - accepted tokens). Still counted: drafts a grammar invalidated (scheduled, but left out of
# num_draft_tokens: scheduler.py:2909-2914, 3317-3318), tokens cut at a stop (scheduler.py:2757-2763), and the
# recompute of a preempted request that had output, which is past its prefill to compute_iteration_details
# (vllm/v1/core/sched/output.py:189-191, scheduler.py:1966-1968).
# Without iteration details (elapsed_ms is NaN) the column is IterationStats.num_generation_tokens, the tokens output
# (vllm/v1/metrics/stats.py:517-520): nothing to take off.
GENERATED = ("(num_generation_tokens - if(isNaN(elapsed_ms), 0, "
             "toInt64(spec_num_draft_tokens) - spec_num_accepted_tokens))")


def generated(scheduled: str = "sum(num_generation_tokens)") -> str:
    """`GENERATED` summed over steps, from the sums the steps' projections keep (schema.STEP_AGGREGATES), so a read of
    it still reads a projection; `scheduled` is the sum of num_generation_tokens the read counts. A bucket holding a
    step without iteration details (an engine run without them, or a plugin that has not seen any yet) takes
    nothing off."""
    return (f"({scheduled} - if(isNaN(sum(elapsed_ms)), 0, "
            "toInt64(sum(spec_num_draft_tokens)) - sum(spec_num_accepted_tokens)))")
