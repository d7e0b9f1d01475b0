"""Running a shared query fragment against the test's store, its parameters bound as the detectors bind them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from stepline.queries.query import Query
from stepline.store.store import Store

Rows = Callable[..., list[tuple[Any, ...]]]


@pytest.fixture
def rows(store: Store) -> Rows:
    """`rows(sql, settings=None, **parameters)`: the result rows, bound by `Query` (a moment as its epoch
    microseconds), in a UTC session so that nothing else depends on the machine's zone."""

    def run(sql: str, settings: dict[str, Any] | None = None, **parameters: Any) -> list[tuple[Any, ...]]:
        query = Query(sql, **parameters)
        result = store.client.query(query.sql, parameters=query.bound(),
                                    settings={**(settings or {}), "session_timezone": "UTC"})
        return [tuple(r) for r in result.result_rows]

    return run
