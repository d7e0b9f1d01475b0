"""The narrow Nvml protocol and RealNvml: NVML's numbers as pynvml has them, return codes to errors, and RealNvml's
own logic (older drivers' fallbacks, GPM buffers, the event set) over pynvml stand-ins."""

from __future__ import annotations

import ctypes
import math
from typing import Any

import pynvml  # type: ignore[import-untyped]
import pytest

from stepline.core.clock import ManualClock
from stepline.model import schema
from stepline.sources.base import SourceContext, SourceError
from stepline.sources.gpu import nvml
from stepline.sources.gpu.nvml import (
    NvmlError,
    NvmlGone,
    NvmlMissing,
    NvmlUnsupported,
    RealNvml,
    XidEvent,
    clock_event_flags,
    nvml_error,
)
from stepline.sources.gpu.source import GpuSource
from tests.sources.gpu.test_source import _poll


def test_nvml_numbers_match_pynvml() -> None:
    assert nvml.FI_DEV_MEMORY_TEMP == pynvml.NVML_FI_DEV_MEMORY_TEMP
    assert nvml.FI_DEV_NVLINK_THROUGHPUT_DATA_TX == pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX
    assert nvml.FI_DEV_NVLINK_THROUGHPUT_DATA_RX == pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX
    assert nvml.GPM_DRAM_BW_UTIL == pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL
    assert nvml.GPM_ANY_TENSOR_UTIL == pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL
    assert nvml.GPM_SM_OCCUPANCY == pynvml.NVML_GPM_METRIC_SM_OCCUPANCY
    assert nvml.GPM_PCIE_TX_PER_SEC == pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC
    assert nvml.GPM_PCIE_RX_PER_SEC == pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC
    for bit, name in schema.CLOCK_EVENT_FLAGS:
        camel = "".join(part.capitalize() for part in name.removeprefix("pynvml_only_").split("_"))
        assert getattr(pynvml, f"nvmlClocksThrottleReason{camel}") == bit, name
        if bit <= 0x100:
            assert getattr(pynvml, f"nvmlClocksEventReason{camel}") == bit, name
        else:  # in pynvml only, in no nvml.h: named as such
            assert not hasattr(pynvml, f"nvmlClocksEventReason{camel}") and name.startswith("pynvml_only_"), name
    assert clock_event_flags(pynvml.nvmlClocksEventReasonAll) == [n for _, n in schema.CLOCK_EVENT_FLAGS[:9]]
    codes = {pynvml.NVML_ERROR_NOT_SUPPORTED: NvmlUnsupported, pynvml.NVML_ERROR_NO_PERMISSION: NvmlUnsupported,
             pynvml.NVML_ERROR_FUNCTION_NOT_FOUND: NvmlUnsupported, pynvml.NVML_ERROR_GPU_IS_LOST: NvmlGone,
             pynvml.NVML_ERROR_GPU_NOT_FOUND: NvmlGone, pynvml.NVML_ERROR_LIBRARY_NOT_FOUND: NvmlMissing,
             pynvml.NVML_ERROR_UNINITIALIZED: NvmlMissing, pynvml.NVML_ERROR_DRIVER_NOT_LOADED: NvmlMissing,
             pynvml.NVML_ERROR_UNKNOWN: NvmlGone, pynvml.NVML_ERROR_RESET_REQUIRED: NvmlGone,
             pynvml.NVML_ERROR_TIMEOUT: NvmlError}
    for code, kind in codes.items():
        assert type(nvml_error(code, "x")) is kind, code


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
