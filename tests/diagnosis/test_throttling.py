"""GPU throttling: clocks held below the GPU's own maximum for a throttle reason, and what it cost the steps."""

from __future__ import annotations

from typing import Any

import pytest

from stepline.diagnosis.throttling import MIN_MATCHED_STEPS, gpu_throttling, matched_slowdown, max_sm_mhz
from tests.diagnosis.conftest import Timelines
from tests.diagnosis.test_detectors import gpu, step

THROTTLED_MHZ = 1200.0  # of an H100's 1,980 MHz boost clock: 61%


def timeline(throttled_from_s: float, *, util: float = 60.0, mhz: float = THROTTLED_MHZ,
             flags: tuple[str, ...] = ("hw_slowdown",)) -> list[Any]:
    """Ten minutes of 10 ms decode-only steps of two requests, 16 ms from `throttled_from_s`, when the GPU (sampled
    every second) runs at `mhz` with `flags`; 1,900 MHz and no flag before."""
    steps = [step(i * 0.5, 16.0 if i * 0.5 >= throttled_from_s else 10.0, n=i) for i in range(1200)]
    gpus = [gpu(float(t), util, mhz, flags) if t >= throttled_from_s else gpu(float(t), util) for t in range(600)]
    return steps + gpus


def test_a_throttled_gpu_is_found_with_its_cost_in_like_for_like_steps(timelines: Timelines) -> None:
    window = timelines.add("throttled", timeline(300.0))
    [found] = gpu_throttling(timelines.store, window)
    assert (found.kind, found.severity) == ("gpu_throttling", "warning")
    e = found.evidence
    assert (e["sm_mhz_throttled"], e["sm_mhz_max"], e["sm_mhz_unthrottled"]) == (1200, 1980, 1900)
    assert e["sm_mhz_max_from"] == "H100 boost clock"
    assert e["clock_share_of_max"] == "61% (throttling from 90% of max down)"
    assert e["throttled_share_busy_samples"] == "50% of 600 (from 10%)"
    assert e["reasons"] == ["hw_slowdown"]
    assert e["step_slowdown"] == "1.60x (decode-only steps of the same batch shape, 600 throttled steps compared)"
    # 600 throttled steps of 16 ms held two requests each (19.2 request-seconds); 1 - 1/1.6 of that was lost.
    assert e["request_s_lost"] == pytest.approx(7.2, abs=0.05) and found.score == pytest.approx(7.2, abs=0.05)
    assert found.title == "GPU throttled (hw_slowdown): SM 1200 of 1980 MHz, steps 1.6x slower"
    assert timelines.store.query(found.sql).result_rows[0][4] == 300  # the SQL counts the throttled samples


def test_throttled_all_window_long_the_clock_ratio_is_the_slowdown(timelines: Timelines) -> None:
    window = timelines.add("capped", timeline(-1.0))
    [found] = gpu_throttling(timelines.store, window)
    assert found.evidence["step_slowdown"] == "1.65x (from the clock ratio: no unthrottled steps to compare with)"
    assert found.evidence["sm_mhz_unthrottled"] is None


@pytest.mark.parametrize(("name", "rows"), [
    ("near_max", timeline(300.0, mhz=1900.0, flags=("sw_power_cap",))),  # flagged, but at 96% of the maximum
    ("no_reason", timeline(300.0, flags=())),  # slow clocks the driver gives no throttle reason for
    ("idle", timeline(300.0, util=2.0)),  # throttled while idle: nothing was slowed
    ("brief", timeline(570.0)),  # 5% of the busy samples
])
def test_what_is_not_throttling(timelines: Timelines, name: str, rows: list[Any]) -> None:
    assert gpu_throttling(timelines.store, timelines.add(name, rows)) == []


def test_the_maximum_clock_is_the_models_boost_or_the_highest_seen() -> None:
    assert max_sm_mhz("NVIDIA H100 80GB HBM3", 1700.0) == (1980.0, "NVIDIA H100 80GB HBM3 boost clock")
    assert max_sm_mhz("NVIDIA H100 PCIe", 1700.0)[0] == 1755.0  # the more specific name is listed first
    assert max_sm_mhz("Tesla T4", 1590.0) == (1590.0, "highest SM clock reported in the window")
    assert max_sm_mhz("NVIDIA A100-SXM4-80GB", 1500.0) == (1500.0, "highest SM clock reported in the window")


def test_matched_slowdown_compares_only_shapes_both_sides_ran() -> None:
    # (throttled, shape, decode-only steps, step p50 ms, request-seconds held)
    rows = [(False, 4, 10, 10.0, 1.0), (True, 4, 30, 20.0, 6.0),  # 2x, over 30 throttled steps
            (False, 8, 10, 10.0, 1.0), (True, 8, 10, 40.0, 2.0),  # 4x, over 10
            (True, 12, 50, 99.0, 5.0),  # no unthrottled steps of this shape: not compared, but held up requests
            (False, 16, MIN_MATCHED_STEPS - 1, 10.0, 1.0), (True, 16, 50, 99.0, 1.0)]  # too few to compare
    slowdown, compared, held = matched_slowdown(rows)
    assert slowdown == pytest.approx((2.0**30 * 4.0**10) ** (1 / 40))  # geometric mean, weighted by steps
    assert (compared, held) == (40, 14.0)
    assert matched_slowdown([(True, 4, 30, 20.0, 6.0)]) == (None, 0, 6.0)
