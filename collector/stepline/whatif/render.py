"""`stepline whatif` as text and as JSON."""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import UTC, datetime
from html import escape
from typing import Any

from stepline.core.texttable import render_table
from stepline.whatif.core import CALIBRATION_TOLERANCE, STEP_TIMES, Priced, WhatIf
from stepline.whatif.figures import BANDS, Figures
from stepline.whatif.fit import MIN_MODEL_ERROR
from stepline.whatif.intervals import Band, nominal_coverage

FIGURE_NAMES = {"ttft_p50_s": "TTFT p50", "ttft_p99_s": "TTFT p99", "itl_p99_s": "ITL p99", "goodput_rps": "goodput"}


def seconds(x: float) -> str:
    if math.isnan(x):
        return "-"
    if math.isinf(x):
        return "open"  # an interval's end that whatif cannot tell (intervals.opened)
    return f"{x * 1e3:.0f}ms" if x < 1 else f"{x:.2f}s" if x < 100 else f"{x:.0f}s"


def rate_range(figures: Figures, name: str) -> str:
    rates = figures.decode_rates.get(name)
    if not rates:
        return "-"
    low, _mid, high = rates
    return f"{low:.1f}-{high:.1f}"


def _row(label: str, f: Figures, delta: str, b: dict[str, Band] | None = None) -> list[str]:
    """A table row: each figure, and with `b` its interval beside it ("1.20s [0.90s-1.70s]")."""
    def shown(name: str, text: str, unit: Callable[[float], str]) -> str:
        band = (b or {}).get(name)
        if band is None or math.isnan(band.low):
            return text
        return f"{text} [{unit(band.low)}-{unit(band.high)}]"

    return [label, shown("ttft_p50_s", seconds(f.ttft_p50_s), seconds),
            shown("ttft_p99_s", seconds(f.ttft_p99_s), seconds), shown("itl_p99_s", seconds(f.itl_p99_s), seconds),
            shown("goodput_rps", f"{f.goodput_rps:.3f}/s ({f.good}/{f.requests})", lambda x: f"{x:.3f}"), delta]


def _rates(label: str, f: Figures, bands: list[str]) -> list[str]:
    return [label, *(rate_range(f, b) for b in bands)]


def _hms(epoch: float) -> str:
    return f"{datetime.fromtimestamp(epoch, UTC):%H:%M:%S}"


