"""What the GPU source reports besides its samples: `events` rows (unsupported readings, XIDs, lost GPUs), failed
calls (logged, rate-limited), and the counts behind its stats."""

from __future__ import annotations

import logging

from stepline.core.clock import Clock
from stepline.core.ratelimit import RateLimitedLog
from stepline.model.rows import Event, micros
from stepline.sources.base import Emit
from stepline.sources.gpu.nvml import NvmlError, XidEvent, gone_reason, xid_message

log = logging.getLogger(__name__)


class GpuEvents:
    """The events the GPU source owes its next emit, and its counts of what went wrong."""

    def __init__(self, clock: Clock, host: str) -> None:
        self._clock = clock
        self._host = host
        self._rows: list[Event] = []
        self._log = RateLimitedLog(log, 60.0)
        self.unsupported_readings = self.xid_events = self.gpus_lost = self.nvml_errors = 0

    def unsupported(self, index: int, uuid: str, engine: str, reading: str, why: str) -> None:
        """A reading this GPU does not offer: said once, as the caller never asks for it again."""
        self.unsupported_readings += 1
        self._rows.append(self._event(
            "gpu_reading_unsupported", "info", f"GPU {index} ({uuid}) does not support {reading}: {why}",
            {"gpu": str(index), "uuid": uuid, "reading": reading}, engine))

    def failed(self, index: int, reading: str, exc: NvmlError) -> None:
        """A call that failed this time (index -1: no device's); counted, and logged once a minute per reading."""
        self.nvml_errors += 1
        self._log.warning(f"{index}:{reading}", "GPU %d: NVML %s failed: %s", index, reading, exc)

    def lost(self, index: int, uuid: str, exc: NvmlError, engine: str) -> None:
        """A GPU fell off the bus or needs a reset (the caller reports each loss once)."""
        self.gpus_lost += 1
        reason = gone_reason(exc)
        self._rows.append(self._event(
            "gpu_lost", "critical",
            f"GPU {index} ({uuid or 'uuid unknown'}) was lost: {exc} (NVML_ERROR_{reason}); sampling the others",
            {"gpu": str(index), "uuid": uuid, "error": reason}, engine))

    def xid(self, xid: XidEvent, engine: str) -> None:
        """An XID critical error, with what it usually means."""
        self.xid_events += 1
        self._rows.append(self._event(
            "gpu_xid", "critical", xid_message(xid.gpu_index, xid.gpu_uuid, xid.xid),
            {"xid": str(xid.xid), "gpu": str(xid.gpu_index), "uuid": xid.gpu_uuid}, engine))

    def take(self) -> list[Event]:
        """The events queued since the last take (or flush), which are then forgotten."""
        rows, self._rows = self._rows, []
        return rows

    def flush(self, emit: Emit) -> None:
        """Emit the queued events now (before the source goes down, so that they are not lost with it)."""
        if self._rows:
            emit(self.take())

    def _event(self, kind: str, severity: str, message: str, attributes: dict[str, str], engine: str) -> Event:
        return Event(micros(self._clock.time()), self._host, engine, "gpu", kind, severity, message, attributes)
