"""whatif's prediction for each value of a launched sweep, checked against what the engine then did, run after run.

`stepline matrix --sweep NAME=V1,V2 --launch ... --replay --repeat N --whatif` prices each value with whatif over
the recorded window before the first launch (one lever a value, each figure with whatif's interval), then launches
the engine with each value and replays the window N times on it. For every figure whatif gives an interval for
(TTFT p50 and p99, ITL p99, goodput), each run's figure is computed with whatif's own definitions
(whatif.figures.figures, over the client's stamps of each request: its first token, its tokens' gaps) and the N
runs give a mean with its 95% confidence interval (core.stats.mean_interval).

A prediction and a measurement then agree, or not, on three levels: the runs' mean falls inside whatif's interval;
it does not, but the two intervals overlap (the engine's run-to-run noise leaves it open); or they are apart, and
by how much. The runs are client-side: their TTFT holds the HTTP round trip and the stream's first write, a few
milliseconds that the engine-side recording whatif replays does not, which matters only where TTFT is itself a
few tens of milliseconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from stepline.core.stats import MEAN_CONFIDENCE, MeanInterval, mean_interval
from stepline.core.texttable import render_table
from stepline.loadgen.client import MatrixError
from stepline.loadgen.replay import ReplayReport
from stepline.loadgen.sweep import SweepValue
from stepline.whatif.core import WhatIf
from stepline.whatif.figures import Figures, Objectives, Served, figures
from stepline.whatif.intervals import FIGURES, Band, nominal_coverage
from stepline.whatif.levers import REPORTED_AS, Lever

_LABELS = {"ttft_p50_s": ("TTFT p50", "ms", 1e3), "ttft_p99_s": ("TTFT p99", "ms", 1e3),
           "itl_p99_s": ("ITL p99", "ms", 1e3), "goodput_rps": ("goodput", "req/s", 1.0)}
_TEXT_SETTINGS = {"policy"}  # the simulator's settings whose value is a word (fcfs, priority), not a number


def sweep_levers(name: str, values: Sequence[str]) -> list[Lever]:
    """One whatif lever per --sweep value; MatrixError for a setting the simulator does not model or a value it
    cannot take."""
    if name not in REPORTED_AS:
        raise MatrixError(f"--whatif prices the settings the simulator models ({', '.join(sorted(REPORTED_AS))}); "
                          f"not {name}")
    levers = []
    for value in values:
        setting: object = value
        if name not in _TEXT_SETTINGS:
            try:
                setting = int(value)
            except ValueError:
                raise MatrixError(f"--whatif: {name}={value} is not a whole number") from None
        levers.append(Lever(f"{name}={value}", name, {name: setting}))
    return levers


def run_figures(report: ReplayReport, objectives: Objectives) -> Figures:
    """One replay's figures as whatif computes a replay's: every completed request's TTFT and gaps, goodput over
    the planned arrivals' span."""
    served, itls = [], []
    for sent in report.sends:
        result = sent.result
        if not sent.done or result is None or result.ttft_s is None:
            continue
        gaps = result.itls_s
        served.append(Served(sent.prompt_tokens, result.tokens, result.ttft_s, sum(gaps)))
        itls.extend(gaps)
    return figures(served, itls, objectives, report.span_s, unfinished=report.sent - report.completed)


@dataclass(frozen=True, slots=True)
class Check:
    """One value's figure: whatif's interval beside the runs' mean and its confidence interval."""

    value: str
    figure: str
    predicted: Band
    measured: MeanInterval

    @property
    def inside(self) -> bool:
        return self.predicted.low <= self.measured.mean <= self.predicted.high

    @property
    def overlaps(self) -> bool:
        m = self.measured
        return m.n > 1 and not math.isnan(m.low) and self.predicted.low <= m.high and m.low <= self.predicted.high

    @property
    def apart_by(self) -> float:
        """How far (relative to the nearer end of whatif's interval) the runs' mean lies outside it; 0 inside."""
        p, mean = self.predicted, self.measured.mean
        if mean > p.high > 0:
            return mean / p.high - 1
        if mean < p.low and p.low > 0:
            return 1 - mean / p.low
        return 0.0

    @property
    def verdict(self) -> str:
        if math.isnan(self.measured.mean) or math.isnan(self.predicted.low):
            return "no figure"
        if self.inside:
            return "inside"
        side = "above" if self.measured.mean > self.predicted.high else "below"
        if self.overlaps:
            return f"overlaps ({side})"
        return f"apart: {self.apart_by:.0%} {side}"


