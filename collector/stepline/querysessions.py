"""The query endpoint's read-only chDB sessions: pooled by settings, one query at a time each."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Mapping
from typing import Any

import clickhouse_connect
from clickhouse_connect.driver.client import Client
from clickhouse_connect.driver.exceptions import DatabaseError

from stepline.chhttp import SqlRefused

Settings = tuple[tuple[str, str], ...]

_PLACEHOLDER = re.compile(r"\{\w+:[^}]+\}")
_SESSION_WAIT_S = 30.0


class _Verbatim:
    """A bind value clickhouse-connect passes on as is: HTTP `param_` values are already ClickHouse escaped text."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __str__(self) -> str:
        return self.text


def _bindings(sql: str, params: Mapping[str, str]) -> dict[str, Any] | None:
    # Without a {name:Type} placeholder clickhouse-connect would %-format the query client-side instead.
    if not params or not _PLACEHOLDER.search(sql):
        return None
    return {k: _Verbatim(v) for k, v in params.items() if not (k.startswith("$") and k.endswith("$"))}


class Sessions:
    """Read-only chDB sessions on the store's path, pooled by settings; each runs one query at a time.

    A session applies its settings, then readonly=1, when it opens: nothing it runs later (a query's own SETTINGS,
    a second statement) can change a setting or write. Per-call settings would not do: clickhouse-connect's chDB
    backend applies them with SET and restores them after, and readonly=1 would make them stick.
    """

    def __init__(self, path: str, max_sessions: int) -> None:
        self._path = path
        self._max = max_sessions
        self._idle: dict[Settings, list[Client]] = {}
        self._count = 0
        self._closed = False
        self._cond = threading.Condition()

    def run(self, settings: Settings, database: str, sql: str, params: Mapping[str, str]) -> bytes:
        session = self._acquire(settings)
        keep = False
        try:
            session.database = database
            data = session.raw_query(sql, parameters=_bindings(sql, params))
            keep = True
            return data
        except DatabaseError:
            keep = True  # an engine error leaves the session usable
            raise
        finally:
            self._release(settings, session, keep)

    def _acquire(self, key: Settings) -> Client:
        deadline = time.monotonic() + _SESSION_WAIT_S
        with self._cond:
            while True:
                if self._closed:
                    raise SqlRefused("the query endpoint is stopping", 202, "TOO_MANY_SIMULTANEOUS_QUERIES")
                if self._idle.get(key):
                    return self._idle[key].pop()
                spare = next((k for k, v in self._idle.items() if v), None)
                if self._count >= self._max and spare is not None:
                    self._idle[spare].pop().close()  # idle, so closing it cannot block
                    self._count -= 1
                if self._count < self._max:
                    self._count += 1
                    break
                if not self._cond.wait(max(0.0, deadline - time.monotonic())):
                    raise SqlRefused(f"all {self._max} query sessions are busy", 202, "TOO_MANY_SIMULTANEOUS_QUERIES")
        try:  # readonly last: every SET before it is still allowed, none after it is
            settings = {**dict(key), "readonly": 1}
            return clickhouse_connect.get_client(interface="chdb", path=self._path, settings=settings)
        except BaseException:
            self._release(key, None, keep=False)
            raise

    def _release(self, key: Settings, session: Client | None, keep: bool) -> None:
        with self._cond:
            self._cond.notify()
            if keep and session is not None and not self._closed:
                self._idle.setdefault(key, []).append(session)
                return
            self._count -= 1
        if session is not None:
            session.close()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            idle = [s for sessions in self._idle.values() for s in sessions]
            self._idle.clear()
            self._count -= len(idle)
            self._cond.notify_all()
        for session in idle:
            session.close()
