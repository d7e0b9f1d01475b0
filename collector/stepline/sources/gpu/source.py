"""Source: every GPU's NVML counters, ~10 Hz, into `gpu_samples`; XIDs and lost GPUs into `events`."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import NoReturn

from stepline.model.rows import GpuSample, Row, micros
from stepline.sources.base import Emit, SourceContext, SourceError
from stepline.sources.gpu.events import GpuEvents
from stepline.sources.gpu.health import Rotation
from stepline.sources.gpu.nvml import (
    GPM_ANY_TENSOR_UTIL,
    GPM_DRAM_BW_UTIL,
    GPM_GRAPHICS_UTIL,
    GPM_SM_OCCUPANCY,
    GPM_SM_UTIL,
    INIT_RETRY_S,
    Nvml,
    NvmlError,
    NvmlGone,
    NvmlMissing,
    RealNvml,
    clock_event_flags,
)
from stepline.sources.gpu.owners import Device, EngineGpus, EngineLookup, PidView, ProcPidView
from stepline.sources.gpu.readings import NAN_PAIR, Gpu, GpuReader

log = logging.getLogger(__name__)


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
        self._events = GpuEvents(ctx.clock, ctx.host)
        self._reader = GpuReader(self._nvml, self._events, ctx.clock, gpm_interval_s=gpm_interval_s,
                                 slow_interval_s=slow_interval_s)
        self._rotation = Rotation(self._nvml, self._events, self._reader, ctx.clock)
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
        self._gpus: list[Gpu] | None = None
        self._initialised = False
        self._retry_at: float | None = None
        self._down_message = ""
        self._samples = 0

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
        events = self._events
        return {"samples": self._samples, "unsupported_readings": events.unsupported_readings,
                "xid_events": events.xid_events, "gpus_lost": events.gpus_lost, "nvml_errors": events.nvml_errors}

    def poll(self, emit: Emit) -> None:
        """One GpuSample per GPU, plus the events (XID, lost GPU, unsupported reading) seen since the last poll."""
        gpus = self._gpus if self._gpus is not None else self._start(emit)
        clock = self._ctx.clock
        stamp, now = micros(clock.time()), clock.monotonic()
        rows: list[Row] = []
        rotation = self._rotation
        self._owners.new_poll()
        try:
            xid_gone = rotation.drain_xid(gpus)
            for gpu in gpus:
                try:
                    rows.append(self._sample(gpu, stamp, now))
                except NvmlGone as exc:
                    rotation.gone(gpu, exc)
                else:
                    rotation.answered(gpu.index)
            gpus = self._gpus = rotation.next(gpus, xid_gone, now)
        except NvmlMissing as exc:
            self._events.flush(emit)
            self._down(f"no NVML: {exc}")
        self._samples += len(rows)
        rows.extend(self._events.take())
        if rows:
            emit(rows)
        if not gpus:
            self._down("no NVML: every GPU was lost")

    def close(self) -> None:
        """Release NVML; a later poll starts again."""
        self._gpus, self._driver = None, None
        self._rotation.closed()
        if self._initialised:
            self._initialised = False
            try:
                self._nvml.shutdown()
            except NvmlError as exc:
                log.debug("NVML shutdown failed: %s", exc)

    def _start(self, emit: Emit) -> list[Gpu]:
        if self._retry_at is not None and self._ctx.clock.monotonic() < self._retry_at:
            raise SourceError(self._down_message)  # the same message every time: the runner logs it once
        try:
            self._nvml.init()
            self._initialised = True
            gpus = self._rotation.discover()
        except NvmlError as exc:
            self._events.flush(emit)
            self._down(f"no NVML: {exc}")
        if not gpus:
            self._events.flush(emit)
            rotation = self._rotation
            self._down("no NVML: every GPU was lost" if rotation.lost else
                       "no NVML: no GPU could be read" if rotation.absent else "no NVML: no GPU found")
        self._retry_at = None
        self._gpus = gpus
        return gpus

    def _down(self, message: str) -> NoReturn:
        self.close()
        self._retry_at = self._ctx.clock.monotonic() + INIT_RETRY_S
        self._down_message = message
        raise SourceError(message)

    def _sample(self, gpu: Gpu, stamp: int, now: float) -> GpuSample:
        reader = self._reader
        v = reader.value
        fields = reader.fields(gpu)
        util = v(gpu, "utilization", NAN_PAIR)
        reasons = v(gpu, "clock_events", 0)
        reader.slow(gpu, now)
        reader.gpm(gpu, now)
        memory = gpu.memory
        remap = gpu.remap
        engine = self._engine(gpu, gpu.procs)
        gpm = gpu.gpm.get
        nan = math.nan
        return GpuSample(
            stamp, self._ctx.host, engine, gpu.index, gpu.uuid, gpu.name,
            float(v(gpu, "sm_clock", nan)), gpu.mem_clock,
            reader.field(gpu, fields, "power", nan) / 1000, reader.counter(gpu, fields, "energy"),
            float(v(gpu, "temp_gpu", nan)), reader.field(gpu, fields, "temp_mem", nan),
            float(util[0]), float(util[1]), None if memory is None else memory.used,
            None if memory is None else memory.total, *reader.pcie(gpu, fields),
            reader.counter(gpu, fields, "pcie_replay"),
            reader.rate(gpu, fields, "nvlink_tx", 1024.0), reader.rate(gpu, fields, "nvlink_rx", 1024.0),
            reasons, clock_event_flags(reasons),
            gpm(GPM_DRAM_BW_UTIL, nan), gpm(GPM_ANY_TENSOR_UTIL, nan), gpm(GPM_SM_OCCUPANCY, nan), dict(gpu.procs),
            self._driver_version(), reader.field(gpu, fields, "power_instant", nan) / 1000,
            None if memory is None else memory.reserved,
            gpm(GPM_SM_UTIL, nan), gpm(GPM_GRAPHICS_UTIL, nan),
            None if remap is None else remap.correctable, None if remap is None else remap.uncorrectable,
            None if remap is None else remap.pending, None if remap is None else remap.failure,
        )

    def _driver_version(self) -> str:
        if self._driver is None:
            try:
                self._driver = self._nvml.driver_version()
            except NvmlMissing:
                raise
            except NvmlError as exc:
                self._driver = ""  # asked once per NVML session: an identity detail, not worth a call a poll
                self._events.failed(-1, "driver_version", exc)
        return self._driver

    def _engine(self, gpu: Gpu, procs: dict[int, int]) -> str:
        engine = self._owners.engine(gpu.index, gpu.uuid, procs.keys())
        if engine is not None:  # None: some PIDs wait for a later poll's lookups; the GPU keeps its engine meanwhile
            gpu.engine = engine
        return gpu.engine

    def _devices(self) -> list[Device] | None:
        """Every GPU NVML shows, in its order; None while some could not be read (indices would not line up)."""
        if self._gpus is None or self._rotation.absent:
            return None
        devices = sorted((gpu.index, Device(gpu.uuid, gpu.name)) for gpu in self._gpus)
        return [d for _, d in devices] if [i for i, _ in devices] == list(range(len(devices))) else None
