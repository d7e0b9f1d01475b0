"""Native batches: the writer's fast form of steps and requests is byte for byte clickhouse-connect's, and a value
that does not fit still costs only its own row."""

from __future__ import annotations

import math
import random
import time
from array import array
from collections.abc import Sequence
from typing import Any

import pytest

from stepline.model import schema
from stepline.model.rows import Request, Step
from stepline.store import batches
from stepline.store.store import Store

NOW_US = int(time.time()) * 1_000_000  # within the store's retention


def _steps(n: int, seed: int = 1) -> list[Step]:
    rng = random.Random(seed)
    return [Step(NOW_US - i * 25_000, "hôst", f"engine-{i % 3}", i % 2, "m" * (i % 200), i,
                 rng.random() * 40, 1, rng.choice((0, 8192)), rng.randrange(64), rng.randrange(64), 64, i % 9,
                 i % 2, rng.random(), rng.randrange(100), rng.randrange(100), i % 3, 0, 0, 0,
                 [rng.random() for _ in range(i % 3)], [rng.random() for _ in range(rng.randrange(70))],
                 i % 7 == 0) for i in range(n)]


def _requests(n: int, seed: int = 2) -> list[Request]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        q, p, d, inf, e2e, ttft, tpot = (rng.random() if i % 5 else math.nan for _ in range(7))
        out.append(Request(NOW_US - i, "h", "e", i % 4, "モデル", f"cmpl-{rng.getrandbits(64):x}-0",
                           ("plugin", "otlp")[i % 2], ("stop", "", "length")[i % 3], NOW_US - i - 5, q, p, d, inf,
                           e2e, ttft, tpot, rng.randrange(2**32), rng.randrange(1000), rng.randrange(5000), 0,
                           2**32 - 1 if i == 3 else 0))
    return out


@pytest.mark.parametrize(("table", "rows"), [("steps", _steps(300)), ("requests", _requests(300)),
                                             ("steps", _steps(1)), ("requests", _requests(1))])
def test_the_fast_form_is_what_clickhouse_connect_writes(table: str, rows: list[Any]) -> None:
    assert batches._plain_columns(table) is not None  # the hot tables take the fast form
    assert batches.encode(table, rows) == batches._encode_general(table, rows)


def test_samples_as_the_wire_carried_them_are_written_as_they_are() -> None:
    def wire(values: Sequence[float]) -> array[float]:
        return array("f", values)

    rows = [s._replace(ttft_seconds=wire(s.ttft_seconds), itl_seconds=wire(s.itl_seconds)) for s in _steps(300)]
    assert batches.encode("steps", rows) == batches._encode_general("steps", rows)
    mixed = rows[:150] + _steps(150)  # some from the wire, some not
    assert batches.encode("steps", mixed) == batches._encode_general("steps", mixed)


def test_tables_with_other_types_take_the_general_encoder() -> None:
    assert batches._plain_columns("events") is None  # a Map column


@pytest.mark.parametrize("bad", [
    {"num_ctx_tokens": -1},  # UInt32 below 0
    {"num_ctx_tokens": 2**32},  # and above its range
    {"engine": None},  # text that is not
    {"itl_seconds": [0.1, "x"]},  # a sample that is not a number
])
def test_a_value_that_does_not_fit_costs_its_row_only(bad: dict[str, Any]) -> None:
    rows = _steps(40)
    rows[17] = rows[17]._replace(**bad)
    with pytest.raises(batches.EncodeError):
        batches.encode("steps", rows)
    data, kept, error = batches.encode_valid("steps", rows)
    assert kept == 39 and error
    names, decoded = batches.decode(data)
    assert [row[names.index("step")] for row in decoded] == [n for n in range(40) if n != 17]


def test_the_store_reads_back_what_the_fast_form_wrote(store: Store) -> None:
    for table, rows in (("steps", _steps(200)), ("requests", _requests(200))):
        names = list(schema.TABLE_BY_NAME[table].column_names)
        store.insert_native(table, names, batches.encode(table, rows))
        assert store.query(f"SELECT count() FROM {table}").result_rows[0][0] == 200
    itl = store.query("SELECT sum(length(itl_seconds)), max(num_ctx_tokens) FROM steps").result_rows[0]
    assert itl == (sum(len(s.itl_seconds) for s in _steps(200)), max(s.num_ctx_tokens for s in _steps(200)))
