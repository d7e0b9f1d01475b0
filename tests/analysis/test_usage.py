"""GPU time and energy per request over a window, read from a store: shares, conservation, idle, unattributed."""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime
from typing import Any

import pytest

from stepline.analysis import usage as usage_module
from stepline.analysis.placement import PRIOR_WEIGHTS, pairs
from stepline.analysis.usage import EngineUsage, Usage, apportion, usage
from stepline.diagnosis.findings import Window
from stepline.model.rows import EngineSample, GpuSample, Request, Step, micros
from stepline.queries import usage as q
from stepline.store.store import Store

T0 = float(int(time.time()) - 600)  # whole seconds: every moment below is whole microseconds
ENGINE = "e"


def step(end: float, elapsed_ms: float, prefill: int = 0, decoding: int = 0, *, engine: str = ENGINE,
         ttft: tuple[float, ...] = ()) -> Step:
    return Step(micros(T0 + end), "h", engine, 0, "m", round(end * 1000), elapsed_ms, 1 if prefill else 0, prefill,
                decoding, decoding, decoding, 0, 0, 0.5, 0, 0, 0, 0, 0, 0, list(ttft), [], False)


def request(rid: str, arrival: float, scheduled: float, first_token: float, finish: float, prompt: int,
            generated: int, cached: int = 0) -> Request:
    return Request(micros(T0 + finish), "h", ENGINE, 0, "m", rid, "plugin", "stop", micros(T0 + arrival),
                   scheduled - arrival, first_token - scheduled, finish - first_token, finish - scheduled,
                   finish - arrival, first_token - arrival, 0.1, prompt, cached, generated, generated, 0)


def gpu(at: float, uuid: str, energy_mj: int | None, power_w: float) -> GpuSample:
    return GpuSample(micros(T0 + at), "h", ENGINE, int(uuid[-1]), uuid, "NVIDIA H200", 1980.0, 3201.0, power_w,
                     energy_mj, 50.0, 56.0, 100.0, 30.0, 1, 2, 0.0, 0.0, 0, 0.0, 0.0, 0, [], 0.0, 0.0, 0.0, {})


def window(start: float, end: float) -> Window:
    return Window(datetime.fromtimestamp(T0 + start, UTC), datetime.fromtimestamp(T0 + end, UTC), ENGINE)


def engine_of(u: Usage) -> EngineUsage:
    (e,) = u.engines
    return e


def shares(u: Usage) -> dict[str, int]:
    return {r.request_id: r.step_us for r in u.requests}


def _decode(context: int) -> float:
    w = PRIOR_WEIGHTS
    return w.decode_request + w.context_token * context


def _prefill(start: int, tokens: int) -> float:
    w = PRIOR_WEIGHTS
    return w.prefill_token * tokens + w.attention_pair * pairs(start, tokens)


def test_a_requests_share_is_its_part_of_each_steps_cost(store: Store) -> None:
    # a: 100-token prompt prefilled in step 1, decodes in steps 2 and 3; b: scheduled as step 1 ends, its 50
    # uncached tokens (of 80) prefilled in step 2 beside a's decode, decodes in step 3. Too few steps to fit: the
    # prior's weights split them.
    store.insert("steps", [step(1.1, 100, prefill=100), step(1.2, 100, prefill=50, decoding=1),
                           step(1.3, 100, decoding=2)], Step._fields)
    store.insert("requests", [request("a", 1.0, 1.0, 1.1, 1.3, 100, 3),
                              request("b", 1.05, 1.1, 1.2, 1.3, 80, 2, cached=30)], Request._fields)
    u = usage(store, window(0, 2))
    a_step2 = _decode(101) / (_decode(101) + _prefill(30, 50))
    a_step3 = _decode(102) / (_decode(102) + _decode(81))
    expected_a = 100_000 * (1 + a_step2 + a_step3)
    got = shares(u)
    assert abs(got["a"] - expected_a) <= 1
    assert got["a"] + got["b"] == 300_000
    e = engine_of(u)
    assert (e.busy_us, e.attributed_us, e.unattributed_us) == (300_000, 300_000, 0)
    assert not e.weights.fitted
    # No GPU was sampled: one GPU per engine index, and no energy.
    assert e.gpus == 0 and e.energy_method == "none" and e.energy_mj is None
    a = next(r for r in u.requests if r.request_id == "a")
    assert a.gpu_seconds == pytest.approx(got["a"] / 1e6) and a.energy_mj is None


