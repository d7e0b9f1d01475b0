"""The narrow `Nvml` protocol (the NVML calls the GPU source makes, in stepline's units), its errors and readings,
NVML's ABI numbers, and `RealNvml`, the protocol over pynvml."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple, Protocol, TypeVar, cast

from stepline.model.schema import CLOCK_EVENT_FLAGS

log = logging.getLogger(__name__)

# NVML ABI numbers (nvml.h); tests check them against pynvml so no import of pynvml is needed here.
# Field ids (NVML_FI_DEV_*), read together in one nvmlDeviceGetFieldValues call per GPU per poll; each value comes
# with the driver's own timestamp (nvmlFieldValue_t.timestamp, microseconds), which rates of counters divide by.
FI_DEV_MEMORY_TEMP = 82  # memory (HBM) temperature, degrees C
FI_DEV_TOTAL_ENERGY_CONSUMPTION = 83  # mJ since the driver loaded, as nvmlDeviceGetTotalEnergyConsumption
FI_DEV_PCIE_REPLAY_COUNTER = 94  # PCIe replays, cumulative, as nvmlDeviceGetPcieReplayCounter
FI_DEV_NVLINK_THROUGHPUT_DATA_TX = 138  # cumulative KiB since driver load
FI_DEV_NVLINK_THROUGHPUT_DATA_RX = 139
FI_DEV_POWER_AVERAGE = 185  # nvml.h: GPU power averaged over 1 s, mW; Ampere (except GA100) and newer
FI_DEV_POWER_INSTANT = 186  # nvml.h: current GPU power, mW; all architectures
FI_DEV_PCIE_COUNT_TX_BYTES = 197  # nvml.h: PCIe transmit bytes, cumulative; "value can be wrapped"
FI_DEV_PCIE_COUNT_RX_BYTES = 198  # PCIe receive bytes, likewise
SCOPE_ALL_LINKS = 0xFFFFFFFF  # nvml.h: scopeId UINT_MAX = the sum over all links, done by the driver
NVLINK_FIELDS = ((FI_DEV_NVLINK_THROUGHPUT_DATA_TX, SCOPE_ALL_LINKS),
                 (FI_DEV_NVLINK_THROUGHPUT_DATA_RX, SCOPE_ALL_LINKS))
# GPM metric ids (NVML_GPM_METRIC_*), all over the interval between two GPM samples.
GPM_GRAPHICS_UTIL = 1  # % of time the graphics engine was active
GPM_SM_UTIL = 2  # % of SMs active (DCGM's "SM active")
GPM_SM_OCCUPANCY = 3
GPM_ANY_TENSOR_UTIL = 5
GPM_DRAM_BW_UTIL = 10
GPM_PCIE_TX_PER_SEC = 20  # MiB/s
GPM_PCIE_RX_PER_SEC = 21
GPM_METRICS = (GPM_DRAM_BW_UTIL, GPM_ANY_TENSOR_UTIL, GPM_SM_OCCUPANCY, GPM_SM_UTIL, GPM_GRAPHICS_UTIL)
GPM_PCIE_METRICS = (GPM_PCIE_TX_PER_SEC, GPM_PCIE_RX_PER_SEC)  # asked only where the PCIe byte fields are missing
GPM_METRIC_NAMES = {GPM_GRAPHICS_UTIL: "graphics_util", GPM_SM_UTIL: "sm_util", GPM_SM_OCCUPANCY: "sm_occupancy",
                    GPM_ANY_TENSOR_UTIL: "any_tensor_util", GPM_DRAM_BW_UTIL: "dram_bw_util",
                    GPM_PCIE_TX_PER_SEC: "pcie_tx_per_sec", GPM_PCIE_RX_PER_SEC: "pcie_rx_per_sec"}
XID_MEANINGS = {
    13: "graphics engine exception (usually the application)",
    31: "GPU memory page fault (usually an illegal address in the application)",
    43: "GPU stopped processing (a channel was reset)",
    45: "preemptive cleanup after an earlier error",
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint/warning",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping recorded",
    64: "ECC page retirement or row remapping failed",
    68: "video decoder (NVDEC) exception",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error (the affected process must restart)",
    95: "uncontained ECC error (the GPU must be reset)",
    119: "GSP RPC timeout",
    120: "GSP error",
}
INIT_RETRY_S = 60.0
MAX_XID_PER_POLL = 64

ClockKind = Literal["sm", "mem"]
TempKind = Literal["gpu", "memory"]
Handle = object  # opaque: whatever the Nvml implementation hands out for one device
T = TypeVar("T")


class NvmlError(RuntimeError):
    """An NVML call failed; `code` is NVML's return code when there is one."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class NvmlUnsupported(NvmlError):
    """This GPU (or driver, or our permissions) does not offer this reading: ask no more."""


