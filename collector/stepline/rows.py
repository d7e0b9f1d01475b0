"""Typed rows that sources yield; each type maps to one timeline table, fields in column order."""

from __future__ import annotations

from typing import NamedTuple


def micros(seconds: float) -> int:
    """Wall-clock seconds to the DateTime64(6) integer the store takes."""
    return round(seconds * 1_000_000)


class EngineSample(NamedTuple):
    """One scraped /metrics sample."""

    ts: int
    host: str
    engine: str
    engine_index: str
    model_name: str
    metric: str
    kind: str
    labels: dict[str, str]
    value: float
    delta: float


class Event(NamedTuple):
    """Something that happened once: an engine went down, a configuration was seen, data was dropped."""

    ts: int
    host: str
    engine: str
    source: str
    kind: str
    severity: str
    message: str
    attributes: dict[str, str]


Row = EngineSample | Event

TABLE_OF: dict[type, str] = {
    EngineSample: "engine_samples",
    Event: "events",
}
