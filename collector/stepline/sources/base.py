"""The one small protocol every source follows, and what a source is given to build itself."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from stepline.core.clock import Clock
from stepline.model.rows import Row
from stepline.sources.addresses import EngineAddresses

Emit = Callable[[Iterable[Row]], object]


class SourceError(RuntimeError):
    """A poll failed; the message is one line naming the source's problem, `reason` its kind in one word (the
    runner exports it as `stepline_source_failure_info{source, reason}`): for a scrape, `refused` (nothing listens:
    the process is gone or not started), `gone` (the connection closed without an answer: it died mid-answer),
    `timeout`, `unreachable` (no such host, no route), `http` (an error status), `invalid` (no exposition);
    `error` when nothing more is known."""

    def __init__(self, message: str, reason: str = "error") -> None:
        super().__init__(message)
        self.reason = reason


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


class EngineModels:
    """Which model each engine serves, by engine name, as the collector learns it: the plugin's engine_config, the
    model_name label of the engine's /metrics, and at start what the store's engine_config events say. The plugin
    receiver names its rows from it; the OTLP receiver names the requests whose spans do not (vLLM's never do)."""

    def __init__(self) -> None:
        # One dict, read on the receivers' hot paths: a single get or set needs no lock under the GIL.
        self._models: dict[str, str] = {}

    def announce(self, engine: str, model: str) -> None:
        """What the engine says it serves now (an engine restarted with another model says so)."""
        self._models[engine] = model

    def remember(self, models: Mapping[str, str]) -> None:
        """What engines announced before this collector started; what they announced since stays."""
        for engine, model in models.items():
            if model:
                self._models.setdefault(engine, model)

    def model_of(self, engine: str) -> str:
        """The engine's model, or "" when none has been announced."""
        return self._models.get(engine, "")


@dataclass(frozen=True)
class SourceContext:
    """Everything a source may need from the collector."""

    host: str
    clock: Clock
    engine_processes: EngineProcesses = field(default_factory=EngineProcesses)
    engine_models: EngineModels = field(default_factory=EngineModels)
    # The engines by the address the collector reaches them at: a gateway's backend named as the engine there.
    engine_addresses: EngineAddresses = field(default_factory=EngineAddresses)


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