def checks(result: WhatIf, values: Sequence[SweepValue], objectives: Objectives) -> list[Check]:
    """Every measured value's figures beside whatif's interval for its lever."""
    priced = {p.lever.name: p for p in result.levers}
    out = []
    for v in values:
        p = priced.get(v.label)
        if p is None or p.replay is None or not v.replays or v.error:
            continue
        runs = [run_figures(r.report, objectives) for r in v.replays if r.report.completed]
        predicted = p.bands()
        for name in FIGURES:
            out.append(Check(v.value, name, predicted[name],
                             mean_interval([float(getattr(f, name)) for f in runs], 0.0)))
    return out


def render_predicted(result: WhatIf, name: str) -> str:
    """What whatif predicts for each value, printed before the first launch."""
    coverage = nominal_coverage(result.replays)
    recorded = {f: float(getattr(result.recorded, f)) for f in FIGURES}
    baseline = result.baseline_bands()
    rows = [["the recording (engine-side)"] + [_fmt(recorded[f], f) for f in FIGURES],
            ["replayed at its own settings"] + [_band(baseline[f], f) for f in FIGURES]]
    notes = []
    for p in result.levers:
        if p.replay is None:
            notes.append(f"{p.lever.name}: not priced: {p.lever.unavailable}")
            continue
        b = p.bands()
        rows.append([p.lever.name] + [_band(b[f], f) for f in FIGURES])
        if p.knife_edge:
            notes.append(f"{p.lever.name}: knife-edge: {p.knife_edge}")
    head = (f"whatif, before the launches: each {name} value replayed in the simulator over the recorded window, "
            f"{result.replays} replays each (interval: lowest-highest, nominal coverage {coverage:.0%})")
    return "\n".join([head, render_table(["plan"] + [_heading(f) for f in FIGURES], rows, max_width=60), *notes])


def render_checks(found: Sequence[Check], result: WhatIf) -> str:
    """The check table and its summary line."""
    if not found:
        return "whatif against the runs: no value was measured"
    rows = [[c.value, _heading(c.figure), _band(c.predicted, c.figure), _measured(c.measured, c.figure), c.verdict]
            for c in found]
    inside = sum(c.inside for c in found)
    overlapping = sum(not c.inside and c.overlaps for c in found)
    runs = max(c.measured.n for c in found)
    lines = [f"whatif against the runs: its interval (nominal {nominal_coverage(result.replays):.0%}) beside the "
             f"runs' mean [{MEAN_CONFIDENCE:.0%} confidence interval of the mean, Student's t, {runs} runs a value; "
             "client-side]",
             render_table(["value", "figure", "whatif predicted [interval]", "runs: mean [interval]", ""], rows,
                          max_width=60),
             f"{inside} of {len(found)} runs' means inside whatif's intervals; {overlapping} more overlap them; "
             f"{len(found) - inside - overlapping} apart"]
    return "\n".join(lines)


def recorded_again(result: WhatIf, found: Sequence[Check], name: str) -> str:
    """How far the runs of the recorded setting itself lie from the recording, figure by figure (from `found`, the
    checks): the engine's own run-to-run noise and the client's view of it (HTTP, streaming) against the engine's,
    which every other value's check is to be read against ('' when the engines were recorded at different values)."""
    recorded = {str(getattr(config, name)) for config in result.settings.values() if hasattr(config, name)}
    if len(recorded) != 1:
        return ""
    setting = recorded.pop()
    same = {c.figure: c.measured.mean for c in found if c.value == setting}
    if not same:
        return (f"no value is the recorded setting ({name}={setting}): with it in the sweep, its runs show how far "
                "the engine's own noise and the client's view lie from the recording")
    parts = []
    for figure in FIGURES:
        mean, was = same[figure], float(getattr(result.recorded, figure))
        change = f" ({mean / was - 1:+.0%})" if was > 0 and not math.isnan(mean) else ""
        parts.append(f"{_LABELS[figure][0]} {_fmt(mean, figure)} against {_fmt(was, figure)}{change}")
    return (f"the recorded setting ({name}={setting}) run again, its runs' mean against the recording: "
            + ", ".join(parts) + "; the engine's run-to-run noise and the client's view (HTTP, streaming) beside "
            "the engine's: read the other values against it")


def _heading(figure: str) -> str:
    label, unit, _ = _LABELS[figure]
    return f"{label} ({unit})"


def _fmt(x: float, figure: str) -> str:
    scale = _LABELS[figure][2]
    return "-" if math.isnan(x) else f"{x * scale:.{1 if scale > 1 else 3}f}"


def _band(b: Band, figure: str) -> str:
    return f"{_fmt(b.value, figure)} [{_fmt(b.low, figure)}-{_fmt(b.high, figure)}]"


def _measured(m: MeanInterval, figure: str) -> str:
    if m.n <= 1:
        return _fmt(m.mean, figure)
    return f"{_fmt(m.mean, figure)} [{_fmt(m.low, figure)}-{_fmt(m.high, figure)}]"
