"""One alerting rule (`Alert`), as every backend renders it, and the `stepline diagnose` hint the pages end with."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from stepline.alerting.config import AlertConfig

Severity = Literal["critical", "warning", "none"]


@dataclass(frozen=True)
class Alert:
    """One alerting rule."""

    name: str
    severity: Severity
    expr: str
    for_: str
    summary: str
    description: str
    labels: dict[str, str] = field(default_factory=dict)
    fast: bool = False
    """Evaluated in the fast group (`AlertConfig.fast_evaluation_interval`), for a page that must arrive within
    30 s of its cause."""

    @property
    def anchor(self) -> str:
        return self.name.lower()


def diagnose_hint(cfg: AlertConfig) -> str:
    return f"Run: stepline diagnose --engine [engine] --since {cfg.diagnose_since}"
