"""Typed rows: one type per timeline table, fields in its column order, the one seconds-to-microseconds conversion,
and fields added later defaulted at the end so that older writers' rows still build."""

from __future__ import annotations

import math

from stepline.model import schema
from stepline.model.rows import TABLE_OF, Event, GatewayDecision, Row, Step, micros
from stepline.store.store import Store


def test_typed_rows_match_their_tables_column_for_column() -> None:
    for row_type, table in TABLE_OF.items():
        assert row_type._fields == schema.TABLE_BY_NAME[table].column_names, table
    assert set(TABLE_OF.values()) == {t.name for t in schema.TABLES}  # every table has its row type


def test_micros_rounds_seconds_to_the_stores_integer() -> None:
    assert micros(1.5) == 1_500_000 and micros(1_700_000_000.0000015) == 1_700_000_000_000_002
    assert micros(-0.25) == -250_000


def test_fields_added_later_come_last_with_defaults() -> None:
    step = Step(0, "h", "e", 0, "m", 1, 1.0, 0, 0, 1, 1, 1, 0, 0, 0.1, 0, 0, 0, 0, 0, 0, [], [], False)
    assert math.isnan(step.vllm_elapsed_ms) and step.step_time == ""
    defaults = [f for f in GatewayDecision._fields if f in GatewayDecision._field_defaults]
    assert defaults == list(GatewayDecision._fields[-len(defaults):])


def test_a_row_inserts_as_its_table_and_reads_back(store: Store) -> None:
    row: Row = Event(micros(1_800_000_000.25), "h", "vllm-0", "test", "engine_down", "critical", "gone", {"k": "v"})
    store.insert(TABLE_OF[Event], [row], Event._fields)
    back = store.query("SELECT toUnixTimestamp64Micro(ts), kind, attributes FROM events").result_rows
    assert back == [(1_800_000_000_250_000, "engine_down", {"k": "v"})]
