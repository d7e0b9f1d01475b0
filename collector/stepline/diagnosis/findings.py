"""What a detector returns: one finding, with its evidence, the SQL that shows it, and the lever."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

SEVERITIES = ("info", "warning", "critical")


@dataclass(frozen=True)
class Window:
    """The time range and engine (empty: every engine) a diagnosis looks at; datetimes are UTC-aware."""

    start: datetime
    end: datetime
    engine: str = ""


@dataclass(frozen=True)
class Finding:
    """One thing that is wrong (or, at info, worth knowing), ranked by severity then score."""

    kind: str  # e.g. "prefill_interference", "head_of_line_blocking", "wedged_engine"
    severity: str  # one of SEVERITIES
    engine: str
    start: datetime  # the window the evidence covers (UTC)
    end: datetime
    title: str  # one line, <= 76 characters, with the key number: what an operator reads first
    evidence: dict[str, Any] = field(default_factory=dict)  # figures: names with units, e.g. "itl_p99_inside_s"
    sql: str = ""  # a query (literal values, no parameters) that reproduces the evidence on the store
    lever: str = ""  # what to change, e.g. "lower --long-prefill-token-threshold to 2048"
    score: float = 0.0  # within a severity, larger ranks first (e.g. the damage in request-seconds)

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {SEVERITIES}, got {self.severity!r}")

    def rank_key(self) -> tuple[int, float]:
        return (-SEVERITIES.index(self.severity), -self.score)

    def as_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "severity": self.severity, "engine": self.engine,
                "start": self.start.isoformat(), "end": self.end.isoformat(), "title": self.title,
                "evidence": self.evidence, "sql": self.sql, "lever": self.lever, "score": self.score}
