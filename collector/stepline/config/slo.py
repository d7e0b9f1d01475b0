"""The service-level objectives one deployment holds its engines to: dashboards draw them, alerts page on
them, `stepline whatif` scores goodput against them, `stepline slo` reports them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from stepline.config.objectives import DEFAULT_OBJECTIVES, LATENCY_SLIS, Objective, load_objectives


@dataclass(frozen=True)
class Slo:
    """Service-level objectives; dashboards draw these as thresholds, alerts page on them."""

    itl_p99_seconds: float = 0.1
    """Inter-token latency p99 a decoding stream should see (DecodeStarvation warning)."""
    itl_p99_critical_seconds: float = 1.0
    """ITL p99 at which decode is effectively stopped (~1 token/s): DecodeStarvation critical."""
    ttft_p99_seconds: float = 10.0
    """Time to first token p99: the bound of the `ttft` objective (99% of requests within it), for dashboards, and
    the TTFT objective of `stepline whatif`'s goodput."""
    tpot_seconds: float = 0.1
    """Mean time per output token a request should see: the TPOT objective of `stepline whatif`'s goodput (a
    request meets it when its decode averages this or better), and the bound of the `tpot` objective."""
    objectives: tuple[Objective, ...] = DEFAULT_OBJECTIVES
    """The objectives the SLI counters, the burn-rate alerts, the SLO dashboard and `stepline slo` read
    (`config.objectives`); their names are label values, unique."""

    def __post_init__(self) -> None:
        names = [o.name for o in self.objectives]
        if len(set(names)) != len(names):
            raise ValueError(f"objective names repeat: {', '.join(sorted(names))}")

    def threshold(self, o: Objective) -> float:
        """The latency bound of a latency objective (its own, else this Slo's for its SLI: the TTFT's for the
        gateway's first byte); 0 for the others."""
        if o.sli not in LATENCY_SLIS:
            return 0.0
        if o.threshold_seconds is not None:
            return o.threshold_seconds
        return self.tpot_seconds if o.sli == "tpot" else self.ttft_p99_seconds


def load_slo(path: str | None) -> Slo:
    """The objectives of the TOML file at `path` (`config.objectives.load_objectives`), else ('' or None) the
    built-in ones; ValueError naming the file and what is wrong."""
    return Slo(objectives=load_objectives(Path(path))) if path else Slo()
