"""An engine announces its model once, at its start: a collector restarted beside it still names its rows."""

from __future__ import annotations

import os
import time

from stepline.app.collector import Collector
from stepline.config.settings import Settings
from stepline.plugin.core import PluginCore
from stepline.sources.registry import REGISTRY
from stepline.store.store import Store
from stepline.testing.vllm_standins import SchedulerIterationDetails, SchedulerStats

HOST = "node-m"


def _collector(store_url: str, socket_path: str) -> Collector:
    settings = Settings.from_env({}, store=store_url, engines=(), metrics_port=0, query_port=0, host_name=HOST,
                                 flush_interval_s=0.05, plugin_socket=socket_path,
                                 disabled_sources=frozenset(s.name for s in REGISTRY if s.name != "plugin"))
    collector = Collector(settings)
    collector.start()
    return collector


def _steps(core: PluginCore, first: int, count: int) -> None:
    for i in range(first, first + count):
        details = SchedulerIterationDetails(i, 0, 0, 1, 1, 3.0)
        core.record(SchedulerStats(num_running_reqs=1, iteration_details=details), None)
    core.close()


def _wait_for_steps(store: Store, count: int) -> None:
    deadline = time.monotonic() + 10
    while store.query("SELECT count() FROM steps").result_rows[0][0] < count and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_restarted_collector_names_the_rows_of_an_engine_that_started_before_it(store: Store, store_url: str,
                                                                                  sock_dir: str) -> None:
    socket_path = os.path.join(sock_dir, "p.sock")
    first = _collector(store_url, socket_path)
    try:
        core = PluginCore("e1", socket_path)
        core.engine_initialized({"model": "/models/tiny", "served_model_name": "tiny"})
        _steps(core, 0, 3)
        _wait_for_steps(store, 3)
    finally:
        first.stop()
    second = _collector(store_url, socket_path)
    try:
        _steps(PluginCore("e1", socket_path), 3, 3)  # the same engine, still running: no new engine_config
        _wait_for_steps(store, 6)
    finally:
        second.stop()
    rows = store.query("SELECT step, model_name FROM steps ORDER BY step").result_rows
    assert rows == [(i, "tiny") for i in range(6)]