class NvmlGone(NvmlError):
    """The GPU is lost or was removed."""


class NvmlMissing(NvmlError):
    """No usable NVML: library absent, driver not loaded, or not initialised."""


class XidEvent(NamedTuple):
    """One XID critical error reported by a GPU."""

    gpu_index: int
    gpu_uuid: str
    xid: int


class FieldReading(NamedTuple):
    """One nvmlFieldValue_t: the value (NaN when `code` is not 0), when the driver took it, and how it wraps."""

    value: float
    timestamp_us: int  # nvmlFieldValue_t.timestamp: the driver's wall clock at the reading, microseconds
    code: int  # nvmlFieldValue_t.nvmlReturn: 0, or the NVML error of this one field
    wrap: int = 0  # for an unsigned counter, the modulus it wraps at (2**32 or 2**64 by value type); 0 otherwise


class GpmValue(NamedTuple):
    """One metric of nvmlGpmMetricsGet: its value (NaN when `code` is not 0) and its own return code."""

    value: float
    code: int


class MemoryInfo(NamedTuple):
    """Framebuffer memory, bytes; `reserved` is None where the driver has no nvmlDeviceGetMemoryInfo_v2."""

    used: int  # total - free, as nvmlDeviceGetMemoryInfo (v1) .used: the driver's reservation included
    total: int
    reserved: int | None


class RemappedRows(NamedTuple):
    """nvmlDeviceGetRemappedRows: HBM rows remapped since the GPU's manufacture, and the remapper's state."""

    correctable: int  # rows remapped for correctable (single-bit) errors
    uncorrectable: int  # rows remapped for uncorrectable (double-bit) errors
    pending: bool  # a remap is pending: it takes effect at the next GPU reset
    failure: bool  # a remap failed (no spare row left): the GPU needs service


class Nvml(Protocol):
    """The NVML calls stepline makes, in stepline's units; every failure raises an NvmlError subclass."""

    def init(self) -> None: ...
    def shutdown(self) -> None: ...
    def device_count(self) -> int: ...
    def handle(self, index: int) -> Handle: ...
    def uuid(self, h: Handle) -> str: ...
    def name(self, h: Handle) -> str: ...
    def clock_mhz(self, h: Handle, kind: ClockKind) -> int: ...
    def power_mw(self, h: Handle) -> int:
        """nvmlDeviceGetPowerUsage: a 1 s average on Ampere (except GA100) and newer, instantaneous before."""
    def energy_mj(self, h: Handle) -> int: ...
    def temperature_c(self, h: Handle, kind: TempKind) -> float: ...
    def utilization(self, h: Handle) -> tuple[int, int]:
        """(gpu %, memory-controller %)."""
    def memory(self, h: Handle) -> MemoryInfo: ...
    def pcie_replay_counter(self, h: Handle) -> int: ...
    def field_values(self, h: Handle, fields: Sequence[tuple[int, int]]) -> list[FieldReading]:
        """One nvmlDeviceGetFieldValues call for (field id, scope id) pairs; a field that failed has its own code."""
    def remapped_rows(self, h: Handle) -> RemappedRows: ...
    def driver_version(self) -> str: ...
    def clock_event_reasons(self, h: Handle) -> int: ...
    def gpm_supported(self, h: Handle) -> bool: ...
    def gpm_sample(self, h: Handle) -> object:
        """A GPM sample, valid until the second next successful gpm_sample of the same device."""
    def gpm_metrics(self, a: object, b: object, metric_ids: Sequence[int]) -> list[GpmValue]:
        """Metrics between two samples, each with its own return code; raises when the whole call fails."""
    def processes(self, h: Handle) -> dict[int, int]:
        """Compute processes: pid -> used GPU memory bytes."""
    def register_xid_events(self, h: Handle) -> None: ...
    def clear_xid_events(self) -> None:
        """Drop the event set (and its queued events); the next register_xid_events starts a new one."""
    def wait_xid(self, timeout_ms: int) -> XidEvent | None: ...


