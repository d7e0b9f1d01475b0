"""The reads GPU usage per request is attributed from (stepline.analysis.usage): an engine's steps, the requests whose
lives touch a window, and its GPUs' energy readings, each bound by epoch microseconds ({lo:Int64}, {hi:Int64}) so that
no session's time zone enters, for the engine bound as {engine:String} ('' for every engine) on the host bound as
{host:String} ('' for every host).

Each read is ordered the way the attribution walks it (per engine and engine index, by time), so that the pass over
them is one walk, never a sort in Python.
"""

from __future__ import annotations

from stepline.queries.query import moment
from stepline.queries.requests import MERGED, SCHEDULED
from stepline.queries.window import EACH_ENGINE, EACH_HOST

_FROM = moment("lo")
_TO = moment("hi")
# The requests alive at some moment of [lo, hi]: finished at or after lo, arrived by hi.
_ALIVE = f"{EACH_ENGINE} AND {EACH_HOST} AND ts >= {_FROM} AND arrival_ts <= {_TO}"

# host, engine, engine_index, end (us), elapsed_ms, prefill tokens, decoding requests, decode tokens (drafts included),
# and the arrival (us) of each request whose first token the step's TTFT samples say came in it: vLLM times a sample
# from the iteration's own timestamp, the step's ts (vllm/v1/metrics/stats.py, IterationStats._time_since: the
# iteration_timestamp less the request's arrival_time; stepline.plugin.core stamps the step with the same
# iteration_timestamp), so the step's ts less a sample is that request's arrival, to Float32's precision.
STEPS = f"""
SELECT host, engine, engine_index, toUnixTimestamp64Micro(ts) AS end_us, elapsed_ms, num_ctx_tokens,
       num_generation_requests, num_generation_tokens,
       arrayMap(s -> toUnixTimestamp64Micro(ts) - toInt64(round(s * 1000000)), ttft_seconds) AS first_token_arrivals_us
FROM steps
WHERE {EACH_ENGINE} AND {EACH_HOST} AND ts >= {_FROM} AND ts <= {_TO}
ORDER BY host, engine, engine_index, ts, step
"""

# How many steps STEPS would answer: counted first, so that a window too long to walk is refused before its rows
# are read (a week of an 8-GPU node is 218M steps).
STEP_COUNT = f"""
SELECT count() AS steps
FROM steps
WHERE {EACH_ENGINE} AND {EACH_HOST} AND ts >= {_FROM} AND ts <= {_TO}
"""

# The earliest moment a request alive in [lo, hi] was scheduled (us; NULL when none is known): where its prefill
# began, so the walk over the steps starts there.
EARLIEST_SCHEDULED = f"""
SELECT minOrNull(toUnixTimestamp64Micro({SCHEDULED})) AS earliest_us
FROM {MERGED}
WHERE {_ALIVE} AND isFinite(queue_seconds)
"""

# host, engine, engine_index, request_id, arrival (us), queue s, ttft s, finish (us), prompt, cached, generated
REQUESTS = f"""
SELECT host, engine, engine_index, request_id, toUnixTimestamp64Micro(arrival_ts) AS arrival_us, queue_seconds,
       ttft_seconds, toUnixTimestamp64Micro(ts) AS finish_us, prompt_tokens, cached_tokens, generation_tokens
FROM {MERGED}
WHERE {_ALIVE}
ORDER BY host, engine, arrival_us, request_id
"""

# host, engine, gpu_uuid, when (us), energy counter (mJ, NULL where the read failed), power (W, NaN where unknown):
# only the GPUs matched to an engine (engine != '').
GPU_ENERGY = f"""
SELECT host, engine, gpu_uuid, toUnixTimestamp64Micro(ts) AS at_us, energy_mj, power_w
FROM gpu_samples
WHERE engine != '' AND {EACH_ENGINE} AND {EACH_HOST} AND ts >= {_FROM} AND ts <= {_TO}
ORDER BY host, engine, gpu_uuid, ts
"""

# host, engine, first and last scrape of its /metrics in [lo, hi] (us): while the collector saw the engine up. Its
# idle time is counted within these (and its steps), not over a window longer than its life; the caller reads a
# little either side of its window, so that an engine up across the window's edge is up at the edge.
LIFE = f"""
SELECT host, engine, toUnixTimestamp64Micro(min(ts)) AS first_us, toUnixTimestamp64Micro(max(ts)) AS last_us
FROM engine_samples
WHERE {EACH_ENGINE} AND {EACH_HOST} AND ts >= {_FROM} AND ts <= {_TO}
GROUP BY host, engine
"""
