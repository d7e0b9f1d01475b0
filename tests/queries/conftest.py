"""Running a shared query fragment against the test's store, its bounds bound the way the columns hold them."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest

from stepline.store.store import Store

Rows = Callable[..., list[tuple[Any, ...]]]


@pytest.fixture
def rows(store: Store) -> Rows:
    """`rows(sql, settings=None, **parameters)`: the result rows; a datetime binds as UTC text read in a UTC session,
    so that the test does not depend on the machine's zone."""

    def run(sql: str, settings: dict[str, Any] | None = None, **parameters: Any) -> list[tuple[Any, ...]]:
        bound = {k: f"{v.astimezone(UTC):%Y-%m-%d %H:%M:%S.%f}" if isinstance(v, datetime) else v
                 for k, v in parameters.items()}
        result = store.client.query(sql, parameters=bound, settings={**(settings or {}), "session_timezone": "UTC"})
        return [tuple(r) for r in result.result_rows]

    return run
