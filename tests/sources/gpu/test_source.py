"""The GPU source over a fake NVML: exact values, unsupported readings, GPM, rates, XID, lost GPUs, no NVML."""

from __future__ import annotations

import ctypes
import logging
import math
import time
from typing import Any

import pynvml  # type: ignore[import-untyped]
import pytest

from stepline.core.clock import ManualClock
from stepline.core.selfmetrics import SelfMetrics
from stepline.ingest.runner import Runner, Scheduled, next_poll_at
from stepline.ingest.writer import Writers
from stepline.model import schema
from stepline.model.rows import Event, GpuSample, Row, micros
from stepline.sources import nvml
from stepline.sources.base import SourceContext, SourceError
from stepline.sources.gpu import GpuSource
from stepline.sources.nvml import (
    NvmlError,
    NvmlGone,
    NvmlMissing,
    NvmlUnsupported,
    RealNvml,
    XidEvent,
    clock_event_flags,
    nvml_error,
)
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


def test_nvml_numbers_match_pynvml() -> None:
    assert nvml.FI_DEV_MEMORY_TEMP == pynvml.NVML_FI_DEV_MEMORY_TEMP
    assert nvml.FI_DEV_NVLINK_THROUGHPUT_DATA_TX == pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX
    assert nvml.FI_DEV_NVLINK_THROUGHPUT_DATA_RX == pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX
    assert nvml.GPM_DRAM_BW_UTIL == pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL
    assert nvml.GPM_ANY_TENSOR_UTIL == pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL
    assert nvml.GPM_SM_OCCUPANCY == pynvml.NVML_GPM_METRIC_SM_OCCUPANCY
    assert nvml.GPM_PCIE_TX_PER_SEC == pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC
    assert nvml.GPM_PCIE_RX_PER_SEC == pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC
    for bit, name in nvml.CLOCK_EVENT_FLAGS:
        camel = "".join(part.capitalize() for part in name.removeprefix("pynvml_only_").split("_"))
        assert getattr(pynvml, f"nvmlClocksThrottleReason{camel}") == bit, name
        if bit <= 0x100:
            assert getattr(pynvml, f"nvmlClocksEventReason{camel}") == bit, name
        else:  # in pynvml only, in no nvml.h: named as such
            assert not hasattr(pynvml, f"nvmlClocksEventReason{camel}") and name.startswith("pynvml_only_"), name
    assert clock_event_flags(pynvml.nvmlClocksEventReasonAll) == [n for _, n in nvml.CLOCK_EVENT_FLAGS[:9]]
    codes = {pynvml.NVML_ERROR_NOT_SUPPORTED: NvmlUnsupported, pynvml.NVML_ERROR_NO_PERMISSION: NvmlUnsupported,
             pynvml.NVML_ERROR_FUNCTION_NOT_FOUND: NvmlUnsupported, pynvml.NVML_ERROR_GPU_IS_LOST: NvmlGone,
             pynvml.NVML_ERROR_GPU_NOT_FOUND: NvmlGone, pynvml.NVML_ERROR_LIBRARY_NOT_FOUND: NvmlMissing,
             pynvml.NVML_ERROR_UNINITIALIZED: NvmlMissing, pynvml.NVML_ERROR_DRIVER_NOT_LOADED: NvmlMissing,
             pynvml.NVML_ERROR_UNKNOWN: NvmlGone, pynvml.NVML_ERROR_RESET_REQUIRED: NvmlGone,
             pynvml.NVML_ERROR_TIMEOUT: NvmlError}
    for code, kind in codes.items():
        assert type(nvml_error(code, "x")) is kind, code


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


