"""Why the store cannot be used, each as one line a person can act on."""

from __future__ import annotations

import re

from stepline.core.oneline import one_line
from stepline.store.discovery import RunningCollector


class StoreError(RuntimeError):
    """The store cannot be used; the message is one line naming the problem."""


class StoreUnreachable(StoreError):
    """The store's server does not answer (refused, timed out, name unknown): it may later."""


class StoreLocked(StoreError):
    """Another process holds the embedded store; `holder` is what it announced beside the store, if anything."""

    def __init__(self, message: str, holder: RunningCollector | None) -> None:
        super().__init__(message)
        self.holder = holder


def error_line(exc: BaseException) -> str:
    """A ClickHouse or transport error as one line of at most 300 characters."""
    text = one_line(exc)
    # Transport errors nest the cause deep inside retry wrappers: the errno text is what a person needs.
    errno_text = re.search(r"\[Errno -?\d+\] ([^'\")]+)", text)
    if errno_text:
        return errno_text.group(1).strip()
    return text[:300]
