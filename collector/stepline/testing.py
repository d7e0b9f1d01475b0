"""Test doubles shipped next to what they stand for: an in-memory sink that can be told to fail."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any


class MemorySink:
    """Keeps inserted batches per table; `failing` makes inserts raise like an unreachable store."""

    def __init__(self) -> None:
        self.batches: dict[str, list[list[Sequence[Any]]]] = {}
        self.failing = False
        self.attempts = 0
        self._lock = threading.Lock()

    def insert(self, table: str, rows: Sequence[Sequence[Any]], column_names: Sequence[str]) -> None:
        with self._lock:
            self.attempts += 1
            if self.failing:
                raise ConnectionError("store unreachable (MemorySink.failing)")
            self.batches.setdefault(table, []).append(list(rows))

    def rows(self, table: str) -> list[Any]:
        with self._lock:
            return [row for batch in self.batches.get(table, []) for row in batch]


def wait_until(predicate: Callable[[], object], timeout_s: float = 10.0, poll_s: float = 0.01) -> None:
    """Poll `predicate` until it is truthy; fail the test with AssertionError after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(poll_s)
    raise AssertionError(f"condition not met within {timeout_s} s")