def test_an_unsupported_reading_is_reported_once_and_never_asked_again() -> None:
    fake = FakeNvml(2)
    # Without nvmlDeviceGetFieldValues, the readings that have a call of their own fall back to it.
    fake.state(1).unsupported |= {"energy_mj", "pcie_replay_counter", "field_values", "clock_event_reasons",
                                  "processes", "register_xid_events", "remapped_rows"}
    fake.state(1).gpm = False
    source, clock = _source(fake)
    rows = _run(source, clock, 50)
    unsupported = _events(rows, "gpu_reading_unsupported")
    assert sorted(e.attributes["reading"] for e in unsupported) == [
        "clock_events", "energy", "fields", "gpm", "pcie_replay", "processes", "remap", "xid"]
    assert all(e.attributes["gpu"] == "1" and e.severity == "info" and e.source == "gpu" for e in unsupported)
    assert unsupported[0].attributes["uuid"] == fake.state(1).uuid
    for call in ("energy_mj", "pcie_replay_counter", "field_values", "clock_event_reasons",
                 "processes", "register_xid_events", "gpm_supported", "remapped_rows"):
        assert fake.calls[(call, 1)] == 1, call
        assert fake.calls[(call, 0)] in (0, 1, 7, 50), call  # 7: once a second over 50 polls of 1/8 s
    assert fake.calls[("gpm_sample", 1)] == 0
    assert fake.calls[("power_mw", 1)] == 50 and fake.calls[("power_mw", 0)] == 0  # the field's fallback
    last = _samples(rows, 1)[-1]
    assert last.energy_mj is None and last.pcie_replay_total is None and last.clock_event_reasons == 0
    assert math.isnan(last.temp_mem_c) and math.isnan(last.nvlink_tx_bytes_per_s) and last.processes == {}
    assert last.clock_event_flags == [] and not math.isnan(last.temp_gpu_c) and last.power_w == 120.0
    assert math.isnan(last.power_instant_w) and last.remapped_rows_pending is None
    assert source.stats()["unsupported_readings"] == 8


def test_a_failing_call_is_counted_and_asked_again() -> None:
    fake = FakeNvml(1)
    fake.state(0).failing.add("utilization")
    source, clock = _source(fake)
    rows = _run(source, clock, 5)
    assert all(math.isnan(r.util_gpu_pct) for r in _samples(rows))
    assert fake.calls[("utilization", 0)] == 5
    assert source.stats()["nvml_errors"] == 5 and not _events(rows, "gpu_reading_unsupported")
    fake.state(0).failing.clear()
    assert _samples(_poll(source))[0].util_gpu_pct == 0.0


def test_gpm_is_sampled_once_per_interval_and_carried_forward_nan_without_it() -> None:
    fake = FakeNvml([FakeGpuState(dram_bw_util_pct=61.5, tensor_active_pct=40.0, sm_occupancy_pct=22.25,
                                  pcie_tx_kbs=2048, pcie_rx_kbs=512),
                     FakeGpuState(name="NVIDIA A100-SXM4-80GB", gpm=False, pcie_tx_kbs=2048, pcie_rx_kbs=512)])
    source, clock = _source(fake)
    rows = _run(source, clock, 24)  # 3 s at 8 Hz
    assert fake.calls[("gpm_sample", 0)] == 3 and fake.calls[("gpm_metrics", 0)] == 2
    hopper = _samples(rows, 0)
    assert all(math.isnan(r.dram_bw_util_pct) for r in hopper[:8])  # one sample is no interval yet
    assert all((r.dram_bw_util_pct, r.tensor_active_pct, r.sm_occupancy_pct) == (61.5, 40.0, 22.25)
               for r in hopper[8:])
    ampere = _samples(rows, 1)
    assert all(math.isnan(r.dram_bw_util_pct) and math.isnan(r.sm_occupancy_pct) for r in ampere)
    assert [e.attributes["gpu"] for e in _events(rows, "gpu_reading_unsupported")] == ["1"]
    assert fake.calls[("gpm_sample", 1)] == 0
    fake.state(0).dram_bw_util_pct = 90.0  # shows only at the next interval
    later = _samples(_run(source, clock, 8), 0)
    assert [r.dram_bw_util_pct for r in later] == [90.0] + [90.0] * 7