_UNSUPPORTED = frozenset({3, 4, 13})  # NOT_SUPPORTED, NO_PERMISSION, FUNCTION_NOT_FOUND
# GPU_IS_LOST, RESET_REQUIRED, GPU_NOT_FOUND, UNKNOWN: a device call answers RESET_REQUIRED or UNKNOWN after XID 79
# (fallen off the bus) or XID 95 (uncontained ECC error) and on every later call; the GPU is gone until it is reset.
_GONE = frozenset({15, 16, 28, 999})
_GONE_NAMES = {15: "GPU_IS_LOST", 16: "RESET_REQUIRED", 28: "GPU_NOT_FOUND", 999: "UNKNOWN"}
_MISSING = frozenset({1, 9, 12, 18})  # UNINITIALIZED, DRIVER_NOT_LOADED, LIBRARY_NOT_FOUND, LIB_RM_VERSION_MISMATCH
_FUNCTION_NOT_FOUND = 13
_TIMEOUT = 10


def nvml_error(code: int, message: str) -> NvmlError:
    """The stepline error for an NVML return code."""
    kind = (NvmlUnsupported if code in _UNSUPPORTED else NvmlGone if code in _GONE
            else NvmlMissing if code in _MISSING else NvmlError)
    return kind(message, code)


def gone_reason(exc: NvmlError) -> str:
    """The NVML error name (nvmlReturn_t without NVML_ERROR_) of a lost GPU, for its event."""
    return _GONE_NAMES.get(exc.code if exc.code is not None else -1, str(exc.code))


def clock_event_flags(reasons: int) -> list[str]:
    """Names of the bits set in a clocks-event-reasons mask."""
    return [name for bit, name in CLOCK_EVENT_FLAGS if reasons & bit]


def xid_message(index: int, uuid: str, xid: int) -> str:
    """One line an operator can act on."""
    meaning = XID_MEANINGS.get(xid, "see NVIDIA's XID catalogue")
    return f"GPU {index} ({uuid or 'uuid unknown'}) reported XID {xid}: {meaning}"


