"""Make the README's two pictures, from the code, on demand: `python docs/images/build.py [--out docs/images]`.

- `timeline.png`: the demo's own incident report, drawn by headless Chromium around the first monster prefill. It
  runs `stepline demo --fast` into a scratch embedded store, asks the store when the slowest step ran, writes
  `stepline report` for the minutes around it and screenshots the report's timeline (its findings list is cut from
  the copy that is drawn, so the picture is the plots: step time against prefill tokens, ITL, the queue, the GPUs).
- `architecture.svg`: the architecture from the text diagram in ARCHITECTURE below (sources on the left, the
  collector in the middle, the store and what reads it on the right).

Needs `stepline` installed and `chromium` on PATH (Debian's package). Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from html import escape
from pathlib import Path

HERE = Path(__file__).resolve().parent
TIMELINE_SIZE = (1200, 1700)
BEFORE_S, AFTER_S = 75, 45  # around the slowest step: the monster's prefill, and the queue it leaves draining


def _stepline(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "stepline", *args], check=True, capture_output=True, text=True,
                         timeout=600)
    return out.stdout


def timeline_png(out: Path, scratch: Path) -> Path:
    """Run the demo into a scratch store and draw its report's timeline around the slowest step."""
    store = f"chdb://{scratch / 'store'}"
    _stepline("demo", "--fast", "--store", store)
    t = float(_stepline("query", "--store", store, "--format", "TabSeparated",
                        "SELECT toUnixTimestamp64Milli(argMax(ts, elapsed_ms)) / 1000 FROM steps"))
    report = scratch / "report.html"
    _stepline("report", "--store", store, "--from", f"{t - BEFORE_S:.3f}", "--to", f"{t + AFTER_S:.3f}",
              "--no-whatif", "--out", str(report))
    html = report.read_text(encoding="utf-8")
    start, end = html.index("<h2>Findings</h2>"), html.index("<h2>Timeline</h2>")
    drawn = scratch / "timeline.html"
    drawn.write_text(html[:start] + html[end:], encoding="utf-8")
    png = out / "timeline.png"
    _screenshot(drawn, png, TIMELINE_SIZE)
    return png


def _screenshot(page: Path, png: Path, size: tuple[int, int]) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("docs/images/build.py: chromium is not on PATH (apt-get install chromium)")
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                        "--disable-background-networking", "--disable-component-update", "--disable-sync",
                        f"--user-data-dir={profile}", f"--screenshot={png}", f"--window-size={size[0]},{size[1]}",
                        "--hide-scrollbars", page.as_uri()], check=True, timeout=120, capture_output=True)


# The architecture, as text: each source, what carries it, and what reads the store. One line each.
ARCHITECTURE = {
    "sources": [
        ("vLLM engine", "stat-logger plugin: every step, every finished request (Unix datagrams)"),
        ("vLLM engine", "OTLP/HTTP llm_request spans"),
        ("vLLM engine", "/metrics, scraped with history"),
        ("NVML", "clocks, power, DRAM BW, PCIe/NVLink, throttle reasons, XID (10 Hz)"),
        ("psutil", "host and engine processes (1 Hz)"),
        ("gateways", "routing decisions (spans, LiteLLM callback), /metrics"),
    ],
    "collector": ("stepline collect", "sources → merge → spool → writers; watchdog"),
    "store": ("ClickHouse", "steps, requests, samples, events, decisions"),
    "readers": [
        ("Grafana", "five dashboards, generated"),
        ("Prometheus + Alertmanager", "watchdog alerts → Slack, PagerDuty, e-mail, webhook"),
        ("stepline diagnose / report / whatif", "ranked causes, one HTML report, levers priced"),
        ("SQL clients", "read-only ClickHouse HTTP endpoint"),
    ],
}


def architecture_svg(out: Path) -> Path:
    """Boxes and arrows from ARCHITECTURE, as an SVG (no browser needed)."""
    box_h, gap, width = 46, 12, 1180
    left_x, left_w, mid_x, mid_w, right_x, right_w = 10, 360, 430, 300, 800, 370
    n = max(len(ARCHITECTURE["sources"]), len(ARCHITECTURE["readers"]))
    height = 20 + n * (box_h + gap)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" width="{width}" '
             f'height="{height}" font-family="Helvetica, Arial, sans-serif">',
             '<defs><marker id="a" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" markerHeight="7" '
             'orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#555"/></marker></defs>',
             f'<rect width="{width}" height="{height}" fill="#fff"/>']

    def box(x: float, y: float, w: float, title: str, line: str, fill: str) -> None:
        parts.append(f'<rect x="{x}" y="{y}" width="{w}" height="{box_h}" rx="6" fill="{fill}" stroke="#444"/>'
                     f'<text x="{x + 8}" y="{y + 18}" font-size="14" font-weight="bold">{escape(title)}</text>'
                     f'<text x="{x + 8}" y="{y + 36}" font-size="11" fill="#333">{escape(line)}</text>')

    def arrow(x1: float, y1: float, x2: float, y2: float) -> None:
        parts.append(f'<line x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}" stroke="#555" stroke-width="1.5" '
                     'marker-end="url(#a)"/>')

    mid_y = height / 2 - box_h - gap / 2
    for i, (title, line) in enumerate(ARCHITECTURE["sources"]):
        y = 10 + i * (box_h + gap)
        box(left_x, y, left_w, title, line, "#e8f0fe")
        arrow(left_x + left_w, y + box_h / 2, mid_x, mid_y + box_h / 2)
    collector, store = ARCHITECTURE["collector"], ARCHITECTURE["store"]
    box(mid_x, mid_y, mid_w, collector[0], collector[1], "#fff4e0")
    box(mid_x, mid_y + box_h + gap, mid_w, store[0], store[1], "#e6f4ea")
    arrow(mid_x + mid_w / 2, mid_y + box_h, mid_x + mid_w / 2, mid_y + box_h + gap)
    readers = ARCHITECTURE["readers"]
    for i, (title, line) in enumerate(readers):
        y = 10 + i * (height - 20 - box_h) / (len(readers) - 1)
        box(right_x, y, right_w, title, line, "#f3e8fd")
        source_y = mid_y + box_h / 2 if title.startswith("Prometheus") else mid_y + box_h + gap + box_h / 2
        arrow(mid_x + mid_w, source_y, right_x, y + box_h / 2)
    parts.append("</svg>")
    svg = out / "architecture.svg"
    svg.write_text("\n".join(parts) + "\n", encoding="utf-8")
    return svg


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE, help="where the pictures go (default: docs/images)")
    parser.add_argument("--only", choices=("timeline", "architecture"), help="make one picture only")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.only != "timeline":
        print(architecture_svg(args.out))
    if args.only != "architecture":
        with tempfile.TemporaryDirectory() as scratch:
            print(timeline_png(args.out, Path(scratch)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
