"""The one small protocol every source follows, and what a source is given to build itself."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from stepline.clock import Clock
from stepline.rows import Row

Emit = Callable[[Iterable[Row]], object]


class SourceError(RuntimeError):
    """A poll failed; the message is one line naming the source's problem."""


class Source(Protocol):
    """Produces typed rows when polled; imports neither ClickHouse nor prometheus_client."""

    @property
    def name(self) -> str: ...

    def poll(self, emit: Emit) -> None:
        """Emit this poll's rows; raise SourceError when the poll failed (rows emitted before stay)."""


@dataclass(frozen=True)
class SourceContext:
    """Everything a source may need from the collector."""

    host: str
    clock: Clock
