"""The progress watchdog: budgets from the work in flight, states, events and exported figures."""

from __future__ import annotations

import math
import urllib.request
from collections.abc import Sequence
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from stepline.app.collector import Collector
from stepline.config.settings import Settings
from stepline.core.clock import ManualClock
from stepline.model.rows import (
    EngineSample,
    Event,
    GatewayDecision,
    GatewaySample,
    GpuSample,
    Request,
    Row,
    Step,
    micros,
)
from stepline.plugin import wire
from stepline.sim.vllm_server import SimServer
from stepline.sources.base import SourceContext
from stepline.sources.plugin_receiver import PluginReceiver
from stepline.store.reads import Reads
from stepline.testing.sink import wait_until
from stepline.watchdog.budget import Policy
from stepline.watchdog.metrics import WatchdogMetrics
from stepline.watchdog.tap import Watchdog

E = "e1"


class Harness:
    """A watchdog on a manual clock, with the events it emitted."""

    def __init__(self, **options: Any) -> None:
        self.clock = ManualClock()
        self.metrics = WatchdogMetrics(CollectorRegistry())
        self.emitted: list[Row] = []
        self.dog = Watchdog(self.metrics, self._emit, host="h", clock=self.clock, **options)

    def _emit(self, rows: Sequence[Row]) -> None:
        self.emitted.extend(rows)

    @property
    def now(self) -> float:
        return self.clock.time()

    def step(self, *, elapsed_ms: float = 30.0, ctx_tokens: int = 0, ctx_requests: int = 0, decoding: int = 8,
             running: int = 8, waiting: int = 0, itl: list[float] | None = None, preempted: int = 0,
             queries: int = 0, hits: int = 0, engine: str = E, at: float | None = None) -> None:
        """A step that ended now, or at `at` (one the plugin delivers late)."""
        ts = micros(self.now if at is None else at)
        self.dog.observe([Step(ts, "h", engine, 0, "m", 0, elapsed_ms, ctx_requests, ctx_tokens,
                               decoding, decoding, running, waiting, 0, 0.4, queries, hits, preempted, 0, 0, 0,
                               [], itl or [], False)])

    def sample(self, metric: str, value: float, delta: float = 0.0, engine: str = E) -> None:
        self.dog.observe([EngineSample(micros(self.now), "h", engine, "0", "m", metric,
                                       "counter" if metric.endswith("_total") else "gauge", {}, value, delta)])

    def gpu(self, util_pct: float, *, flags: Sequence[str] = (), index: int = 0, engine: str = E,
            remap: tuple[bool | None, bool | None] = (None, None)) -> None:
        sample = GpuSample(micros(self.now), "h", engine, index, "GPU-0", "H100", 1980.0, 2619.0, 300.0, 0,
                           50.0, 60.0, util_pct, 0.0, 0, 0, 0.0, 0.0, 0, 0.0, 0.0, 0, list(flags),
                           math.nan, math.nan, math.nan, {})
        self.dog.observe([sample._replace(remapped_rows_pending=remap[0], remapped_rows_failure=remap[1])])

    def event(self, kind: str, engine: str = E, **attributes: str) -> None:
        self.dog.observe([Event(micros(self.now), "h", engine, "vllm_metrics", kind, "critical", kind, attributes)])

    def tick(self, seconds: float = 1.0) -> str:
        """Advance, evaluate, and return the engine's state."""
        self.clock.advance(seconds)
        return self.state()

    def state(self, engine: str = E) -> str:
        return next(a.state for a in self.dog.evaluate() if a.engine == engine)

    def value(self, name: str, **labels: str) -> float | None:
        return self.metrics.registry.get_sample_value(name, {"engine": E, **labels} if "engine" not in labels
                                                      else labels)

    def state_events(self) -> list[Event]:
        return [r for r in self.emitted if isinstance(r, Event) and r.kind == "engine_state"]