def test_gpm_that_fails_gives_nan_and_close_starts_again() -> None:
    fake = FakeNvml([FakeGpuState(dram_bw_util_pct=50.0)])
    source, clock = _source(fake)
    assert _samples(_run(source, clock, 9))[-1].dram_bw_util_pct == 50.0
    fake.state(0).failing.add("gpm_metrics")
    rows = _samples(_run(source, clock, 8))
    assert math.isnan(rows[-1].dram_bw_util_pct) and source.stats()["nvml_errors"] == 1
    source.close()
    assert not fake.initialised
    assert len(_samples(_poll(source))) == 1 and fake.calls[("init", -1)] == 2


def test_pcie_from_the_byte_counter_fields_or_gpm_never_the_blocking_call() -> None:
    fake = FakeNvml([FakeGpuState(gpm=False, pcie_tx_kbs=100, pcie_rx_kbs=10), FakeGpuState(pcie_tx_kbs=2048)])
    fake.state(1).unsupported |= {f"field:{field}" for field in (nvml.FI_DEV_PCIE_COUNT_TX_BYTES,
                                                                 nvml.FI_DEV_PCIE_COUNT_RX_BYTES)}
    source, clock = _source(fake)
    rows: list[Row] = []
    for _ in range(16):
        source.poll(rows.extend)
        clock.advance(TICK)
        for state in fake.devices:
            state.advance(TICK)
    counted = _samples(rows, 0)
    assert math.isnan(counted[0].pcie_tx_bytes_per_s)  # one reading is no rate yet
    assert all((r.pcie_tx_bytes_per_s, r.pcie_rx_bytes_per_s) == (100 * 1024, 10 * 1024) for r in counted[1:])
    via_gpm = _samples(rows, 1)  # no byte counters: GPM's PCIe metrics, once a GPM interval
    assert via_gpm[-1].pcie_tx_bytes_per_s == 2048 * 1024 and math.isnan(via_gpm[0].pcie_tx_bytes_per_s)
    assert not any("pcie_throughput" in call for call, _ in fake.calls)
    assert {e.attributes["reading"] for e in _events(rows, "gpu_reading_unsupported")} == {"pcie_tx", "pcie_rx", "gpm"}


def test_nvlink_counters_become_rates_over_the_fields_own_timestamps() -> None:
    fake = FakeNvml(1)
    state = fake.state(0)
    state.nvlink_tx_kib, state.nvlink_rx_kib = 1_000_000, 5_000
    source, clock = _source(fake)
    first = _samples(_poll(source))[0]
    assert math.isnan(first.nvlink_tx_bytes_per_s) and math.isnan(first.nvlink_rx_bytes_per_s)
    clock.advance(0.1)  # the poll's clock moved 0.1 s, the driver's counter 0.5 s
    state.field_ts_us += 500_000
    state.nvlink_tx_kib += 500_000
    state.nvlink_rx_kib += 1_000
    row = _samples(_poll(source))[0]
    assert (row.nvlink_tx_bytes_per_s, row.nvlink_rx_bytes_per_s) == (500_000 * 1024 / 0.5, 1_000 * 1024 / 0.5)
    clock.advance(0.1)  # not refreshed by the driver since: the last rate stands
    assert _samples(_poll(source))[0].nvlink_tx_bytes_per_s == 500_000 * 1024 / 0.5
    clock.advance(0.5)
    state.field_ts_us += 500_000
    state.nvlink_tx_kib, state.nvlink_rx_kib = 10, 1  # driver reloaded: counters start again
    assert math.isnan(_samples(_poll(source))[0].nvlink_tx_bytes_per_s)
    clock.advance(0.25)
    state.field_ts_us += 250_000
    state.nvlink_tx_kib, state.nvlink_rx_kib = 266, 1
    row = _samples(_poll(source))[0]
    assert (row.nvlink_tx_bytes_per_s, row.nvlink_rx_bytes_per_s) == (256 * 1024 / 0.25, 0.0)


