"""The window a command line names: the last --since, or --from to --to (diagnose, report, whatif, replay)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from stepline.analysis.timeline import parse_moment
from stepline.core.timeparse import parse_duration
from stepline.core.usageerror import UsageError
from stepline.diagnosis.findings import Window


def window_from(since: str, from_: str | None, to: str | None, engine: str = "",
                now: datetime | None = None) -> Window:
    """From --from (else --since before the end) to --to (else now); UsageError when it does not run forward."""
    now = now or datetime.now(UTC)
    end = parse_moment(to, now) if to else now
    start = parse_moment(from_, now) if from_ else end - timedelta(seconds=parse_duration(since))
    if start >= end:
        raise UsageError(f"the window start {start:%Y-%m-%d %H:%M:%S} is not before its end {end:%H:%M:%S}")
    return Window(start, end, engine)


def describe(window: Window) -> str:
    """The window in one phrase, e.g. "2026-01-01 00:00:00..01:00:00 UTC on engine e0"."""
    on = f" on engine {window.engine}" if window.engine else ""
    return f"{window.start:%Y-%m-%d %H:%M:%S}..{window.end:%H:%M:%S} UTC{on}"