def steady(h: Harness, seconds: int, per_second: int = 20, **step: Any) -> list[str]:
    states = []
    for _ in range(seconds):
        for _ in range(per_second):
            h.clock.advance(1 / per_second)
            h.step(**step)
        states.append(h.state())
    return states


def test_a_steady_engine_is_progressing_with_the_floor_budget() -> None:
    h = Harness()
    assert set(steady(h, 10)) == {"progressing"}
    assert h.value("stepline_engine_state", state="progressing") == 1
    assert h.value("stepline_engine_state", state="stalled") == 0
    assert h.value("stepline_engine_progress_budget_seconds") == 5.0
    assert h.value("stepline_engine_progress_age_seconds") == pytest.approx(0.0, abs=1e-5)
    assert h.value("stepline_engine_running_requests") == 8
    assert h.state_events() == []  # a healthy first verdict is no news


def test_a_huge_prefill_then_a_700k_decode_is_slow_but_never_stalled() -> None:
    h = Harness()
    steady(h, 10)  # the decode-only baseline: 30 ms steps
    budgets, states = [], []
    # 700k prompt in 8192-token chunks at 2-4 s each (86 chunks, ~4.5 minutes).
    for i in range(86):
        elapsed = 2000.0 + (i % 3) * 1000
        for _ in range(int(elapsed / 1000)):
            states.append(h.tick())
            budgets.append(h.value("stepline_engine_progress_budget_seconds"))
        h.step(elapsed_ms=elapsed, ctx_tokens=8192, ctx_requests=1, decoding=4, running=5, waiting=3)
        if i == 5:
            assert h.value("stepline_engine_queued_behind_prefill") == 3
            assert h.value("stepline_engine_inflight_prefill_tokens") == 8192
    assert "stalled" not in states and "slow" in states
    assert min(b for b in budgets[6:] if b is not None) >= 20.0  # well above the 2-4 s step
    h.tick(0.1)
    assert h.value("stepline_engine_longest_context_tokens") == 86 * 8192
    # Then the 700k-token request decodes alone: 1.5 s steps, slow, still coming.
    for _ in range(200):
        states.append(h.tick(1.5))
        h.step(elapsed_ms=1500.0, decoding=1, running=1)
    assert "stalled" not in states
    assert h.value("stepline_engine_longest_context_tokens") == 86 * 8192  # still decoding
    assert all(e.attributes["state"] != "stalled" for e in h.state_events())
    h.dog.observe([Request(micros(h.now), "h", E, 0, "m", "r1", "plugin", "stop", 0, 0, 0, 0, 0, 0, 0, 0,
                           704_512, 0, 10, 10, 0)])
    h.tick()
    assert h.value("stepline_engine_longest_context_tokens") == 0


def test_a_wedged_engine_stalls_within_its_floor_and_pages() -> None:
    h = Harness()
    steady(h, 5, decoding=2, running=2)
    h.clock.advance(0.5)
    h.step(decoding=2, running=2, waiting=4)
    states = []
    for _ in range(10):  # /metrics keeps answering: 4 waiting, leaked slots "running", no token, GPUs idle
        h.clock.advance(1.0)
        h.sample("vllm:num_requests_waiting", 4)
        h.sample("vllm:num_requests_running", 2)
        h.sample("vllm:generation_tokens_total", 1000, 0.0)
        h.gpu(0.0)
        states.append(h.state())
    assert "stalled" in states and states.index("stalled") <= 6
    assert h.value("stepline_engine_progress_budget_seconds") == 5.0
    assert h.value("stepline_engine_gpu_utilization_ratio") == 0.0
    stalled = [e for e in h.state_events() if e.attributes["state"] == "stalled"]
    assert len(stalled) == 1
    event = stalled[0]
    assert event.severity == "critical" and event.engine == E and event.source == "watchdog"
    assert event.attributes["waiting"] == "4" and event.attributes["budget_s"] == "5.000"
    assert "stalled" in event.message and "4 waiting" in event.message and "GPUs 0% busy" in event.message
    # Progress again: back to progressing, with an event.
    h.clock.advance(0.1)
    h.step(decoding=2, running=2, waiting=3)
    assert h.state() == "progressing"
    last = h.state_events()[-1]
    assert last.attributes["previous"] == "stalled" and last.severity == "info"


