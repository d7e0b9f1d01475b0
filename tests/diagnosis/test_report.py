"""`stepline report`: the HTML page from a real embedded store, and a real headless Chromium rendering it."""

from __future__ import annotations

import argparse
import math
import shutil
import struct
import subprocess
import tempfile
import time
import zlib
from dataclasses import replace
from datetime import UTC, datetime
from html.parser import HTMLParser
from pathlib import Path

import pytest

from stepline.cli.report import add_arguments, run
from stepline.diagnosis.findings import Finding, Window
from stepline.diagnosis.report import WIDTH, bucket_seconds, render_report, write_report
from stepline.model.rows import GpuSample, Request, Step, micros
from stepline.store.store import Store

T0 = float(int(time.time()) - 660)  # ten minutes of data ending a minute ago: well inside the 30-day TTL
SLOW = (T0 + 240, T0 + 300)  # long prefills: steps take 1.5 s and every decode waits
CAPPED = (T0 + 360, T0 + 480)  # the GPUs sit at their power cap with SM clocks down


def _at(t: float) -> datetime:
    return datetime.fromtimestamp(t, UTC)


def _range(t0: float, t1: float) -> str:
    """How the page spells a range: "14:02:10 → 14:03:25", or with dates when it crosses a day."""
    pattern = "%H:%M:%S" if _at(t0).date() == _at(t1).date() else "%Y-%m-%d %H:%M:%S"
    return f"{_at(t0).strftime(pattern)} → {_at(t1).strftime(pattern)}"


def _step(t: float, i: int) -> Step:
    slow = SLOW[0] <= t < SLOW[1]
    elapsed = 1500.0 if slow else 12.0 + 6 * math.sin(i / 50)
    itl = [elapsed / 1000] * 3 + [elapsed / 500]
    waiting = 40 if slow else 2
    return Step(micros(t), "h", "e", 0, "m", i, elapsed, 1 if slow else 0, 8192 if slow else 64, 24, 24,
                24, waiting, 0, 0.3 + 0.5 * (t - T0) / 600, 100, 60 if i % 7 else 20, 0, 0, 0, 0, [], itl, False)


def _gpu(t: float, index: int) -> GpuSample:
    capped = CAPPED[0] <= t < CAPPED[1]
    nan = math.nan
    return GpuSample(micros(t), "h", "e", index, f"GPU-{index}", "H200", 1410.0 if capped else 1980.0, 2619,
                     700.0 if capped else 420.0 + 20 * index, 1000, 60, 70, 95, 40, 10 << 30, 141 << 30, 1e6, 1e6, 0,
                     2e9, 2e9, 4 if capped else 0, ["sw_power_cap"] if capped else [], 80.0 if capped else 55.0, nan,
                     nan, {4242: 10 << 30})


def _request(t: float, i: int) -> Request:
    return Request(micros(t), "h", "e", 0, "m", f"r{i}", "plugin", "stop", micros(t - 5), 0.1, 0.3, 4.6, 4.9, 5.0,
                   0.4, 0.02, 512, 0, 230, 256, 0)


@pytest.fixture
def filled(store: Store) -> Store:
    steps, t, i = [], T0, 0
    while t < T0 + 600:
        steps.append(_step(t, i))
        t += 1.5 if SLOW[0] <= t < SLOW[1] else 0.1
        i += 1
    store.insert("steps", steps, Step._fields)
    store.insert("gpu_samples", [_gpu(T0 + k * 0.5, g) for k in range(1200) for g in (0, 1)], GpuSample._fields)
    store.insert("requests", [_request(T0 + 10 + k * 3, k) for k in range(190)], Request._fields)
    return store


WINDOW = Window(_at(T0), _at(T0 + 600), "e")
FINDINGS = [
    Finding("gpu_power_cap", "warning", "e", _at(CAPPED[0]), _at(CAPPED[1]),
            "GPUs at their 700 W power cap: SM clock 1410 MHz, -29%",
            {"power_w": 700.0, "sm_clock_mhz": 1410.0}, "SELECT avg(power_w) FROM gpu_samples",
            "check cooling and the power limit (nvidia-smi -pl)", 3.0),
    Finding("prefill_interference", "critical", "e", _at(SLOW[0]), _at(SLOW[1]),
            "Long prefills <8192 tok> stall decodes: ITL p99 1.5 s vs 12 ms",
            {"itl_p99_inside_s": 1.5, "itl_p99_outside_s": 0.012, "steps": 40},
            "SELECT ts FROM steps WHERE num_ctx_tokens > 4096 AND 'http://x.example/<script>' != ''",
            "lower --long-prefill-token-threshold to 2048", 120.0),
]


