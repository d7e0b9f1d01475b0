"""One GPU's readings for a sample: the scalar fields of one nvmlDeviceGetFieldValues call (a call of its own where
the GPU lacks a field), counter rates over the driver's own timestamps, GPM metrics over an interval, and the slow
readings (processes, memory, memory clock, row remapping) taken once a slow interval."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar, cast

from stepline.core.clock import Clock
from stepline.sources.gpu.events import GpuEvents
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
    GPM_METRIC_NAMES,
    GPM_METRICS,
    GPM_PCIE_METRICS,
    GPM_PCIE_RX_PER_SEC,
    GPM_PCIE_TX_PER_SEC,
    INIT_RETRY_S,
    SCOPE_ALL_LINKS,
    FieldReading,
    GpmValue,
    Handle,
    MemoryInfo,
    Nvml,
    NvmlError,
    NvmlGone,
    NvmlMissing,
    NvmlUnsupported,
    RemappedRows,
)

T = TypeVar("T")

NAN_PAIR = (math.nan, math.nan)
_MIB = 1 << 20
# Typed "nothing" defaults, so that value/_attempt keep the reading's type.
_NO_DICT: dict[int, int] | None = None
_NO_OBJECT: object | None = None
_NO_MEMORY: MemoryInfo | None = None
_NO_REMAP: RemappedRows | None = None
GPM_PROBE_TRIES = 3  # gpm_supported calls that fail (not "unsupported") before GPM is given up for the run
# The scalar readings of one nvmlDeviceGetFieldValues call per GPU per poll: (reading, field id, scope id).
FIELDS = (
    ("power", FI_DEV_POWER_AVERAGE, 0),
    ("power_instant", FI_DEV_POWER_INSTANT, 0),
    ("energy", FI_DEV_TOTAL_ENERGY_CONSUMPTION, 0),
    ("temp_mem", FI_DEV_MEMORY_TEMP, 0),
    ("pcie_replay", FI_DEV_PCIE_REPLAY_COUNTER, 0),
    ("pcie_tx", FI_DEV_PCIE_COUNT_TX_BYTES, 0),
    ("pcie_rx", FI_DEV_PCIE_COUNT_RX_BYTES, 0),
    ("nvlink_tx", FI_DEV_NVLINK_THROUGHPUT_DATA_TX, SCOPE_ALL_LINKS),
    ("nvlink_rx", FI_DEV_NVLINK_THROUGHPUT_DATA_RX, SCOPE_ALL_LINKS),
)
# Field readings with a call of their own, made only where the GPU (or driver) lacks the field.
_FIELD_FALLBACKS = frozenset({"power", "energy", "pcie_replay"})
# Return codes that mean "never": INVALID_ARGUMENT (a field or metric id this driver does not know), NOT_SUPPORTED,
# NO_PERMISSION, FUNCTION_NOT_FOUND. Any other code of one field or metric is counted and asked again.
_REFUSED = frozenset({2, 3, 4, 13})


class Gpu:
    """What the source keeps of one GPU between polls."""

    __slots__ = ("calls", "counters", "engine", "fields", "gpm", "gpm_at", "gpm_prev", "gpm_probe_at", "gpm_probes",
                 "gpm_refused", "handle", "index", "lost", "mem_clock", "memory", "name", "pcie", "pcie_via_gpm",
                 "procs", "rates", "remap", "slow_at", "uuid", "xid")

    def __init__(self, index: int, uuid: str, name: str, handle: Handle, calls: dict[str, Callable[[], Any]]) -> None:
        self.index, self.uuid, self.name, self.handle = index, uuid, name, handle
        self.calls = calls  # reading -> call; a reading the GPU does not support is removed, never called again
        self.lost = False
        self.engine = ""
        self.xid: bool | None = False  # registered for XID events; None: this GPU cannot be
        self.gpm_probes = 0  # gpm_supported calls that failed so far
        self.gpm_probe_at = math.inf  # when to ask gpm_supported again after a failure
        self.fields = list(FIELDS)  # a field the GPU refuses is removed, never asked again
        self.counters: dict[str, FieldReading] = {}  # reading -> the counter's base for its next rate
        self.rates: dict[str, float] = {}
        self.gpm_prev: object | None = None
        self.gpm_at = -math.inf
        self.gpm: dict[int, float] = {}  # metric id -> value over the last GPM interval, carried forward
        self.gpm_refused: set[int] = set()  # metrics this GPU refuses: never asked again
        self.pcie_via_gpm = False  # GPM may give PCIe: asked only where the PCIe byte fields are missing
        self.pcie = NAN_PAIR
        # Read once a second (slow_at), carried forward in between.
        self.slow_at = -math.inf
        self.mem_clock = math.nan
        self.memory: MemoryInfo | None = None
        self.procs: dict[int, int] = {}
        self.remap: RemappedRows | None = None


def device_calls(nvml: Nvml, h: Handle) -> dict[str, Callable[[], Any]]:
    """A new GPU's readings that have a call of their own: reading -> the call."""
    return {
        "sm_clock": partial(nvml.clock_mhz, h, "sm"),
        "temp_gpu": partial(nvml.temperature_c, h, "gpu"),
        "utilization": partial(nvml.utilization, h),
        "clock_events": partial(nvml.clock_event_reasons, h),
        "gpm": partial(nvml.gpm_sample, h),
        # Once a second:
        "mem_clock": partial(nvml.clock_mhz, h, "mem"),
        "memory": partial(nvml.memory, h),
        "processes": partial(nvml.processes, h),
        "remap": partial(nvml.remapped_rows, h),
        # Only where the GPU lacks the field (FIELDS):
        "power": partial(nvml.power_mw, h),
        "energy": partial(nvml.energy_mj, h),
        "pcie_replay": partial(nvml.pcie_replay_counter, h),
    }


