"""Source: every GPU's NVML counters, ~10 Hz, into `gpu_samples`; XIDs and lost GPUs into `events`."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, NoReturn, TypeVar, cast

from stepline.core.ratelimit import RateLimitedLog
from stepline.model.rows import Event, GpuSample, Row, micros
from stepline.sources.base import Emit, SourceContext, SourceError
from stepline.sources.gpu_owners import Device, EngineGpus, EngineLookup, PidView, ProcPidView
from stepline.sources.nvml import (
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
    GPM_METRIC_NAMES,
    GPM_METRICS,
    GPM_PCIE_METRICS,
    GPM_PCIE_RX_PER_SEC,
    GPM_PCIE_TX_PER_SEC,
    GPM_SM_OCCUPANCY,
    GPM_SM_UTIL,
    INIT_RETRY_S,
    MAX_XID_PER_POLL,
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
    RealNvml,
    RemappedRows,
    clock_event_flags,
    gone_reason,
    xid_message,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

_NAN_PAIR = (math.nan, math.nan)
_MIB = 1 << 20
# Typed "nothing" defaults, so that _value/_attempt keep the reading's type.
_NO_DICT: dict[int, int] | None = None
_NO_OBJECT: object | None = None
_NO_MEMORY: MemoryInfo | None = None
_NO_REMAP: RemappedRows | None = None
_NO_COUNT: int | None = None
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


class _Gpu:
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
        self.pcie = _NAN_PAIR
        # Read once a second (slow_at), carried forward in between.
        self.slow_at = -math.inf
        self.mem_clock = math.nan
        self.memory: MemoryInfo | None = None
        self.procs: dict[int, int] = {}
        self.remap: RemappedRows | None = None


def _calls(nvml: Nvml, h: Handle) -> dict[str, Callable[[], Any]]:
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


class GpuSource:
    """Samples every GPU once per poll; no NVML (or no GPU) is a state, re-checked every INIT_RETRY_S."""

    def __init__(self, ctx: SourceContext, nvml: Nvml | None = None, *, gpm_interval_s: float = 1.0,
                 slow_interval_s: float = 1.0, engine_of_pid: Callable[[int], str] | None = None,
                 pid_view: PidView | None = None, engine_of_gpu: Callable[[str], str] | None = None,
                 configured_gpus: Mapping[str, str] | None = None,
                 own_environ: Mapping[str, str] | None = None,
                 gpu_generation: Callable[[], int] | None = None) -> None:
        self._ctx = ctx
        self._nvml: Nvml = nvml if nvml is not None else RealNvml()
        self._gpm_interval_s = gpm_interval_s
        # Processes, memory, memory clock and row remapping change slowly: read once per slow interval per GPU.
        self._slow_interval_s = slow_interval_s
        self._driver: str | None = None  # nvmlSystemGetDriverVersion, read once per NVML session
        # Default: the engine processes the host source found, so a GPU is tied to the engine it serves: by the PIDs
        # NVML reports, else (PIDs not visible here) by the GPUs their environments name, else by the setting
        # (configured_gpus: GPU UUID -> engine; engine_of_gpu replaces it).
        view = pid_view or ProcPidView()
        by_uuid = EngineGpus(ctx.engine_processes.processes, view, configured=configured_gpus, own_environ=own_environ)
        self._owners = EngineLookup(
            engine_of_pid or ctx.engine_processes.engine_of, view,
            generation=(lambda: 0) if engine_of_pid else ctx.engine_processes.generation,
            engine_of_gpu=engine_of_gpu or by_uuid.configured,
            engine_of_hidden_gpu=lambda uuid: by_uuid.by_environ(uuid, self._devices()),
            gpu_generation=gpu_generation or (lambda: 0))  # engine_of_gpu's answers change with it
        self._gpus: list[_Gpu] | None = None
        self._initialised = False
        self._xid = False
        self._retry_at: float | None = None
        self._down_message = ""
        self._events: list[Event] = []
        self._lost: set[int] = set()  # indexes; survives re-initialisation, so a lost GPU is reported once
        self._absent: set[int] = set()  # indexes out of rotation (lost, or discovery failed): tried every INIT_RETRY_S
        self._rediscover_at = -math.inf
        self._xid_rebuild_at = -math.inf
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
        self._owners.new_poll()
        try:
            xid_gone = self._drain_xid(gpus)
            for gpu in gpus:
                try:
                    rows.append(self._sample(gpu, stamp, now))
                except NvmlGone as exc:
                    self._gone(gpu, exc)
                else:
                    if self._lost:
                        self._lost.discard(gpu.index)
            gpus = self._rotation(gpus, xid_gone, now)
        except NvmlMissing as exc:
            self._flush(emit)
            self._down(f"no NVML: {exc}")
        self._samples += len(rows)
        rows.extend(self._events)
        self._events.clear()
        if rows:
            emit(rows)
        if not gpus:
            self._down("no NVML: every GPU was lost")

    def close(self) -> None:
        """Release NVML; a later poll starts again."""
        self._gpus, self._xid, self._driver = None, False, None
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
            self._down("no NVML: every GPU was lost" if self._lost else
                       "no NVML: no GPU could be read" if self._absent else "no NVML: no GPU found")
        self._retry_at = None
        self._gpus = gpus
        return gpus

    def _discover(self) -> list[_Gpu]:
        nvml = self._nvml
        nvml.init()
        self._initialised = True
        self._absent.clear()
        self._xid_rebuild_at = -math.inf
        return [gpu for gpu in map(self._open, range(nvml.device_count())) if gpu is not None]

    def _open(self, index: int) -> _Gpu | None:
        """One GPU ready to sample, or None: then it is out of rotation and tried again every INIT_RETRY_S."""
        nvml = self._nvml
        try:
            h = nvml.handle(index)
            gpu = _Gpu(index, self._text(nvml.uuid, h), self._text(nvml.name, h), h, _calls(nvml, h))
            self._probe(gpu)
        except NvmlGone as exc:
            self._lose(index, "", exc, "")
        except NvmlMissing:
            raise
        except NvmlError as exc:  # transient: this GPU is asked again at the next rediscovery
            self._failed(index, "handle", exc)
        else:
            self._absent.discard(index)
            return gpu
        self._out_of_rotation(index)
        return None

    def _gone(self, gpu: _Gpu, exc: NvmlGone) -> None:
        gpu.lost = True
        self._lose(gpu.index, gpu.uuid, exc, gpu.engine)
        self._out_of_rotation(gpu.index)

    def _out_of_rotation(self, index: int) -> None:
        if not self._absent:
            self._rediscover_at = self._ctx.clock.monotonic() + INIT_RETRY_S
        self._absent.add(index)

    def _probe(self, gpu: _Gpu) -> None:
        self._probe_gpm(gpu)
        self._register_xid(gpu)

    def _probe_gpm(self, gpu: _Gpu) -> None:
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
            self._failed(gpu.index, "gpm", exc)
            gpu.gpm_probes += 1
            if gpu.gpm_probes < GPM_PROBE_TRIES:
                gpu.gpm_probe_at = self._ctx.clock.monotonic() + INIT_RETRY_S
                return
            supported, why = False, f"gpm_supported failed {gpu.gpm_probes} times, given up: {exc}"
        if not supported:
            self._unsupported(gpu, "gpm", why)
            return
        gpu.calls["gpm"] = partial(self._nvml.gpm_sample, gpu.handle)
        gpu.pcie_via_gpm = True

    def _register_xid(self, gpu: _Gpu) -> None:
        if gpu.xid is None:
            return
        try:
            self._nvml.register_xid_events(gpu.handle)
        except NvmlUnsupported as exc:
            gpu.xid = None
            self._unsupported(gpu, "xid", str(exc))
            return
        except (NvmlGone, NvmlMissing):
            raise
        except NvmlError as exc:  # registered again when the event set is next rebuilt
            gpu.xid = False
            self._failed(gpu.index, "xid", exc)
            return
        gpu.xid = self._xid = True

    def _rotation(self, gpus: list[_Gpu], xid_gone: bool, now: float) -> list[_Gpu]:
        """The GPUs the next poll samples: lost ones out, ones back from rediscovery in, the XID event set to match."""
        if any(gpu.lost for gpu in gpus) or (xid_gone and now >= self._xid_rebuild_at):
            gpus = self._rebuild_xid([gpu for gpu in gpus if not gpu.lost], now)
        for gpu in gpus:
            if now >= gpu.gpm_probe_at:
                try:
                    self._probe_gpm(gpu)
                except NvmlGone as exc:
                    self._gone(gpu, exc)
        gpus = [gpu for gpu in gpus if not gpu.lost]
        if self._absent and now >= self._rediscover_at:
            self._rediscover_at = now + INIT_RETRY_S
            back = [gpu for gpu in map(self._open, sorted(self._absent)) if gpu is not None]
            gpus = sorted(gpus + back, key=lambda gpu: gpu.index)
        self._gpus = gpus
        return gpus

    def _rebuild_xid(self, gpus: list[_Gpu], now: float) -> list[_Gpu]:
        # A lost GPU in the event set makes every wait answer GPU_IS_LOST, and then no other GPU's XID is ever drained:
        # start a new set with the GPUs still in rotation (one that cannot register now is lost too), then drain it.
        # When the wait says "lost" and no GPU is found lost, this is tried again every INIT_RETRY_S, not every poll.
        self._xid_rebuild_at = now + INIT_RETRY_S
        self._nvml.clear_xid_events()
        self._xid = False
        for gpu in gpus:
            try:
                self._register_xid(gpu)
            except NvmlGone as exc:
                self._gone(gpu, exc)
        gpus = [gpu for gpu in gpus if not gpu.lost]
        self._drain_xid(gpus)
        return gpus

    def _down(self, message: str) -> NoReturn:
        self.close()
        self._retry_at = self._ctx.clock.monotonic() + INIT_RETRY_S
        self._down_message = message
        raise SourceError(message)

    def _sample(self, gpu: _Gpu, stamp: int, now: float) -> GpuSample:
        v = self._value
        fields = self._fields(gpu)
        util = v(gpu, "utilization", _NAN_PAIR)
        reasons = v(gpu, "clock_events", 0)
        self._slow(gpu, now)
        self._gpm(gpu, now)
        memory = gpu.memory or MemoryInfo(0, 0, None)
        remap = gpu.remap
        engine = self._engine(gpu, gpu.procs)
        gpm = gpu.gpm.get
        nan = math.nan
        return GpuSample(
            stamp, self._ctx.host, engine, gpu.index, gpu.uuid, gpu.name,
            float(v(gpu, "sm_clock", nan)), gpu.mem_clock,
            self._field(gpu, fields, "power", nan) / 1000, self._counter(gpu, fields, "energy"),
            float(v(gpu, "temp_gpu", nan)), self._field(gpu, fields, "temp_mem", nan),
            float(util[0]), float(util[1]), memory.used, memory.total, *self._pcie(gpu, fields),
            self._counter(gpu, fields, "pcie_replay"),
            self._rate(gpu, fields, "nvlink_tx", 1024.0), self._rate(gpu, fields, "nvlink_rx", 1024.0),
            reasons, clock_event_flags(reasons),
            gpm(GPM_DRAM_BW_UTIL, nan), gpm(GPM_ANY_TENSOR_UTIL, nan), gpm(GPM_SM_OCCUPANCY, nan), dict(gpu.procs),
            self._driver_version(), self._field(gpu, fields, "power_instant", nan) / 1000, memory.reserved,
            gpm(GPM_SM_UTIL, nan), gpm(GPM_GRAPHICS_UTIL, nan),
            None if remap is None else remap.correctable, None if remap is None else remap.uncorrectable,
            None if remap is None else remap.pending, None if remap is None else remap.failure,
        )

    def _fields(self, gpu: _Gpu) -> dict[str, FieldReading]:
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
            self._failed(gpu.index, "fields", exc)
            return {}
        values: dict[str, FieldReading] = {}
        refused: list[tuple[str, int]] = []
        for (reading, fid, _), got in zip(gpu.fields, readings, strict=True):
            if got.code == 0:
                values[reading] = got
            elif got.code in _REFUSED:
                refused.append((reading, fid))
            else:
                self._failed(gpu.index, reading, NvmlError(f"field {fid}: NVML error {got.code}", got.code))
        if refused:
            gone = {reading for reading, _ in refused}
            gpu.fields = [f for f in gpu.fields if f[0] not in gone]
            for reading, fid in refused:
                if reading not in _FIELD_FALLBACKS:  # else its own call takes over, and says so if it fails too
                    self._unsupported(gpu, reading, f"field {fid} is not supported")
        return values

    def _asked(self, gpu: _Gpu, reading: str) -> bool:
        return any(f[0] == reading for f in gpu.fields)

    def _field(self, gpu: _Gpu, fields: dict[str, FieldReading], reading: str, default: float) -> float:
        """A field's value; where the GPU lacks the field, its own call's (when it has one)."""
        got = fields.get(reading)
        if got is not None:
            return got.value
        if reading in _FIELD_FALLBACKS and not self._asked(gpu, reading):
            return float(self._value(gpu, reading, default))
        return default

    def _counter(self, gpu: _Gpu, fields: dict[str, FieldReading], reading: str) -> int | None:
        """A cumulative counter; None (NULL), never 0, when the read failed or the GPU lacks it."""
        value = self._field(gpu, fields, reading, math.nan)
        return None if math.isnan(value) else int(value)

    def _rate(self, gpu: _Gpu, fields: dict[str, FieldReading], reading: str, scale: float) -> float:
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

    def _pcie(self, gpu: _Gpu, fields: dict[str, FieldReading]) -> tuple[float, float]:
        # PCIe bytes from the cumulative fields (never nvmlDeviceGetPcieThroughput, which blocks 20 ms per call);
        # where the GPU lacks them, GPM's PCIe metrics, carried forward between GPM intervals.
        if self._asked(gpu, "pcie_tx") or self._asked(gpu, "pcie_rx"):
            return self._rate(gpu, fields, "pcie_tx", 1.0), self._rate(gpu, fields, "pcie_rx", 1.0)
        return gpu.pcie

    def _slow(self, gpu: _Gpu, now: float) -> None:
        if now - gpu.slow_at < self._slow_interval_s:
            return
        gpu.slow_at = now
        v = self._value
        gpu.mem_clock = float(v(gpu, "mem_clock", math.nan))
        gpu.memory = v(gpu, "memory", _NO_MEMORY)
        procs = v(gpu, "processes", _NO_DICT)
        gpu.procs = {} if procs is None else procs
        gpu.remap = v(gpu, "remap", _NO_REMAP)

    def _driver_version(self) -> str:
        if self._driver is None:
            try:
                self._driver = self._nvml.driver_version()
            except NvmlMissing:
                raise
            except NvmlError as exc:
                self._driver = ""  # asked once per NVML session: an identity detail, not worth a call a poll
                self._failed(-1, "driver_version", exc)
        return self._driver

    def _gpm(self, gpu: _Gpu, now: float) -> None:
        # One GPM sample per interval; the metrics span the previous and the current sample, and the 10 Hz rows
        # in between carry the latest values forward (GPM needs a long window to mean anything). A failed sample
        # keeps the previous one: the next interval is longer, never empty.
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

    def _pcie_from_gpm(self, gpu: _Gpu) -> bool:
        return gpu.pcie_via_gpm and not (self._asked(gpu, "pcie_tx") or self._asked(gpu, "pcie_rx"))

    def _gpm_metrics(self, gpu: _Gpu, a: object, b: object) -> dict[int, float]:
        wanted = [m for m in GPM_METRICS + (GPM_PCIE_METRICS if self._pcie_from_gpm(gpu) else ())
                  if m not in gpu.gpm_refused]
        try:
            results = self._nvml.gpm_metrics(a, b, wanted)
        except (NvmlGone, NvmlMissing):
            raise
        except NvmlError as exc:
            if exc.code not in _REFUSED:
                self._failed(gpu.index, "gpm", exc)
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
                self._failed(gpu.index, f"gpm:{GPM_METRIC_NAMES[metric]}",
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

    def _engine(self, gpu: _Gpu, procs: dict[int, int]) -> str:
        engine = self._owners.engine(gpu.index, gpu.uuid, procs.keys())
        if engine is not None:  # None: some PIDs wait for a later poll's lookups; the GPU keeps its engine meanwhile
            gpu.engine = engine
        return gpu.engine

    def _devices(self) -> list[Device] | None:
        """Every GPU NVML shows, in its order; None while some could not be read (indices would not line up)."""
        if self._gpus is None or self._absent:
            return None
        devices = sorted((gpu.index, Device(gpu.uuid, gpu.name)) for gpu in self._gpus)
        return [d for _, d in devices] if [i for i, _ in devices] == list(range(len(devices))) else None

    def _drain_xid(self, gpus: list[_Gpu]) -> bool:
        """Queue this poll's XID events; True when the wait says a GPU in the event set is lost."""
        if not self._xid:
            return False
        for _ in range(MAX_XID_PER_POLL):
            try:
                xid = self._nvml.wait_xid(0)
            except NvmlMissing:
                raise
            except NvmlGone as exc:  # it says so at every wait until the event set is rebuilt without that GPU
                self._failed(-1, "xid", exc)
                return True
            except NvmlError as exc:
                self._failed(-1, "xid", exc)
                return False
            if xid is None:
                return False
            self._xid_events += 1
            engine = next((g.engine for g in gpus if g.index == xid.gpu_index), "")
            self._events.append(self._event(
                "gpu_xid", "critical", xid_message(xid.gpu_index, xid.gpu_uuid, xid.xid),
                {"xid": str(xid.xid), "gpu": str(xid.gpu_index), "uuid": xid.gpu_uuid}, engine))
        return False

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
        reason = gone_reason(exc)
        self._events.append(self._event(
            "gpu_lost", "critical",
            f"GPU {index} ({uuid or 'uuid unknown'}) was lost: {exc} (NVML_ERROR_{reason}); sampling the others",
            {"gpu": str(index), "uuid": uuid, "error": reason}, engine))

    def _event(self, kind: str, severity: str, message: str, attributes: dict[str, str], engine: str) -> Event:
        return Event(micros(self._ctx.clock.time()), self._ctx.host, engine, "gpu", kind, severity, message,
                     attributes)

    def _flush(self, emit: Emit) -> None:
        if self._events:
            emit(list(self._events))
            self._events.clear()
