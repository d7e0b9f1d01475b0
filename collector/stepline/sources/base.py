"""The one small protocol every source follows, and what a source is given to build itself."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from stepline.core.clock import Clock
from stepline.model.rows import Row

Emit = Callable[[Iterable[Row]], object]


class SourceError(RuntimeError):
    """A poll failed; the message is one line naming the source's problem."""


class Source(Protocol):
    """Produces typed rows when polled; imports neither ClickHouse nor prometheus_client."""

    @property
    def name(self) -> str: ...

    def poll(self, emit: Emit) -> None:
        """Emit this poll's rows; raise SourceError when the poll failed (rows emitted before stay)."""


class EngineProcesses:
    """Which process runs which engine, as the host source finds them; the GPU source reads it to tie a
    GPU to the engine whose process uses it."""

    def __init__(self) -> None:
        self._by_pid: dict[int, str] = {}
        self._lock = threading.Lock()
        self._generation = 0
        # Set by the host source: a GPU's process may be a child of the engine process it found.
        self.ancestors: Callable[[int], list[int]] = lambda pid: []

    def found(self, engine: str, pid: int) -> None:
        with self._lock:
            if self._by_pid.get(pid) != engine:
                self._by_pid[pid] = engine
                self._generation += 1

    def lost(self, pid: int) -> None:
        with self._lock:
            if self._by_pid.pop(pid, None) is not None:
                self._generation += 1

    def processes(self) -> dict[int, str]:
        """Every engine process found: pid -> engine (the GPU source reads their environments)."""
        with self._lock:
            return dict(self._by_pid)

    def generation(self) -> int:
        """A number that changes whenever an engine process is found or lost: answers cached before are stale."""
        with self._lock:
            return self._generation

    def engine_of(self, pid: int) -> str:
        """The engine `pid` (or one of its parents) runs, or "" when stepline knows of none."""
        with self._lock:
            known = self._by_pid.get(pid)
            if known is not None or not self._by_pid:
                return known or ""
        for parent in self.ancestors(pid):
            with self._lock:
                if parent in self._by_pid:
                    return self._by_pid[parent]
        return ""


@dataclass(frozen=True)
class SourceContext:
    """Everything a source may need from the collector."""

    host: str
    clock: Clock
    engine_processes: EngineProcesses = field(default_factory=EngineProcesses)


@runtime_checkable
class Listener(Protocol):
    """A source that receives pushed data (datagrams, OTLP) and so owns a socket between start and stop."""

    def start(self) -> None:
        """Bind and begin receiving; raise OSError with a clear message when the address is taken."""

    def stop(self) -> None:
        """Stop receiving; data already received stays available to the next poll."""


@runtime_checkable
class Counting(Protocol):
    """A source that keeps counts of its own (datagrams, rejects, drops) for the collector to export."""

    def stats(self) -> Mapping[str, int]:
        """Cumulative counts by name."""
