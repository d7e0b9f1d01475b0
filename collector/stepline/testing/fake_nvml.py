"""A fake NVML with several GPUs, shipped next to the real one for tests and for the simulator."""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from stepline.sources.gpu.nvml import (
    FI_DEV_MEMORY_TEMP,
    FI_DEV_NVLINK_THROUGHPUT_DATA_RX,
    FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
    FI_DEV_PCIE_COUNT_RX_BYTES,
    FI_DEV_PCIE_COUNT_TX_BYTES,
    FI_DEV_PCIE_REPLAY_COUNTER,
    FI_DEV_POWER_AVERAGE,
    FI_DEV_POWER_INSTANT,
    FI_DEV_TOTAL_ENERGY_CONSUMPTION,
    GPM_ANY_TENSOR_UTIL,
    GPM_DRAM_BW_UTIL,
    GPM_GRAPHICS_UTIL,
    GPM_PCIE_RX_PER_SEC,
    GPM_PCIE_TX_PER_SEC,
    GPM_SM_OCCUPANCY,
    GPM_SM_UTIL,
    ClockKind,
    FieldReading,
    GpmValue,
    Handle,
    MemoryInfo,
    NvmlError,
    NvmlGone,
    NvmlMissing,
    NvmlUnsupported,
    RemappedRows,
    TempKind,
    XidEvent,
    nvml_error,
)

_TIMEOUT = 10  # NVML_ERROR_TIMEOUT: what a busy driver answers now and then; the next call may well succeed
_NOT_SUPPORTED = 3
GPU_IS_LOST, RESET_REQUIRED, UNKNOWN = 15, 16, 999  # NVML_ERROR_*: what calls on a dead GPU answer
_LOST_MESSAGES = {GPU_IS_LOST: "GPU is lost", RESET_REQUIRED: "GPU requires reset", UNKNOWN: "Unknown Error"}


@dataclass
class FakeGpuState:
    """One fake GPU's current readings, in NVML's units; mutate freely between polls.

    `unsupported` holds the calls that raise NvmlUnsupported: a method name ("energy_mj") or a method and its
    kind ("temperature_c:memory"), or one field ("field:<id>", which then carries NOT_SUPPORTED in its own
    nvmlReturn, as the real call reports it); "gpm_metric:<id>" gives one GPM metric NOT_SUPPORTED in its own
    return code. `refused_gpm` holds GPM metric ids for which the driver refuses the whole nvmlGpmMetricsGet call.
    `transient[key]` (same keys) is how many of the next calls fail with NVML_ERROR_TIMEOUT, then succeed again.
    Field values carry `field_ts_us` as their timestamp; `advance` moves it, the energy and the PCIe byte counters.
    """

    name: str = "NVIDIA H100 80GB HBM3"
    uuid: str = ""
    sm_clock_mhz: int = 1980
    mem_clock_mhz: int = 2619
    power_mw: int = 120_000  # nvmlDeviceGetPowerUsage and field POWER_AVERAGE (the 1 s average)
    power_instant_mw: int | None = None  # field POWER_INSTANT; None: the same as power_mw
    energy_mj: int = 0
    temp_gpu_c: int = 40
    temp_mem_c: int = 45
    util_gpu_pct: int = 0
    util_mem_pct: int = 0
    mem_used_bytes: int = 0
    mem_total_bytes: int = 80 << 30
    mem_reserved_bytes: int = 512 << 20
    pcie_tx_kbs: int = 0  # rates (GPM PCIe metrics; `advance` adds them to the byte counters)
    pcie_rx_kbs: int = 0
    pcie_tx_bytes: int = 0  # cumulative, fields PCIE_COUNT_TX_BYTES/RX_BYTES
    pcie_rx_bytes: int = 0
    pcie_replay: int = 0
    field_ts_us: int = 1_700_000_000_000_000
    nvlink_tx_kib: int = 0  # cumulative, like the driver's counters
    nvlink_rx_kib: int = 0
    clock_event_reasons: int = 0
    gpm: bool = True
    dram_bw_util_pct: float = 0.0
    tensor_active_pct: float = 0.0
    sm_occupancy_pct: float = 0.0
    sm_util_pct: float = 0.0
    graphics_util_pct: float = 0.0
    remapped_rows: RemappedRows = field(default_factory=lambda: RemappedRows(0, 0, False, False))
    refused_gpm: set[int] = field(default_factory=set)
    transient: Counter[str] = field(default_factory=Counter)
    processes: dict[int, int] = field(default_factory=dict)
    unsupported: set[str] = field(default_factory=set)
    failing: set[str] = field(default_factory=set)  # same keys as unsupported; these raise a plain NvmlError
    removed: bool = False

    def advance(self, seconds: float) -> None:
        """Move the energy counter on by the current power over `seconds`, the PCIe byte counters by the current
        rates, and the field timestamp by `seconds`."""
        self.energy_mj += round(self.power_mw * seconds)
        self.pcie_tx_bytes += round(self.pcie_tx_kbs * 1024 * seconds)
        self.pcie_rx_bytes += round(self.pcie_rx_kbs * 1024 * seconds)
        self.field_ts_us += round(seconds * 1_000_000)