@pytest.mark.parametrize("samples", [True, False])
def test_the_first_token_is_the_step_whose_ttft_sample_is_the_requests(store: Store, samples: bool) -> None:
    # As in the test above, but b's report puts its first token 4 ms before the step that computed it ended (vLLM's
    # TTFT is e2e on the front-end's clock less decode on the engine core's). Step 2's TTFT sample, timed from the
    # step's own timestamp, says the first token came there: its 50 prefill tokens are b's.
    store.insert("steps", [step(1.1, 100, prefill=100, ttft=(0.1,) if samples else ()),
                           step(1.2, 100, prefill=50, decoding=1, ttft=(0.15,) if samples else ()),
                           step(1.3, 100, decoding=2)], Step._fields)
    store.insert("requests", [request("a", 1.0, 1.0, 1.1, 1.3, 100, 3),
                              request("b", 1.05, 1.1, 1.196, 1.3, 80, 2, cached=30)], Request._fields)
    e = engine_of(usage(store, window(0, 2)))
    if samples:
        assert (e.busy_us, e.attributed_us, e.unattributed_us) == (300_000, 300_000, 0)
    else:  # what the report's TTFT alone gives: step 2 read as b's decode, its prefill nobody's
        assert e.unattributed_us > 0


def _timeline(store: Store) -> None:
    """Back-to-back 50 ms steps from 1 s to 5 s, idle from 5 s to 6 s, then 6-8 s again; three requests whose
    lives cross the windows below, and one step's decoder nobody reported (still running)."""
    steps = []
    t = 1.0
    while t < 4.999:
        t += 0.05
        steps.append(step(t, 50, prefill=400 if abs(t - 1.05) < 1e-6 else 0, decoding=1 if t > 1.051 else 0))
    t = 6.0
    while t < 7.999:
        t += 0.05
        steps.append(step(t, 50, prefill=200 if abs(t - 6.05) < 1e-6 else 0, decoding=3 if t > 6.051 else 1))
    store.insert("steps", steps, Step._fields)
    # long: decodes through the idle gap's edges (its decode steps end from 1.10 to 8.00); short: 6.0-6.5;
    # the second decoder from 6.10 on in the second stretch has no report.
    store.insert("requests", [request("long", 0.9, 1.0, 1.05, 8.0, 400, 139),
                              request("short", 5.9, 6.0, 6.05, 8.0, 200, 40)], Request._fields)


def _busy(start: float, end: float) -> int:
    """Hand-computed: the 50 ms steps' spans clipped to [start, end], us."""
    spans = [(1.0 + 0.05 * k, 1.05 + 0.05 * k) for k in range(80)] + [(6.0 + 0.05 * k, 6.05 + 0.05 * k)
                                                                      for k in range(40)]
    return sum(max(0, round((min(end, b) - max(start, a)) * 1e6)) for a, b in spans)


@pytest.mark.parametrize(("start", "end"), [(0, 10), (2.0, 3.0), (3.025, 6.525), (6.5, 7.0), (4.5, 6.2)])
def test_shares_sum_to_the_busy_time_and_busy_plus_idle_to_the_window(store: Store, start: float,
                                                                       end: float) -> None:
    _timeline(store)
    e = engine_of(u := usage(store, window(start, end)))
    assert e.busy_us == _busy(start, end)
    assert e.attributed_us + e.unattributed_us == e.busy_us
    assert sum(shares(u).values()) == e.attributed_us
    assert e.busy_us + e.idle_us == e.window_us == round((end - start) * 1e6)


def test_windows_add_up_and_a_request_cut_in_half_keeps_only_its_part_inside(store: Store) -> None:
    _timeline(store)
    whole, first, second = (usage(store, window(a, b)) for a, b in ((0, 10), (0, 3.025), (3.025, 10)))
    for field in ("busy_us", "idle_us", "window_us"):
        assert getattr(engine_of(first), field) + getattr(engine_of(second), field) == getattr(engine_of(whole),
                                                                                               field)
    # `long` decodes alone before the idle gap: all of each step's time there is its, half a step at the cut.
    assert shares(first)["long"] == _busy(0, 3.025)
    assert abs(shares(first)["long"] + shares(second)["long"] - shares(whole)["long"]) <= 1
    assert "short" not in shares(first)


def test_idle_time_is_its_own_line(store: Store) -> None:
    _timeline(store)
    e = engine_of(usage(store, window(4.5, 6.5)))
    # Busy 4.5-5.0 and 6.0-6.5; idle 5.0-6.0: nothing spread onto the requests.
    assert (e.busy_us, e.idle_us) == (1_000_000, 1_000_000)
    assert e.attributed_us + e.unattributed_us == 1_000_000


def test_work_no_report_can_take_is_unattributed(store: Store) -> None:
    _timeline(store)
    u = usage(store, window(7.0, 8.0))
    e = engine_of(u)
    # Each step decodes `long`, `short` and one request nobody reported: a third of the work, by the context each
    # holds (long: 400 + 1 + its steps so far; short: 200 + ...; the unknown: their mean).
    assert e.unattributed_us > 0
    assert e.unattributed_us + sum(shares(u).values()) == e.busy_us == 1_000_000
    assert 0.25 < e.unattributed_us / e.busy_us < 0.40
    # Before the unknown decoder came, nothing was unattributed.
    assert engine_of(usage(store, window(2.0, 3.0))).unattributed_us == 0