def test_an_engine_seen_only_through_metrics_progresses_on_counter_deltas() -> None:
    h = Harness()
    states = []
    for i in range(12):  # scraped every 5 s; tokens move on every scrape
        h.clock.advance(5.0)
        h.sample("vllm:num_requests_running", 3)
        h.sample("vllm:num_requests_waiting", 1)
        h.sample("vllm:generation_tokens_total", 100.0 * i, 100.0)
        states.append(h.state())
    assert set(states) == {"progressing"}
    assert h.value("stepline_engine_progress_budget_seconds") == 15.0  # floor + two scrape intervals
    for _ in range(4):  # tokens stop moving
        h.clock.advance(5.0)
        h.sample("vllm:generation_tokens_total", 1100.0, 0.0)
        h.sample("vllm:num_requests_running", 3)
    assert h.state() == "stalled"


def test_an_engine_gone_idle_per_its_gauges_is_never_stalled() -> None:
    # The plugin ships steps in batches: a busy spell's last steps (the one saying 0 running among them) wait in
    # its buffer until vLLM's next record() or log(), and a batch can reach the watchdog after a newer scrape.
    h = Harness()

    def scrape(running: int) -> None:
        h.sample("vllm:num_requests_waiting", 0)
        h.sample("vllm:num_requests_running", running)
        h.sample("vllm:generation_tokens_total", 0.0, 1.0 if running else 0.0)

    steady(h, 3, decoding=1, running=1)
    scrape(1)
    steady(h, 1, decoding=1, running=1)
    last_delivered = h.now  # the engine finishes 20 ms later; those steps stay in the plugin's buffer
    h.clock.advance(0.1)
    scrape(0)  # vLLM's own gauges: nothing running
    h.clock.advance(0.2)
    h.step(decoding=1, running=1, at=last_delivered - 0.05)  # a batch the plugin sent earlier arrives now
    states = [h.state()]
    for second in range(1, 31):  # scraped every 6 s (a slow scrape, or a longer interval than the budget)
        if second % 6 == 0:
            scrape(0)
        states.append(h.tick())
    assert "stalled" not in states and "slow" not in states, states
    assert states[-1] == "idle"
    # Before any gauge reading, the last delivered step is all there is: no verdict by age until one confirms.
    h2 = Harness()
    steady(h2, 3, decoding=1, running=1)
    h2.sample("vllm:num_requests_running", 1)
    steady(h2, 1, decoding=1, running=1)
    states = [h2.tick() for _ in range(5)] + [h2.tick(0.9)]  # the next scrape is late: 5.9 s after the last step
    h2.sample("vllm:num_requests_running", 0)
    states.append(h2.tick(0.1))
    assert "stalled" not in states and "slow" not in states, states
    assert states[-1] == "idle"
    assert all(e.attributes["state"] in ("idle", "progressing") for e in h.state_events() + h2.state_events())


def test_requests_the_scheduler_deferred_are_queued_work() -> None:
    # vLLM 0.33 counts the waiting requests it deferred (grammars compiling, KVs on their way) apart, in
    # num_skipped_waiting_reqs: 0 running, 0 waiting, 3 deferred. The step reaches the watchdog as the collector
    # decodes the plugin's datagram.
    h = Harness()
    steady(h, 3, decoding=1, running=1)
    h.clock.advance(0.05)
    receiver = PluginReceiver(SourceContext("h", h.clock), "/nonexistent/plugin.sock")
    last = wire.StepRecord(h.now, 999, 0, 30.0, 0, 0, 0, 0, 0, 0, 3, 0.4, 0, 0, 0, 0, 0, 0, False)
    h.dog.observe(receiver.rows(wire.encode_header(E.encode(), 1, 1, 0, 0) + wire.encode_step(last)))
    assert h.state() == "progressing" and h.value("stepline_engine_waiting_requests") == 3
    states = [h.tick() for _ in range(10)]  # and nothing is ever scheduled again
    assert "idle" not in states and states[-1] == "stalled", states


