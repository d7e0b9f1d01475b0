"""Any text (an exception, a message) as one line: what logs, labels, events and error answers carry."""

from __future__ import annotations


def one_line(text: object, limit: int | None = None) -> str:
    """`str(text)` with each run of whitespace (newlines included) made one space, cut at `limit` characters."""
    line = " ".join(str(text).split())
    return line if limit is None else line[:limit]
