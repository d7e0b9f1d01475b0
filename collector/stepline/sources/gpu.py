"""Source: every GPU's NVML counters, ~10 Hz, into `gpu_samples`; XIDs and lost GPUs into `events`."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, NoReturn, TypeVar, cast

from stepline.ratelimit import RateLimitedLog
from stepline.rows import Event, GpuSample, Row, micros
from stepline.sources.base import Emit, SourceContext, SourceError
from stepline.sources.nvml import (
    GPM_METRICS,
    INIT_RETRY_S,
    MAX_XID_PER_POLL,
    NVLINK_FIELDS,
    Handle,
    Nvml,
    NvmlError,
    NvmlGone,
    NvmlMissing,
    NvmlUnsupported,
    RealNvml,
    clock_event_flags,
    xid_message,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

_NAN_PAIR = (math.nan, math.nan)
_ZERO_PAIR = (0, 0)
_NO_GPM = (math.nan, math.nan, math.nan)
_MIB = 1 << 20
# Typed "nothing" defaults, so that _value/_attempt keep the reading's type.
_NO_LIST: list[float] | None = None
_NO_DICT: dict[int, int] | None = None
_NO_OBJECT: object | None = None


class _Gpu:
    """What the source keeps of one GPU between polls."""

    __slots__ = ("calls", "engine", "gpm", "gpm_at", "gpm_prev", "handle", "index", "lost", "name", "nvl_at",
                 "nvl_rx", "nvl_tx", "pcie", "pcie_at", "pcie_via_gpm", "pids", "uuid")

    def __init__(self, index: int, uuid: str, name: str, handle: Handle, calls: dict[str, Callable[[], Any]]) -> None:
        self.index, self.uuid, self.name, self.handle = index, uuid, name, handle
        self.calls = calls  # reading -> call; a reading the GPU does not support is removed, never called again
        self.lost = False
        self.engine = ""
        self.pids: set[int] = set()
        self.nvl_at: float | None = None
        self.nvl_tx = self.nvl_rx = 0.0
        self.gpm_prev: object | None = None
        self.gpm_at = -math.inf
        self.gpm = _NO_GPM
        self.pcie_via_gpm = False
        self.pcie_at = -math.inf
        self.pcie = _NAN_PAIR


def _calls(nvml: Nvml, h: Handle) -> dict[str, Callable[[], Any]]:
    return {
        "sm_clock": partial(nvml.clock_mhz, h, "sm"),
        "mem_clock": partial(nvml.clock_mhz, h, "mem"),
        "power": partial(nvml.power_mw, h),
        "energy": partial(nvml.energy_mj, h),
        "temp_gpu": partial(nvml.temperature_c, h, "gpu"),
        "temp_mem": partial(nvml.temperature_c, h, "memory"),
        "utilization": partial(nvml.utilization, h),
        "memory": partial(nvml.memory, h),
        "pcie_tx": partial(nvml.pcie_throughput_kbs, h, "tx"),
        "pcie_rx": partial(nvml.pcie_throughput_kbs, h, "rx"),
        "pcie_replay": partial(nvml.pcie_replay_counter, h),
        "nvlink": partial(nvml.field_values, h, NVLINK_FIELDS),
        "clock_events": partial(nvml.clock_event_reasons, h),
        "gpm": partial(nvml.gpm_sample, h),
        "processes": partial(nvml.processes, h),
    }


def _register_xid(nvml: Nvml, h: Handle) -> bool:
    nvml.register_xid_events(h)
    return True


class GpuSource:
    """Samples every GPU once per poll; no NVML (or no GPU) is a state, re-checked every INIT_RETRY_S."""

    def __init__(self, ctx: SourceContext, nvml: Nvml | None = None, *, gpm_interval_s: float = 1.0,
                 pcie_interval_s: float = 1.0, engine_of_pid: Callable[[int], str] | None = None) -> None:
        self._ctx = ctx
        self._nvml: Nvml = nvml if nvml is not None else RealNvml()
        self._gpm_interval_s = gpm_interval_s
        self._pcie_interval_s = pcie_interval_s
        # Default: the engine processes the host source found, so a GPU is tied to the engine it serves.
        self._engine_of_pid = engine_of_pid or ctx.engine_processes.engine_of
        self._gpus: list[_Gpu] | None = None
        self._initialised = False
        self._xid = False
        self._retry_at: float | None = None
        self._down_message = ""
        self._events: list[Event] = []
        self._lost: set[int] = set()  # indexes; survives re-initialisation, so a lost GPU is reported once
        self._pcie_budget = 0
        self._log = RateLimitedLog(log, 60.0)
        self._samples = self._unsupported_readings = self._xid_events = self._gpus_lost = self._nvml_errors = 0

    @property
    def name(self) -> str:
        return "gpu"

    def retry_in_s(self) -> float:
        """Seconds until NVML is tried again while the source is down (0 while it samples): the runner's pace."""
        if self._gpus is not None or self._retry_at is None:
            return 0.0
        return max(0.0, self._retry_at - self._ctx.clock.monotonic())

    def stats(self) -> Mapping[str, int]:
        """Cumulative counts by name."""
        return {"samples": self._samples, "unsupported_readings": self._unsupported_readings,
                "xid_events": self._xid_events, "gpus_lost": self._gpus_lost, "nvml_errors": self._nvml_errors}

    def poll(self, emit: Emit) -> None:
        """One GpuSample per GPU, plus the events (XID, lost GPU, unsupported reading) seen since the last poll."""
        gpus = self._gpus if self._gpus is not None else self._start(emit)
        clock = self._ctx.clock
        stamp, now = micros(clock.time()), clock.monotonic()
        rows: list[Row] = []
        # nvmlDeviceGetPcieThroughput blocks for its 20 ms window: at most one GPU pays it per poll.
        self._pcie_budget = 1
        lost = False
        try:
            self._drain_xid(gpus)
            for gpu in gpus:
                try:
                    rows.append(self._sample(gpu, stamp, now))
                except NvmlGone as exc:
                    gpu.lost = lost = True
                    self._lose(gpu.index, gpu.uuid, exc, gpu.engine)
                else:
                    if self._lost:
                        self._lost.discard(gpu.index)
        except NvmlMissing as exc:
            self._flush(emit)
            self._down(f"no NVML: {exc}")
        self._samples += len(rows)
        rows.extend(self._events)
        self._events.clear()
        if rows:
            emit(rows)
        if lost:
            self._gpus = gpus = [g for g in gpus if not g.lost]
            if not gpus:
                self._down("no NVML: every GPU was lost")

    def close(self) -> None:
        """Release NVML; a later poll starts again."""
        self._gpus, self._xid = None, False
        if self._initialised:
            self._initialised = False
            try:
                self._nvml.shutdown()
            except NvmlError as exc:
                log.debug("NVML shutdown failed: %s", exc)

    def _start(self, emit: Emit) -> list[_Gpu]:
        if self._retry_at is not None and self._ctx.clock.monotonic() < self._retry_at:
            raise SourceError(self._down_message)  # the same message every time: the runner logs it once
        try:
            gpus = self._discover()
        except NvmlError as exc:
            self._flush(emit)
            self._down(f"no NVML: {exc}")
        if not gpus:
            self._flush(emit)
            self._down("no NVML: every GPU was lost" if self._lost else "no NVML: no GPU found")
        self._retry_at = None
        self._gpus = gpus
        return gpus

    def _discover(self) -> list[_Gpu]:
        nvml = self._nvml
        nvml.init()
        self._initialised = True
        gpus: list[_Gpu] = []
        for index in range(nvml.device_count()):
            try:
                h = nvml.handle(index)
                gpu = _Gpu(index, self._text(nvml.uuid, h), self._text(nvml.name, h), h, _calls(nvml, h))
                self._probe(gpu)
            except NvmlGone as exc:
                self._lose(index, "", exc, "")
                continue
            except NvmlMissing:
                raise
            except NvmlError as exc:
                self._failed(index, "handle", exc)
                continue
            gpus.append(gpu)
        return gpus

    def _probe(self, gpu: _Gpu) -> None:
        try:
            supported = self._nvml.gpm_supported(gpu.handle)
        except (NvmlGone, NvmlMissing):
            raise
        except NvmlError as exc:
            supported = False
            if not isinstance(exc, NvmlUnsupported):
                self._failed(gpu.index, "gpm", exc)
        if not supported:
            self._unsupported(gpu, "gpm", "no GPM: DRAM bandwidth, tensor activity and SM occupancy need Hopper+")
        gpu.pcie_via_gpm = supported
        self._xid |= self._attempt(gpu, "xid", partial(_register_xid, self._nvml, gpu.handle), False)

    def _down(self, message: str) -> NoReturn:
        self.close()
        self._retry_at = self._ctx.clock.monotonic() + INIT_RETRY_S
        self._down_message = message
        raise SourceError(message)

    def _sample(self, gpu: _Gpu, stamp: int, now: float) -> GpuSample:
        v = self._value
        util = v(gpu, "utilization", _NAN_PAIR)
        used, total = v(gpu, "memory", _ZERO_PAIR)
        reasons = v(gpu, "clock_events", 0)
        self._gpm(gpu, now)
        pcie_tx, pcie_rx = self._pcie(gpu, now)
        nvl_tx, nvl_rx = self._nvlink(gpu, now)
        procs = v(gpu, "processes", _NO_DICT)
        if procs is None:
            procs = {}
        engine = self._engine(gpu, procs)
        gpm = gpu.gpm
        return GpuSample(
            stamp, self._ctx.host, engine, gpu.index, gpu.uuid, gpu.name,
            float(v(gpu, "sm_clock", math.nan)), float(v(gpu, "mem_clock", math.nan)),
            v(gpu, "power", math.nan) / 1000, v(gpu, "energy", 0),
            float(v(gpu, "temp_gpu", math.nan)), float(v(gpu, "temp_mem", math.nan)),
            float(util[0]), float(util[1]), used, total, pcie_tx, pcie_rx, v(gpu, "pcie_replay", 0),
            nvl_tx, nvl_rx, reasons, clock_event_flags(reasons), gpm[0], gpm[1], gpm[2], procs,
        )

    def _gpm(self, gpu: _Gpu, now: float) -> None:
        # One GPM sample per interval; the metrics span the previous and the current sample, and the 10 Hz rows
        # in between carry the latest values forward (GPM needs a long window to mean anything).
        call = gpu.calls.get("gpm")
        if call is None or now - gpu.gpm_at < self._gpm_interval_s:
            return
        sample = self._attempt(gpu, "gpm", call, _NO_OBJECT)
        if sample is not None:
            prev, gpu.gpm_prev, gpu.gpm_at = gpu.gpm_prev, sample, now
            if prev is not None:
                values = self._attempt(gpu, "gpm", partial(self._nvml.gpm_metrics, prev, sample, GPM_METRICS),
                                       _NO_LIST)
                gpu.gpm = _NO_GPM if values is None else (values[0], values[1], values[2])
                if values is not None and gpu.pcie_via_gpm:
                    if math.isnan(values[3]) or math.isnan(values[4]):
                        gpu.pcie_via_gpm = False  # this GPU's GPM lacks PCIe: use the timed call instead
                    else:
                        gpu.pcie = (values[3] * _MIB, values[4] * _MIB)
        if "gpm" not in gpu.calls:
            gpu.gpm, gpu.gpm_prev, gpu.pcie_via_gpm = _NO_GPM, None, False

    def _pcie(self, gpu: _Gpu, now: float) -> tuple[float, float]:
        # Without GPM, PCIe comes from nvmlDeviceGetPcieThroughput (KB/s, counted as KiB like every NVML tool),
        # at most every pcie_interval_s per GPU and for one GPU per poll; rows in between carry it forward.
        if gpu.pcie_via_gpm or not self._pcie_budget or now - gpu.pcie_at < self._pcie_interval_s:
            return gpu.pcie
        if "pcie_tx" in gpu.calls or "pcie_rx" in gpu.calls:
            self._pcie_budget -= 1
            gpu.pcie_at = now
            gpu.pcie = (self._value(gpu, "pcie_tx", math.nan) * 1024.0, self._value(gpu, "pcie_rx", math.nan) * 1024.0)
        return gpu.pcie

    def _nvlink(self, gpu: _Gpu, now: float) -> tuple[float, float]:
        # NVLINK_THROUGHPUT_DATA_TX/RX are cumulative KiB of payload since the driver loaded, summed over the links
        # by the driver (scope UINT_MAX). Rate = delta KiB * 1024 / delta monotonic seconds between two polls;
        # NaN on the first poll and when a counter went back (driver reload).
        counters = self._value(gpu, "nvlink", _NO_LIST)
        if counters is None:
            return _NAN_PAIR
        tx, rx = counters
        at, last_tx, last_rx = gpu.nvl_at, gpu.nvl_tx, gpu.nvl_rx
        gpu.nvl_at, gpu.nvl_tx, gpu.nvl_rx = now, tx, rx
        if at is None or now <= at or tx < last_tx or rx < last_rx:
            return _NAN_PAIR
        dt = now - at
        return (tx - last_tx) * 1024.0 / dt, (rx - last_rx) * 1024.0 / dt

    def _engine(self, gpu: _Gpu, procs: dict[int, int]) -> str:
        if not procs:
            return ""
        if gpu.engine and procs.keys() == gpu.pids:
            return gpu.engine
        engine = ""
        for pid in procs:
            engine = self._engine_of_pid(pid)
            if engine:
                break
        gpu.engine, gpu.pids = engine, set(procs)
        return engine

    def _drain_xid(self, gpus: list[_Gpu]) -> None:
        if not self._xid:
            return
        for _ in range(MAX_XID_PER_POLL):
            try:
                xid = self._nvml.wait_xid(0)
            except NvmlMissing:
                raise
            except NvmlError as exc:
                self._failed(-1, "xid", exc)
                return
            if xid is None:
                return
            self._xid_events += 1
            engine = next((g.engine for g in gpus if g.index == xid.gpu_index), "")
            self._events.append(self._event(
                "gpu_xid", "critical", xid_message(xid.gpu_index, xid.gpu_uuid, xid.xid),
                {"xid": str(xid.xid), "gpu": str(xid.gpu_index), "uuid": xid.gpu_uuid}, engine))

    def _value(self, gpu: _Gpu, reading: str, default: T) -> T:
        call = gpu.calls.get(reading)
        return default if call is None else self._attempt(gpu, reading, call, default)

    def _attempt(self, gpu: _Gpu, reading: str, call: Callable[[], Any], default: T) -> T:
        try:
            return cast(T, call())
        except NvmlUnsupported as exc:
            self._unsupported(gpu, reading, str(exc))
        except (NvmlGone, NvmlMissing):
            raise
        except NvmlError as exc:
            self._failed(gpu.index, reading, exc)
        return default

    def _text(self, call: Callable[[Handle], str], h: Handle) -> str:
        try:
            return call(h)
        except NvmlUnsupported:
            return ""

    def _unsupported(self, gpu: _Gpu, reading: str, why: str) -> None:
        gpu.calls.pop(reading, None)
        self._unsupported_readings += 1
        self._events.append(self._event(
            "gpu_reading_unsupported", "info", f"GPU {gpu.index} ({gpu.uuid}) does not support {reading}: {why}",
            {"gpu": str(gpu.index), "uuid": gpu.uuid, "reading": reading}, gpu.engine))

    def _failed(self, index: int, reading: str, exc: NvmlError) -> None:
        self._nvml_errors += 1
        self._log.warning(f"{index}:{reading}", "GPU %d: NVML %s failed: %s", index, reading, exc)

    def _lose(self, index: int, uuid: str, exc: NvmlError, engine: str) -> None:
        if index in self._lost:
            return
        self._lost.add(index)
        self._gpus_lost += 1
        self._events.append(self._event(
            "gpu_lost", "critical", f"GPU {index} ({uuid or 'uuid unknown'}) was lost: {exc}; sampling the others",
            {"gpu": str(index), "uuid": uuid}, engine))

    def _event(self, kind: str, severity: str, message: str, attributes: dict[str, str], engine: str) -> Event:
        return Event(micros(self._ctx.clock.time()), self._ctx.host, engine, "gpu", kind, severity, message,
                     attributes)

    def _flush(self, emit: Emit) -> None:
        if self._events:
            emit(list(self._events))
            self._events.clear()
