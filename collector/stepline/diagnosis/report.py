"""The HTML incident report: the findings over inline SVG plots that share one time axis, loading nothing."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from html import escape
from pathlib import Path
from typing import Any

from stepline.diagnosis.evidence import Line, evidence_of
from stepline.diagnosis.findings import Finding, Window
from stepline.queries.query import moment
from stepline.queries.window import EACH_ENGINE
from stepline.store.reads import Reads, Row, named, only

WIDTH = 1200
HEIGHT = 170
LEFT, RIGHT, TOP, BOTTOM = 72, 72, 24, 26
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")
# A plot's later lines are dashed, so that one drawn over an equal one (two GPUs that read the same) lets it show.
DASHES = ("", "7 3", "2 3", "10 3 2 3")
BAND_FILL = {"critical": "#d62728", "warning": "#ff9f1a", "info": "#4c8bf5"}
MARKER_FILL = {"critical": "#f2b8b8", "warning": "#ffdca8", "info": "#c4d7fb"}
# Finding markers: a labelled bar per finding in rows above the plot, no two sharing a row where they would touch.
LANE_H = 14
LABEL_CHAR_PX = 7.5  # an 11 px bold label's characters, generously
# A finding over (nearly) the whole axis is only its bar above the plot: tinting all of every plot says nothing.
MAX_TINT_SHARE = 0.9
MIN_AXIS_S = 10.0  # data at one instant is drawn over this much time
# Nice tick spacings in seconds for the shared time axis.
_TIME_STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400)

Point = tuple[float, float | None]  # (epoch seconds, value); None breaks the line


@dataclass(frozen=True)
class Series:
    """One line: its legend name, its points, and whether it reads on the right-hand axis."""

    name: str
    points: Sequence[Point]
    right: bool = False
    color: str = ""
    dash: str = ""  # an SVG stroke-dasharray; "" is solid


@dataclass(frozen=True)
class Band:
    """A finding's time range, labelled with its number and kind ("#1 prefill_interference")."""

    start: float
    end: float
    severity: str
    label: str
    number: int = 0


@dataclass(frozen=True)
class Plot:
    """One panel: a title, units for the left (and optional right) axis, and its series."""

    title: str
    unit: str
    series: Sequence[Series] = field(default_factory=tuple)
    right_unit: str = ""
    y_max: float | None = None  # a fixed top (e.g. 100 for percentages); None: from the data


