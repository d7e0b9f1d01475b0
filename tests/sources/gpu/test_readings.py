"""One GPU's readings as a real H100/H200 gives them (issue 17): unsupported readings reported once and never asked
again, failed counters NULL, counter rates over the driver's own timestamps, both powers, GPM once an interval that
survives a failed sample, a refused metric or a failed probe, PCIe without the blocking call, row remapping, reserved
memory, and few NVML calls per GPU per poll."""

from __future__ import annotations

import math
import time

from stepline.core.clock import ManualClock
from stepline.model.rows import GpuSample, Row
from stepline.sources.gpu import nvml
from stepline.sources.gpu.events import GpuEvents
from stepline.sources.gpu.nvml import INIT_RETRY_S, FieldReading, RemappedRows
from stepline.sources.gpu.readings import Gpu, GpuReader
from stepline.sources.gpu.source import GpuSource
from stepline.store.store import Store
from stepline.testing.fake_nvml import FakeGpuState, FakeNvml
from tests.sources.gpu.test_source import TICK, _events, _poll, _run, _samples, _source


def _drive(source: GpuSource, clock: ManualClock, fake: FakeNvml, polls: int) -> list[GpuSample]:
    """Samples of `polls` polls while the fake's counters and timestamps move on with the clock."""
    rows: list[Row] = []
    for _ in range(polls):
        source.poll(rows.extend)
        clock.advance(TICK)
        for state in fake.devices:
            state.advance(TICK)
    return [r for r in rows if isinstance(r, GpuSample)]


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


def test_a_narrow_counter_that_wraps_keeps_its_rate_a_64_bit_one_going_back_does_not() -> None:
    clock = ManualClock()
    reader = GpuReader(FakeNvml(1), GpuEvents(clock, "h"), clock, gpm_interval_s=1.0, slow_interval_s=1.0)
    gpu = Gpu(0, "GPU-0", "H100", 0, {})

    def tx(timestamp_us: int, value: float, wrap: int) -> dict[str, FieldReading]:
        return {"pcie_tx": FieldReading(value, timestamp_us, 0, wrap)}

    assert math.isnan(reader.rate(gpu, tx(0, 2**32 - 1000, 2**32), "pcie_tx", 1.0))  # one reading is no rate yet
    assert reader.rate(gpu, tx(500_000, 1000, 2**32), "pcie_tx", 1.0) == 2000 / 0.5  # wrapped past 2**32
    assert reader.rate(gpu, tx(500_000, 1500, 2**32), "pcie_tx", 1.0) == 2000 / 0.5  # not refreshed: it stands
    assert math.isnan(reader.rate(gpu, tx(1_000_000, 10, 2**64), "pcie_tx", 1.0))  # a reset (driver reload)


def test_a_failed_gpm_probe_is_asked_again_then_given_up_counted() -> None:
    fake = FakeNvml([FakeGpuState(dram_bw_util_pct=61.5), FakeGpuState(dram_bw_util_pct=12.0)])
    for state in fake.devices:
        state.failing.add("gpm_supported")
    source, clock = _source(fake)
    rows = _run(source, clock, 8)
    assert not _events(rows, "gpu_reading_unsupported") and fake.calls[("gpm_sample", 0)] == 0
    fake.state(0).failing.clear()
    for _ in range(2):
        clock.advance(INIT_RETRY_S)
        rows += _run(source, clock, 24)
    assert fake.calls[("gpm_supported", 0)] == 2 and fake.calls[("gpm_supported", 1)] == 3
    assert _samples(rows, 0)[-1].dram_bw_util_pct == 61.5
    gave_up = _events(rows, "gpu_reading_unsupported")
    assert [(e.attributes["gpu"], e.attributes["reading"]) for e in gave_up] == [("1", "gpm")]
    assert "failed 3 times" in gave_up[0].message
    clock.advance(INIT_RETRY_S)
    _run(source, clock, 8)
    assert fake.calls[("gpm_supported", 1)] == 3 and fake.calls[("gpm_sample", 1)] == 0
    assert all(math.isnan(r.dram_bw_util_pct) for r in _samples(rows, 1))


def test_a_failed_counter_read_is_null_never_zero() -> None:
    fake = FakeNvml(1)
    state = fake.state(0)
    state.energy_mj, state.pcie_replay = 5_000_000_000, 7
    state.transient[f"field:{nvml.FI_DEV_TOTAL_ENERGY_CONSUMPTION}"] = 1
    state.transient[f"field:{nvml.FI_DEV_PCIE_REPLAY_COUNTER}"] = 1
    source, clock = _source(fake)
    rows = _drive(source, clock, fake, 3)
    assert [r.energy_mj for r in rows] == [None, 5_000_000_000 + 15_000, 5_000_000_000 + 30_000]
    assert [r.pcie_replay_total for r in rows] == [None, 7, 7]
    assert source.stats()["nvml_errors"] == 2 and source.stats()["unsupported_readings"] == 0