def test_down_on_engine_down_and_recovery_with_events() -> None:
    h = Harness()
    steady(h, 3)
    h.event("engine_down")
    assert h.tick() == "down"
    assert h.value("stepline_engine_state", state="down") == 1
    down = h.state_events()[-1]
    assert down.attributes["state"] == "down" and down.severity == "critical"
    h.event("engine_up")
    h.step()
    assert h.tick(0.1) == "progressing"
    assert h.state_events()[-1].attributes["previous"] == "down"


def test_a_scraped_engine_silent_for_long_is_down() -> None:
    h = Harness(policy=Policy(down_after_s=30.0))
    h.sample("vllm:num_requests_running", 0)
    assert h.tick() == "idle"
    assert h.tick(31.0) == "down"


def test_the_budget_grows_with_the_prefill_in_flight_and_shrinks_when_idle() -> None:
    h = Harness()
    steady(h, 2)
    floor = h.value("stepline_engine_progress_budget_seconds")
    h.step(elapsed_ms=800.0, ctx_tokens=8192, ctx_requests=1, decoding=8, running=9, waiting=1)
    h.tick(0.1)
    grown = h.value("stepline_engine_progress_budget_seconds")
    assert floor == 5.0 and grown is not None and grown > floor
    h.step(elapsed_ms=3000.0, ctx_tokens=16384, ctx_requests=1, decoding=8, running=9)
    h.tick(0.1)
    bigger = h.value("stepline_engine_progress_budget_seconds")
    assert bigger is not None and bigger > grown and bigger >= 30.0
    h.step(elapsed_ms=20.0, decoding=0, running=0, waiting=0)
    assert h.tick() == "idle"
    assert h.value("stepline_engine_progress_budget_seconds") == 5.0
    assert h.value("stepline_engine_state", state="idle") == 1


def test_window_figures_and_gpu_metrics() -> None:
    h = Harness()
    assert h.metrics.registry.get_sample_value("stepline_gpu_present") == 0
    for i in range(10):
        h.clock.advance(0.5)
        # Prefill steps take three times as long: half the steps, three quarters of the time. One lookup of a huge
        # uncached prompt weighs as one step's ratio, not as its 300k tokens.
        h.step(ctx_tokens=512 if i % 2 else 0, ctx_requests=1 if i % 2 else 0, itl=[0.01] * 9 + [0.5],
               elapsed_ms=90.0 if i % 2 else 30.0, queries=300_000 if i == 9 else 100, hits=0 if i == 9 else 25,
               preempted=1 if i == 3 else 0)
        h.gpu(80.0, flags=["sw_power_cap"], remap=(True, False))
        h.gpu(60.0, index=1)
    h.event("gpu_xid", xid="79", gpu="1")
    h.event("gpu_lost", gpu="1")
    h.tick(0.1)
    assert h.value("stepline_engine_itl_p99_seconds") == 0.5
    assert h.value("stepline_engine_prefill_step_share") == pytest.approx(0.75)
    assert h.value("stepline_engine_prefix_cache_hit_ratio") == pytest.approx(0.9 * 0.25)
    assert h.value("stepline_engine_kv_cache_usage_ratio") == pytest.approx(0.4)
    assert h.value("stepline_engine_preemptions_total") == 1
    assert h.value("stepline_engine_gpu_utilization_ratio") == pytest.approx(0.7)
    assert h.value("stepline_gpu_clock_event_active", engine=E, gpu="0", reason="sw_power_cap") == 1
    assert h.value("stepline_gpu_clock_event_active", engine=E, gpu="1", reason="sw_power_cap") == 0
    assert h.value("stepline_gpu_sm_clock_mhz", engine=E, gpu="1") == 1980.0
    assert h.value("stepline_gpu_xid_errors_total", engine=E, gpu="1", xid="79") == 1
    assert h.value("stepline_gpu_lost_total", engine=E, gpu="1") == 1  # GpuLost pages on it
    assert h.value("stepline_gpu_row_remap", engine=E, gpu="0", state="pending") == 1  # GpuRowRemap: warning
    assert h.value("stepline_gpu_row_remap", engine=E, gpu="0", state="failed") == 0
    assert h.value("stepline_gpu_row_remap", engine=E, gpu="1", state="pending") is None  # no remapper reading
    assert h.metrics.registry.get_sample_value("stepline_gpu_present") == 1
    h.tick(61.0)  # no GPU data any more: the utilisation is absent, not 0
    assert h.value("stepline_engine_gpu_utilization_ratio") is None
    assert h.value("stepline_engine_itl_p99_seconds") is None
    assert h.metrics.registry.get_sample_value("stepline_gpu_present") == 0


