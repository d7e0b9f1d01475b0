"""A finding's evidence in words, for the terminal (`diagnose`) and the incident report (`report`) alike.

Each figure is a named line, rounded, with the unit a word of its name says (`itl_p99_inside_s` 1.397 -> "1.4 s",
`sm_mhz_max` 1980 -> "1,980 MHz", `own_steps_share` 0.977 -> "97.7%"); a finding folded under its cause
(causes.merge, the `symptoms` key) is a block of its own with its title and figures; what whatif would buy
(whatif/offer.py, the `whatif` key) is its lever, then each figure as `value [low-high]` over the replays. The JSON
(`--json`) keeps the raw values.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

FOLDED = "symptoms"  # causes.merge: the findings told under this one
WHATIF = "whatif"  # whatif/offer.annotate: what the finding's best lever would buy
# The word of a figure's name that says its unit (names are words joined by "_": `sm_mhz_max`, `queue_max_s`).
UNITS = {"ms": " ms", "mhz": " MHz", "pct": "%", "w": " W"}
SECONDS = ("s", "seconds")  # "1.4 s", or milliseconds under one second
FRACTIONS = ("share", "usage", "acceptance")  # words of 0..1 figures, printed as percentages (and `hit_rate`)
# whatif's figures in the order an operator reads them (the headline four, then each prompt band's decode rate).
WHATIF_FIRST = ("ttft_p50_s", "ttft_p99_s", "itl_p99_s", "goodput_rps")


@dataclass(frozen=True)
class Line:
    """One named figure: `name` as the finding's JSON holds it, `text` rounded with its unit."""

    name: str
    text: str


@dataclass(frozen=True)
class Folded:
    """A finding told under another (its symptom): its kind, severity, title and figures."""

    kind: str
    severity: str
    title: str
    lines: tuple[Line, ...]


@dataclass(frozen=True)
class Evidence:
    """A finding's evidence as lines: its own figures, the findings folded under it, and what whatif would buy."""

    lines: tuple[Line, ...]
    folded: tuple[Folded, ...]
    whatif: tuple[Line, ...]


def evidence_of(evidence: Mapping[str, Any]) -> Evidence:
    """The lines of a finding's evidence dictionary (Finding.evidence)."""
    own = tuple(Line(k, figure(k, v)) for k, v in evidence.items() if k not in (FOLDED, WHATIF))
    folded = tuple(_folded(s) for s in evidence.get(FOLDED) or () if isinstance(s, Mapping))
    priced = evidence.get(WHATIF)
    return Evidence(own, folded, whatif_lines(priced) if isinstance(priced, Mapping) else ())


def _folded(symptom: Mapping[str, Any]) -> Folded:
    lines = tuple(Line(k, figure(k, v)) for k, v in symptom.items() if k not in ("kind", "severity", "title"))
    return Folded(str(symptom.get("kind", "")), str(symptom.get("severity", "")), str(symptom.get("title", "")),
                  lines)


def whatif_lines(priced: Mapping[str, Any]) -> tuple[Line, ...]:
    """What a lever would buy (whatif/offer.annotate's `whatif`): the lever, the goodput change, whether the replay
    reproduces the recording, then each figure as `value [low-high]` (the replays' interval), or the bare value."""
    lines = [Line("lever", str(priced.get("lever", "")))]
    if priced.get("goodput_delta") is not None:
        lines.append(Line("goodput_delta", signed_percent(priced["goodput_delta"])))
    lines.append(Line("reproduces", "yes (the replay reproduces the recording)" if priced.get("reproduces") else
                      "no (the replay does not reproduce the recording: a direction, not an amount)"))
    if priced.get("knife_edge"):
        lines.append(Line("knife_edge", "yes (at a capacity cliff)"))
    intervals = priced.get("intervals")
    if isinstance(intervals, Mapping) and intervals:
        names = [n for n in WHATIF_FIRST if n in intervals] + [n for n in intervals if n not in WHATIF_FIRST]
        for name in names:
            band = intervals[name]
            if isinstance(band, Mapping):
                lines.append(Line(name, interval(name, band.get("value"), band.get("low"), band.get("high"))))
    else:
        lines.extend(Line(n, figure(n, priced[n])) for n in WHATIF_FIRST if n in priced)
    return tuple(lines)


def interval(name: str, value: Any, low: Any, high: Any) -> str:
    """`value [low-high]` in the unit of `name`, said once where the three share it ("686 ms [593-784]"); an end
    the replays cannot tell (None, infinite) is "open"."""
    def end(x: Any) -> str:
        return "open" if x is None or (isinstance(x, float) and not math.isfinite(x)) else figure(name, x)

    shown, lo, hi = figure(name, value), end(low), end(high)
    unit = shown.partition(" ")[2] if " " in shown else shown.lstrip("+-0123456789.,")
    if unit and all(e.endswith(unit) and e != unit for e in (lo, hi)):
        lo, hi = lo.removesuffix(unit).rstrip(), hi.removesuffix(unit).rstrip()
    return f"{shown} [{lo}-{hi}]"


def figure(name: str, value: Any) -> str:
    """`value` rounded, with the unit `name` ends in; lists joined by commas, mappings as "key: value; ..."."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, datetime):
        aware = value if value.tzinfo else value.replace(tzinfo=UTC)
        return f"{aware.astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC"
    if isinstance(value, Mapping):
        return "; ".join(f"{k}: {figure(str(k), v)}" for k, v in value.items())
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return ", ".join(figure(name, v) for v in value)
    if isinstance(value, int | float):
        return _number(name, float(value), isinstance(value, int))
    return str(value)


def _number(name: str, x: float, whole: bool) -> str:
    if math.isnan(x):
        return "-"
    if math.isinf(x):
        return "open"
    words = name.replace(" ", "_").split("_")
    if words[0] == "decode" or words[-2:] == ["tok", "s"]:  # whatif's decode rate of a prompt band, a token rate
        return f"{rounded(x)} tok/s"
    if words[-2:] == ["per", "s"] or words[-1] == "rps":
        return f"{rounded(x)}/s"
    if not whole and abs(x) <= 1 and (any(w in FRACTIONS for w in words) or "hit_rate" in name):
        return f"{rounded(x * 100)}%"
    unit = next((UNITS[w] for w in words if w in UNITS), None)
    if unit is None and any(w in SECONDS for w in words):
        return seconds(x)
    return (f"{x:,.0f}" if whole else rounded(x)) + (unit or "")


def rounded(x: float) -> str:
    """Three significant digits, whole numbers from 1000 up, with thousands separated: 0.0404, 9.4, 824, 1,151."""
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.3g}"


def seconds(x: float) -> str:
    """Milliseconds under a second, seconds from there: "40 ms", "1.4 s", "4,878 s"."""
    if x == 0:
        return "0 s"
    if abs(x) < 1:
        return f"{rounded(x * 1000)} ms"
    return f"{rounded(x)} s"


def signed_percent(fraction: Any) -> str:
    """A change as a signed percentage: 0.1643 -> "+16.4%"."""
    x = float(fraction)
    return "-" if math.isnan(x) else f"{x * 100:+.3g}%"