def test_a_failed_memory_read_is_null_never_zero() -> None:
    fake = FakeNvml([FakeGpuState(mem_used_bytes=70 << 30)])
    fake.state(0).transient["memory"] = 1  # the first once-a-second read fails; the next one, a second on, answers
    source, clock = _source(fake)
    rows = _drive(source, clock, fake, 9)
    assert {(r.mem_used_bytes, r.mem_total_bytes, r.mem_reserved_bytes) for r in rows[:8]} == {(None, None, None)}
    assert (rows[8].mem_used_bytes, rows[8].mem_total_bytes, rows[8].mem_reserved_bytes) == (
        70 << 30, 80 << 30, 512 << 20)
    assert source.stats()["nvml_errors"] == 1 and source.stats()["unsupported_readings"] == 0


def test_counter_rollups_pass_over_a_failed_read(store: Store) -> None:
    fake = FakeNvml(1)
    fake.state(0).energy_mj = 5_000_000_000
    source, clock = _source(fake, ManualClock(time.time() // 60 * 60))
    fake.state(0).transient[f"field:{nvml.FI_DEV_TOTAL_ENERGY_CONSUMPTION}"] = 1
    rows = _drive(source, clock, fake, 8 * 10)  # 10 s at 120 W, 15 J a poll; the first read failed
    store.insert("gpu_samples", rows, GpuSample._fields)
    got = store.query("SELECT (max(energy_mj) - min(energy_mj)) / 1000, countIf(energy_mj IS NULL) "
                      "FROM gpu_samples").result_rows
    assert got == [(78 * 15.0, 1)]  # from the second reading to the 80th; with a 0 it was 5,001,185 J


def test_power_average_and_instant_are_both_kept() -> None:
    fake = FakeNvml([FakeGpuState(power_mw=400_000, power_instant_mw=650_500)])
    source, clock = _source(fake)
    row = _drive(source, clock, fake, 1)[0]
    assert (row.power_w, row.power_instant_w) == (400.0, 650.5)
    assert fake.calls[("power_mw", 0)] == 0  # the average comes in the one field call


def test_one_refused_gpm_metric_costs_only_that_metric() -> None:
    # A GPU without PCIe byte fields asks GPM for PCIe, and this driver refuses the whole call for it.
    state = FakeGpuState(dram_bw_util_pct=61.5, tensor_active_pct=40.0, sm_occupancy_pct=22.0, sm_util_pct=88.0,
                         graphics_util_pct=95.0, refused_gpm={nvml.GPM_PCIE_TX_PER_SEC})
    state.unsupported |= {f"field:{nvml.FI_DEV_PCIE_COUNT_TX_BYTES}", f"field:{nvml.FI_DEV_PCIE_COUNT_RX_BYTES}"}
    fake = FakeNvml([state])
    source, clock = _source(fake)
    rows = _drive(source, clock, fake, 8 * 4)
    last = rows[-1]
    assert (last.dram_bw_util_pct, last.tensor_active_pct, last.sm_occupancy_pct) == (61.5, 40.0, 22.0)
    assert (last.sm_active_pct, last.graphics_active_pct) == (88.0, 95.0)
    assert math.isnan(last.pcie_tx_bytes_per_s)
    assert last.pcie_rx_bytes_per_s == 0.0  # the metric the driver does give
    # Refused once, then never asked again: three intervals, one split into single metrics.
    assert fake.calls[("gpm_metrics", 0)] == 3 + 7


def test_row_remapping_reserved_memory_and_driver_version() -> None:
    fake = FakeNvml(2)
    fake.state(1).remapped_rows = RemappedRows(3, 1, True, False)
    fake.state(1).mem_reserved_bytes = 519 << 20
    fake.driver = "570.124.06"
    source, clock = _source(fake)
    rows = _drive(source, clock, fake, 16)
    gpu1 = [r for r in rows if r.gpu_index == 1]
    assert {(r.remapped_rows_correctable, r.remapped_rows_uncorrectable, r.remapped_rows_pending,
             r.remapped_rows_failure) for r in gpu1} == {(3, 1, True, False)}
    assert {r.mem_reserved_bytes for r in gpu1} == {519 << 20}
    assert {r.driver_version for r in rows} == {"570.124.06"}
    assert fake.calls[("driver_version", -1)] == 1
    assert fake.calls[("remapped_rows", 1)] == 2  # once a second


def test_few_nvml_calls_per_gpu_per_poll() -> None:
    fake = FakeNvml(1)
    source, clock = _source(fake)
    _drive(source, clock, fake, 80)  # 10 s
    calls = sum(n for (_, index), n in fake.calls.items() if index == 0 and _ != "handle")
    per_poll = calls / 80
    # 5 calls a poll (one of them the field call) + 4 once a second + GPM's 2 a second, at 8 polls a second.
    assert per_poll < 6.5, dict(fake.calls)
    assert fake.calls[("field_values", 0)] == 80 and fake.calls[("processes", 0)] == 10