def test_a_lost_gpu_stays_gone_until_it_is_sampled_again() -> None:
    h = Harness()
    h.gpu(60.0, index=1)
    h.event("gpu_lost", gpu="1")
    h.tick(0.1)
    assert h.value("stepline_gpu_gone", engine=E, gpu="1") == 1  # GpuLost holds on it
    h.gpu(70.0, index=0)
    h.tick(600.0)  # long after the loss, while the source samples only the others
    assert h.value("stepline_gpu_gone", engine=E, gpu="1") == 1
    assert h.value("stepline_gpu_lost_total", engine=E, gpu="1") == 1
    h.gpu(60.0, index=1, engine="e2")  # back in rotation (rediscovered), now serving another engine
    h.tick(0.1)
    assert h.value("stepline_gpu_gone", engine=E, gpu="1") is None
    h.event("gpu_lost", engine="e2", gpu="1")  # lost again: gone again, under the engine it served
    assert h.value("stepline_gpu_gone", engine="e2", gpu="1") == 1
    assert h.value("stepline_gpu_lost_total", engine="e2", gpu="1") == 1


def test_the_top_finding_is_refreshed_while_work_is_in_flight_and_kept_after_recovery() -> None:
    answers: list[tuple[str, str, str] | None] = [None, ("prefill_interference", "critical", "monster prefill"),
                                                  ("wedged_engine", "critical", "4 waiting, no step for 9s")]
    calls: list[tuple[float, list[str]]] = []

    def fake_diagnose(_reader: Reads, engines: Sequence[str], now: float) -> dict[str, tuple[str, str, str] | None]:
        calls.append((now, list(engines)))
        return {e: answers[min(len(calls) - 1, len(answers) - 1)] for e in engines}

    h = Harness(reader_factory=lambda: object(), diagnose=fake_diagnose, diagnose_every_s=5.0,
                diagnose_idle_every_s=60.0)
    steady(h, 1, running=2, waiting=4)
    h.dog.refresh_findings()
    assert len(calls) == 1  # first seen: diagnosed at once, nothing found
    steady(h, 2, running=2, waiting=4)
    h.dog.refresh_findings()
    assert len(calls) == 1  # progressing, in flight: not before diagnose_every_s
    steady(h, 4, running=2, waiting=4)
    h.dog.refresh_findings()
    assert len(calls) == 2  # in flight, 6 s on: diagnosed while still progressing
    monster = {"engine": E, "kind": "prefill_interference", "severity": "critical", "title": "monster prefill"}
    assert h.value("stepline_engine_top_finding_info", **monster) == 1
    for _ in range(6):  # no progress: stalled after the 5 s floor, and diagnosed on the change at once
        h.tick()
        h.dog.refresh_findings()
    assert h.state() == "stalled" and len(calls) == 3
    wedge = {"engine": E, "kind": "wedged_engine", "severity": "critical", "title": "4 waiting, no step for 9s"}
    assert h.value("stepline_engine_top_finding_info", **wedge) == 1
    assert h.value("stepline_engine_top_finding_info", **monster) is None  # replaced, not added
    h.step(running=0, decoding=0)
    h.tick()
    h.dog.refresh_findings()
    assert h.state() == "idle" and len(calls) == 3
    assert h.value("stepline_engine_top_finding_info", **wedge) == 1  # recovery does not drop it
    answers.append(None)
    h.tick(61.0)
    h.dog.refresh_findings()
    assert len(calls) == 4 and h.value("stepline_engine_top_finding_info", **wedge) is None  # aged out


