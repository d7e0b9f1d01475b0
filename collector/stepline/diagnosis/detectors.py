"""Run every detector over a window, rank what they find, and render it for a terminal or as JSON."""

from __future__ import annotations

import json
import logging
import textwrap
from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta

from stepline.core.oneline import one_line
from stepline.diagnosis import gateway, hardware, health, load, prefill, slots, throttling
from stepline.diagnosis.causes import merge
from stepline.diagnosis.common import Detector, Memo, hms
from stepline.diagnosis.evidence import WHATIF_FIRST, evidence_of
from stepline.diagnosis.findings import Finding, Window
from stepline.queries.query import Query
from stepline.queries.window import ENGINES, IN_WINDOW
from stepline.store.reads import Reads

log = logging.getLogger(__name__)

# In priority order; adding a detector is one function and one line here.
DETECTORS: tuple[tuple[str, Detector], ...] = (
    ("prefill_interference", prefill.prefill_interference),
    ("head_of_line_blocking", prefill.head_of_line_blocking),
    ("overload", load.overload),
    ("gpu_throttling", throttling.gpu_throttling),
    ("scheduler_vs_hardware", hardware.scheduler_vs_hardware),
    ("prefix_cache_collapse", health.prefix_cache_collapse),
    ("kv_pressure", health.kv_pressure),
    ("wedged_engine", health.wedged_engine),
    ("leaked_slots", slots.leaked_slots),
    ("config_not_in_effect", prefill.config_not_in_effect),
    ("gpu_xid", hardware.gpu_xid),
    ("spec_decode_acceptance_shift", health.spec_decode_acceptance_shift),
    ("lane_leak", gateway.lane_leak),
    ("gateway_fail_open", gateway.gateway_fail_open),
    ("gateway_slot_leak", gateway.gateway_slot_leak),
    ("orphaned_engine_work", gateway.orphaned_engine_work),
)


# The detectors whose figures are made of step durations: their findings say which reading of a step's duration
# they rest on (the `steps` table's step_time: vLLM's elapsed_ms, or the cadence of a batch-queued engine core's
# step ends, sources/step_time.py).
STEP_TIME_READERS = frozenset({"prefill_interference", "head_of_line_blocking", "overload", "gpu_throttling",
                               "scheduler_vs_hardware", "wedged_engine"})
STEP_TIME_SAYS = {  # in the order they are said
    "elapsed": "vLLM's elapsed_ms (a synchronous engine core: the step's wall time)",
    "cadence": "time between the engine core's step ends (it steps through its batch queue, async scheduling or "
               "pipeline parallelism: vLLM's elapsed_ms is only its wait for a launched step)",
    "wait": "vLLM's elapsed_ms of a batch-queued core, where no earlier step end bounds the step (after idle)",
    "": "vLLM's elapsed_ms (stored before stepline recorded the reading)",
}
_STEP_TIMES = (f"SELECT engine, groupUniqArray(step_time) AS readings FROM steps WHERE {ENGINES} AND {IN_WINDOW} "
               "AND NOT isNaN(elapsed_ms) GROUP BY engine")


def step_time_used(reader: Reads, window: Window, engines: Sequence[str]) -> dict[str, str]:
    """engine -> which readings of a step's duration its steps in the window rest on, in words."""
    if not engines:
        return {}
    rows = Query(_STEP_TIMES, engines=sorted(engines), start=window.start, end=window.end).rows(reader)
    order = list(STEP_TIME_SAYS)
    return {str(r.engine): "; ".join(STEP_TIME_SAYS.get(str(how), str(how))
                                   for how in sorted(r.readings, key=lambda h: order.index(h) if h in order else 9))
            for r in rows}


def _say_step_time(reader: Reads, window: Window, found: list[Finding]) -> list[Finding]:
    readers = [f for f in found if f.kind in STEP_TIME_READERS and f.engine]
    used = step_time_used(reader, window, sorted({f.engine for f in readers}))
    return [replace(f, evidence={**f.evidence, "step_time": used[f.engine]})
            if f.kind in STEP_TIME_READERS and f.engine in used else f for f in found]


def diagnose(reader: Reads, window: Window,
             detectors: Sequence[tuple[str, Detector]] = DETECTORS) -> list[Finding]:
    """Every detector's findings, each cause once with its symptoms (causes.merge), ranked; a detector that fails
    is logged and reported, never fatal. Findings made of step durations say which reading they rest on."""
    found: list[Finding] = []
    reader = Memo(reader)
    for name, detect in detectors:
        try:
            found.extend(detect(reader, window))
        except Exception as exc:  # one broken detector must not hide what the others see
            log.warning("detector %s failed: %s", name, exc, exc_info=True)
            found.append(Finding("detector_failed", "info", window.engine, window.start, window.end,
                                 f"detector {name} failed: {one_line(exc)}"[:76],
                                 {"detector": name, "error": one_line(exc, 500)}))
    return merge(_say_step_time(reader, window, found))


def as_json(findings: Sequence[Finding]) -> str:
    """The findings as a JSON array, ranked."""
    return json.dumps([f.as_json() for f in findings], indent=2, sort_keys=True, default=str)


def render(findings: Sequence[Finding], width: int = 80, max_evidence: int = 8) -> str:
    """One block per finding, readable in `width` columns: its figures (evidence.py: the report prints the same
    lines), each finding folded under it, what whatif would buy, the lever and the SQL."""
    if not findings:
        return "no findings: nothing looks wrong in this window"
    blocks = []
    for i, f in enumerate(findings, 1):
        lines = [f"{i}. {f.severity.upper()}  {f.kind}  {f.engine or '(all engines)'}  "
                 f"{hms(f.start)}..{hms(f.end)} UTC",
                 *textwrap.wrap(f.title, width, initial_indent="   ", subsequent_indent="   ")]
        said = evidence_of(f.evidence)
        for line in said.lines[:max_evidence]:
            lines.extend(textwrap.wrap(f"{line.name}: {line.text}", width, initial_indent="   - ",
                                       subsequent_indent="       "))
        for folded in said.folded:
            lines.extend(textwrap.wrap(f"also {folded.kind}: {folded.title}", width,
                                       initial_indent="   + ", subsequent_indent="       "))
        for line in [w for w in said.whatif if w.name in WHATIF_FIRST]:  # the lever line names the lever, the gain
            lines.extend(textwrap.wrap(f"whatif {line.name}: {line.text}", width, initial_indent="   ~ ",
                                       subsequent_indent="       "))
        if f.lever:
            lines.extend(textwrap.wrap(f"lever: {f.lever}", width, initial_indent="   ", subsequent_indent="     "))
        if f.sql:
            lines.append("   sql:")
            lines.extend("     " + line for line in f.sql.splitlines() if line.strip())
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def summary_for_demo(reader: Reads, engine: str, since: float, width: int = 80) -> str:
    """The top finding for one engine since `since` (epoch seconds) in full but its SQL, the rest a line each."""
    window = Window(datetime.fromtimestamp(since, UTC), datetime.now(UTC) + timedelta(seconds=1), engine)
    findings = diagnose(reader, window)
    if not findings:
        return render(findings)
    top = render([replace(findings[0], sql="")], width)
    rest = [textwrap.shorten(f"{i}. {f.severity.upper()}  {f.kind}: {f.title}", width - 1, placeholder="…")
            for i, f in enumerate(findings[1:], 2)]
    return "\n".join([top, *rest, "(evidence and SQL for each: stepline diagnose --since 1h)"])