def render(result: WhatIf, *, top: int | None = None) -> str:
    bands = [name for name, _ in BANDS if name in result.recorded.decode_rates]
    header = ["", "TTFT p50", "TTFT p99", "ITL p99", "goodput", "vs baseline"]
    rates_header = ["decode tok/s p10-p90", *bands]
    o = result.objectives
    lines = [f"whatif: {result.recorded.requests} requests arriving {_hms(result.start)}..{_hms(result.end)} UTC "
             f"on {', '.join(result.engines)}; goodput = requests/s with TTFT <= {seconds(o.ttft_s)} and mean "
             f"TPOT <= {seconds(o.tpot_s)}; decode tok/s as p10-p90 per prompt band", ""]
    for engine, fit in result.fits.items():
        lines.append(f"step cost of {engine}, fitted on {fit.steps:,} steps: {fit.describe()}")
        lines.append(f"  on {fit.held_out:,} held-out steps: median error {fit.median_error:.1%}, p90 "
                     f"{fit.p90_error:.1%}, total time {fit.total_error:+.1%}, by kind of step (form) "
                     f"{fit.form_error:.1%}")
    for why in result.skipped.values():
        lines.append(f"not replayed: {why}")
    for note in result.assumed:
        lines.append(f"assumed: {note}")
    lines.append("")
    lines.append("calibration: the recorded window, and the same requests replayed under the recorded settings")
    lines.append(f"  each replayed step takes {result.step_times} (closer to the recording than the other way, "
                 f"whose worst figure is off by {result.other_mode_worst:.0%})")
    lines.append(render_table(header[:-1], [_row("recorded", result.recorded, "")[:-1],
                                            _row("replayed", result.baseline.figures, "",
                                                 result.baseline_bands() if result.baseline_spread else None)[:-1]]))
    lines.append(render_table(rates_header, [_rates("recorded", result.recorded, bands),
                                             _rates("replayed", result.baseline.figures, bands)]))
    errors = result.calibration_errors
    worst = max(errors, key=lambda k: abs(errors[k])) if errors else None
    if result.baseline.stopped:
        lines.append(f"the replay does NOT reproduce the recording: {result.baseline.stopped}")
    elif worst is not None and result.reproduces:
        lines.append(f"the replay reproduces the recording within {CALIBRATION_TOLERANCE:.0%} (worst: "
                     f"{FIGURE_NAMES[worst]} {errors[worst]:+.0%})")
    elif worst is not None:
        off = ", ".join(f"{FIGURE_NAMES[k]} {v:+.0%}" for k, v in errors.items() if abs(v) > CALIBRATION_TOLERANCE)
        lines.append(f"the replay does NOT reproduce the recording: {off} (tolerance {CALIBRATION_TOLERANCE:.0%}); "
                     "read the levers' figures as directions, not amounts")
    lines.extend(_sureness(result))
    lines.append("")
    ranked = result.ranked()
    shown = [p for p in ranked if p.replay is not None][:top] if top else [p for p in ranked if p.replay]
    base = result.baseline.figures
    labels = ["replayed baseline", *(f"{i}. {p.lever.name}" for i, p in enumerate(shown, 1))]
    figs = [base, *(p.replay.figures for p in shown if p.replay is not None)]
    deltas = ["", *(_delta(p, base) + (" (knife-edge)" if p.knife_edge else "") for p in shown)]
    spread = bool(result.baseline_spread)
    intervals = [result.baseline_bands() if spread else None, *(p.bands() if spread else None for p in shown)]
    lines.append("levers, ranked by goodput" + (f" [lowest-highest over {result.replays} replays]" if spread else ""))
    lines.append(render_table(header, [_row(lb, f, d, b) for lb, f, d, b in
                                       zip(labels, figs, deltas, intervals, strict=True)], max_width=44))
    lines.extend(_verdict(result, shown))
    lines.append("")
    lines.append(render_table(rates_header, [_rates(lb, f, bands) for lb, f in zip(labels, figs, strict=True)],
                              max_width=44))
    for p in shown:
        if p.replay is not None and (p.replay.stopped or p.replay.figures.unfinished):
            lines.append(f"  {p.lever.name}: {p.replay.stopped or ''} {p.replay.figures.unfinished} requests "
                         "unserved".strip())
    unavailable = [p for p in ranked if p.replay is None]
    if unavailable:
        lines.append("")
        lines.append("unavailable on this engine:")
        lines.extend(f"  {p.lever.name}: {p.lever.unavailable}" for p in unavailable)
    notes = {p.lever.family: p.lever.note for p in ranked if p.lever.note}
    if notes:
        lines.append("")
        lines.extend(f"  {family}: {note}" for family, note in notes.items())
    return "\n".join(lines)


def _sureness(result: WhatIf) -> list[str]:
    """How the intervals are made, and whether the recording falls inside the baseline's own."""
    if not result.baseline_spread:
        return ["intervals: none (--replays 0)"]
    n = result.replays
    residuals = " and residuals drawn anew" if result.step_times == STEP_TIMES[1] else ""
    lines = [f"intervals: each figure's lowest and highest over {n} replays of its plan: the fitted cost, and "
             f"{n - 1} costs as the fit might have come out (its steps resampled in runs of 50, each cost scaled "
             f"within its held-out error, total or by kind of step, at least {MIN_MODEL_ERROR:.0%}){residuals}; "
             f"nominal coverage {nominal_coverage(n):.0%}"]
    if any(p.dearer is not None for p in result.levers):
        lines.append("a plan with a lane within its fit's error of its capacity is replayed once more with every "
                     "step that much dearer: its interval holds that replay too (a cost off by more it does not)")
    outside = result.recorded_outside()
    if outside:
        missed = ", ".join(f"{FIGURE_NAMES[k]} {_figure(k, v)} outside [{_figure(k, b.low)}-{_figure(k, b.high)}]"
                           for k, (v, b) in outside.items())
        widen = ", ".join(f"{FIGURE_NAMES[k]} +-{v:.0%}" for k, v in result.misses().items())
        lines.append(f"the recording falls outside the baseline's own intervals ({missed}): whatif's model misses this "
                     f"engine there, by what the replays do not vary; every lever's interval for those figures is "
                     f"widened by the miss ({widen})")
    else:
        lines.append("the recorded figures fall inside the replayed baseline's intervals")
    if result.baseline_knife_edge:
        lines.append(f"the recorded settings sit at a capacity cliff: {result.baseline_knife_edge}")
    return lines


