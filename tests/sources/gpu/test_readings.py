"""GPU readings as a real H100/H200 gives them (issue 17): failed counters are NULL, counter rates over the
driver's own timestamps, both powers, GPM that survives a failed sample or a refused metric, row remapping,
reserved memory, the driver version, and few NVML calls per GPU per poll."""

from __future__ import annotations

import math
import time

import pynvml  # type: ignore[import-untyped]

from stepline.core.clock import ManualClock
from stepline.model import schema
from stepline.model.rows import GpuSample, Row
from stepline.sources import nvml
from stepline.sources.base import SourceContext
from stepline.sources.gpu import GpuSource
from stepline.sources.nvml import RealNvml, RemappedRows
from stepline.store.store import Store
from stepline.testing.fake_nvml import FakeGpuState, FakeNvml

TICK = 0.125


def _source(fake: FakeNvml, clock: ManualClock | None = None) -> tuple[GpuSource, ManualClock]:
    clock = clock or ManualClock()
    return GpuSource(SourceContext("h", clock), fake), clock


def _run(source: GpuSource, clock: ManualClock, fake: FakeNvml, polls: int) -> list[GpuSample]:
    rows: list[Row] = []
    for _ in range(polls):
        source.poll(rows.extend)
        clock.advance(TICK)
        for state in fake.devices:
            state.advance(TICK)
    return [r for r in rows if isinstance(r, GpuSample)]


def test_new_nvml_numbers_match_pynvml() -> None:
    for ours, theirs in ((nvml.FI_DEV_TOTAL_ENERGY_CONSUMPTION, "NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION"),
                         (nvml.FI_DEV_PCIE_REPLAY_COUNTER, "NVML_FI_DEV_PCIE_REPLAY_COUNTER"),
                         (nvml.FI_DEV_POWER_AVERAGE, "NVML_FI_DEV_POWER_AVERAGE"),
                         (nvml.FI_DEV_POWER_INSTANT, "NVML_FI_DEV_POWER_INSTANT"),
                         (nvml.FI_DEV_PCIE_COUNT_TX_BYTES, "NVML_FI_DEV_PCIE_COUNT_TX_BYTES"),
                         (nvml.FI_DEV_PCIE_COUNT_RX_BYTES, "NVML_FI_DEV_PCIE_COUNT_RX_BYTES"),
                         (nvml.GPM_SM_UTIL, "NVML_GPM_METRIC_SM_UTIL"),
                         (nvml.GPM_GRAPHICS_UTIL, "NVML_GPM_METRIC_GRAPHICS_UTIL")):
        assert ours == getattr(pynvml, theirs), theirs
    for name in ("nvmlDeviceGetRemappedRows", "nvmlSystemGetDriverVersion", "nvmlDeviceGetFieldValues",
                 "nvmlDeviceGetMemoryInfo", "nvmlMemory_v2"):
        assert hasattr(pynvml, name), name
    assert {n for n, _ in pynvml.c_nvmlMemory_v2_t._fields_} >= {"reserved", "total", "free"}
    assert {n for n, _ in pynvml.c_nvmlFieldValue_t._fields_} >= {"timestamp", "nvmlReturn", "valueType"}


def test_a_failed_counter_read_is_null_never_zero() -> None:
    fake = FakeNvml(1)
    state = fake.state(0)
    state.energy_mj, state.pcie_replay = 5_000_000_000, 7
    state.transient[f"field:{nvml.FI_DEV_TOTAL_ENERGY_CONSUMPTION}"] = 1
    state.transient[f"field:{nvml.FI_DEV_PCIE_REPLAY_COUNTER}"] = 1
    source, clock = _source(fake)
    rows = _run(source, clock, fake, 3)
    assert [r.energy_mj for r in rows] == [None, 5_000_000_000 + 15_000, 5_000_000_000 + 30_000]
    assert [r.pcie_replay_total for r in rows] == [None, 7, 7]
    assert source.stats()["nvml_errors"] == 2 and source.stats()["unsupported_readings"] == 0


