"""One row per request, whichever of the plugin and OTLP reports it first."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable


class RecentRequests:
    """Remembers the (engine, request id) pairs seen within a window, bounded in count.

    The plugin reports a request when its last step ends; OTLP exporters batch spans for a few
    seconds. A ten-minute window covers that gap with room to spare; past it (or past
    `max_entries`) the oldest are forgotten, so memory stays bounded whatever the traffic.
    """

    WINDOW_S = 600.0

    def __init__(self, window_s: float = WINDOW_S, max_entries: int = 500_000,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self._window_s = window_s
        self._max_entries = max_entries
        self._monotonic = monotonic
        self._seen: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._oldest_at = monotonic()  # when the oldest entry was seen: nothing to forget before window_s after it
        self._lock = threading.Lock()

    def first_time(self, engine: str, request_id: str) -> bool:
        """True the first time a request is seen (and remember it); False for a repeat."""
        key = (engine, request_id)
        with self._lock:
            seen = self._seen
            if key in seen:
                return False
            now = self._monotonic()
            seen[key] = now
            if len(seen) > self._max_entries or now - self._oldest_at > self._window_s:
                self._forget(now)
            return True

    def _forget(self, now: float) -> None:
        """Under the lock: drop entries past the window or beyond the bound, oldest first."""
        seen = self._seen
        while seen:
            oldest_key, at = next(iter(seen.items()))
            if now - at <= self._window_s and len(seen) <= self._max_entries:
                self._oldest_at = at
                return
            del seen[oldest_key]
        self._oldest_at = now

    def __len__(self) -> int:
        return len(self._seen)