@dataclass(frozen=True)
class FakeGpmSample:
    """A GPM sample: the device's GPM metrics as they were when it was taken."""

    index: int
    seq: int
    metrics: dict[int, float]


class FakeNvml:
    """Implements `Nvml` over FakeGpuState; handles are device indexes; `calls[(method, index)]` counts calls.

    Calls with a kind count under "method:kind" ("clock_mhz:sm"); calls of no device count under index -1.
    """

    def __init__(self, devices: int | Sequence[FakeGpuState] = 2, *, missing: bool = False) -> None:
        self.devices = [FakeGpuState() for _ in range(devices)] if isinstance(devices, int) else list(devices)
        for i, state in enumerate(self.devices):
            state.uuid = state.uuid or f"GPU-00000000-0000-4000-8000-{i:012d}"
        self.missing = missing
        self.initialised = False
        self.calls: Counter[tuple[str, int]] = Counter()
        self._xids: deque[XidEvent] = deque()
        self._registered: set[int] = set()
        self._gpm_seq = 0
        self._lost_codes: dict[int, int] = {}
        # namespace pid -> host pid: an older driver reports host pids, which differ from the pids a collector in a
        # nested PID namespace (a sidecar) sees; `processes` keeps namespace pids and processes() answers host ones.
        self.host_pids: dict[int, int] = {}
        self.driver = "570.124.06"

    def state(self, index: int) -> FakeGpuState:
        """The mutable state of one device."""
        return self.devices[index]

    def remove(self, index: int, code: int = GPU_IS_LOST) -> None:
        """The device falls off the bus: every later call on it raises NvmlGone with `code` (GPU_IS_LOST, or
        RESET_REQUIRED / UNKNOWN as after XID 79 or 95); the event wait answers GPU_IS_LOST while it is in the set."""
        self.devices[index].removed = True
        self._lost_codes[index] = code


    def inject_xid(self, index: int, code: int) -> None:
        """Queue an XID critical error, delivered by wait_xid if the device registered for events."""
        self._xids.append(XidEvent(index, self.devices[index].uuid, code))

    def _global(self, method: str) -> None:
        self.calls[(method, -1)] += 1
        if not self.initialised:
            raise NvmlMissing("Uninitialized", 1)

    def _dev(self, method: str, h: Handle, kind: str | None = None) -> FakeGpuState:
        if not isinstance(h, int):
            raise TypeError(f"not a FakeNvml handle: {h!r}")
        key = method if kind is None else f"{method}:{kind}"
        self.calls[(key, h)] += 1
        if not self.initialised:
            raise NvmlMissing("Uninitialized", 1)
        state = self.devices[h]
        if state.removed:
            code = self._lost_codes.get(h, GPU_IS_LOST)
            raise nvml_error(code, _LOST_MESSAGES.get(code, "GPU is lost"))
        if method in state.unsupported or key in state.unsupported:
            raise NvmlUnsupported("Not Supported", 3)
        if method in state.failing or key in state.failing:
            raise NvmlError("Timeout", _TIMEOUT)  # not a lost GPU, as UNKNOWN would be
        for name in (key, method):
            if state.transient[name] > 0:
                state.transient[name] -= 1
                raise NvmlError("Timeout", _TIMEOUT)
        return state

    def init(self) -> None:
        self.calls[("init", -1)] += 1
        if self.missing:
            raise NvmlMissing("NVML Shared Library Not Found", 12)
        self.initialised = True

    def shutdown(self) -> None:
        self._global("shutdown")
        self.initialised = False
        self._registered.clear()

    def device_count(self) -> int:
        self._global("device_count")
        return len(self.devices)

    def handle(self, index: int) -> Handle:
        if not 0 <= index < len(self.devices):
            raise NvmlError("Invalid Argument", 2)
        self._dev("handle", index)
        return index

    def uuid(self, h: Handle) -> str:
        return self._dev("uuid", h).uuid

    def name(self, h: Handle) -> str:
        return self._dev("name", h).name

    def clock_mhz(self, h: Handle, kind: ClockKind) -> int:
        state = self._dev("clock_mhz", h, kind)
        return state.sm_clock_mhz if kind == "sm" else state.mem_clock_mhz

    def power_mw(self, h: Handle) -> int:
        return self._dev("power_mw", h).power_mw

    def energy_mj(self, h: Handle) -> int:
        return self._dev("energy_mj", h).energy_mj

    def temperature_c(self, h: Handle, kind: TempKind) -> float:
        state = self._dev("temperature_c", h, kind)
        return state.temp_gpu_c if kind == "gpu" else state.temp_mem_c

    def utilization(self, h: Handle) -> tuple[int, int]:
        state = self._dev("utilization", h)
        return state.util_gpu_pct, state.util_mem_pct

    def memory(self, h: Handle) -> MemoryInfo:
        state = self._dev("memory", h)
        return MemoryInfo(state.mem_used_bytes, state.mem_total_bytes, state.mem_reserved_bytes)

    def pcie_replay_counter(self, h: Handle) -> int:
        return self._dev("pcie_replay_counter", h).pcie_replay

    def field_values(self, h: Handle, fields: Sequence[tuple[int, int]]) -> list[FieldReading]:
        state = self._dev("field_values", h)
        instant = state.power_mw if state.power_instant_mw is None else state.power_instant_mw
        known = {FI_DEV_NVLINK_THROUGHPUT_DATA_TX: state.nvlink_tx_kib,
                 FI_DEV_NVLINK_THROUGHPUT_DATA_RX: state.nvlink_rx_kib, FI_DEV_MEMORY_TEMP: state.temp_mem_c,
                 FI_DEV_TOTAL_ENERGY_CONSUMPTION: state.energy_mj, FI_DEV_PCIE_REPLAY_COUNTER: state.pcie_replay,
                 FI_DEV_POWER_AVERAGE: state.power_mw, FI_DEV_POWER_INSTANT: instant,
                 FI_DEV_PCIE_COUNT_TX_BYTES: state.pcie_tx_bytes, FI_DEV_PCIE_COUNT_RX_BYTES: state.pcie_rx_bytes}
        out: list[FieldReading] = []
        for field_id, _scope in fields:
            key = f"field:{field_id}"
            if field_id not in known or key in state.unsupported:
                out.append(FieldReading(math.nan, state.field_ts_us, _NOT_SUPPORTED))
            elif state.transient[key] > 0:
                state.transient[key] -= 1
                out.append(FieldReading(math.nan, state.field_ts_us, _TIMEOUT))
            else:
                out.append(FieldReading(float(known[field_id]), state.field_ts_us, 0, 1 << 64))
        return out

    def remapped_rows(self, h: Handle) -> RemappedRows:
        return self._dev("remapped_rows", h).remapped_rows

    def driver_version(self) -> str:
        self._global("driver_version")
        return self.driver

    def clock_event_reasons(self, h: Handle) -> int:
        return self._dev("clock_event_reasons", h).clock_event_reasons

    def gpm_supported(self, h: Handle) -> bool:
        return self._dev("gpm_supported", h).gpm

    def gpm_sample(self, h: Handle) -> object:
        state = self._dev("gpm_sample", h)
        if not state.gpm:
            raise NvmlUnsupported("Not Supported", 3)
        self._gpm_seq += 1
        metrics = {GPM_DRAM_BW_UTIL: state.dram_bw_util_pct, GPM_ANY_TENSOR_UTIL: state.tensor_active_pct,
                   GPM_SM_OCCUPANCY: state.sm_occupancy_pct, GPM_SM_UTIL: state.sm_util_pct,
                   GPM_GRAPHICS_UTIL: state.graphics_util_pct, GPM_PCIE_TX_PER_SEC: state.pcie_tx_kbs / 1024,
                   GPM_PCIE_RX_PER_SEC: state.pcie_rx_kbs / 1024}
        assert isinstance(h, int)
        return FakeGpmSample(h, self._gpm_seq, metrics)

    def gpm_metrics(self, a: object, b: object, metric_ids: Sequence[int]) -> list[GpmValue]:
        if not (isinstance(a, FakeGpmSample) and isinstance(b, FakeGpmSample)) or a.index != b.index:
            raise NvmlError("Invalid Argument: GPM samples of different devices", 2)
        if a.seq == b.seq:  # one sample passed twice: no interval
            raise NvmlError("Invalid Argument: the same GPM sample twice", 2)
        state = self._dev("gpm_metrics", b.index)
        if state.refused_gpm & set(metric_ids):
            raise NvmlUnsupported("Not Supported", _NOT_SUPPORTED)
        return [GpmValue(math.nan, _NOT_SUPPORTED) if f"gpm_metric:{metric}" in state.unsupported
                else GpmValue(b.metrics.get(metric, math.nan), 0) for metric in metric_ids]

    def processes(self, h: Handle) -> dict[int, int]:
        return {self.host_pids.get(pid, pid): used for pid, used in self._dev("processes", h).processes.items()}


    def register_xid_events(self, h: Handle) -> None:
        self._dev("register_xid_events", h)
        assert isinstance(h, int)
        self._registered.add(h)

    def clear_xid_events(self) -> None:
        self._global("clear_xid_events")
        self._registered.clear()
        self._xids.clear()  # freeing the set drops what it had queued

    def wait_xid(self, timeout_ms: int) -> XidEvent | None:
        self._global("wait_xid")
        if any(self.devices[index].removed for index in self._registered):
            raise NvmlGone("GPU is lost", GPU_IS_LOST)
        while self._xids:
            event = self._xids.popleft()
            if event.gpu_index in self._registered:
                return event
        return None