def test_counter_rollups_pass_over_a_failed_read(store: Store) -> None:
    fake = FakeNvml(1)
    fake.state(0).energy_mj = 5_000_000_000
    source, clock = _source(fake, ManualClock(time.time() // 60 * 60))
    fake.state(0).transient[f"field:{nvml.FI_DEV_TOTAL_ENERGY_CONSUMPTION}"] = 1
    rows = _run(source, clock, fake, 8 * 10)  # 10 s at 120 W, 15 J a poll; the first read failed
    store.insert("gpu_samples", rows, GpuSample._fields)
    got = store.query("SELECT (max(energy_mj) - min(energy_mj)) / 1000, countIf(energy_mj IS NULL) "
                      "FROM gpu_samples").result_rows
    assert got == [(78 * 15.0, 1)]  # from the second reading to the 80th; with a 0 it was 5,001,185 J


def test_a_version_2_store_gets_nullable_counters_in_place(store: Store) -> None:
    db = store.database
    table = schema.TABLE_BY_NAME["gpu_samples"]
    for projection in table.projections:
        store.client.command(f"ALTER TABLE `{db}`.gpu_samples DROP PROJECTION `{projection.name}`")
    for name, after in (("energy_mj", "power_w"), ("pcie_replay_total", "pcie_rx_bytes_per_s")):  # as version 2
        store.client.command(f"ALTER TABLE `{db}`.gpu_samples DROP COLUMN `{name}`")
        store.client.command(f"ALTER TABLE `{db}`.gpu_samples ADD COLUMN `{name}` UInt64 CODEC(Delta, ZSTD(1)) "
                             f"AFTER `{after}`")
    for projection in table.projections:
        for statement in schema.add_projection_sql(db, table, projection):
            store.client.command(statement)
    store.client.command(f"INSERT INTO `{db}`.gpu_samples (ts, host, gpu_index, energy_mj, pcie_replay_total) "
                         "VALUES (now64(6), 'h', 0, 9000, 0), (now64(6), 'h', 0, 0, 0), (now64(6), 'h', 0, 12000, 1)")
    store.ensure_schema(30)
    types = {str(n): str(t) for n, t in store.query("SELECT name, type FROM system.columns WHERE "
                                                     "database = {db:String} AND table = 'gpu_samples'",
                                                     parameters={"db": db}).result_rows}
    assert types["energy_mj"] == types["pcie_replay_total"] == "Nullable(UInt64)"
    projections = [r[0] for r in store.query("SELECT name FROM system.projections WHERE database = {db:String} "
                                             "AND table = 'gpu_samples'", parameters={"db": db}).result_rows]
    assert projections == [p.name for p in table.projections]
    for _ in range(100):  # the zero-to-NULL mutation runs in the background
        got = store.query("SELECT max(energy_mj) - min(energy_mj), max(pcie_replay_total) - min(pcie_replay_total) "
                          "FROM gpu_samples").result_rows
        if got == [(3000, 1)]:
            break
        time.sleep(0.05)
    assert got == [(3000, 1)]  # the version-2 zero was a failed read: passed over, not 12 J since load
    assert store.schema_version() == schema.SCHEMA_VERSION == 3


def test_power_average_and_instant_are_both_kept() -> None:
    fake = FakeNvml([FakeGpuState(power_mw=400_000, power_instant_mw=650_500)])
    source, clock = _source(fake)
    row = _run(source, clock, fake, 1)[0]
    assert (row.power_w, row.power_instant_w) == (400.0, 650.5)
    assert fake.calls[("power_mw", 0)] == 0  # the average comes in the one field call


class _GpmStub:
    """pynvml's GPM surface: nvmlGpmSampleGet fills the buffer it is given, or fails when told to."""

    NVMLError = type("StubError", (Exception,), {"value": 0})
    c_nvmlGpmMetricsGet_t = pynvml.c_nvmlGpmMetricsGet_t
    NVML_GPM_METRICS_GET_VERSION = 1

    def __init__(self) -> None:
        self.fail_next = False

    def nvmlInit(self) -> None: ...

    def nvmlGpmSampleAlloc(self) -> object:
        return pynvml.c_nvmlGpmSample_t()

    def nvmlGpmSampleGet(self, h: int, sample: object) -> object:
        if self.fail_next:
            self.fail_next = False
            error = self.NVMLError()
            error.value = pynvml.NVML_ERROR_TIMEOUT
            raise error
        return sample


def test_a_failed_gpm_sample_does_not_flip_the_buffer() -> None:
    stub = _GpmStub()
    real = RealNvml(stub)
    real.init()
    a = real.gpm_sample(0)
    stub.fail_next = True
    try:
        real.gpm_sample(0)
    except nvml.NvmlError:
        pass  # what the source counts as a failed reading
    else:
        raise AssertionError("the stub's sample should have failed")
    b = real.gpm_sample(0)
    assert a is not b  # the interval spans two buffers, never one twice
    assert real.gpm_sample(0) is a  # and the buffers alternate from there


def test_one_refused_gpm_metric_costs_only_that_metric() -> None:
    # A GPU without PCIe byte fields asks GPM for PCIe, and this driver refuses the whole call for it.
    state = FakeGpuState(dram_bw_util_pct=61.5, tensor_active_pct=40.0, sm_occupancy_pct=22.0, sm_util_pct=88.0,
                         graphics_util_pct=95.0, refused_gpm={nvml.GPM_PCIE_TX_PER_SEC})
    state.unsupported |= {f"field:{nvml.FI_DEV_PCIE_COUNT_TX_BYTES}", f"field:{nvml.FI_DEV_PCIE_COUNT_RX_BYTES}"}
    fake = FakeNvml([state])
    source, clock = _source(fake)
    rows = _run(source, clock, fake, 8 * 4)
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
    rows = _run(source, clock, fake, 16)
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
    _run(source, clock, fake, 80)  # 10 s
    calls = sum(n for (_, index), n in fake.calls.items() if index == 0 and _ != "handle")
    per_poll = calls / 80
    # 5 calls a poll (one of them the field call) + 4 once a second + GPM's 2 a second, at 8 polls a second.
    assert per_poll < 6.5, dict(fake.calls)
    assert fake.calls[("field_values", 0)] == 80 and fake.calls[("processes", 0)] == 10
