"""A batch-queued engine core's step durations: the cadence of its step ends, vLLM's wait where none bounds it."""

from __future__ import annotations

from typing import Any

from stepline.sources.step_time import CADENCE, WAIT, StepTimes

S = 1_000_000  # microseconds


class _Rounded(StepTimes):
    """Durations to the microsecond the timestamps carry, to compare exactly."""

    def duration(self, *args: Any, **kwargs: Any) -> tuple[float, str]:
        ms, how = super().duration(*args, **kwargs)
        return round(ms, 3), how


def test_a_busy_cores_step_lasts_from_the_previous_step_end_not_the_wait_vllm_timed() -> None:
    times = _Rounded()
    assert times.duration("e", 0, 10, 100 * S, 2.0, running=4) == (2.0, WAIT)  # nothing before it: vLLM's reading
    # 250 ms after the previous step ended; vLLM timed 241 ms of waiting (the rest was spent scheduling the next).
    assert times.duration("e", 0, 11, 100 * S + 250_000, 241.0, running=4) == (250.0, CADENCE)
    # A step the GPU finished before the core looked: vLLM read 0.1 ms; it took the 12 ms since the last one.
    assert times.duration("e", 0, 12, 100 * S + 262_000, 0.1, running=4) == (12.0, CADENCE)


def test_the_wait_is_a_floor_under_a_cadence_the_front_end_squeezed() -> None:
    times = _Rounded()
    times.duration("e", 0, 1, 10 * S, 5.0, running=2)
    # The API server processed two steps' outputs back to back: 1 ms apart, though the core waited 9 ms for it.
    assert times.duration("e", 0, 2, 10 * S + 1_000, 9.0, running=2) == (9.0, CADENCE)


def test_after_an_idle_core_the_step_is_vllms_reading() -> None:
    times = _Rounded()
    times.duration("e", 0, 1, 10 * S, 5.0, running=0)  # left nothing running: the core sat idle after it
    assert times.duration("e", 0, 2, 70 * S, 14.0, running=1) == (14.0, WAIT)  # not the minute in between
    assert times.duration("e", 0, 3, 70 * S + 15_000, 3.0, running=1) == (15.0, CADENCE)


def test_steps_relayed_by_other_api_servers_share_the_time_between() -> None:
    times = _Rounded()
    times.duration("e", 0, 100, 10 * S, 1.0, running=8)
    # Steps 101 and 102 went to another API server's plugin: 103 ends 60 ms later, 20 ms a step.
    assert times.duration("e", 0, 103, 10 * S + 60_000, 1.0, running=8) == (20.0, CADENCE)
    # Another API server's 101 arrives late: out of order, vLLM's reading, and the core's last step stays 103.
    assert times.duration("e", 0, 101, 10 * S + 20_000, 4.0, running=8) == (4.0, WAIT)
    assert times.duration("e", 0, 104, 10 * S + 80_000, 1.0, running=8) == (20.0, CADENCE)


def test_engine_cores_are_apart_and_remembered_within_a_bound() -> None:
    times = _Rounded(limit=2)
    times.duration("e", 0, 1, 10 * S, 1.0, running=1)
    times.duration("e", 1, 1, 10 * S, 1.0, running=1)  # data-parallel rank 1: a core of its own
    assert times.duration("e", 1, 2, 10 * S + 30_000, 1.0, running=1) == (30.0, CADENCE)
    times.duration("f", 0, 1, 10 * S, 1.0, running=1)  # a third core: the least recent (e, 0) is forgotten
    assert times.duration("e", 0, 2, 10 * S + 50_000, 1.0, running=1) == (1.0, WAIT)