class RealNvml:
    """Nvml over pynvml (nvidia-ml-py); libnvidia-ml is loaded by init(), never at import."""

    def __init__(self, lib: Any = None) -> None:
        self._given = lib  # the pynvml module (imported by init() when None), or a stand-in for tests
        self._nv: Any = None
        self._error: type[BaseException] = _NeverRaised
        self._events: Any = None
        self._gpm: dict[int | None, list[Any]] = {}  # device address -> [sample, sample, next slot]
        self._metrics_get: Any = None
        self._memory_v2 = True
        self._fallbacks: dict[str, tuple[str, ...]] = {  # newest call first, for older drivers
            "reasons": ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"),
            "processes": ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2"),
            "temperature": ("nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature"),
        }

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except self._error as exc:
            code = int(getattr(exc, "value", -1))
            raise nvml_error(code, str(exc)) from None

    def _lib(self) -> Any:
        if self._nv is None:
            raise NvmlMissing("NVML is not initialised", 1)
        return self._nv

    def _newest(self, key: str, *args: Any) -> Any:
        names = self._fallbacks[key]
        try:
            return self._call(getattr(self._lib(), names[0]), *args)
        except NvmlUnsupported as exc:
            if exc.code != _FUNCTION_NOT_FOUND or len(names) == 1:
                raise
            self._fallbacks[key] = names[1:]  # this driver predates the newer call: use the older from now on
            return self._call(getattr(self._lib(), names[1]), *args)

    def init(self) -> None:
        nv = self._given
        if nv is None:
            import pynvml  # type: ignore[import-untyped]

            nv = pynvml
        self._error = nv.NVMLError
        self._call(nv.nvmlInit)
        self._nv = nv

    def shutdown(self) -> None:
        nv = self._lib()
        for ring in self._gpm.values():
            for sample in ring[:2]:
                self._call(nv.nvmlGpmSampleFree, sample)
        self._gpm.clear()
        if self._events is not None:
            self._call(nv.nvmlEventSetFree, self._events)
            self._events = None
        self._nv = None
        self._call(nv.nvmlShutdown)

    def device_count(self) -> int:
        return int(self._call(self._lib().nvmlDeviceGetCount))

    def handle(self, index: int) -> Handle:
        return cast(Handle, self._call(self._lib().nvmlDeviceGetHandleByIndex, index))

    def uuid(self, h: Handle) -> str:
        return str(self._call(self._lib().nvmlDeviceGetUUID, h))

    def name(self, h: Handle) -> str:
        return str(self._call(self._lib().nvmlDeviceGetName, h))

    def clock_mhz(self, h: Handle, kind: ClockKind) -> int:
        nv = self._lib()
        return int(self._call(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM if kind == "sm" else nv.NVML_CLOCK_MEM))

    def power_mw(self, h: Handle) -> int:
        return int(self._call(self._lib().nvmlDeviceGetPowerUsage, h))

    def energy_mj(self, h: Handle) -> int:
        return int(self._call(self._lib().nvmlDeviceGetTotalEnergyConsumption, h))

    def temperature_c(self, h: Handle, kind: TempKind) -> float:
        if kind == "memory":
            reading = self.field_values(h, ((FI_DEV_MEMORY_TEMP, 0),))[0]
            if reading.code:
                raise nvml_error(reading.code, f"field {FI_DEV_MEMORY_TEMP}: {self._error(reading.code)}")
            return reading.value
        return float(self._newest("temperature", h, self._lib().NVML_TEMPERATURE_GPU))

    def utilization(self, h: Handle) -> tuple[int, int]:
        rates = self._call(self._lib().nvmlDeviceGetUtilizationRates, h)
        return int(rates.gpu), int(rates.memory)

    def memory(self, h: Handle) -> MemoryInfo:
        nv = self._lib()
        if self._memory_v2:
            try:  # nvmlDeviceGetMemoryInfo_v2: the only one that tells the driver's reservation apart
                info = self._call(nv.nvmlDeviceGetMemoryInfo, h, nv.nvmlMemory_v2)
                return MemoryInfo(int(info.total) - int(info.free), int(info.total), int(info.reserved))
            except NvmlUnsupported as exc:
                if exc.code != _FUNCTION_NOT_FOUND:
                    raise
                self._memory_v2 = False  # this driver predates it
        info = self._call(nv.nvmlDeviceGetMemoryInfo, h)
        return MemoryInfo(int(info.used), int(info.total), None)

    def pcie_replay_counter(self, h: Handle) -> int:
        return int(self._call(self._lib().nvmlDeviceGetPcieReplayCounter, h))

    def field_values(self, h: Handle, fields: Sequence[tuple[int, int]]) -> list[FieldReading]:
        values = self._call(self._lib().nvmlDeviceGetFieldValues, h, list(fields))
        out: list[FieldReading] = []
        for v in values:
            code = int(v.nvmlReturn)
            if code != 0:
                out.append(FieldReading(math.nan, int(v.timestamp), code))
                continue
            member, wrap = _VALUE_MEMBER.get(int(v.valueType), ("ullVal", 1 << 64))
            out.append(FieldReading(float(getattr(v.value, member)), int(v.timestamp), 0, wrap))
        return out

    def remapped_rows(self, h: Handle) -> RemappedRows:
        corr, unc, pending, failure = self._call(self._lib().nvmlDeviceGetRemappedRows, h)
        return RemappedRows(int(corr), int(unc), bool(pending), bool(failure))

    def driver_version(self) -> str:
        return str(self._call(self._lib().nvmlSystemGetDriverVersion))

    def clock_event_reasons(self, h: Handle) -> int:
        return int(self._newest("reasons", h))

    def gpm_supported(self, h: Handle) -> bool:
        return bool(self._call(self._lib().nvmlGpmQueryDeviceSupport, h).isSupportedDevice)

    def gpm_sample(self, h: Handle) -> object:
        import ctypes

        nv = self._lib()
        key = ctypes.cast(cast(Any, h), ctypes.c_void_p).value
        ring = self._gpm.get(key)
        if ring is None:
            ring = self._gpm[key] = [self._call(nv.nvmlGpmSampleAlloc), self._call(nv.nvmlGpmSampleAlloc), 0]
        slot = ring[2]
        sample = cast(object, self._call(nv.nvmlGpmSampleGet, h, ring[slot]))
        # Two buffers per device, flipped only after a sample succeeded: the previous good sample stays valid for
        # gpm_metrics, and a failed sample never makes the next interval span one buffer twice.
        ring[2] = 1 - slot
        return sample

    def gpm_metrics(self, a: object, b: object, metric_ids: Sequence[int]) -> list[GpmValue]:
        nv = self._lib()
        mg = self._metrics_get
        if mg is None:
            mg = self._metrics_get = nv.c_nvmlGpmMetricsGet_t()
        mg.version = nv.NVML_GPM_METRICS_GET_VERSION
        mg.numMetrics = len(metric_ids)
        mg.sample1, mg.sample2 = a, b
        for i, metric in enumerate(metric_ids):
            mg.metrics[i].metricId = metric
        self._call(nv.nvmlGpmMetricsGet, mg)
        return [GpmValue(float(m.value), 0) if m.nvmlReturn == 0 else GpmValue(math.nan, int(m.nvmlReturn))
                for m in mg.metrics[:len(metric_ids)]]

    def processes(self, h: Handle) -> dict[int, int]:
        return {int(p.pid): int(p.usedGpuMemory or 0) for p in self._newest("processes", h)}

    def register_xid_events(self, h: Handle) -> None:
        nv = self._lib()
        if self._events is None:
            self._events = self._call(nv.nvmlEventSetCreate)
        self._call(nv.nvmlDeviceRegisterEvents, h, nv.nvmlEventTypeXidCriticalError, self._events)

    def clear_xid_events(self) -> None:
        events, self._events = self._events, None
        if events is not None:
            try:
                self._call(self._lib().nvmlEventSetFree, events)
            except NvmlError as exc:  # a set holding a lost GPU may refuse to go: it is dropped all the same
                log.debug("NVML event set free failed: %s", exc)

    def wait_xid(self, timeout_ms: int) -> XidEvent | None:
        nv = self._lib()
        if self._events is None:
            return None
        try:
            data = self._call(nv.nvmlEventSetWait_v2, self._events, timeout_ms)
        except NvmlError as exc:
            if exc.code == _TIMEOUT:
                return None
            raise
        index, uuid = -1, ""
        try:  # a GPU that fell off the bus may not say who it is: still report its XID
            index = int(self._call(nv.nvmlDeviceGetIndex, data.device))
            uuid = str(self._call(nv.nvmlDeviceGetUUID, data.device))
        except NvmlError:
            pass
        return XidEvent(index, uuid, int(data.eventData))


class _NeverRaised(Exception):
    """Stands for pynvml.NVMLError until pynvml is imported."""


# nvmlValueType_t -> the member of nvmlValue_t that holds it, and the modulus an unsigned counter of it wraps at
# (ulVal is C `unsigned long` in pynvml's c_nvmlValue_t: 64 bits on the Linux ABI NVML ships for).
_VALUE_MEMBER = {0: ("dVal", 0), 1: ("uiVal", 1 << 32), 2: ("ulVal", 1 << 64), 3: ("ullVal", 1 << 64),
                 4: ("sllVal", 0), 5: ("siVal", 0), 6: ("usVal", 1 << 16)}
