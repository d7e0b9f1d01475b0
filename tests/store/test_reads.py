"""Reads: what every reader of the timeline needs from a store, met by the Store and by a bare clickhouse-connect
client alike."""

from __future__ import annotations

from typing import Any

from stepline.store.reads import Reads
from stepline.store.store import Store


def _count(reader: Reads) -> int:
    """A reader as the diagnosis and whatif modules use one."""
    result: Any = reader.query("SELECT count() FROM numbers({n:UInt32})", parameters={"n": 7})
    return int(result.result_rows[0][0])


def test_the_store_and_its_client_answer_the_same_query(store: Store) -> None:
    assert _count(store) == 7
    assert _count(store.client) == 7
