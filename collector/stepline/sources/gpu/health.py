"""Which GPUs the GPU source samples: those NVML shows at discovery, less the lost ones (reported once) and those that
could not be read, which are tried again every INIT_RETRY_S; and the XID event set, rebuilt without a lost GPU."""

from __future__ import annotations

import math
from collections.abc import Callable

from stepline.core.clock import Clock
from stepline.sources.gpu.events import GpuEvents
from stepline.sources.gpu.nvml import (
    INIT_RETRY_S,
    MAX_XID_PER_POLL,
    Handle,
    Nvml,
    NvmlError,
    NvmlGone,
    NvmlMissing,
    NvmlUnsupported,
)
from stepline.sources.gpu.readings import Gpu, GpuReader, device_calls


class Rotation:
    """The GPUs in rotation, lost GPUs and the XID event set, across polls and NVML sessions."""

    def __init__(self, nvml: Nvml, events: GpuEvents, reader: GpuReader, clock: Clock) -> None:
        self._nvml = nvml
        self._events = events
        self._reader = reader
        self._clock = clock
        self._xid = False  # some GPU is registered in the event set
        self.lost: set[int] = set()  # indexes; survives re-initialisation, so a lost GPU is reported once
        self.absent: set[int] = set()  # indexes out of rotation (lost, or discovery failed): tried every INIT_RETRY_S
        self._rediscover_at = -math.inf
        self._xid_rebuild_at = -math.inf

    def discover(self) -> list[Gpu]:
        """Every GPU of a new NVML session that can be read now."""
        self.absent.clear()
        self._xid_rebuild_at = -math.inf
        return [gpu for gpu in map(self._open, range(self._nvml.device_count())) if gpu is not None]

    def closed(self) -> None:
        """NVML was shut down, and the event set with it."""
        self._xid = False

    def answered(self, index: int) -> None:
        """This GPU was sampled: if it is lost again, that is reported again."""
        if self.lost:
            self.lost.discard(index)

    def gone(self, gpu: Gpu, exc: NvmlGone) -> None:
        """A GPU in rotation is lost: reported, and out of rotation from the next poll on."""
        gpu.lost = True
        self._lose(gpu.index, gpu.uuid, exc, gpu.engine)
        self._out_of_rotation(gpu.index)

    def next(self, gpus: list[Gpu], xid_gone: bool, now: float) -> list[Gpu]:
        """The GPUs the next poll samples: lost ones out, ones back from rediscovery in, the XID event set to match."""
        if any(gpu.lost for gpu in gpus) or (xid_gone and now >= self._xid_rebuild_at):
            gpus = self._rebuild_xid([gpu for gpu in gpus if not gpu.lost], now)
        for gpu in gpus:
            if now >= gpu.gpm_probe_at:
                try:
                    self._reader.probe_gpm(gpu)
                except NvmlGone as exc:
                    self.gone(gpu, exc)
        gpus = [gpu for gpu in gpus if not gpu.lost]
        if self.absent and now >= self._rediscover_at:
            self._rediscover_at = now + INIT_RETRY_S
            back = [gpu for gpu in map(self._open, sorted(self.absent)) if gpu is not None]
            gpus = sorted(gpus + back, key=lambda gpu: gpu.index)
        return gpus

    def drain_xid(self, gpus: list[Gpu]) -> bool:
        """Queue this poll's XID events; True when the wait says a GPU in the event set is lost."""
        if not self._xid:
            return False
        for _ in range(MAX_XID_PER_POLL):
            try:
                xid = self._nvml.wait_xid(0)
            except NvmlMissing:
                raise
            except NvmlGone as exc:  # it says so at every wait until the event set is rebuilt without that GPU
                self._events.failed(-1, "xid", exc)
                return True
            except NvmlError as exc:
                self._events.failed(-1, "xid", exc)
                return False
            if xid is None:
                return False
            self._events.xid(xid, next((g.engine for g in gpus if g.index == xid.gpu_index), ""))
        return False

    def _open(self, index: int) -> Gpu | None:
        """One GPU ready to sample, or None: then it is out of rotation and tried again every INIT_RETRY_S."""
        nvml = self._nvml
        try:
            h = nvml.handle(index)
            gpu = Gpu(index, _text(nvml.uuid, h), _text(nvml.name, h), h, device_calls(nvml, h))
            self._reader.probe_gpm(gpu)
            self._register_xid(gpu)
        except NvmlGone as exc:
            self._lose(index, "", exc, "")
        except NvmlMissing:
            raise
        except NvmlError as exc:  # transient: this GPU is asked again at the next rediscovery
            self._events.failed(index, "handle", exc)
        else:
            self.absent.discard(index)
            return gpu
        self._out_of_rotation(index)
        return None

    def _lose(self, index: int, uuid: str, exc: NvmlError, engine: str) -> None:
        if index in self.lost:
            return
        self.lost.add(index)
        self._events.lost(index, uuid, exc, engine)

    def _out_of_rotation(self, index: int) -> None:
        if not self.absent:
            self._rediscover_at = self._clock.monotonic() + INIT_RETRY_S
        self.absent.add(index)

    def _register_xid(self, gpu: Gpu) -> None:
        if gpu.xid is None:
            return
        try:
            self._nvml.register_xid_events(gpu.handle)
        except NvmlUnsupported as exc:
            gpu.xid = None
            self._events.unsupported(gpu.index, gpu.uuid, gpu.engine, "xid", str(exc))
            return
        except (NvmlGone, NvmlMissing):
            raise
        except NvmlError as exc:  # registered again when the event set is next rebuilt
            gpu.xid = False
            self._events.failed(gpu.index, "xid", exc)
            return
        gpu.xid = self._xid = True

    def _rebuild_xid(self, gpus: list[Gpu], now: float) -> list[Gpu]:
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
                self.gone(gpu, exc)
        gpus = [gpu for gpu in gpus if not gpu.lost]
        self.drain_xid(gpus)
        return gpus


def _text(call: Callable[[Handle], str], h: Handle) -> str:
    try:
        return call(h)
    except NvmlUnsupported:
        return ""
