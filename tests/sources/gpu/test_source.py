"""The GPU source over a fake NVML: one exact row per GPU, no NVML (or no GPU) as a state retried every minute under
the runner, engines tied through the GPUs' processes, and rows that fit the store."""

from __future__ import annotations

import logging
import time
from typing import Any

import pynvml  # type: ignore[import-untyped]
import pytest
from prometheus_client import CollectorRegistry

from stepline.core.clock import ManualClock
from stepline.ingest.metrics import IngestMetrics
from stepline.ingest.runner import Runner, Scheduled, next_poll_at
from stepline.ingest.writer import Writers
from stepline.model import schema
from stepline.model.rows import Event, GpuSample, Row, micros
from stepline.sources.base import SourceContext, SourceError
from stepline.sources.gpu.source import GpuSource
from stepline.store.store import Store
from stepline.testing.fake_nvml import FakeGpuState, FakeNvml
from stepline.testing.sink import MemorySink

TICK = 0.125  # exact in binary, so 8 ticks are exactly one second


def _source(fake: FakeNvml, clock: ManualClock | None = None, **kwargs: Any) -> tuple[GpuSource, ManualClock]:
    clock = clock or ManualClock()
    return GpuSource(SourceContext("gpu-node-1", clock), fake, **kwargs), clock


def _poll(source: GpuSource) -> list[Row]:
    rows: list[Row] = []
    source.poll(rows.extend)
    return rows


def _run(source: GpuSource, clock: ManualClock, polls: int) -> list[Row]:
    rows: list[Row] = []
    for _ in range(polls):
        source.poll(rows.extend)
        clock.advance(TICK)
    return rows


def _samples(rows: list[Row], gpu: int | None = None) -> list[GpuSample]:
    return [r for r in rows if isinstance(r, GpuSample) and (gpu is None or r.gpu_index == gpu)]


def _events(rows: list[Row], kind: str) -> list[Event]:
    return [r for r in rows if isinstance(r, Event) and r.kind == kind]


def test_gpu_sample_fields_are_the_table_columns() -> None:
    assert GpuSample._fields == schema.TABLE_BY_NAME["gpu_samples"].column_names


def test_one_row_per_gpu_with_exact_values() -> None:
    fake = FakeNvml(3)
    s = fake.state(1)
    s.sm_clock_mhz, s.mem_clock_mhz, s.power_mw, s.energy_mj = 1755, 2619, 612_345, 9_000_000
    s.temp_gpu_c, s.temp_mem_c, s.util_gpu_pct, s.util_mem_pct = 71, 80, 98, 41
    s.mem_used_bytes, s.pcie_replay = 70 << 30, 3
    s.clock_event_reasons = pynvml.nvmlClocksEventReasonSwPowerCap | pynvml.nvmlClocksEventReasonHwThermalSlowdown
    s.processes = {4242: 69 << 30}
    source, clock = _source(fake)
    rows = _poll(source)
    assert [r.gpu_index for r in _samples(rows)] == [0, 1, 2]
    row = _samples(rows, 1)[0]
    assert row.ts == micros(clock.time()) and row.host == "gpu-node-1" and row.engine == ""
    assert (row.gpu_uuid, row.gpu_name) == (s.uuid, "NVIDIA H100 80GB HBM3")
    assert (row.sm_clock_mhz, row.mem_clock_mhz, row.power_w, row.energy_mj) == (1755.0, 2619.0, 612.345, 9_000_000)
    assert (row.power_instant_w, row.driver_version, row.mem_reserved_bytes) == (612.345, "570.124.06", 512 << 20)
    assert (row.remapped_rows_correctable, row.remapped_rows_uncorrectable) == (0, 0)
    assert (row.remapped_rows_pending, row.remapped_rows_failure) == (False, False)
    assert (row.temp_gpu_c, row.temp_mem_c, row.util_gpu_pct, row.util_mem_copy_pct) == (71.0, 80.0, 98.0, 41.0)
    assert (row.mem_used_bytes, row.mem_total_bytes, row.pcie_replay_total) == (70 << 30, 80 << 30, 3)
    assert row.clock_event_reasons == 0x44
    assert row.clock_event_flags == ["sw_power_cap", "hw_thermal_slowdown"]
    assert row.processes == {4242: 69 << 30}
    assert source.stats() == {"samples": 3, "unsupported_readings": 0, "xid_events": 0, "gpus_lost": 0,
                              "nvml_errors": 0}
    s.processes[1] = 1  # a row keeps what it saw
    assert row.processes == {4242: 69 << 30}