def _figure(name: str, value: float) -> str:
    return f"{value:.3f}/s" if name == "goodput_rps" else seconds(value)


def _verdict(result: WhatIf, shown: list[Priced]) -> list[str]:
    lines = [f"  {p.lever.name}: knife-edge: {p.knife_edge}" for p in shown if p.knife_edge]
    if not result.baseline_spread:
        return lines
    v = result.verdict()
    if v.recommended:
        lines.append(f"recommended: {v.recommended} (its goodput interval clears every other plan's)")
    else:
        more = (f"; about {v.replays_to_separate} replays each would separate the first two"
                if v.replays_to_separate else "")
        lines.append(f"no clear winner: {', '.join(v.tied)} tie on goodput (their intervals overlap){more}")
    return lines


def _delta(p: Priced, base: Figures) -> str:
    d = p.delta(base)
    return "-" if math.isnan(d) else f"{d:+.0%} goodput"


def as_json(result: WhatIf) -> dict[str, Any]:
    return {
        "start": datetime.fromtimestamp(result.start, UTC).isoformat(),
        "end": datetime.fromtimestamp(result.end, UTC).isoformat(),
        "objectives": {"ttft_s": result.objectives.ttft_s, "tpot_s": result.objectives.tpot_s},
        "engines": result.engines,
        "fits": {e: {"model": f.describe(), "steps": f.steps, "held_out_steps": f.held_out,
                     "median_error": f.median_error, "p90_error": f.p90_error, "total_error": f.total_error,
                     "form_error": f.form_error,
                     "coefficients": {"overhead_s": f.cost.step_overhead_s, "prefill_token_s": f.cost.prefill_token_s,
                                      "attention_pair_s": f.cost.prefill_attention_pair_s,
                                      "decode_request_s": f.cost.decode_request_s,
                                      "decode_context_token_s": f.cost.decode_context_token_s}}
                 for e, f in result.fits.items()},
        "skipped": result.skipped,
        "assumed": result.assumed,
        "recorded": result.recorded.as_json(),
        "baseline": result.baseline.figures.as_json(),
        "calibration_errors": result.calibration_errors,
        "step_times": result.step_times,
        "reproduces": result.reproduces,
        "levers": [{"lever": p.lever.name, "family": p.lever.family, "note": p.lever.note,
                    "available": p.replay is not None, "unavailable": p.lever.unavailable,
                    "figures": p.replay.figures.as_json() if p.replay else None,
                    "intervals": {k: b.as_json() for k, b in p.bands().items()} if result.baseline_spread else None,
                    "knife_edge": bool(p.knife_edge), "knife_edge_why": p.knife_edge,
                    "headroom": [{"engine": h.engine, "load": h.load, "error": h.error} for h in p.headroom],
                    "goodput_delta": None if math.isnan(p.delta(result.baseline.figures)) else
                    p.delta(result.baseline.figures),
                    "stopped": p.replay.stopped if p.replay else ""}
                   for p in result.ranked()],
        **_intervals_json(result),
    }


def _intervals_json(result: WhatIf) -> dict[str, Any]:
    if not result.baseline_spread:
        return {"intervals": None}
    v = result.verdict()
    return {
        "intervals": {"replays": result.replays, "nominal_coverage": nominal_coverage(result.replays),
                      "how": "lowest and highest over the replays of each plan: the fitted cost, and costs drawn "
                             "by a block bootstrap of the fit's steps, each scaled within its held-out error",
                      "recorded_outside_baseline": {k: {"recorded": v_, **b.as_json()}
                                                    for k, (v_, b) in result.recorded_outside().items()},
                      "widened_by": result.misses()},
        "baseline_intervals": {k: b.as_json() for k, b in result.baseline_bands().items()},
        "baseline_knife_edge": bool(result.baseline_knife_edge),
        "recommended": v.recommended or None, "tied": v.tied, "replays_to_separate": v.replays_to_separate,
    }


