"""Durations as people type them on a command line: 90s, 30m, 2h, 1d."""

from __future__ import annotations

import math

from stepline.core.usageerror import UsageError


def parse_duration(text: str) -> float:
    """'90s', '30m', '2h', '1d' (or plain seconds) in seconds; UsageError naming the text otherwise."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    value, unit = (text[:-1], text[-1]) if text and text[-1] in units else (text, "s")
    try:
        seconds = float(value) * units[unit]
    except ValueError:
        raise UsageError(f"duration {text!r} is not like 90s, 30m, 2h or 1d") from None
    if not 0 < seconds < math.inf:  # nan and inf too: the duration becomes a bound Int64 of microseconds
        raise UsageError(f"duration {text!r} must be positive and finite")
    return seconds
