"""A scenario served live on the wall clock beside a running collector: what the collector meets beside a real
engine (plugin datagrams, OTLP spans, /metrics, the GPU source over the simulated GPUs), as it happens."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from stepline.app.collector import Collector
from stepline.config.settings import Settings
from stepline.drills.live import LiveEngine
from stepline.drills.scenarios import TICK_S, PowerCap, Scenario
from stepline.sim.workloads import compose, one_request
from stepline.store.store import Store

NAME = "live-a"
CAP_W = 150.0  # from the start, for the whole run: the GPU's demand while decoding is above it
REQUESTS = ("r-long", "r-short")


@dataclass
class Served:
    engine: LiveEngine
    store: Store
    before_s: float  # wall-clock time the engine was started at
    in_flight_at_start: int


@pytest.fixture(scope="module")
def served(chdb_dir: object, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """Two requests served live (their arrivals 0.2 and 0.4 s in) to a collector writing to a store of its own."""
    workload = compose("live", 1.0, 3.0, [one_request(REQUESTS[0], 0.2, 3000, 80),
                                          one_request(REQUESTS[1], 0.4, 500, 20)])
    scenario = Scenario("live", None, workload, power_cap=PowerCap(0.0, 60.0, CAP_W), gpus=1)
    sock_dir = tmp_path_factory.mktemp("live", numbered=True)
    store_url = f"chdb://{chdb_dir}?database=live_{os.getpid()}"
    before = time.time()
    engine = LiveEngine(NAME, scenario)
    settings = Settings.from_env({}, store=store_url, engines=(f"{NAME}={engine.url}",), metrics_port=0,
                                 query_port=0, otlp_port=0, plugin_socket=str(sock_dir / "p.sock"),
                                 disabled_sources=frozenset({"gpu"}))
    collector = Collector(settings, extra=lambda ctx: [engine.gpu_source(ctx)])
    try:
        collector.start()
        engine.attach(collector)
        in_flight = engine.in_flight()
        deadline = time.time() + 30
        while not engine.done() and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # the GPU source samples the idle GPUs too
    finally:
        engine.stop()
        collector.stop()
    store = Store.open(store_url)
    yield Served(engine, store, before, in_flight)
    store.client.command(f"DROP DATABASE IF EXISTS `{store.database}`")
    store.close()


def _one(served: Served, sql: str) -> tuple[Any, ...]:
    rows = served.store.query(sql, parameters={"e": NAME}).result_rows
    return tuple(rows[0])


def test_the_scenario_runs_from_its_start_on_the_wall_clock(served: Served) -> None:
    assert served.engine.done()
    assert served.before_s <= served.engine.started <= served.before_s + 5
    assert served.engine.at(2.5) == served.engine.started + 2.5
    assert served.in_flight_at_start <= len(REQUESTS)


def test_every_request_reaches_the_store_through_the_normal_path(served: Served) -> None:
    rows = served.store.query("SELECT request_id, groupUniqArray(source), max(generation_tokens) FROM requests "
                              "WHERE engine = {e:String} GROUP BY request_id ORDER BY request_id",
                              parameters={"e": NAME}).result_rows
    assert [r[0] for r in rows] == sorted(REQUESTS)
    assert all("plugin" in r[1] for r in rows)  # the stat-logger datagrams the engine sent the collector
    assert {r[0]: r[2] for r in rows} == {"r-long": 80, "r-short": 20}
    # The arrivals are timed from the engine's start: 0.2 s and 0.4 s in.
    (first,) = _one(served, "SELECT toFloat64(min(arrival_ts)) FROM requests WHERE engine = {e:String}")
    assert float(first) == pytest.approx(served.engine.at(0.2), abs=0.25)


def test_steps_and_scrapes_are_collected_as_they_happen(served: Served) -> None:
    steps, generated = _one(served, "SELECT count(), sum(num_generation_tokens) FROM steps WHERE engine = {e:String}")
    # Decode tokens: every output token but each request's first, which its last prefill step samples.
    assert int(steps) > 0 and int(generated) == 80 + 20 - len(REQUESTS)
    (scraped,) = _one(served, "SELECT count() FROM engine_samples WHERE engine = {e:String}")
    assert int(scraped) > 0  # the collector scraped the simulated server's /metrics


def test_the_gpus_are_sampled_and_capped_on_the_scenarios_schedule(served: Served) -> None:
    rows = served.store.query("SELECT toFloat64(ts), power_w, has(clock_event_flags, 'sw_power_cap') FROM gpu_samples "
                              "WHERE engine = {e:String} ORDER BY ts", parameters={"e": NAME}).result_rows
    assert len(rows) >= 3  # every 0.5 s (GPU_INTERVAL_S) for the run's seconds
    # The cap holds from the engine's first tick on: the board never drew more, and said why its clocks dropped.
    capped = [(watts, flagged) for ts, watts, flagged in rows if ts >= served.engine.at(TICK_S)]
    assert capped and max(watts for watts, _ in capped) <= CAP_W
    assert any(flagged for _, flagged in capped)