class _Tags(HTMLParser):
    """Every tag with its attributes, and the text inside <style> and <script>."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.code: list[str] = []
        self._in_code = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        self._in_code = tag in ("style", "script")

    def handle_endtag(self, tag: str) -> None:
        self._in_code = False

    def handle_data(self, data: str) -> None:
        if self._in_code:
            self.code.append(data)


class _Svgs(HTMLParser):
    """Each <svg> of a page as its elements: (tag, attributes, text inside)."""

    def __init__(self) -> None:
        super().__init__()
        self.svgs: list[list[tuple[str, dict[str, str], str]]] = []
        self._open: list[int] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "svg":
            self.svgs.append([])
        if self.svgs:
            self._open.append(len(self.svgs[-1]))
            self.svgs[-1].append((tag, {k: v or "" for k, v in attrs}, ""))

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.handle_starttag(tag, attrs)
        self._open.pop()

    def handle_endtag(self, tag: str) -> None:
        if self._open:
            self._open.pop()

    def handle_data(self, data: str) -> None:
        if self._open and self.svgs:
            i = self._open[-1]
            tag, attrs, text = self.svgs[-1][i]
            self.svgs[-1][i] = (tag, attrs, text + data)


def _svgs(page: str) -> list[list[tuple[str, dict[str, str], str]]]:
    parser = _Svgs()
    parser.feed(page)
    return parser.svgs


def _assert_self_contained(page: str) -> None:
    tags = _Tags()
    tags.feed(page)
    names = {name for name, _ in tags.tags}
    assert not names & {"link", "img", "iframe", "object", "embed", "image", "use"}
    for name, attrs in tags.tags:
        assert name != "script" or "src" not in attrs
        for value in attrs.values():
            assert "http:" not in (value or "") and "https:" not in (value or ""), (name, attrs)
    code = "".join(tags.code)
    assert "http" not in code and "@import" not in code and "url(" not in code


def test_the_page_holds_the_findings_escaped_and_loads_nothing(filled: Store) -> None:
    page = render_report(filled, WINDOW, FINDINGS, title="incident <42>", database=filled.database)
    assert "<h1>incident &lt;42&gt;</h1>" in page
    # Ranked: the critical finding is #1, whatever order they came in.
    assert page.index("Long prefills &lt;8192 tok&gt; stall decodes") < page.index("GPUs at their 700 W power cap")
    assert "&#x27;http://x.example/&lt;script&gt;&#x27;" in page and "<script>'" not in page
    assert "lower --long-prefill-token-threshold to 2048" in page
    _assert_self_contained(page)
    assert page.count("<svg") == 8 and "no data in this window" not in page
    assert "GPU 0" in page and "GPU 1" in page
    # Two shaded bands on each of the eight plots.
    assert page.count('fill-opacity="0.16"') == 16


def test_the_time_axis_fits_the_data_and_findings_not_the_asked_hour(filled: Store) -> None:
    asked = Window(_at(T0 + 660 - 3600), _at(T0 + 660), "e")
    late = Finding("kv_pressure", "warning", "e", _at(T0 + 620), _at(T0 + 640), "KV cache 99% full", {})
    everywhere = Finding("scheduler_vs_hardware", "warning", "e", asked.start, asked.end, "slow under load", {})
    page = render_report(filled, asked, [*FINDINGS, late, everywhere], database=filled.database)
    for svg in _svgs(page):
        attrs = svg[0][1]
        # From the first row to the last finding's end; the window-wide finding moves nothing.
        assert float(attrs["data-t0"]) == pytest.approx(T0, abs=0.01)
        assert float(attrs["data-t1"]) == pytest.approx(T0 + 640, abs=0.01)
    # Clock times, with dates where a range crosses midnight (the asked hour does for a run just after 00:00 UTC).
    assert f"showing {_range(T0, T0 + 640)} UTC" in page
    assert f"asked for {_range(asked.start.timestamp(), asked.end.timestamp())} UTC" in page
    # Only the data, without findings: from its first row to its last (a step 0.1 s before T0 + 600).
    bare = _svgs(render_report(filled, asked, [], database=filled.database))[0][0][1]
    assert float(bare["data-t0"]) == pytest.approx(T0, abs=0.01)
    assert float(bare["data-t1"]) == pytest.approx(T0 + 599.95, abs=0.06)


def test_each_gpu_line_has_a_style_of_its_own_and_a_legend(filled: Store) -> None:
    page = render_report(filled, WINDOW, FINDINGS, database=filled.database)
    gpu_plots = [svg for svg in _svgs(page) if svg[0][1]["aria-label"].startswith("GPU")]
    assert len(gpu_plots) == 3
    for svg in gpu_plots:
        lines = [attrs for tag, attrs, _ in svg if tag == "polyline"]
        styles = {(a["stroke"], a.get("stroke-dasharray", "")) for a in lines}
        assert len(styles) == 2, styles
        # The two GPUs may read the same: the one drawn on top is dashed, so the one below shows through.
        assert lines[-1].get("stroke-dasharray"), lines[-1]
        # The legend draws each line's own style beside its name.
        samples = {(a["stroke"], a.get("stroke-dasharray", "")) for tag, a, _ in svg
                   if tag == "line" and "legend" in a.get("class", "")}
        assert samples == styles
        names = [text for tag, a, text in svg if tag == "text" and "legend" in a.get("class", "")]
        assert sorted(names) == ["GPU 0", "GPU 1"]


def _boxes(svg: list[tuple[str, dict[str, str], str]]) -> list[tuple[str, tuple[float, float, float, float]]]:
    """(finding number, box) of every finding marker's label and bar, labels at 7 px a character of 11 px text."""
    out = []
    for tag, attrs, text in svg:
        if tag == "text" and "band" in attrs.get("class", ""):
            x, y = float(attrs["x"]), float(attrs["y"])
            out.append((text.split()[0], (x, y - 10, x + 7 * len(text), y + 2)))
        elif tag == "rect" and "marker" in attrs.get("class", ""):
            x, y, w, h = (float(attrs[k]) for k in ("x", "y", "width", "height"))
            out.append((f"#{attrs['data-finding']}", (x, y, x + w, y + h)))
    return out


