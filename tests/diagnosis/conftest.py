"""One store per detector test module, each test's timeline on an engine and host of its own (test_detectors' row
helpers)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from stepline.diagnosis.findings import Window
from stepline.model.rows import EngineSample
from stepline.store.store import Store
from tests.diagnosis.test_detectors import WINDOW, insert


class Timelines:
    """A store that holds many timelines side by side: `add` puts one on an engine of its own, on a host of its own
    (a GPU is its host's and index's: two timelines on one host would share GPU samples)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def add(self, engine: str, rows: Sequence[Any]) -> Window:
        """`rows` (test_detectors' steps, requests, GPU samples and events, and scraped engine samples) as
        `engine`'s; its diagnosis window."""
        placed = [row._replace(engine=engine, host=engine) for row in rows]
        insert(self.store, [row for row in placed if not isinstance(row, EngineSample)])
        scraped = [row for row in placed if isinstance(row, EngineSample)]
        if scraped:
            self.store.insert("engine_samples", scraped, EngineSample._fields)
        return Window(WINDOW.start, WINDOW.end, engine)


@pytest.fixture(scope="module")
def timelines(chdb_dir: Path) -> Iterator[Timelines]:
    store = Store.open(f"chdb://{chdb_dir}?database=diag_{uuid.uuid4().hex[:10]}")
    store.ensure_schema(30)
    yield Timelines(store)
    store.client.command(f"DROP DATABASE IF EXISTS `{store.database}`")
    store.close()