def render_svg(plot: Plot, t0: float, t1: float, bands: Sequence[Band]) -> str:
    """The plot as an inline <svg> over [t0, t1]; a labelled 'no data' panel when no series has a value.

    Each finding is a labelled bar in a row above the plot area, and a short one also tints the area.
    """
    inner_w = WIDTH - LEFT - RIGHT
    span = max(t1 - t0, 1e-9)

    def x(t: float) -> float:
        return LEFT + (min(max(t, t0), t1) - t0) / span * inner_w

    shown = [band for band in bands if band.end >= t0 and band.start <= t1]
    markers = _markers(shown, x)
    rows = 1 + max((lane for lane, _ in markers), default=-1)
    strip = LANE_H * rows + (4 if rows else 0)
    top, height = TOP + strip, HEIGHT + strip
    inner_h = height - top - BOTTOM
    parts = [f'<svg class="plot" viewBox="0 0 {WIDTH} {height}" '
             f'data-t0="{t0:.3f}" data-t1="{t1:.3f}" role="img" aria-label="{escape(plot.title)}">',
             f'<rect x="{LEFT}" y="{top}" width="{inner_w}" height="{inner_h}" class="frame"/>']
    for severity, bx, bw in _tints(shown, x, MAX_TINT_SHARE * inner_w):
        parts.append(f'<rect class="tint" x="{bx:.1f}" y="{top}" width="{bw:.1f}" height="{inner_h}" '
                     f'fill="{BAND_FILL.get(severity, "#999")}" fill-opacity="0.16"/>')
    for band, (lane, label_x) in zip(shown, markers, strict=True):
        bx, bw = x(band.start), max(x(band.end) - x(band.start), 2.0)
        lane_y = TOP + lane * LANE_H
        parts.append(f'<rect class="marker" data-finding="{band.number}" x="{bx:.1f}" y="{lane_y + 1}" '
                     f'width="{bw:.1f}" height="{LANE_H - 2}" fill="{MARKER_FILL.get(band.severity, "#ddd")}" '
                     f'stroke="{BAND_FILL.get(band.severity, "#999")}"/>'
                     f'<text x="{label_x:.1f}" y="{lane_y + 11}" class="band">{escape(band.label)}</text>')
    for tick in _time_ticks(t0, t1):
        tx = x(tick)
        parts.append(f'<line x1="{tx:.1f}" x2="{tx:.1f}" y1="{top}" y2="{top + inner_h}" class="grid"/>'
                     f'<text x="{tx:.1f}" y="{height - 8}" class="tick" text-anchor="middle">'
                     f'{datetime.fromtimestamp(tick, UTC):%H:%M:%S}</text>')
    styled = [replace(s, color=s.color or PALETTE[i % len(PALETTE)], dash=s.dash or DASHES[i % len(DASHES)])
              for i, s in enumerate(plot.series)]
    has_data = False
    for side in (False, True):
        values = [v for s in styled if s.right == side for _, v in s.points if v is not None and math.isfinite(v)]
        if not values:
            continue
        has_data = True
        y_top = plot.y_max if plot.y_max is not None and not side else _nice_ceiling(max(values))
        bottom = min(0.0, min(values))

        def y(v: float, lo: float = bottom, hi: float = y_top) -> float:
            return top + inner_h - (v - lo) / max(hi - lo, 1e-12) * inner_h

        for tick_value in (bottom, (bottom + y_top) / 2, y_top):
            ax = LEFT + inner_w + 6 if side else LEFT - 6
            parts.append(f'<text x="{ax}" y="{y(tick_value) + 4:.1f}" class="tick" '
                         f'text-anchor="{"start" if side else "end"}">{_number(tick_value)}</text>')
            if not side:
                parts.append(f'<line x1="{LEFT}" x2="{LEFT + inner_w}" y1="{y(tick_value):.1f}" '
                             f'y2="{y(tick_value):.1f}" class="grid"/>')
        for s in styled:
            if s.right == side:
                parts.extend(_polylines(s, x, y))
    unit = escape(plot.unit) + (f" · right: {escape(plot.right_unit)}" if plot.right_unit else "")
    parts.append(f'<text x="{LEFT}" y="{TOP - 8}" class="title">{escape(plot.title)}'
                 f'<tspan class="unit"> ({unit})</tspan></text>')
    parts.extend(_legend(styled))
    if not has_data:
        parts.append(f'<text x="{LEFT + inner_w / 2:.0f}" y="{top + inner_h / 2 + 6:.0f}" class="nodata" '
                     f'text-anchor="middle">no data in this window</text>')
    parts.append(f'<line class="cursor" x1="-10" x2="-10" y1="{top}" y2="{top + inner_h}"/></svg>')
    return "".join(parts)


def _markers(bands: Sequence[Band], x: Callable[[float], float]) -> list[tuple[int, float]]:
    """(row, label x) per band: first fit in rank order, so that no bar or label touches another's."""
    right_edge = WIDTH - RIGHT
    rows: list[list[tuple[float, float]]] = []
    out = []
    for band in bands:
        left, end = x(band.start), max(x(band.end), x(band.start) + 2.0)
        width = LABEL_CHAR_PX * len(band.label)
        label_x = min(left + 3, right_edge - width)  # near the right edge the label ends at the edge
        box = (min(left, label_x), max(end, label_x + width))
        row = next((k for k, taken in enumerate(rows) if all(box[1] + 4 <= a or b + 4 <= box[0] for a, b in taken)),
                   len(rows))
        if row == len(rows):
            rows.append([])
        rows[row].append(box)
        out.append((row, label_x))
    return out