def test_xid_becomes_a_critical_event() -> None:
    fake = FakeNvml(2)
    fake.state(1).processes = {77: 1}
    source, _ = _source(fake, engine_of_pid=lambda pid: "vllm-b" if pid == 77 else "")
    _poll(source)
    fake.inject_xid(1, 79)
    fake.inject_xid(0, 4242)
    rows = _poll(source)
    xids = _events(rows, "gpu_xid")
    uuid = fake.state(1).uuid
    assert xids[0].message == f"GPU 1 ({uuid}) reported XID 79: GPU has fallen off the bus"
    assert (xids[0].severity, xids[0].engine, xids[0].source) == ("critical", "vllm-b", "gpu")
    assert xids[0].attributes == {"xid": "79", "gpu": "1", "uuid": uuid}
    assert xids[1].message.endswith("reported XID 4242: see NVIDIA's XID catalogue")
    assert source.stats()["xid_events"] == 2
    assert not _events(_poll(source), "gpu_xid")


def test_xid_of_a_gpu_that_cannot_register_is_not_reported() -> None:
    fake = FakeNvml(1)
    fake.state(0).unsupported.add("register_xid_events")
    source, _ = _source(fake)
    _poll(source)
    fake.inject_xid(0, 13)
    assert not _events(_poll(source), "gpu_xid")
    assert fake.calls[("wait_xid", -1)] == 0  # nothing registered: nothing to wait for


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


def _count(metrics: SelfMetrics, name: str) -> float:
    return metrics.registry.get_sample_value(name, {"source": "gpu"}) or 0.0


def test_no_nvml_under_the_runner_is_one_attempt_a_minute_not_one_a_poll(caplog: pytest.LogCaptureFixture) -> None:
    # The runner polls the GPU source at 10 Hz; without NVML it must wait for the source's own retry time.
    fake = FakeNvml(2, missing=True)
    source, clock = _source(fake)
    metrics = SelfMetrics()
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
    metrics = SelfMetrics()
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


def test_real_nvml_on_a_machine_without_a_gpu() -> None:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        pass
    else:
        pytest.skip("this machine has libnvidia-ml")
    with pytest.raises(NvmlMissing, match="NVML Shared Library Not Found"):
        RealNvml().init()
    source = GpuSource(SourceContext("h", ManualClock()))
    for _ in range(3):
        with pytest.raises(SourceError, match=r"^no NVML: NVML Shared Library Not Found$"):
            _poll(source)


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


def test_a_gpu_that_disappears_is_reported_once_and_the_others_keep_coming() -> None:
    fake = FakeNvml(3)
    source, clock = _source(fake)
    _run(source, clock, 2)
    fake.remove(1)
    rows = _run(source, clock, 10)
    lost = _events(rows, "gpu_lost")
    assert len(lost) == 1 and lost[0].severity == "critical"
    assert lost[0].attributes == {"gpu": "1", "uuid": fake.state(1).uuid, "error": "GPU_IS_LOST"}
    assert lost[0].message.startswith(f"GPU 1 ({fake.state(1).uuid}) was lost: GPU is lost")
    assert [r.gpu_index for r in _samples(rows)] == [0, 2] * 10
    assert fake.calls[("field_values", 1)] == 3 and source.stats()["gpus_lost"] == 1  # the third found it lost
    fake.remove(0)
    fake.remove(2)
    with pytest.raises(SourceError, match=r"^no NVML: every GPU was lost$"):
        _poll(source)
    clock.advance(60.0)
    with pytest.raises(SourceError, match=r"^no NVML: every GPU was lost$"):
        _poll(source)  # re-discovered, still lost: no new gpu_lost events
    assert source.stats()["gpus_lost"] == 3


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


class _StubError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value