def test_one_diagnosis_covers_every_engine_due() -> None:
    calls: list[list[str]] = []

    def fake_diagnose(_reader: Reads, engines: Sequence[str], _now: float) -> dict[str, tuple[str, str, str] | None]:
        calls.append(sorted(engines))
        return {"e2": ("overload", "warning", "arrivals above capacity")}

    h = Harness(reader_factory=lambda: object(), diagnose=fake_diagnose)
    h.step(running=2)
    h.step(running=3, engine="e2")
    h.tick()
    h.dog.refresh_findings()
    assert calls == [["e1", "e2"]]
    assert h.value("stepline_engine_top_finding_info", engine="e2", kind="overload", severity="warning",
                   title="arrivals above capacity") == 1


def test_a_failing_diagnosis_is_logged_not_fatal(caplog: pytest.LogCaptureFixture) -> None:
    def broken(_reader: Reads, _engines: Sequence[str], _now: float) -> dict[str, tuple[str, str, str] | None]:
        raise ConnectionError("store gone")

    h = Harness(reader_factory=lambda: object(), diagnose=broken)
    steady(h, 1, running=2, waiting=4)
    for _ in range(7):
        h.tick()
        h.dog.refresh_findings()
    assert sum("store gone" in r.getMessage() for r in caplog.records) == 1
    assert h.state() == "stalled"


def test_observe_never_raises_on_odd_rows() -> None:
    h = Harness()
    h.dog.observe([Step(0, "h", E, 0, "m", 0, math.nan, 0, 0, 0, 0, 1, 0, 0, 0.0, 0, 0, 0, 0, 0, 0, [], [], True)])
    h.dog.observe([None])  # type: ignore[list-item]
    assert h.tick() in ("progressing", "slow", "stalled")


def test_the_collector_exports_the_watchdog_on_its_metrics(store_url: str, steady_engine: SimServer,
                                                           sock_dir: str) -> None:
    settings = Settings.from_env({}, store=store_url, engines=(f"sim={steady_engine.url}", "dead=http://127.0.0.1:9"),
                                 metrics_port=0, query_port=0, scrape_interval_s=0.2, flush_interval_s=0.1,
                                 otlp_port=0, plugin_socket=f"{sock_dir}/p.sock")
    collector = Collector(settings)
    collector.start()
    try:
        assert collector.metrics_server is not None
        url = f"http://127.0.0.1:{collector.metrics_server.port}/metrics"

        def text() -> str:
            return str(urllib.request.urlopen(url).read().decode())

        wait_until(lambda: 'stepline_engine_state{engine="dead",state="down"} 1.0' in text())
        wait_until(lambda: 'stepline_engine_progress_budget_seconds{engine="sim"}' in text())
        body = text()
        assert 'stepline_engine_state{engine="sim",state="down"} 0.0' in body
        assert 'stepline_engine_running_requests{engine="sim"}' in body
        assert "stepline_gpu_present 0.0" in body
        assert collector.store is not None
        wait_until(lambda: collector.store is not None and collector.store.query(
            "SELECT count() FROM events WHERE kind = 'engine_state' AND engine = 'dead'").result_rows[0][0] >= 1)
    finally:
        collector.stop()


# --- gateways in front: lanes, their budgets, the gateway's slots and decisions ---

def _decision(h: Harness, engine: str, lane: str, *, in_flight: int | None = None, status: int = 200,
              sized: bool = True, swallowed: str = "", disconnected: bool = False) -> None:
    size = 1_000 if sized else None
    h.dog.observe([GatewayDecision(micros(h.now), "h", engine, "router", "r1", 1, lane, [], size, size, None,
                                   400_000.0, "chars", "", in_flight, status, "", disconnected, None,
                                   micros(h.now), swallowed)])


