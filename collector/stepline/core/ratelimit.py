"""Rate-limited logging: a drop or an error is always counted, but logged at most once per interval."""

from __future__ import annotations

import logging
import threading
import time


class RateLimitedLog:
    """Logs a keyed message at most once per interval, saying how many were suppressed meanwhile."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._lock = threading.Lock()

    def mark(self, key: str) -> None:
        """Count `key` as logged now (by someone else): the next warning for it waits out the interval."""
        with self._lock:
            self._last[key] = time.monotonic()

    def warning(self, key: str, message: str, *args: object) -> bool:
        """Log unless `key` was logged within the interval; returns whether it logged."""
        now = time.monotonic()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self._interval_s:
                self._suppressed[key] = self._suppressed.get(key, 0) + 1
                return False
            self._last[key] = now
            suppressed = self._suppressed.pop(key, 0)
        if suppressed:
            message += f" ({suppressed} similar messages suppressed)"
        self._logger.warning(message, *args)
        return True