class _StubPynvml:
    """Just enough of pynvml's surface to drive RealNvml's own logic without a GPU."""

    NVMLError = _StubError
    NVML_TEMPERATURE_GPU = 0
    c_nvmlGpmMetricsGet_t = pynvml.c_nvmlGpmMetricsGet_t
    NVML_GPM_METRICS_GET_VERSION = 1
    nvmlEventTypeXidCriticalError = pynvml.nvmlEventTypeXidCriticalError

    def __init__(self) -> None:
        self.xids: list[tuple[int, int]] = []
        self.freed: list[object] = []

    def nvmlInit(self) -> None: ...

    def nvmlShutdown(self) -> None: ...

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: int) -> int:
        raise _StubError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h: int) -> int:
        return 0x44

    def nvmlDeviceGetTemperatureV(self, h: int, sensor: int) -> int:
        raise _StubError(pynvml.NVML_ERROR_GPU_IS_LOST)

    def nvmlDeviceGetFieldValues(self, h: int, fields: list[tuple[int, int]]) -> Any:
        values = (pynvml.c_nvmlFieldValue_t * len(fields))()
        for v, (field_id, scope) in zip(values, fields, strict=True):
            v.fieldId, v.scopeId = field_id, scope
            if field_id == nvml.FI_DEV_MEMORY_TEMP:
                v.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
            else:
                v.valueType, v.value.ullVal = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, 2**40 + field_id
        return values

    def nvmlGpmSampleAlloc(self) -> object:
        return pynvml.c_nvmlGpmSample_t()

    def nvmlGpmSampleGet(self, h: int, sample: object) -> object:
        return sample

    def nvmlGpmSampleFree(self, sample: object) -> None:
        self.freed.append(sample)

    def nvmlGpmMetricsGet(self, mg: Any) -> Any:
        for i in range(mg.numMetrics):
            mg.metrics[i].value = 10.0 * mg.metrics[i].metricId
            mg.metrics[i].nvmlReturn = 0 if i else pynvml.NVML_ERROR_NOT_SUPPORTED
        return mg

    def nvmlEventSetCreate(self) -> str:
        return "set"

    def nvmlDeviceRegisterEvents(self, h: int, types: int, event_set: str) -> None: ...

    def nvmlEventSetFree(self, event_set: str) -> None: ...

    def nvmlEventSetWait_v2(self, event_set: str, timeout_ms: int) -> Any:
        if not self.xids:
            raise _StubError(pynvml.NVML_ERROR_TIMEOUT)
        device, code = self.xids.pop(0)
        return type("Data", (), {"device": device, "eventData": code})()

    def nvmlDeviceGetIndex(self, device: int) -> int:
        if device == 99:
            raise _StubError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return device

    def nvmlDeviceGetUUID(self, device: int) -> str:
        return f"GPU-{device}"


def test_real_nvml_translates_pynvml() -> None:
    stub = _StubPynvml()
    real = RealNvml(stub)
    with pytest.raises(NvmlMissing):
        real.power_mw(0)  # before init
    real.init()
    assert real.clock_event_reasons(0) == 0x44  # older driver: falls back to the throttle-reasons call
    assert real.clock_event_reasons(0) == 0x44
    with pytest.raises(NvmlGone):
        real.temperature_c(0, "gpu")
    with pytest.raises(NvmlUnsupported):
        real.temperature_c(0, "memory")
    assert [r.value for r in real.field_values(0, nvml.NVLINK_FIELDS)] == [2**40 + 138, 2**40 + 139]
    a, b, c = real.gpm_sample(1), real.gpm_sample(1), real.gpm_sample(1)
    assert a is c and a is not b  # two buffers per device
    metrics = real.gpm_metrics(a, b, nvml.GPM_METRICS + nvml.GPM_PCIE_METRICS)
    assert math.isnan(metrics[0].value) and metrics[0].code == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert [m.value for m in metrics[1:]] == [50.0, 30.0, 20.0, 10.0, 200.0, 210.0]
    assert real.wait_xid(0) is None  # nothing registered
    real.register_xid_events(3)
    stub.xids.append((3, 48))
    assert real.wait_xid(0) == XidEvent(3, "GPU-3", 48)
    assert real.wait_xid(0) is None  # NVML_ERROR_TIMEOUT
    stub.xids.append((99, 79))
    assert real.wait_xid(0) == XidEvent(-1, "", 79)  # fell off the bus: the XID still counts
    real.shutdown()
    assert len(stub.freed) == 2


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