def test_no_nvml_is_a_state_retried_every_minute() -> None:
    fake = FakeNvml(2, missing=True)
    source, clock = _source(fake)
    messages = []
    for _ in range(20):
        with pytest.raises(SourceError) as err:
            _poll(source)
        messages.append(str(err.value))
        clock.advance(2.5)
    assert set(messages) == {"no NVML: NVML Shared Library Not Found"}
    assert fake.calls[("init", -1)] == 1
    clock.advance(10.0)  # 60 s after the first try
    with pytest.raises(SourceError):
        _poll(source)
    assert fake.calls[("init", -1)] == 2
    fake.missing = False  # the driver came up
    clock.advance(30.0)
    with pytest.raises(SourceError):
        _poll(source)
    clock.advance(30.0)
    assert len(_samples(_poll(source))) == 2


def _count(metrics: IngestMetrics, name: str) -> float:
    return metrics.registry.get_sample_value(name, {"source": "gpu"}) or 0.0


def test_no_nvml_under_the_runner_is_one_attempt_a_minute_not_one_a_poll(caplog: pytest.LogCaptureFixture) -> None:
    # The runner polls the GPU source at 10 Hz; without NVML it must wait for the source's own retry time.
    fake = FakeNvml(2, missing=True)
    source, clock = _source(fake)
    metrics = IngestMetrics(CollectorRegistry())
    runner = Runner([], Writers(MemorySink(), metrics), metrics, "h")
    polls = errors = 0
    next_at = clock.monotonic()
    with caplog.at_level(logging.DEBUG, logger="stepline.ingest.runner"):
        while clock.monotonic() < 300.0 + 1_700_000_000.0:  # five minutes of a 10 Hz schedule
            polls += 1
            ok = runner.poll_once(source)
            errors += not ok
            now = clock.monotonic()
            next_at = next_poll_at(next_at, now, 0.1, source.retry_in_s())
            clock.set(next_at)
    assert polls == errors == 5 and fake.calls[("init", -1)] == 5  # at 0, 60, 120, 180, 240 s
    assert _count(metrics, "stepline_source_errors_total") == 5
    assert _count(metrics, "stepline_source_up") == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == ["source gpu: no NVML: NVML Shared Library Not Found (next attempt in 60 s)"]
    fake.missing = False  # the driver came up: the next attempt (a minute later) samples
    assert source.retry_in_s() == pytest.approx(60.0 - (clock.monotonic() - 1_700_000_240.0))
    clock.set(1_700_000_300.0)
    with caplog.at_level(logging.INFO, logger="stepline.ingest.runner"):
        assert runner.poll_once(source)
    assert source.retry_in_s() == 0 and "source gpu recovered" in caplog.text
    assert _count(metrics, "stepline_source_up") == 1


