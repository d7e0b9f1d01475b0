"""FakeNvml: several GPUs behind the `Nvml` protocol, answering as NVML does, and failing as NVML fails (unsupported
readings, timeouts that pass, lost GPUs, XID events), with every call counted."""

from __future__ import annotations

import math

import pytest

from stepline.sources.gpu.nvml import (
    FI_DEV_POWER_INSTANT,
    FI_DEV_TOTAL_ENERGY_CONSUMPTION,
    GPM_DRAM_BW_UTIL,
    Nvml,
    NvmlError,
    NvmlGone,
    NvmlMissing,
    NvmlUnsupported,
    XidEvent,
)
from stepline.testing.fake_nvml import RESET_REQUIRED, FakeGpuState, FakeNvml


def _up(devices: int = 2) -> FakeNvml:
    fake = FakeNvml(devices)
    fake.init()
    return fake


def test_it_is_an_nvml_with_several_gpus_each_its_own_uuid() -> None:
    nvml: Nvml = _up(3)
    assert nvml.device_count() == 3
    uuids = [nvml.uuid(nvml.handle(i)) for i in range(3)]
    assert len(set(uuids)) == 3 and uuids[2] == "GPU-00000000-0000-4000-8000-000000000002"
    assert nvml.name(0) == "NVIDIA H100 80GB HBM3" and nvml.clock_mhz(0, "sm") == 1980


def test_calls_before_init_or_without_a_driver_fail_as_nvml_does() -> None:
    with pytest.raises(NvmlMissing, match="Uninitialized"):
        FakeNvml().device_count()
    with pytest.raises(NvmlMissing, match="Shared Library Not Found"):
        FakeNvml(missing=True).init()
    with pytest.raises(NvmlError, match="Invalid Argument"):
        _up(2).handle(2)


def test_readings_follow_the_state_and_advance_moves_the_counters() -> None:
    fake = _up(1)
    state = fake.state(0)
    state.power_mw, state.power_instant_mw = 300_000, 350_000
    state.advance(2.0)
    readings = fake.field_values(0, [(FI_DEV_TOTAL_ENERGY_CONSUMPTION, 0), (FI_DEV_POWER_INSTANT, 0), (1, 0)])
    assert [r.value for r in readings[:2]] == [600_000.0, 350_000.0] and readings[0].code == 0
    assert math.isnan(readings[2].value) and readings[2].code == 3  # a field this GPU does not know
    assert readings[0].timestamp_us == 1_700_000_002_000_000


def test_unsupported_transient_and_lost_are_three_different_failures() -> None:
    fake = _up(2)
    fake.state(0).unsupported.add("temperature_c:memory")
    fake.state(0).transient["power_mw"] = 1
    with pytest.raises(NvmlUnsupported):
        fake.temperature_c(0, "memory")
    assert fake.temperature_c(0, "gpu") == 40
    with pytest.raises(NvmlError, match="Timeout"):
        fake.power_mw(0)
    assert fake.power_mw(0) == 120_000  # the next call succeeds
    fake.remove(1, RESET_REQUIRED)
    with pytest.raises(NvmlGone):
        fake.uuid(1)
    assert fake.calls[("power_mw", 0)] == 2 and fake.calls[("temperature_c:memory", 0)] == 1


def test_gpm_metrics_need_two_samples_of_one_device() -> None:
    fake = _up(2)
    fake.state(0).dram_bw_util_pct = 61.5
    first, second = fake.gpm_sample(0), fake.gpm_sample(0)
    assert fake.gpm_metrics(first, second, [GPM_DRAM_BW_UTIL])[0].value == 61.5
    with pytest.raises(NvmlError, match="the same GPM sample twice"):
        fake.gpm_metrics(second, second, [GPM_DRAM_BW_UTIL])
    with pytest.raises(NvmlError, match="different devices"):
        fake.gpm_metrics(first, fake.gpm_sample(1), [GPM_DRAM_BW_UTIL])


def test_xid_events_reach_only_registered_devices_and_a_lost_one_ends_the_wait() -> None:
    fake = FakeNvml([FakeGpuState(uuid="GPU-a"), FakeGpuState(uuid="GPU-b")])
    fake.init()
    fake.register_xid_events(0)
    fake.inject_xid(1, 48)
    fake.inject_xid(0, 79)
    assert fake.wait_xid(100) == XidEvent(0, "GPU-a", 79) and fake.wait_xid(100) is None
    fake.remove(0)
    with pytest.raises(NvmlGone):
        fake.wait_xid(100)


def test_processes_are_answered_with_host_pids_where_the_driver_gives_those() -> None:
    fake = _up(1)
    fake.state(0).processes = {12: 1 << 30}
    fake.host_pids[12] = 48012
    assert fake.processes(0) == {48012: 1 << 30}
