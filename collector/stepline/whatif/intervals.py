"""How sure a replayed figure is: the spread of perturbed replays around it, cliffs where they disagree, and
rankings only where levers separate.

Each plan (the recorded settings, and each lever) is replayed once with the fitted cost and `n` more times with a
cost as the fit might have come out (fit.Fit.draws: block-bootstrapped coefficients scaled within the fit's
held-out error) and, where steps draw recorded residuals, another seed for them. A figure's interval is the
lowest and highest value over those n + 1 replays: for n + 1 exchangeable draws, a further draw falls inside it with
probability n / (n + 2), the interval's nominal coverage. What the replays cannot vary (a step cost of another
form than the fit's, the scheduler's model of vLLM) they do not cover: where the recording falls outside the
replayed baseline's own interval, by some share, every plan's interval for that figure is widened by that share.

Near a lane's capacity a figure stops moving with the cost and jumps: a lane that fills 93% of its capacity in the
central replay queues without end when its steps cost 8% more. Where a lane's load lies within its fit's error of
its capacity (load x (1 - error) < 1 <= load x (1 + error)), the plan is a knife-edge whatever its replays say, and
it is replayed once more with every step as dear as that error allows: its figures extend the interval (past its
nominal coverage), or, where that replay takes the lane past its capacity, the interval is open-ended: past the cliff
the figures depend on how far the cost is off, which whatif cannot tell.
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
        """null where a figure is unknown (nan) or the interval is open-ended (infinite)."""
        return {k: (None if not math.isfinite(v) else v) for k, v in (("value", self.value), ("low", self.low),
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
    early ('' when it drained); `busiest`, the lane with the highest load in the central replay and the load."""
    every = [central, *spread]
    backlog = [bool(stopped) or f.unfinished > 0 for f, stopped in every]
    edge = f", {busiest[0]} at {busiest[1]:.0%} of its capacity (headroom {max(0.0, 1 - busiest[1]):.0%})" \
        if busiest else ""
    if any(backlog) and not all(backlog):
        return f"the queue drains in {backlog.count(False)} of {len(every)} replays{edge}"
    ttft = [f.ttft_p99_s for f, _ in every if f.ttft_p99_s > 0 and not math.isnan(f.ttft_p99_s)]
    if len(ttft) > 1 and max(ttft) >= KNIFE_EDGE_SPREAD * min(ttft):
        return f"TTFT p99 spans {min(ttft):.2f}-{max(ttft):.2f} s over {len(every)} replays{edge}"
    return ""


@dataclass(frozen=True, slots=True)
class Headroom:
    """A lane whose load in the central replay lies within its fit's error of its capacity: a cost off by that
    error, one way or the other, takes it across."""

    engine: str
    load: float  # its share of its capacity over the window (whatif.core.fill), in the central replay
    error: float  # how far its step cost may be off, either way (whatif.fit.Fit.model_error)

    def describe(self) -> str:
        if self.load < 1:
            return (f"{self.engine} at {self.load:.0%} of its capacity (headroom {1 - self.load:.0%}), less than its "
                    f"fit's error ({self.error:.0%} of the step cost): steps {1 / self.load - 1:.0%} dearer fill it")
        return (f"{self.engine} at {self.load:.0%} of its capacity (no headroom), within its fit's error "
                f"({self.error:.0%} of the step cost): steps {1 - 1 / self.load:.0%} cheaper would drain it")


def at_capacity(loads: dict[str, float], errors: dict[str, float]) -> list[Headroom]:
    """The lanes whose load lies within their fit's error of their capacity: load x (1 - error) < 1 <= load x
    (1 + error). Further under it, a cost that far off leaves room; further over, every replay queues, and their
    spread says by how much."""
    return [Headroom(engine, load, errors[engine]) for engine, load in sorted(loads.items())
            if engine in errors and load > 0 and load * (1.0 - errors[engine]) < 1.0 <= load * (1.0 + errors[engine])]


def undrained(f: Figures, stopped: str) -> bool:
    return bool(stopped) or f.unfinished > 0


def past_capacity(lanes: Sequence[Headroom], f: Figures, stopped: str, loads: dict[str, float]) -> bool:
    """Whether the dearer replay (figures, why it stopped, each lane's load) took a lane at its capacity past its
    capacity: its figures then depend on how far past, that is on how far the cost is off, which the fit's error
    does not bound (a lever moves a lane to a mix of steps the recording did not hold)."""
    return undrained(f, stopped) or any(loads.get(h.engine, 0.0) >= 1.0 for h in lanes)


def headroom_edge(lanes: Sequence[Headroom], dearer: tuple[Figures, str, dict[str, float]] | None) -> str:
    """Why a plan sits at a capacity cliff by its lanes' headroom ('' when none is short of it), and what its replay
    with every step as dear as the fit's error allows (`dearer`: figures, why it stopped, each lane's load; None:
    not replayed) gave."""
    if not lanes:
        return ""
    text = "; ".join(h.describe() for h in lanes)
    if dearer is None:
        return text
    f, stopped, loads = dearer
    at = ", ".join(f"{h.engine} at {loads.get(h.engine, 0.0):.0%}" for h in lanes)
    then = f"with every step that much dearer {at} of its capacity, TTFT p99 {f.ttft_p99_s:.2f} s" + (
        f", {stopped or f'{f.unfinished} requests unserved'}" if undrained(f, stopped) else "")
    if past_capacity(lanes, f, stopped, loads):
        return (f"{text}; {then}: past its capacity how far the figures go depends on how far the cost is off, "
                "which whatif cannot tell: the interval is open-ended (latencies without a highest value, goodput "
                "down to 0)")
    return f"{text}; {then}, which the interval holds (a cost off by more than the fit's error it does not)"


def opened(b: dict[str, Band]) -> dict[str, Band]:
    """`b` open-ended the way a lane past its capacity goes: latencies without a highest value, rates down to 0."""
    return {name: Band(band.value, band.low, math.inf) if name.endswith("_s")
            else Band(band.value, 0.0, band.high) for name, band in b.items()}


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