def test_no_nvml_the_running_collector_polls_once_and_waits(caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeNvml(2, missing=True)
    source, _ = _source(fake)  # its clock stands still: the retry is always a minute away
    metrics = IngestMetrics(CollectorRegistry())
    writers = Writers(MemorySink(), metrics, flush_interval_s=0.01)
    runner = Runner([Scheduled(source, 0.01)], writers, metrics, "h")
    with caplog.at_level(logging.DEBUG, logger="stepline.ingest.runner"):
        runner.start()
        time.sleep(0.3)
        started = time.monotonic()
        runner.stop()
    assert time.monotonic() - started < 1.0  # the minute's wait does not hold up the stop
    assert fake.calls[("init", -1)] == 1
    assert _count(metrics, "stepline_source_errors_total") == 1 and _count(metrics, "stepline_source_up") == 0
    assert sum("NVML" in r.getMessage() for r in caplog.records) == 1


def test_next_poll_keeps_the_cadence_and_honours_a_retry() -> None:
    assert next_poll_at(10.0, 10.02, 0.1) == pytest.approx(10.1)
    assert next_poll_at(10.0, 10.35, 0.1) == pytest.approx(10.4)  # missed ticks are skipped, not bunched
    assert next_poll_at(10.0, 10.02, 0.1, 60.0) == pytest.approx(70.02)
    assert next_poll_at(10.0, 10.02, 0.1, 0.05) == pytest.approx(10.1)


def test_no_gpu_and_nvml_failing_mid_run() -> None:
    source, clock = _source(FakeNvml(0))
    with pytest.raises(SourceError, match=r"^no NVML: no GPU found$"):
        _poll(source)
    fake = FakeNvml(1)
    source, clock = _source(fake)
    _poll(source)
    fake.shutdown()  # as if the driver went away
    with pytest.raises(SourceError, match=r"^no NVML: Uninitialized$"):
        _poll(source)
    with pytest.raises(SourceError, match=r"^no NVML: Uninitialized$"):
        _poll(source)
    clock.advance(60.0)
    assert len(_samples(_poll(source))) == 1 and fake.calls[("init", -1)] == 2


def test_engine_is_tied_through_the_gpu_processes() -> None:
    fake = FakeNvml(3)
    fake.state(0).processes = {11: 1 << 30, 1234: 70 << 30}
    fake.state(1).processes = {4321: 70 << 30}
    asked: list[int] = []

    def engine_of(pid: int) -> str:
        asked.append(pid)
        return {1234: "engine-a", 4321: "engine-b"}.get(pid, "")

    source, clock = _source(fake, engine_of_pid=engine_of)
    rows = _run(source, clock, 5)
    assert [r.engine for r in _samples(rows)[:3]] == ["engine-a", "engine-b", ""]
    assert asked == [11, 1234, 4321]  # the same processes are not asked about again
    fake.state(0).processes = {999: 1}
    clock.advance(1.0)  # processes are read once a second
    assert _samples(_poll(source), 0)[0].engine == ""


def test_engine_defaults_to_the_context_engine_processes() -> None:
    fake = FakeNvml(1)
    fake.state(0).processes = {5: 1}
    ctx = SourceContext("h", ManualClock())
    ctx.engine_processes.found("vllm-0", 5)
    assert _samples(_poll(GpuSource(ctx, fake)))[0].engine == "vllm-0"


def test_samples_fit_the_store(store: Store) -> None:
    fake = FakeNvml([FakeGpuState(processes={1234: 70 << 30}, clock_event_reasons=0x41),
                     FakeGpuState(gpm=False, unsupported={"energy_mj"})])
    source, clock = _source(fake, ManualClock(time.time()), engine_of_pid=lambda pid: "engine-a")
    rows = _samples(_run(source, clock, 10))  # today: the table's TTL drops parts older than the retention
    store.insert("gpu_samples", rows, GpuSample._fields)
    got = store.query("SELECT gpu_index, engine, count(), max(power_w), max(energy_mj), any(clock_event_flags), "
                      "any(processes), countIf(isNaN(dram_bw_util_pct)) FROM gpu_samples "
                      "GROUP BY gpu_index, engine ORDER BY gpu_index").result_rows
    assert got == [
        (0, "engine-a", 10, 120.0, 0, ["gpu_idle", "hw_thermal_slowdown"], {1234: 70 << 30}, 8),
        (1, "", 10, 120.0, 0, [], {}, 10),
    ]
