"""How sure a replayed figure is: the spread of perturbed replays around it, cliffs where they disagree, and
rankings only where levers separate.

Each plan (the recorded settings, and each lever) is replayed once with the fitted cost and `n` more times with a
cost as the fit might have come out (fit.Fit.draws: block-bootstrapped coefficients scaled within the fit's
held-out error) and, where steps draw recorded residuals, another seed for them. A figure's interval is the
lowest and highest value over those n + 1 replays: for n + 1 exchangeable draws, a further draw falls inside it with
probability n / (n + 2), the interval's nominal coverage. What the replays cannot vary (a step cost of another
form than the fit's, the scheduler's model of vLLM) they do not cover: where the recording falls outside the
replayed baseline's own interval, by some share, every plan's interval for that figure is widened by that share.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from stepline.whatif.figures import Figures

FIGURES = ("ttft_p50_s", "ttft_p99_s", "itl_p99_s", "goodput_rps")
# Perturbed replays of each plan beside its central one: 9 + 1 replays give each figure an interval of nominal
# coverage 82%, at ten times the replays' time.
INTERVAL_REPLAYS = 9
# A lever is at a capacity cliff (knife-edge) when its replays disagree on the regime: the queue drains in some and
# not in others, or TTFT p99 spans this factor or more between the lowest and the highest replay.
KNIFE_EDGE_SPREAD = 3.0
SEPARATION_Z = 1.645  # one-sided 95%: two levers separate at 90% when each's interval clears the other's


@dataclass(frozen=True, slots=True)
class Band:
    value: float
    low: float
    high: float

    def overlaps(self, other: Band) -> bool:
        return self.low <= other.high and other.low <= self.high

    def as_json(self) -> dict[str, float | None]:
        return {k: (None if math.isnan(v) else v) for k, v in (("value", self.value), ("low", self.low),
                                                                 ("high", self.high))}


def nominal_coverage(replays: int) -> float:
    """The interval's nominal coverage over `replays` replays (the central one included)."""
    return (replays - 1) / (replays + 1) if replays > 1 else 0.0


def values(f: Figures) -> dict[str, float]:
    """Every figure an interval is given for: FIGURES and each prompt band's decode rate p50."""
    out = {name: float(getattr(f, name)) for name in FIGURES}
    out.update({f"decode_p50 {band}": rates[1] for band, rates in f.decode_rates.items()})
    return out


def bands(central: Figures, spread: Sequence[Figures]) -> dict[str, Band]:
    """figure -> its value in the central replay and the lowest and highest over every replay."""
    out = {}
    every = [values(f) for f in spread]
    for name, value in values(central).items():
        seen = [v for v in (value, *(e.get(name, math.nan) for e in every)) if not math.isnan(v)]
        out[name] = Band(value, min(seen), max(seen)) if seen else Band(value, math.nan, math.nan)
    return out


def outside(recorded: Figures, baseline: dict[str, Band]) -> dict[str, tuple[float, Band]]:
    """figure -> (its recorded value, the replayed baseline's interval), for the FIGURES whose recorded value (a
    positive one) falls outside that interval."""
    out = {}
    for name in FIGURES:
        true, band = float(getattr(recorded, name)), baseline.get(name)
        if band is not None and true > 0 and not band.low <= true <= band.high:
            out[name] = (true, band)
    return out


def misses(recorded: Figures, baseline: dict[str, Band]) -> dict[str, float]:
    """figure -> how far (relative) the recording lies outside the replayed baseline's interval, for the FIGURES
    where it does: what the replays do not vary (the cost's form, the scheduler's model) missed by that much."""
    out = {}
    for name, (true, band) in outside(recorded, baseline).items():
        if math.isnan(band.low):
            continue
        if true > band.high > 0:
            out[name] = true / band.high - 1
        elif true < band.low:
            out[name] = 1 - true / band.low
    return out


def widened(b: dict[str, Band], miss: dict[str, float]) -> dict[str, Band]:
    """`b` with each missed figure's interval widened by the miss, either way; never below 0 (every figure is a
    latency or a rate: a miss of more than 100% took a low end below 0, printed as -0.0)."""
    return {name: Band(band.value, max(0.0, band.low * (1 - miss[name])), band.high * (1 + miss[name]))
            if name in miss else band for name, band in b.items()}


def knife_edge(central: tuple[Figures, str], spread: Sequence[tuple[Figures, str]],
               busiest: tuple[str, float] | None) -> str:
    """Why a plan sits at a capacity cliff ('' when its replays agree): each replay's figures and why it stopped
    early ('' when it drained); `busiest`, the engine busiest in the central replay and its busy share."""
    every = [central, *spread]
    backlog = [bool(stopped) or f.unfinished > 0 for f, stopped in every]
    edge = f", {busiest[0]} busy {busiest[1]:.0%} of the time (headroom {max(0.0, 1 - busiest[1]):.0%})" \
        if busiest else ""
    if any(backlog) and not all(backlog):
        return f"the queue drains in {backlog.count(False)} of {len(every)} replays{edge}"
    ttft = [f.ttft_p99_s for f, _ in every if f.ttft_p99_s > 0 and not math.isnan(f.ttft_p99_s)]
    if len(ttft) > 1 and max(ttft) >= KNIFE_EDGE_SPREAD * min(ttft):
        return f"TTFT p99 spans {min(ttft):.2f}-{max(ttft):.2f} s over {len(every)} replays{edge}"
    return ""


@dataclass(frozen=True, slots=True)
class Verdict:
    """Which lever to recommend: the best by goodput where its interval clears every other's, else none, with the
    levers tied with the best and about how many replays each would separate the best from the next."""

    recommended: str  # '' for no clear winner
    tied: list[str]
    replays_to_separate: int | None


def verdict(names: Sequence[str], goodput: Sequence[Band], spreads: Sequence[Sequence[float]]) -> Verdict:
    """`names` ranked best first with their goodput bands and every replay's goodput; the replayed baseline is
    one of them (it wins when no lever beats it)."""
    if not names:
        return Verdict("", [], None)
    best = goodput[0]
    tied = [n for n, b in zip(names[1:], goodput[1:], strict=True) if b.overlaps(best)]
    if not tied:
        return Verdict(names[0], [], None)
    runner = spreads[1]
    gap = best.value - goodput[1].value
    spread = _sd(spreads[0]) + _sd(runner)
    needed = math.ceil((SEPARATION_Z * spread / gap) ** 2) if gap > 0 and spread > 0 else None
    return Verdict("", [names[0], *tied], needed)


def _sd(xs: Sequence[float]) -> float:
    finite = [x for x in xs if not math.isnan(x)]
    return statistics.stdev(finite) if len(finite) > 1 else 0.0