class GpuReader:
    """Takes GPUs' readings; a reading the GPU does not support is reported once and never asked again, one that
    fails is counted and asked again at the next poll."""

    def __init__(self, nvml: Nvml, events: GpuEvents, clock: Clock, *, gpm_interval_s: float,
                 slow_interval_s: float) -> None:
        self._nvml = nvml
        self._events = events
        self._clock = clock
        self._gpm_interval_s = gpm_interval_s
        # Processes, memory, memory clock and row remapping change slowly: read once per slow interval per GPU.
        self._slow_interval_s = slow_interval_s

    def probe_gpm(self, gpu: Gpu) -> None:
        """Whether GPM is sampled on this GPU (Hopper and newer)."""
        # A failure that is not "unsupported" asks again every INIT_RETRY_S, GPM_PROBE_TRIES times in all, and samples
        # no GPM meanwhile: one failed call must not take GPM away for the whole run.
        gpu.calls.pop("gpm", None)
        gpu.pcie_via_gpm, gpu.gpm_probe_at = False, math.inf
        why = "no GPM: DRAM bandwidth, tensor activity and SM occupancy need Hopper+"
        try:
            supported = self._nvml.gpm_supported(gpu.handle)
        except (NvmlGone, NvmlMissing):
            raise
        except NvmlUnsupported:
            supported = False
        except NvmlError as exc:
            self._events.failed(gpu.index, "gpm", exc)
            gpu.gpm_probes += 1
            if gpu.gpm_probes < GPM_PROBE_TRIES:
                gpu.gpm_probe_at = self._clock.monotonic() + INIT_RETRY_S
                return
            supported, why = False, f"gpm_supported failed {gpu.gpm_probes} times, given up: {exc}"
        if not supported:
            self._unsupported(gpu, "gpm", why)
            return
        gpu.calls["gpm"] = partial(self._nvml.gpm_sample, gpu.handle)
        gpu.pcie_via_gpm = True

    def fields(self, gpu: Gpu) -> dict[str, FieldReading]:
        """One nvmlDeviceGetFieldValues call for the GPU's scalar readings: reading -> what the driver gave, for the
        fields that answered (with their timestamps, which rates divide by)."""
        if not gpu.fields:
            return {}
        try:
            readings = self._nvml.field_values(gpu.handle, [(fid, scope) for _, fid, scope in gpu.fields])
        except NvmlUnsupported as exc:  # a driver without nvmlDeviceGetFieldValues: the fallback calls take over
            gpu.fields = []
            self._unsupported(gpu, "fields", str(exc))
            return {}
        except (NvmlGone, NvmlMissing):
            raise
        except NvmlError as exc:
            self._events.failed(gpu.index, "fields", exc)
            return {}
        values: dict[str, FieldReading] = {}
        refused: list[tuple[str, int]] = []
        for (reading, fid, _), got in zip(gpu.fields, readings, strict=True):
            if got.code == 0:
                values[reading] = got
            elif got.code in _REFUSED:
                refused.append((reading, fid))
            else:
                self._events.failed(gpu.index, reading, NvmlError(f"field {fid}: NVML error {got.code}", got.code))
        if refused:
            gone = {reading for reading, _ in refused}
            gpu.fields = [(reading, fid, scope) for reading, fid, scope in gpu.fields if reading not in gone]
            for reading, fid in refused:
                if reading not in _FIELD_FALLBACKS:  # else its own call takes over, and says so if it fails too
                    self._unsupported(gpu, reading, f"field {fid} is not supported")
        return values

    def field(self, gpu: Gpu, fields: dict[str, FieldReading], reading: str, default: float) -> float:
        """A field's value; where the GPU lacks the field, its own call's (when it has one)."""
        got = fields.get(reading)
        if got is not None:
            return got.value
        if reading in _FIELD_FALLBACKS and not self._asked(gpu, reading):
            return float(self.value(gpu, reading, default))
        return default

    def counter(self, gpu: Gpu, fields: dict[str, FieldReading], reading: str) -> int | None:
        """A cumulative counter; None (NULL), never 0, when the read failed or the GPU lacks it."""
        value = self.field(gpu, fields, reading, math.nan)
        return None if math.isnan(value) else int(value)

    def rate(self, gpu: Gpu, fields: dict[str, FieldReading], reading: str, scale: float) -> float:
        """The change of a cumulative counter field per second of the field's own timestamps (each GPU is read after
        every earlier GPU's calls: the poll's clock is not when the counter was taken), times `scale`.
        NaN on the first reading, when the read failed, and when the counter went back (driver reload)."""
        got = fields.get(reading)
        if got is None:
            return math.nan
        last = gpu.counters.get(reading)
        if last is None:
            gpu.counters[reading] = got
            return math.nan
        seconds = (got.timestamp_us - last.timestamp_us) / 1e6
        if seconds <= 0:  # the driver has not refreshed the counter since the last read: the last rate stands
            return gpu.rates.get(reading, math.nan)
        gpu.counters[reading] = got
        delta = got.value - last.value
        if delta < 0:
            # A counter narrower than 64 bits wraps (nvml.h says the PCIe byte counts can); a 64-bit one going back
            # was reset (driver reload): it would take centuries to wrap.
            if not got.wrap or got.wrap >= 1 << 64:
                gpu.rates[reading] = math.nan
                return math.nan
            delta += got.wrap
        rate = gpu.rates[reading] = delta * scale / seconds
        return rate

    def pcie(self, gpu: Gpu, fields: dict[str, FieldReading]) -> tuple[float, float]:
        """PCIe (transmit, receive) bytes a second."""
        # From the cumulative fields (never nvmlDeviceGetPcieThroughput, which blocks 20 ms per call); where the GPU
        # lacks them, GPM's PCIe metrics, carried forward between GPM intervals.
        if self._asked(gpu, "pcie_tx") or self._asked(gpu, "pcie_rx"):
            return self.rate(gpu, fields, "pcie_tx", 1.0), self.rate(gpu, fields, "pcie_rx", 1.0)
        return gpu.pcie

    def slow(self, gpu: Gpu, now: float) -> None:
        """Refresh the slow readings once a slow interval; they are carried forward in between."""
        if now - gpu.slow_at < self._slow_interval_s:
            return
        gpu.slow_at = now
        v = self.value
        gpu.mem_clock = float(v(gpu, "mem_clock", math.nan))
        gpu.memory = v(gpu, "memory", _NO_MEMORY)
        procs = v(gpu, "processes", _NO_DICT)
        gpu.procs = {} if procs is None else procs
        gpu.remap = v(gpu, "remap", _NO_REMAP)

    def gpm(self, gpu: Gpu, now: float) -> None:
        """Take a GPM sample once a GPM interval, and the metrics since the one before."""
        # The metrics span the previous and the current sample, and the 10 Hz rows in between carry the latest values
        # forward (GPM needs a long window to mean anything). A failed sample keeps the previous one: the next
        # interval is longer, never empty.
        call = gpu.calls.get("gpm")
        if call is None or now - gpu.gpm_at < self._gpm_interval_s:
            return
        sample = self._attempt(gpu, "gpm", call, _NO_OBJECT)
        if sample is not None:
            prev, gpu.gpm_prev, gpu.gpm_at = gpu.gpm_prev, sample, now
            if prev is not None:
                gpu.gpm = self._gpm_metrics(gpu, prev, sample)
                if self._pcie_from_gpm(gpu):
                    gpu.pcie = (gpu.gpm.get(GPM_PCIE_TX_PER_SEC, math.nan) * _MIB,
                                gpu.gpm.get(GPM_PCIE_RX_PER_SEC, math.nan) * _MIB)
        if "gpm" not in gpu.calls:
            gpu.gpm, gpu.gpm_prev, gpu.pcie_via_gpm = {}, None, False

    def value(self, gpu: Gpu, reading: str, default: T) -> T:
        """The reading of its own call, or `default` when the call failed or the GPU does not support it."""
        call = gpu.calls.get(reading)
        return default if call is None else self._attempt(gpu, reading, call, default)

    def _asked(self, gpu: Gpu, reading: str) -> bool:
        return any(asked == reading for asked, _fid, _scope in gpu.fields)

    def _pcie_from_gpm(self, gpu: Gpu) -> bool:
        return gpu.pcie_via_gpm and not (self._asked(gpu, "pcie_tx") or self._asked(gpu, "pcie_rx"))

    def _gpm_metrics(self, gpu: Gpu, a: object, b: object) -> dict[int, float]:
        wanted = [m for m in GPM_METRICS + (GPM_PCIE_METRICS if self._pcie_from_gpm(gpu) else ())
                  if m not in gpu.gpm_refused]
        try:
            results = self._nvml.gpm_metrics(a, b, wanted)
        except (NvmlGone, NvmlMissing):
            raise
        except NvmlError as exc:
            if exc.code not in _REFUSED:
                self._events.failed(gpu.index, "gpm", exc)
                return {}
            # A driver may refuse the whole call for one metric it lacks: ask each metric alone, so that one
            # refusal costs that metric only (the refused ones are remembered, so this happens once).
            results = [self._gpm_alone(a, b, metric) for metric in wanted]
        values: dict[int, float] = {}
        for metric, got in zip(wanted, results, strict=True):
            if got.code == 0:
                values[metric] = got.value
            elif got.code in _REFUSED:
                gpu.gpm_refused.add(metric)
                self._unsupported(gpu, f"gpm:{GPM_METRIC_NAMES[metric]}", f"GPM metric {metric} is refused")
            else:
                self._events.failed(gpu.index, f"gpm:{GPM_METRIC_NAMES[metric]}",
                                    NvmlError(f"GPM metric {metric}: NVML error {got.code}", got.code))
        if gpu.gpm_refused.issuperset(GPM_METRICS + GPM_PCIE_METRICS):
            gpu.calls.pop("gpm", None)  # nothing left to ask GPM for
        return values

    def _gpm_alone(self, a: object, b: object, metric: int) -> GpmValue:
        try:
            return self._nvml.gpm_metrics(a, b, (metric,))[0]
        except (NvmlGone, NvmlMissing):
            raise
        except NvmlError as exc:
            return GpmValue(math.nan, -1 if exc.code is None else exc.code)

    def _attempt(self, gpu: Gpu, reading: str, call: Callable[[], Any], default: T) -> T:
        try:
            return cast(T, call())
        except NvmlUnsupported as exc:
            self._unsupported(gpu, reading, str(exc))
        except (NvmlGone, NvmlMissing):
            raise
        except NvmlError as exc:
            self._events.failed(gpu.index, reading, exc)
        return default

    def _unsupported(self, gpu: Gpu, reading: str, why: str) -> None:
        gpu.calls.pop(reading, None)
        self._events.unsupported(gpu.index, gpu.uuid, gpu.engine, reading, why)