def test_finding_markers_stay_apart_when_they_crowd_together(filled: Store) -> None:
    crowd = [Finding("prefill_interference" if k % 2 else "head_of_line_blocking", "warning", "e",
                     _at(SLOW[0] + k // 2), _at(SLOW[1] + k // 2), f"finding {k}", {})
             for k in range(12)]
    page = render_report(filled, WINDOW, crowd, database=filled.database)
    for svg in _svgs(page):
        boxes = _boxes(svg)
        assert {n for n, _ in boxes} == {f"#{k}" for k in range(1, 13)}
        for i, (n, a) in enumerate(boxes):
            for m, b in boxes[i + 1:]:
                apart = a[2] <= b[0] or b[2] <= a[0] or a[3] <= b[1] or b[3] <= a[1]
                assert n == m or apart, (n, a, m, b)
        # Each label names its finding's kind, not only its number.
        assert any(text.startswith("#1 ") and "_" in text for tag, _, text in svg if tag == "text")


def test_a_finding_over_the_whole_window_tints_nothing(filled: Store) -> None:
    everywhere = Finding("scheduler_vs_hardware", "warning", "e", WINDOW.start, WINDOW.end, "slow under load", {})
    page = render_report(filled, WINDOW, [*FINDINGS, everywhere], database=filled.database)
    for svg in _svgs(page):
        tints = [float(a["width"]) for tag, a, _ in svg if tag == "rect" and ("fill-opacity" in a or "tint" in
                                                                             a.get("class", ""))]
        assert len(tints) == 2 and max(tints) < WIDTH / 4, tints  # the two short findings only
        assert [text for tag, a, text in svg if tag == "text" and text.startswith("#3")]


def test_an_empty_store_renders_every_plot_as_no_data(store: Store) -> None:
    page = render_report(store, WINDOW, [], database=store.database)
    assert page.count("no data in this window") == 8 and "No findings in this window." in page
    _assert_self_contained(page)


def test_the_bucket_follows_the_range() -> None:
    assert bucket_seconds(600) == 1.0 and bucket_seconds(1800) == 5.0 and bucket_seconds(60) == 0.1
    assert 300 <= 86400 / bucket_seconds(86400) <= 600


def _png_pixels(data: bytes) -> tuple[int, int, int, bytes]:
    """Width, height, bytes per pixel and the unfiltered pixel rows of an 8-bit RGB(A) PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, bytearray(), b""
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        header = body if kind == b"IHDR" else header
        idat += body if kind == b"IDAT" else b""
        pos += 12 + length
    width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", header)
    assert depth == 8 and color in (2, 6) and interlace == 0
    bpp = 3 if color == 2 else 4
    raw, stride = zlib.decompress(bytes(idat)), width * bpp
    out, prev = bytearray(), bytearray(stride)
    for y in range(height):
        kind, row = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        if kind == 2:
            row = bytearray((a + b) & 255 for a, b in zip(row, prev, strict=True))
        elif kind:
            for x in range(stride):
                left = row[x - bpp] if x >= bpp else 0
                up, corner = prev[x], prev[x - bpp] if x >= bpp else 0
                if kind == 1:
                    row[x] = (row[x] + left) & 255
                elif kind == 3:
                    row[x] = (row[x] + (left + up) // 2) & 255
                else:
                    p = left + up - corner
                    pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                    row[x] = (row[x] + (left if pa <= pb and pa <= pc else up if pb <= pc else corner)) & 255
        out += row
        prev = row
    return width, height, bpp, bytes(out)


@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium is not on PATH (.ci/run installs it)")
def test_chromium_draws_the_report(filled: Store, tmp_path: Path) -> None:
    html = write_report(filled, WINDOW, FINDINGS, tmp_path / "incident.html", database=filled.database)
    png = tmp_path / "incident.png"
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(
            ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}", f"--screenshot={png}", "--window-size=1400,3000",
             "--hide-scrollbars", f"file://{html}"],
            check=True, timeout=60, capture_output=True,
        )
    assert png.exists() and png.stat().st_size > 10_000
    width, height, bpp, pixels = _png_pixels(png.read_bytes())
    assert (width, height) == (1400, 3000)
    # The plots start below the findings: their region must hold lines, bands and text in many colours.
    region = pixels[600 * width * bpp:2400 * width * bpp]
    colours = {region[i:i + 3] for i in range(0, len(region), bpp * 7)}
    non_white = sum(1 for i in range(0, len(region), bpp * 7) if region[i:i + 3] != b"\xff\xff\xff")
    assert len(colours) > 50 and non_white > 5_000, (len(colours), non_white)


class _Text(HTMLParser):
    """The text a reader sees: everything but <style>, <script> and the plots' SVG."""

    def __init__(self) -> None:
        super().__init__()
        self.text: list[str] = []
        self._hidden = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._hidden += tag in ("style", "script", "svg")

    def handle_endtag(self, tag: str) -> None:
        self._hidden -= tag in ("style", "script", "svg")

    def handle_data(self, data: str) -> None:
        if not self._hidden:
            self.text.append(data)


@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium is not on PATH (.ci/run installs it)")
def test_chromium_shows_the_evidence_as_diagnose_prints_it(filled: Store, tmp_path: Path) -> None:
    from tests.diagnosis.test_evidence import EVIDENCE

    merged = replace(FINDINGS[1], evidence={**FINDINGS[1].evidence, **EVIDENCE})
    html = write_report(filled, WINDOW, [FINDINGS[0], merged], tmp_path / "incident.html", database=filled.database)
    with tempfile.TemporaryDirectory() as profile:
        dom = subprocess.run(
            ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}", "--dump-dom", f"file://{html}"],
            check=True, timeout=60, capture_output=True, text=True,
        ).stdout
    parser = _Text()
    parser.feed(dom)
    text = " ".join(" ".join(parser.text).split())
    assert "Findings" in text and "burst-000646" in text, text[:500]
    # No Python reprs, no 16-digit floats: named lines, rounded, with units.
    assert "{'" not in text and "0.1163412086196646" not in text and "[{" not in text
    for line in ("itl_p99_inside_s: 1.4 s", "step_p50_inside_ms: 1,151 ms", "own_steps_share: 97.7%",
                 "power_w: 700 W", "sm_clock_mhz: 1,410 MHz"):
        assert line in text, line
    # The folded finding under its cause, on lines of its own; whatif as value [low-high].
    assert "also head_of_line_blocking warning · 131 requests queued" in text
    assert "queue_max_s: 49.6 s" in text
    assert "lever: long_prefill_token_threshold=512" in text and "ttft_p50_s: 116 ms [92.7-784]" in text
    assert "decode_p50 1k-8k: 9.96 tok/s [8.47-11.9]" in text


def test_the_command_diagnoses_and_writes_the_page(filled: Store, store_url: str, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "incident.html"
    assert run(parser.parse_args(["--since", "15m", "--engine", "e", "--out", str(out), "--store", store_url])) == 0
    printed = capsys.readouterr().out
    count = int(printed.split(": ")[1].split()[0])
    assert printed.startswith(f"{out}: ") and count >= 1  # the real detectors find the slow prefill stretch
    assert "prefill" in out.read_text(encoding="utf-8")