def _tints(bands: Sequence[Band], x: Callable[[float], float], widest: float) -> list[tuple[str, float, float]]:
    """(severity, x, width) shading the plot area where findings of a severity are, overlapping ones merged once."""
    out: list[tuple[str, float, float]] = []
    for severity in ("info", "warning", "critical"):  # the worst drawn last, on top
        spans = sorted((x(b.start), max(x(b.end), x(b.start) + 2.0)) for b in bands if b.severity == severity)
        merged: list[list[float]] = []
        for left, right in spans:
            if right - left > widest:
                continue  # over (nearly) the whole axis: its bar above the plot says it
            if merged and left <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], right)
            else:
                merged.append([left, right])
        out.extend((severity, left, right - left) for left, right in merged)
    return out


def _legend(series: Sequence[Series]) -> list[str]:
    """Right-aligned above the plot: each line's own colour and dashes, then its name (→: the right axis)."""
    parts, legend_x = [], float(WIDTH - RIGHT)
    for s in reversed(series):
        name = s.name + (" →" if s.right else "")
        text_x = legend_x - 7 * len(name)  # about 7 px a character at 12 px
        dash = f' stroke-dasharray="{s.dash}"' if s.dash else ""
        parts.append(f'<line class="legend" x1="{text_x - 26:.0f}" x2="{text_x - 4:.0f}" y1="{TOP - 12}" '
                     f'y2="{TOP - 12}" stroke="{s.color}"{dash} stroke-width="2"/>'
                     f'<text x="{text_x:.0f}" y="{TOP - 8}" class="legend">{escape(name)}</text>')
        legend_x = text_x - 44
    return parts


def bucket_seconds(span_s: float, max_buckets: int = 600) -> float:
    """The smallest nice bucket giving at most max_buckets over span_s seconds."""
    for step in (0.1, 0.2, 0.5, *sorted({*_TIME_STEPS, 180})):
        if span_s / step <= max_buckets:
            return float(step)
    return float(math.ceil(span_s / max_buckets))


def _polylines(series: Series, x: Callable[[float], float], y: Callable[[float], float]) -> list[str]:
    """Polylines for the runs of finite values; a lone point becomes a dot."""
    runs: list[list[tuple[float, float]]] = [[]]
    for t, v in sorted(series.points, key=lambda p: p[0]):
        if v is None or not math.isfinite(v):
            if runs[-1]:
                runs.append([])
            continue
        runs[-1].append((x(t), y(v)))
    out = []
    for run in runs:
        if len(run) == 1:
            out.append(f'<circle cx="{run[0][0]:.1f}" cy="{run[0][1]:.1f}" r="1.8" fill="{series.color}"/>')
        elif run:
            pts = " ".join(f"{px:.1f},{py:.1f}" for px, py in run)
            dash = f' stroke-dasharray="{series.dash}"' if series.dash else ""
            out.append(f'<polyline points="{pts}" stroke="{series.color}"{dash} class="line"/>')
    return out


