"""A step's duration when vLLM's own reading is not one: engine cores that step through their batch queue.

vLLM 0.33 steps an engine core through a batch queue when `max_concurrent_batches` > 1: async scheduling (on by
default on GPUs, vllm/config/vllm.py:1668-1719) or pipeline parallelism (vllm/v1/engine/core.py:208-214). The core
schedules and launches step N+1, then blocks on step N (core.py:727-783); `capture_iteration_details` times only that
block (core.py:779-783, 630-632). So SchedulerIterationDetails.elapsed_ms is how long the core waited for a step
that had been running since before, and reads near 0 when the GPU finished first (vLLM PR #35072, closed; #48292,
open). While the core has work, the GPU runs the launched steps back to back, so the time from one step's end to the
next is that step's duration, host overhead and all: what a decoding request waits per token.

Per engine core (engine name, engine index; the iteration index is the core's, whichever API server relays it):
- the time since the previous step ended, divided among the steps in between (another API server's, with
  `--api-server-count` > 1), and never less than vLLM's wait: `cadence`;
- vLLM's reading where nothing bounds the step from before: the core's first step this collector sees, a step out
  of order, or a step after one that left nothing running (the core sat idle in between; its wait for the first
  step after idle is that step less the scheduling of the next): `wait`.

Public: StepTimes, CADENCE, WAIT, ELAPSED.
"""

from __future__ import annotations

from collections import OrderedDict

ELAPSED = "elapsed"  # vLLM's reading of a synchronously stepped core: the step's wall time
CADENCE = "cadence"
WAIT = "wait"
MAX_CORES = 4_096  # engine cores remembered at once (a host runs a handful); past it the least recent is forgotten


class StepTimes:
    """The last step seen of each batch-queued engine core, and from it the next step's duration."""

    __slots__ = ("_last", "_limit")

    def __init__(self, limit: int = MAX_CORES) -> None:
        # (engine, engine index) -> (iteration, end in microseconds, whether the step left requests running)
        self._last: OrderedDict[tuple[str, int], tuple[int, int, bool]] = OrderedDict()
        self._limit = limit

    def duration(self, engine: str, engine_index: int, iteration: int, ts_us: int, vllm_ms: float,
                 running: int) -> tuple[float, str]:
        """(duration ms, CADENCE or WAIT) of the step of `iteration` that ended at `ts_us`."""
        key = (engine, engine_index)
        last = self._last.get(key)
        if last is not None and iteration <= last[0]:
            return vllm_ms, WAIT  # out of order (another API server's datagram came late) or a restarted core
        self._last[key] = (iteration, ts_us, running > 0)
        self._last.move_to_end(key)
        if len(self._last) > self._limit:
            self._last.popitem(last=False)
        if last is None or not last[2] or ts_us < last[1]:
            return vllm_ms, WAIT
        per_step_ms = (ts_us - last[1]) / 1000 / (iteration - last[0])
        return (per_step_ms if per_step_ms > vllm_ms else vllm_ms), CADENCE