HTML_LEVERS = 8


def envelope(timelines: list[list[tuple[float, float]]]) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """Per bucket (the replays share their buckets: whatif.core.itl_timeline), the lowest and highest value any of
    `timelines` has there."""
    by_bucket: dict[float, list[float]] = {}
    for timeline in timelines:
        for t, v in timeline:
            by_bucket.setdefault(t, []).append(v)
    ordered = sorted(by_bucket.items())
    return [(t, min(vs)) for t, vs in ordered], [(t, max(vs)) for t, vs in ordered]


def html_section(result: WhatIf | None, why_not: str = "") -> str:
    """The report's whatif section: the calibration, the ranked levers, and ITL p99 over time recorded, replayed
    and under the best lever on one axis."""
    from stepline.diagnosis.report import Plot, Series, render_svg

    if result is None:
        return f"<h2>What each lever would buy</h2><p>Not available: {escape(why_not)}</p>"
    base = result.baseline.figures
    ranked = [p for p in result.ranked() if p.replay is not None]
    errors = result.calibration_errors
    verdict = ("The replay reproduces the recording within " f"{CALIBRATION_TOLERANCE:.0%}" if result.reproduces
               else "The replay does NOT reproduce the recording: read the levers as directions, not amounts")
    calibration = ", ".join(f"{FIGURE_NAMES[k]} {v:+.0%}" for k, v in errors.items())
    spread = bool(result.baseline_spread)
    rows: list[tuple[str, Figures, str, dict[str, Band] | None]] = [
        ("recorded", result.recorded, "", None),
        ("replayed baseline", base, "", result.baseline_bands() if spread else None)]
    rows += [(p.lever.name, p.replay.figures, _delta(p, base) + (" (knife-edge)" if p.knife_edge else ""),
              p.bands() if spread else None) for p in ranked[:HTML_LEVERS] if p.replay is not None]
    cells = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in _row(label, f, d, b)) + "</tr>"
                    for label, f, d, b in rows)
    if spread:
        chosen = result.verdict()
        verdict += (f". Each figure shows [lowest-highest] over {result.replays} replays (nominal coverage "
                    f"{nominal_coverage(result.replays):.0%}); "
                    + (f"recommended: {chosen.recommended}" if chosen.recommended
                       else "no clear winner: " + ", ".join(chosen.tied) + " tie on goodput"))
    unavailable = "".join(f"<li>{escape(p.lever.name)}: {escape(p.lever.unavailable)}</li>"
                          for p in result.ranked() if p.replay is None)
    series = [Series("recorded", result.recorded_timeline), Series("replayed baseline", result.baseline.timeline)]
    if ranked and ranked[0].replay is not None:
        series.append(Series(f"best lever: {ranked[0].lever.name}", ranked[0].replay.timeline))
        if ranked[0].spread:
            low, high = envelope([ranked[0].replay.timeline, *(r.timeline for r in ranked[0].spread)])
            n = 1 + len(ranked[0].spread)
            series += [Series(f"best lever, lowest of {n} replays", low, dash="3 3"),
                       Series(f"best lever, highest of {n} replays", high, dash="3 3")]
    plot = Plot("ITL p99: recorded, replayed, and under the best lever", "s", series)
    t0 = min([result.start, *(t for s in series for t, _ in s.points)])
    t1 = max([result.end, *(t for s in series for t, _ in s.points)])
    o = result.objectives
    return (f'<h2>What each lever would buy</h2><div class="meta">{escape(verdict)} ({escape(calibration)}); '
            f"goodput counts requests with TTFT &lt;= {seconds(o.ttft_s)} and mean TPOT &lt;= {seconds(o.tpot_s)}. "
            f"`stepline whatif` prints every lever.</div>"
            "<table><tr><th></th><th>TTFT p50</th><th>TTFT p99</th><th>ITL p99</th><th>goodput</th>"
            f"<th>vs baseline</th></tr>{cells}</table>"
            + (f"<p>Unavailable on this engine:</p><ul>{unavailable}</ul>" if unavailable else "")
            + render_svg(plot, t0, t1 + 1.0, []))