def _time_ticks(t0: float, t1: float, target: int = 10) -> list[float]:
    span = t1 - t0
    step = next((s for s in _TIME_STEPS if span / s <= target), _TIME_STEPS[-1])
    first = math.ceil(t0 / step) * step
    return [first + i * step for i in range(int((t1 - first) // step) + 1)]


def _nice_ceiling(value: float) -> float:
    if value <= 0:
        return 1.0
    magnitude = 10.0 ** math.floor(math.log10(value))
    return next(m * magnitude for m in (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10) if m * magnitude >= value)


def _number(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 10000:
        return f"{value / 1000:.0f}k"
    if abs(value) >= 10:
        return f"{value:.0f}"
    return f"{value:.3g}"


DEFAULT_TITLE = "stepline incident report"

_BOUNDS = (f" WHERE ts >= {moment('from_us')}"
           f" AND ts < {moment('to_us')}"
           f" AND {EACH_ENGINE}")
_BUCKET = "intDiv(toUnixTimestamp64Micro(ts) - {from_us:Int64}, {bucket_us:Int64}) AS b"


def _steps_sql(steps: str) -> str:
    """Per bucket over every engine in the window of `steps` (the table): the worst step, the prefill it carried, the
    ITL tails."""
    return (f"SELECT {_BUCKET}, max(elapsed_ms) AS step_ms, sum(num_ctx_tokens) AS prefill_tokens,"
            " quantilesExactArray(0.5, 0.99)(itl_seconds) AS itl, sum(length(itl_seconds)) AS itl_samples,"
            " max(running) AS running_max, max(waiting) AS waiting_max, max(kv_cache_usage) AS kv_max,"
            " sum(prefix_cache_hits) AS hits, sum(prefix_cache_queries) AS queries"
            f" FROM {steps}{_BOUNDS} AND NOT is_dummy GROUP BY b ORDER BY b")


def _gpus_sql(gpus: str) -> str:
    """Per bucket and GPU of `gpus` (the table): clocks, power and DRAM bandwidth. NaN means a GPU does not support
    the reading: averaged over the finite samples only."""
    return (f"SELECT {_BUCKET}, host, gpu_index, avgIf(sm_clock_mhz, isFinite(sm_clock_mhz)) AS sm_mhz,"
            " avgIf(power_w, isFinite(power_w)) AS power, avgIf(dram_bw_util_pct, isFinite(dram_bw_util_pct)) AS dram"
            f" FROM {gpus}{_BOUNDS} GROUP BY b, host, gpu_index ORDER BY b, host, gpu_index")


def _span_sql(table: str) -> str:
    return (f"SELECT count() AS samples, toUnixTimestamp64Micro(min(ts)) AS first_us, "
            f"toUnixTimestamp64Micro(max(ts)) AS last_us FROM {table}{_BOUNDS}")


_MAX_GPU_LINES = 8  # more GPUs than this are drawn as their average

_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:16px 24px;color:#222;background:#fff}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:18px 0 6px}.meta{color:#555}
.finding{border-left:5px solid #999;padding:4px 10px;margin:8px 0;background:#fafafa}
.finding.critical{border-color:#d62728}.finding.warning{border-color:#ff9f1a}.finding.info{border-color:#4c8bf5}
.sev{font-weight:bold;text-transform:uppercase;font-size:12px}.kind{color:#555;font-family:monospace}
.ev{font-size:12px;color:#333;margin:2px 0;padding-left:18px;columns:22em auto;column-gap:24px}
.ev li{break-inside:avoid}.ev b{font-weight:600}.ev.folded{margin-left:14px}.also{font-size:12px;margin:4px 0 0 14px}
pre{background:#f0f0f0;padding:6px;overflow-x:auto;font-size:12px;white-space:pre-wrap}
.plots{max-width:1400px}svg.plot{display:block;width:100%;height:auto}
.frame{fill:none;stroke:#bbb}.grid{stroke:#e6e6e6}.line{fill:none;stroke-width:1.4}
.tick{font-size:11px;fill:#555}.title{font-size:13px;font-weight:bold;fill:#222}.unit{font-weight:normal;fill:#666}
.legend{font-size:12px}.band{font-size:11px;font-weight:bold;fill:#444}.nodata{font-size:15px;fill:#999}
.cursor{stroke:#333;stroke-dasharray:3 3}#at{position:fixed;right:12px;top:8px;background:#fffd;padding:2px 6px}
"""
# A crosshair that follows the pointer over every plot at once, with the time under it.
_SCRIPT = """
document.querySelectorAll('svg.plot').forEach(function(s){s.addEventListener('mousemove',function(e){
var r=s.getBoundingClientRect(),k=WIDTH/r.width,x=(e.clientX-r.left)*k,l=LEFT,w=WIDTH-LEFT-RIGHT;
if(x<l||x>l+w)return;var t=+s.dataset.t0+(x-l)/w*(s.dataset.t1-s.dataset.t0);
document.querySelectorAll('line.cursor').forEach(function(c){c.setAttribute('x1',x);c.setAttribute('x2',x);});
document.getElementById('at').textContent=new Date(t*1000).toISOString().slice(11,23)+' UTC';});});
""".replace("WIDTH", str(WIDTH)).replace("LEFT", str(LEFT)).replace("RIGHT", str(RIGHT))


def render_report(reader: Reads, window: Window, findings: Sequence[Finding], *, title: str = DEFAULT_TITLE,
                  database: str = "", asked: str = "", appendix: str = "") -> str:
    """The report as one HTML page; `database` qualifies the tables (empty: the client's default).

    The plots show the span of the data and the findings within the window; `asked` says how the window was
    asked for (e.g. "the last 1h"), for the line that tells the two apart; `appendix` is HTML put after the
    timeline (the whatif section).
    """
    w0, w1 = window.start.timestamp(), window.end.timestamp()
    if not w1 > w0:
        raise ValueError(f"the window must end after it starts: {window.start} .. {window.end}")
    ranked = sorted(findings, key=lambda f: f.rank_key())
    t0, t1 = fit_axis(window, _data_span(reader, window, database), ranked)
    bucket = bucket_seconds(t1 - t0)
    bands = [Band(f.start.timestamp(), f.end.timestamp(), f.severity,
                  f"#{i} {f.kind}" + (" (the whole window)" if _whole(f, window) else ""), i)
             for i, f in enumerate(ranked, 1)]
    plots = _plots(reader, window.engine, t0, t1, bucket, database)
    scope = f"engine {window.engine}" if window.engine else "all engines"
    what = "the asked window" if (t0, t1) == (w0, w1) else "the span of the data and findings"
    asked_for = f"{asked} ({_span(w0, w1)})" if asked else _span(w0, w1)
    head = (f"showing {_span(t0, t1)} ({_duration(t1 - t0)}), {what}; asked for {asked_for} · {scope} · "
            f"{len(ranked)} finding(s) · bucket {bucket:g} s · generated {_moment(datetime.now(UTC))} UTC")
    body = [f"<h1>{escape(title)}</h1>", f'<div class="meta">{escape(head)}</div>', "<h2>Findings</h2>"]
    body.extend(_finding_html(i, f) for i, f in enumerate(ranked, 1))
    if not ranked:
        body.append("<p>No findings in this window.</p>")
    body.append('<h2>Timeline</h2><div class="plots">')
    body.extend(render_svg(plot, t0, t1, bands) for plot in plots)
    body.append("</div>")
    if appendix:
        body.append(appendix)
    body.append('<div id="at"></div>')
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
            f"<style>{_STYLE}</style></head><body>\n" + "\n".join(body)
            + f"\n<script>{_SCRIPT}</script></body></html>\n")


def fit_axis(window: Window, data: tuple[float, float] | None, findings: Sequence[Finding]) -> tuple[float, float]:
    """The plotted range: from the first row or finding to the last, within the window; the window when empty.

    A finding over the whole window (a detector's verdict on all of it) says nothing about when, so moves nothing.
    """
    w0, w1 = window.start.timestamp(), window.end.timestamp()
    edges = list(data or ())
    for f in findings:
        start, end = max(f.start.timestamp(), w0), min(f.end.timestamp(), w1)
        if start <= end and not _whole(f, window):
            edges += [start, end]
    if not edges:
        return w0, w1
    t0, t1 = max(w0, min(edges)), min(w1, max(edges))
    if t1 - t0 < MIN_AXIS_S:
        middle = (t0 + t1) / 2
        t0, t1 = max(w0, middle - MIN_AXIS_S / 2), min(w1, middle + MIN_AXIS_S / 2)
    return t0, t1


def write_report(reader: Reads, window: Window, findings: Sequence[Finding], out: str | Path, *,
                 title: str = DEFAULT_TITLE, database: str = "", asked: str = "", appendix: str = "") -> Path:
    """Render the report and write it to `out` (UTF-8); returns the path written."""
    path = Path(out)
    path.write_text(render_report(reader, window, findings, title=title, database=database, asked=asked,
                                  appendix=appendix), encoding="utf-8")
    return path


def _whole(finding: Finding, window: Window) -> bool:
    """Whether the finding spans the window (to within 1%): a verdict on all of it rather than on a moment."""
    w0, w1 = window.start.timestamp(), window.end.timestamp()
    return finding.start.timestamp() <= w0 + 0.01 * (w1 - w0) and finding.end.timestamp() >= w1 - 0.01 * (w1 - w0)


def _data_span(reader: Reads, window: Window, database: str) -> tuple[float, float] | None:
    """The first and last step or GPU sample in the window (epoch seconds); None when it holds neither."""
    params = {"from_us": round(window.start.timestamp() * 1_000_000),
              "to_us": round(window.end.timestamp() * 1_000_000), "engine": window.engine}
    edges = []
    for table in ("steps", "gpu_samples"):
        sql = _span_sql(_table(database, table)) + (" AND NOT is_dummy" if table == "steps" else "")
        span = only(reader.query(sql, parameters=params))
        if span.samples:
            edges += [span.first_us / 1e6, span.last_us / 1e6]
    return (min(edges), max(edges)) if edges else None


def _plots(reader: Reads, engine: str, t0: float, t1: float, bucket: float, database: str) -> list[Plot]:
    # The last row sits on t1 itself: the bounds' end is exclusive.
    params = {"from_us": round(t0 * 1_000_000), "to_us": round(t1 * 1_000_000) + 1,
              "bucket_us": max(1, round(bucket * 1_000_000)), "engine": engine}

    def at(b: int) -> float:  # a bucket is drawn at its middle
        return t0 + (b + 0.5) * bucket

    steps = named(reader.query(_steps_sql(_table(database, "steps")), parameters=params))
    cols: dict[str, list[Point]] = {k: [] for k in ("step", "prefill", "p50", "p99", "run", "wait", "kv", "hit")}
    for r in steps:
        t = at(r.b)
        cols["step"].append((t, _f(r.step_ms)))
        cols["prefill"].append((t, _f(r.prefill_tokens)))
        # An empty bucket says 0, not NaN.
        p50, p99 = (_scaled(q, 1000) for q in r.itl) if r.itl_samples else (None, None)
        cols["p50"].append((t, p50))
        cols["p99"].append((t, p99))
        cols["run"].append((t, _f(r.running_max)))
        cols["wait"].append((t, _f(r.waiting_max)))
        cols["kv"].append((t, _scaled(r.kv_max, 100)))
        cols["hit"].append((t, 100 * r.hits / r.queries if r.queries else None))
    gpu_rows = named(reader.query(_gpus_sql(_table(database, "gpu_samples")), parameters=params))
    sm, power, dram = _gpu_series(gpu_rows, at)
    return [
        Plot("Step duration (max) and prefill tokens (sum) per bucket", "ms", (
            Series("step ms", cols["step"]), Series("prefill tokens", cols["prefill"], right=True)),
             right_unit="tokens"),
        Plot("Inter-token latency", "ms", (Series("ITL p50", cols["p50"]), Series("ITL p99", cols["p99"]))),
        Plot("Requests running / waiting (max per bucket)", "requests",
             (Series("running", cols["run"]), Series("waiting", cols["wait"]))),
        Plot("KV cache usage (max per bucket)", "%", (Series("KV used", cols["kv"]),), y_max=100.0),
        Plot("Prefix-cache hit rate", "% of queried tokens", (Series("hit rate", cols["hit"]),), y_max=100.0),
        Plot("GPU SM clock", "MHz", sm),
        Plot("GPU power", "W", power),
        Plot("GPU DRAM bandwidth utilisation", "%", dram, y_max=100.0),
    ]


def _gpu_series(rows: Sequence[Row], at: Callable[[int], float]
                ) -> tuple[list[Series], list[Series], list[Series]]:
    """One line per GPU (host:index when several hosts), or their average when there are many GPUs: _GPUS's rows."""
    by_gpu: dict[tuple[str, int], list[tuple[float, float | None, float | None, float | None]]] = {}
    for r in rows:
        by_gpu.setdefault((r.host, r.gpu_index), []).append((at(r.b), _f(r.sm_mhz), _f(r.power), _f(r.dram)))
    gpus = len(by_gpu)
    if gpus > _MAX_GPU_LINES:
        merged: dict[float, list[tuple[float | None, float | None, float | None]]] = {}
        for points in by_gpu.values():
            for t, *values in points:
                merged.setdefault(t, []).append((values[0], values[1], values[2]))
        by_gpu = {("", -1): [(t, _mean([v[0] for v in vs]), _mean([v[1] for v in vs]), _mean([v[2] for v in vs]))
                             for t, vs in sorted(merged.items())]}
    hosts = {host for host, _ in by_gpu}
    out: tuple[list[Series], list[Series], list[Series]] = ([], [], [])
    for (host, gpu), points in sorted(by_gpu.items()):
        name = f"mean of {gpus} GPUs" if gpu < 0 else f"{host}:GPU {gpu}" if len(hosts) > 1 else f"GPU {gpu}"
        for i, series in enumerate(out):
            series.append(Series(name, [(p[0], p[i + 1]) for p in points]))
    return out


def _finding_html(number: int, f: Finding) -> str:
    said = evidence_of(f.evidence)
    parts = [f'<div class="finding {escape(f.severity)}" id="finding-{number}">',
             f'<div><b>#{number}</b> <span class="sev">{escape(f.severity)}</span> '
             f'<span class="kind">{escape(f.kind)}</span> · <b>{escape(f.title)}</b></div>',
             f'<div class="meta">{escape(f.engine or "all engines")} · {_moment(f.start)} → {_moment(f.end)} UTC</div>',
             _lines_html(said.lines)]
    for folded in said.folded:
        parts.append(f'<div class="also">also <span class="kind">{escape(folded.kind)}</span> '
                     f'<span class="sev">{escape(folded.severity)}</span> · {escape(folded.title)}</div>')
        parts.append(_lines_html(folded.lines, "ev folded"))
    if said.whatif:
        parts.append('<div class="also">whatif: what the best lever of this finding would buy, replayed '
                     "(value [low-high] over the replays)</div>")
        parts.append(_lines_html(said.whatif, "ev folded"))
    if f.lever:
        parts.append(f"<div><b>Lever:</b> {escape(f.lever)}</div>")
    if f.sql:
        parts.append(f"<details><summary>SQL</summary><pre>{escape(f.sql)}</pre></details>")
    parts.append("</div>")
    return "".join(parts)


def _lines_html(lines: Sequence[Line], css: str = "ev") -> str:
    """Named lines (evidence.py, as `diagnose` prints them): "name: <b>figure</b>" each."""
    if not lines:
        return ""
    items = "".join(f"<li>{escape(line.name)}: <b>{escape(line.text)}</b></li>" for line in lines)
    return f'<ul class="{css}">{items}</ul>'


def _table(database: str, name: str) -> str:
    return f"`{database.replace('`', '')}`.`{name}`" if database else f"`{name}`"


def _span(t0: float, t1: float) -> str:
    """"14:02:10 → 14:03:25 UTC", with dates when the range is not within one day."""
    first, last = datetime.fromtimestamp(t0, UTC), datetime.fromtimestamp(t1, UTC)
    pattern = "%H:%M:%S" if first.date() == last.date() else "%Y-%m-%d %H:%M:%S"
    return f"{first.strftime(pattern)} → {last.strftime(pattern)} UTC"


def _duration(seconds: float) -> str:
    """"75 s", "12 min 5 s", "3 h 20 min"."""
    whole = round(seconds)
    if whole < 60:
        return f"{seconds:.3g} s" if seconds < 10 else f"{whole} s"
    if whole < 3600:
        return f"{whole // 60} min" + (f" {whole % 60} s" if whole % 60 else "")
    return f"{whole // 3600} h" + (f" {whole % 3600 // 60} min" if whole % 3600 // 60 else "")


def _moment(moment: datetime) -> str:
    aware = moment if moment.tzinfo else moment.replace(tzinfo=UTC)  # chDB may hand back naive UTC
    return f"{aware.astimezone(UTC):%Y-%m-%d %H:%M:%S}"


def _f(value: Any) -> float | None:
    if value is None:
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _scaled(value: Any, factor: float) -> float | None:
    number = _f(value)
    return None if number is None else number * factor


def _mean(values: Sequence[float | None]) -> float | None:
    finite = [v for v in values if v is not None]
    return sum(finite) / len(finite) if finite else None
