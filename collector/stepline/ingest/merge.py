"""One row per request with every field the plugin and OTLP know: which reports are worth writing.

The store merges the reports of a request field by field (`requests` is an AggregatingMergeTree whose columns
keep each field's largest value, see stepline.model.schema), whatever their order, however late the second comes
(a collector restart, a replayed spool) and however often one is written. That alone makes the stored request
right. What this module adds is economy: a report that carries no field the request's earlier reports left
unknown (the span of a request the plugin already gave, a retry) is not written at all, so that most requests
are one row from the start and the merged read (stepline.queries.requests) has little to merge.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from stepline.model.rows import Request

# The fields that merge: all but the key (host, engine, request_id) and the times, which both reports carry.
_MERGED = tuple(i for i, name in enumerate(Request._fields)
                if name not in ("ts", "host", "engine", "request_id", "arrival_ts"))
_SOURCE = Request._fields.index("source")


def known_fields(request: Request) -> int:
    """A bit per merged field this report gives a value: text not empty, a count not 0, seconds not NaN.

    These are exactly the values that can raise the store's per-field maximum over what a report that lacks
    them wrote; `source` counts only as 'plugin', the value that outranks 'otlp'.
    """
    mask = 0
    for bit, i in enumerate(_MERGED):
        value = request[i]
        if i == _SOURCE:
            known = value == "plugin"
        elif isinstance(value, float):
            known = not math.isnan(value)
        else:
            known = bool(value)
        if known:
            mask |= 1 << bit
    return mask


class RecentRequests:
    """Remembers, per (engine, request id) seen within a window, which fields its reports gave; bounded in count.

    The plugin reports a request when its last step ends; OTLP exporters batch spans for a few seconds. A
    ten-minute window covers that gap with room to spare; past it (or past `max_entries`) the oldest are
    forgotten, so memory stays bounded whatever the traffic. A report of a forgotten request is written: the
    store merges it with what it has, so forgetting costs a row, never a field.
    """

    WINDOW_S = 600.0

    def __init__(self, window_s: float = WINDOW_S, max_entries: int = 500_000,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self._window_s = window_s
        self.max_entries = max_entries
        self._monotonic = monotonic
        self._seen: OrderedDict[tuple[str, str], tuple[float, int]] = OrderedDict()
        self._oldest_at = monotonic()  # when the oldest entry was seen: nothing to forget before window_s after it
        self._lock = threading.Lock()

    def adds_fields(self, request: Request) -> bool:
        """Whether this report gives a field no earlier report of its request did (and remember what it gives).

        False for a report with nothing new: a repeat, or the span of a request the plugin reported."""
        key = (request.engine, request.request_id)
        mask = known_fields(request)
        with self._lock:
            seen = self._seen
            entry = seen.get(key)
            if entry is not None:
                if not mask & ~entry[1]:
                    return False
                seen[key] = (entry[0], entry[1] | mask)  # keeps its place: forgotten when its first report would be
                return True
            now = self._monotonic()
            seen[key] = (now, mask)
            if len(seen) > self.max_entries or now - self._oldest_at > self._window_s:
                self._forget(now)
            return True

    def _forget(self, now: float) -> None:
        """Under the lock: drop entries past the window or beyond the bound, oldest first."""
        seen = self._seen
        while seen:
            oldest_key, (at, _) = next(iter(seen.items()))
            if now - at <= self._window_s and len(seen) <= self.max_entries:
                self._oldest_at = at
                return
            del seen[oldest_key]
        self._oldest_at = now

    def __len__(self) -> int:
        return len(self._seen)
