"""The replay against the simulator: the recorded shape is what the engine counts, on the recorded clock.

The simulator counts token-id prompts exactly and reports a prefix-cache hit only for a prompt it saw before,
whole; the replay's prompts share a prefix and never a whole prompt, so it shows no hit (test_replay_plan.py checks
the shared prefixes against a small model of vLLM's block hashing).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence

import pytest
from prometheus_client.parser import text_string_to_metric_families

from stepline.analysis.window import describe, window_from
from stepline.loadgen import replay
from stepline.loadgen.client import Endpoint
from stepline.model.rows import Request, micros
from stepline.sim.config import EngineConfig
from stepline.sim.vllm_server import SimServer, idle_workload, serve
from stepline.store.store import Store

MODEL = "test/model"
T0 = time.time() - 600  # the recording: ten minutes ago


@pytest.fixture
def server() -> Iterator[SimServer]:
    handle = serve(idle_workload(), EngineConfig(model=MODEL), port=0, speed=1.0)
    yield handle
    handle.stop()


def recorded(rid: str, arrival: float, prompt: int, cached: int, generated: int, engine: str = "rec") -> Request:
    return Request(micros(arrival + 1), "h", engine, 0, "m", rid, "plugin", "length", micros(arrival), 0.01, 0.1,
                   0.5, 0.6, 0.61, 0.11, 0.01, prompt, cached, generated, generated, 0)


# (offset s, prompt, cached, generated): a short chat, a repeated long prompt (a hit), more short ones.
SHAPE = [(0.0, 40, 0, 8), (0.3, 300, 0, 4), (0.5, 300, 288, 4), (0.9, 64, 0, 16), (1.2, 1000, 512, 2)]


def fill(store: Store, shape: Sequence[tuple[float, int, int, int]] = SHAPE, start: float = T0,
         engine: str = "rec") -> None:
    store.insert("requests", [recorded(f"{engine}-{i}", start + t, p, c, g, engine)
                              for i, (t, p, c, g) in enumerate(shape)], Request._fields)


def counters(server: SimServer) -> dict[str, float]:
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(server.metrics().decode()):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def test_arrivals_keep_their_recorded_spacing_divided_by_the_speed(server: SimServer) -> None:
    shape = [replay.Recorded("e", f"r{i}", T0 + t, 16, 0, 2, "length") for i, t in enumerate((0.0, 0.4, 1.2, 1.3))]
    for speed in (1.0, 2.0):
        report = replay.replay(Endpoint(server.url, 10), replay.plan(shape, speed=speed), max_seconds=30)
        sent = [s.sent_s for s in report.sends]
        assert [s.scheduled_s for s in report.sends] == pytest.approx([t / speed for t in (0.0, 0.4, 1.2, 1.3)])
        for got, due in zip(sent, (0.0, 0.4, 1.2, 1.3), strict=True):
            assert due / speed <= got + 1e-6 < due / speed + 0.1, (speed, sent)
        assert report.span_s == pytest.approx(1.3 / speed) and report.send_lag_max_s < 0.1
        assert report.duration_s >= 1.3 / speed and report.completed == 4


def test_max_seconds_stops_sending_and_abandons_what_is_in_flight(server: SimServer) -> None:
    shape = [replay.Recorded("e", "long", T0, 16, 0, 5000, "length"),  # ~5000 steps: still decoding at the deadline
             replay.Recorded("e", "late", T0 + 5, 16, 0, 2, "length")]
    started = time.monotonic()
    report = replay.replay(Endpoint(server.url, 10), replay.plan(shape), max_seconds=1.0)
    assert time.monotonic() - started < 3
    assert (report.sent, report.completed, report.abandoned, report.stopped_by) == (1, 0, 1, "max-seconds")
    assert "stopped by --max-seconds" in replay.render(report)


def test_requests_that_generated_nothing_are_left_out_and_counted(server: SimServer) -> None:
    shape = [replay.Recorded("e", "ok", T0, 16, 0, 2, "length"), replay.Recorded("e", "aborted", T0, 16, 0, 0, "abort")]
    report = replay.replay(Endpoint(server.url, 10), replay.plan(shape), max_seconds=30)
    assert (report.recorded, report.skipped, report.sent, report.completed) == (2, 1, 1, 1)
    assert "left out: 1 that generated no token" in replay.render(report)


def test_a_stop_event_ends_the_replay_as_ctrl_c_does(server: SimServer) -> None:
    shape = [replay.Recorded("e", f"r{i}", T0 + i, 16, 0, 2, "length") for i in range(10)]
    stop = threading.Event()
    threading.Timer(1.5, stop.set).start()
    report = replay.replay(Endpoint(server.url, 10), replay.plan(shape), max_seconds=30, stop=stop)
    assert report.stopped_by == "stopped" and 1 <= report.sent <= 3 and report.duration_s < 3


def test_a_window_read_from_the_store_is_replayed_as_the_engine_counts_it(server: SimServer, store: Store,
                                                                         store_url: str) -> None:
    fill(store)
    fill(store, [(0.1, 5000, 0, 50)], engine="other")  # another engine's request: not in the window
    window = window_from("30m", str(T0 - 1), str(T0 + 60), "rec")
    report = replay.replay_window(server.url, replay.load_window(store_url, window), window, speed=4,
                                  max_requests=3)
    assert (report.window, report.model, report.planned, report.bounded, report.completed) == (
        describe(window), MODEL, 3, 2, 3)
    assert (report.prompt_tokens_sent, report.warmup_prompt_tokens) == (40 + 300 + 300, 288)
    assert counters(server)["vllm:prompt_tokens_total"] == 40 + 300 + 300 + 288
