"""Test doubles shipped next to what they stand for: an in-memory sink that can be told to fail."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from stepline.model.rows import TABLE_OF
from stepline.store.batches import decode


class MemorySink:
    """Keeps inserted batches per table; `failing` makes inserts raise like an unreachable store.

    Like ClickHouse with a deduplication window, a batch whose token was seen before is not kept again.
    """

    def __init__(self) -> None:
        self.batches: dict[str, list[list[Sequence[Any]]]] = {}
        self.tokens: list[str | None] = []
        self.failing = False
        self.attempts = 0
        self._seen: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def insert_native(self, table: str, column_names: Sequence[str], data: bytes,
                      dedup_token: str | None = None) -> None:
        _, rows = decode(data)
        self.insert(table, rows, column_names, dedup_token)

    def insert(self, table: str, rows: Sequence[Sequence[Any]], column_names: Sequence[str],
               dedup_token: str | None = None) -> None:
        with self._lock:
            self.attempts += 1
            if self.failing:
                raise ConnectionError("store unreachable (MemorySink.failing)")
            self.tokens.append(dedup_token)
            if dedup_token is not None:
                if (table, dedup_token) in self._seen:
                    return
                self._seen.add((table, dedup_token))
            self.batches.setdefault(table, []).append(list(rows))

    def rows(self, table: str) -> list[Any]:
        """The table's rows in insert order, as its typed row (the spool hands the store plain tuples)."""
        row_type = next(t for t, name in TABLE_OF.items() if name == table)
        with self._lock:
            return [row_type(*row) for batch in self.batches.get(table, []) for row in batch]


def wait_until(predicate: Callable[[], object], timeout_s: float = 10.0, poll_s: float = 0.01) -> None:
    """Poll `predicate` until it is truthy; fail the test with AssertionError after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(poll_s)
    raise AssertionError(f"condition not met within {timeout_s} s")