def _gpus(store: Store, *, counter: bool) -> None:
    """Two GPUs at 400 W and 200 W, sampled every 0.5 s from 0 to 10 s: by their counters, or power alone."""
    rows = []
    for k in range(21):
        at = 0.5 * k
        rows.append(gpu(at, "GPU-1", 10**9 + round(400_000 * at) if counter else None, 400.0))
        rows.append(gpu(at, "GPU-2", 5 * 10**8 + round(200_000 * at) if counter else None, 200.0))
    store.insert("gpu_samples", rows, GpuSample._fields)


@pytest.mark.parametrize("counter", [True, False])
def test_energy_from_the_counter_or_from_power_over_time(store: Store, counter: bool) -> None:
    _timeline(store)
    _gpus(store, counter=counter)
    u = usage(store, window(4.5, 6.5))
    e = engine_of(u)
    assert e.energy_method == ("counter" if counter else "power")
    assert e.gpus == 2
    # 600 W over the 2 s window; 600 W over the 1 s busy of it.
    assert e.energy_mj == 1_200_000
    assert e.busy_energy_mj == 600_000 and e.idle_energy_mj == 600_000
    assert e.attributed_energy_mj is not None and e.unattributed_energy_mj is not None
    assert e.attributed_energy_mj + e.unattributed_energy_mj == e.busy_energy_mj
    assert sum(r.energy_mj or 0 for r in u.requests) == e.attributed_energy_mj
    # Power is constant: a request's energy is its time at 600 W, and its GPU-seconds count both GPUs.
    for r in u.requests:
        assert r.energy_mj == pytest.approx(r.step_us * 0.6, abs=2)
        assert r.gpu_seconds == pytest.approx(2 * r.step_us / 1e6)


def test_a_failed_counter_read_is_passed_over(store: Store) -> None:
    _timeline(store)
    _gpus(store, counter=True)
    store.insert("gpu_samples", [gpu(5.25, "GPU-1", None, math.nan)], GpuSample._fields)
    e = engine_of(usage(store, window(4.5, 6.5)))
    assert (e.energy_method, e.energy_mj) == ("counter", 1_200_000)


def test_apportion_splits_an_integer_exactly() -> None:
    assert apportion(10, [1.0, 1.0, 1.0]) in ([4, 3, 3], [3, 4, 3], [3, 3, 4])
    assert apportion(7, [0.0, 0.0]) == [0, 7]
    assert sum(apportion(1_000_003, [0.1, 0.2, 0.3, 0.4])) == 1_000_003


def test_an_idle_engine_with_sampled_gpus_has_all_its_window_idle(store: Store) -> None:
    _gpus(store, counter=True)
    e = engine_of(usage(store, window(1.0, 3.0)))
    assert (e.busy_us, e.idle_us, e.window_us) == (0, 2_000_000, 2_000_000)
    assert (e.busy_energy_mj, e.idle_energy_mj) == (0, 1_200_000)


def test_idle_is_counted_while_the_engine_was_up_not_over_a_longer_window(store: Store) -> None:
    """Scraped from 0.5 s to 9 s (its /metrics): a window of 100 s counts 8.5 s of its life, the steps' 6 s busy."""
    _timeline(store)
    store.insert("engine_samples", [EngineSample(micros(T0 + at), "h", ENGINE, "0", "m", "vllm:num_requests_running",
                                                 "gauge", {}, 1.0, 0.0) for at in (0.5, 3.0, 9.0)],
                 EngineSample._fields)
    e = engine_of(usage(store, window(-50, 50)))
    assert e.busy_us == _busy(-50, 50) == 6_000_000
    assert e.window_us == 8_500_000 and e.busy_us + e.idle_us == e.window_us
    # Scraped before the window began, up at its start: the life is what lies inside it.
    assert engine_of(usage(store, window(5.0, 50))).window_us == 4_000_000
    assert engine_of(usage(store, window(2.0, 4.0))).window_us == 2_000_000


class _Recording:
    """The store, keeping the SQL of every query it answered."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.sql: list[str] = []

    def query(self, sql: str, parameters: dict[str, Any] | None = None) -> Any:
        self.sql.append(sql)
        return self.store.query(sql, parameters)


def test_a_window_with_more_steps_than_a_pass_may_walk_is_refused_before_they_are_read(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    _timeline(store)
    monkeypatch.setattr(usage_module, "MAX_STEPS", 3)  # as if the window held a week of a node (218M steps)
    reader = _Recording(store)
    with pytest.raises(ValueError, match=r"steps to walk, more than 3: ask for a shorter window"):
        usage(reader, window(0, 10))
    assert q.STEPS not in reader.sql and q.STEP_COUNT in reader.sql
