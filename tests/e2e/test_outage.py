"""Fault injection: the store (a real ClickHouse HTTP endpoint) goes away mid-run; every row still lands, once."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import clickhouse_connect
import pytest

from stepline.app.collector import Collector
from stepline.config.settings import Settings
from stepline.model.rows import EngineSample, Event, GpuSample, HostSample, Row
from stepline.sim.config import EngineConfig
from stepline.sim.replay import replay
from stepline.sim.telemetry import Telemetry
from stepline.sim.workloads import make_workload
from stepline.store.store import Store
from stepline.testing.sink import wait_until
from stepline.testing.storeserver import StoreServer

TABLES = ("steps", "requests", "engine_samples", "gpu_samples", "host_samples", "events")


def _direct_rows(phase: int, n: int) -> list[Row]:
    """Rows of the tables no running source feeds here, `n` of each, told apart by phase."""
    now = int(time.time() * 1e6)
    rows: list[Row] = []
    for i in range(n):
        ts = now + phase * 1_000_000 + i
        rows.append(EngineSample(ts, "h", "eng", "0", "m", "vllm:num_requests_running", "gauge", {}, float(i), 0.0))
        rows.append(GpuSample(ts, "h", "eng", i % 8, f"GPU-{i % 8}", "H200", 1980.0, 3200.0, 500.0, i, 60.0, 70.0,
                              90.0, 40.0, 1 << 30, 1 << 37, 1e9, 1e9, 0, 2e10, 2e10, 0, [], 80.0, 60.0, 50.0, {}))
        rows.append(HostSample(ts, "h", "eng", "host", 0, 30.0, [30.0, 30.0], 1.0, 1 << 30, 1 << 33, 1 << 34, 0,
                               0, 0, 0, {"eth0": 1}, {"eth0": 1}, {}, 0, 0))
        rows.append(Event(ts, "h", "eng", "test", "injected", "info", f"phase {phase} #{i}", {}))
    return rows


def _opened(collector: Collector) -> Store | None:
    return collector.store


def _counts(server: StoreServer, database: str) -> dict[str, int]:
    client = clickhouse_connect.get_client(dsn=f"chdb://{server.path}", database=database)
    try:
        counts = {t: int(client.query(f"SELECT count() FROM `{t}`").result_rows[0][0]) for t in TABLES[:-1]}
        counts["events"] = int(client.query("SELECT count() FROM events WHERE source = 'test'").result_rows[0][0])
    finally:
        client.close()
    return counts


@pytest.mark.parametrize("fault", ["stopped", "refusing"])
def test_rows_wait_in_the_spool_through_a_store_outage_and_land_exactly_once(
        store_server: StoreServer, sock_dir: str, tmp_path: Path, fault: str) -> None:
    database = f"o_{uuid.uuid4().hex[:12]}"
    spool_dir = tmp_path / "spool"
    settings = Settings.from_env(
        {}, store=store_server.store_url(database), metrics_port=0, query_port=0, otlp_port=0,
        plugin_socket=f"{sock_dir}/p.sock", flush_interval_s=0.1, spool_dir=str(spool_dir),
        disabled_sources=frozenset({"vllm_metrics", "gpu", "host", "otlp"}),
    )
    collector = Collector(settings)
    collector.start()
    assert collector.writers is not None
    value = collector.metrics.registry.get_sample_value

    def received(counter: str) -> int:
        return int(value("stepline_source_counts_total", {"source": "plugin", "counter": counter}) or 0)

    def engine_run(name: str) -> None:
        telemetry = Telemetry(name, EngineConfig(), plugin_socket=settings.plugin_socket)
        replay(make_workload("steady", duration_s=8), None, 5.0, lambda ts, body: None,
               on_step=telemetry.on_step, keep_records=False)
        telemetry.close()

    try:
        engine_run("before")
        collector.writers.write(_direct_rows(1, 50))
        wait_until(lambda: _counts(store_server, database)["steps"] == received("steps") > 0, timeout_s=30)

        if fault == "stopped":
            store_server.stop()
        else:
            store_server.refuse_inserts = True
        engine_run("during")
        collector.writers.write(_direct_rows(2, 70))
        wait_until(lambda: (value("stepline_writer_write_errors_total", {"table": "steps"}) or 0) >= 2, timeout_s=30)
        wait_until(lambda: collector.writers is not None and sum(collector.writers.depth().values())
                   == collector.writers.spool.rows(), timeout_s=10)  # everything accepted is in the spool
        on_disk = [name for name in os.listdir(spool_dir / "") if name.endswith(".seg")]
        assert {name.split(".")[1] for name in on_disk} >= set(TABLES)
        during = _counts(store_server, database)

        if fault == "stopped":
            store_server.start()  # the same port: the collector's client reconnects
        else:
            store_server.refuse_inserts = False
        engine_run("after")
        wait_until(lambda: collector.writers is not None and not any(collector.writers.depth().values()), timeout_s=60)
    finally:
        collector.stop()

    expected = {"steps": received("steps"), "requests": received("requests"), "engine_samples": 120,
                "gpu_samples": 120, "host_samples": 120, "events": 120}
    assert _counts(store_server, database) == expected
    assert during["steps"] < expected["steps"]  # the outage did hold rows back
    assert not [n for n in os.listdir(spool_dir) if n.endswith(".seg")]
    dropped = [s for m in collector.metrics.registry.collect() if m.name == "stepline_writer_rows_dropped"
               for s in m.samples if s.name.endswith("_total") and s.value]
    assert dropped == []
    if fault == "refusing":
        assert store_server.refused >= 2


def test_a_collector_started_while_its_store_is_down_collects_into_the_spool(
        store_server: StoreServer, sock_dir: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    database = f"d_{uuid.uuid4().hex[:12]}"
    store_server.stop()  # the port stays known, nothing listens on it
    settings = Settings.from_env(
        {}, store=store_server.store_url(database), metrics_port=0, query_port=0, otlp_port=0,
        plugin_socket=f"{sock_dir}/p.sock", flush_interval_s=0.1, spool_dir=str(tmp_path / "spool"),
        disabled_sources=frozenset({"vllm_metrics", "gpu", "host", "otlp"}),
    )
    collector = Collector(settings)
    collector.start()
    try:
        assert _opened(collector) is None, "the store was down: nothing to open yet"
        assert any("collecting into the spool until it answers" in r.getMessage() for r in caplog.records)
        assert collector.writers is not None
        collector.writers.write(_direct_rows(1, 30))
        wait_until(lambda: collector.writers is not None and collector.writers.spool.rows() >= 120, timeout_s=10)
        store_server.start()
        wait_until(lambda: collector.writers is not None and not any(collector.writers.depth().values()), timeout_s=60)
        assert _opened(collector) is not None  # opened, with its schema, by the first insert that got through
    finally:
        collector.stop()
    assert _counts(store_server, database) == {"steps": 0, "requests": 0, "engine_samples": 30, "gpu_samples": 30,
                                         "host_samples": 30, "events": 30}