@pytest.mark.parametrize(("lane", "state"), [("heavy", "progressing"), ("fast", "stalled")])
def test_a_lane_slow_by_design_has_room_its_other_lanes_do_not(lane: str, state: str) -> None:
    """One step of one decoding request, then 90 s of nothing: a stall on the fast lane, within the heavy
    lane's 300 s floor (the seed's 719k-token decode outlived a 90 s probe)."""
    h = Harness(lane_budgets={"heavy": 300.0})
    _decision(h, E, lane)
    h.step(decoding=1, running=1)
    h.tick(90)
    assert h.state() == state
    assert h.value("stepline_engine_lane_info", gateway="router", lane=lane) == 1
    assert h.value("stepline_engine_progress_budget_seconds") == (300.0 if lane == "heavy" else 5.0)


def test_a_crash_pages_on_the_slow_lane_at_once() -> None:
    h = Harness(lane_budgets={"heavy": 300.0})
    _decision(h, E, "heavy")
    h.step(decoding=1, running=1)
    h.dog.observe([Event(micros(h.now), "h", E, "vllm_metrics", "engine_down", "critical", "connection refused",
                         {})])
    h.tick(1)
    assert h.state() == "down"


def test_an_engine_moved_to_another_lane_carries_only_its_latest() -> None:
    h = Harness(lane_budgets={"heavy": 300.0})
    _decision(h, E, "heavy")
    _decision(h, E, "fast")
    h.step(decoding=1, running=1)
    h.tick(30)
    assert h.state() == "stalled"  # the fast lane's budget: its own 5 s floor
    assert h.value("stepline_engine_lane_info", gateway="router", lane="heavy") is None
    assert h.value("stepline_engine_lane_info", gateway="router", lane="fast") == 1


def test_decisions_are_counted_by_outcome() -> None:
    h = Harness()
    _decision(h, E, "fast")
    _decision(h, E, "fast", sized=False)  # measured nothing against its bar: failed open
    _decision(h, E, "fast", swallowed="KeyError: 'messages'")
    _decision(h, E, "heavy", status=429)
    _decision(h, E, "heavy", status=499, disconnected=True)
    _decision(h, E, "heavy", status=502)
    counted = {(lane, outcome): h.metrics.registry.get_sample_value(
        "stepline_gateway_decisions_total", {"gateway": "router", "lane": lane, "outcome": outcome})
        for lane, outcome in (("fast", "answered"), ("fast", "failed_open"), ("heavy", "refused"),
                              ("heavy", "disconnected"), ("heavy", "error"))}
    assert counted == {("fast", "answered"): 1, ("fast", "failed_open"): 2, ("heavy", "refused"): 1,
                       ("heavy", "disconnected"): 1, ("heavy", "error"): 1}


def test_the_gateways_slots_are_exported_while_fresh() -> None:
    h = Harness()
    _decision(h, "heavy-0", "heavy", in_flight=4, status=429)
    h.dog.observe([GatewaySample(micros(h.now), "h", "heavy-0", "vr", "vllm_router_running_requests", "gauge",
                                 {"worker": "http://heavy-0"}, 3.0, 0.0)])
    h.clock.advance(1)
    h.dog.evaluate()
    source = {"gateway": "router", "engine": "heavy-0", "source": "decisions"}
    scraped = {"gateway": "vr", "engine": "heavy-0", "source": "vllm_router_running_requests"}
    assert h.metrics.registry.get_sample_value("stepline_gateway_in_flight", source) == 4
    assert h.metrics.registry.get_sample_value("stepline_gateway_in_flight", scraped) == 3
    h.clock.advance(61)  # no decision and no scrape for a minute: nothing said about the slots now
    h.dog.evaluate()
    assert h.metrics.registry.get_sample_value("stepline_gateway_in_flight", source) is None
