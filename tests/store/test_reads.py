"""Reads: what every reader of the timeline needs from a store, met by the Store and by a bare clickhouse-connect
client alike; what either answers keeps its column names on the way to every reader (stepline.queries.rows, which
stepline.store.reads re-exports)."""

from __future__ import annotations

import pytest

from stepline.queries import rows as queries_rows
from stepline.store import reads
from stepline.store.reads import Reads, first_or_none, named, only, scalar
from stepline.store.store import Store


def _count(reader: Reads) -> int:
    """A reader as the diagnosis and whatif modules use one."""
    return int(scalar(reader.query("SELECT count() AS n FROM numbers({n:UInt32})", parameters={"n": 7})))


def test_the_store_and_its_client_answer_the_same_query(store: Store) -> None:
    assert _count(store) == 7
    assert _count(store.client) == 7


def test_the_store_re_exports_the_rows_of_the_query_layer() -> None:
    for name in ("Result", "Row", "first_or_none", "named", "only", "row_type", "rows_of", "scalar"):
        assert getattr(reads, name) is getattr(queries_rows, name), name


def test_a_rows_columns_are_its_attributes_and_it_stays_the_tuple_it_was(store: Store) -> None:
    rows = named(store.query("SELECT number AS n, toString(number) AS text, number * 2 AS twice "
                             "FROM numbers(3) ORDER BY n"))
    assert [(r.n, r.text, r.twice) for r in rows] == [(0, "0", 0), (1, "1", 2), (2, "2", 4)]
    assert rows[1] == (1, "1", 2)  # compares, unpacks and hashes as the row's values did
    n, text, twice = rows[2]
    assert (n, text, twice) == (2, "2", 4) and len({rows[0], (0, "0", 0)}) == 1
    assert rows[0].columns == ("n", "text", "twice") and rows[0].as_dict() == {"n": 0, "text": "0", "twice": 0}
    assert type(rows[0]) is type(rows[2])  # one class per distinct SELECT


def test_a_column_added_in_front_moves_no_ones_value(store: Store) -> None:
    before = only(store.query("SELECT 7 AS steps, 'a' AS engine"))
    after = only(store.query("SELECT now() AS at, 'x' AS host, 7 AS steps, 'a' AS engine"))
    assert (before.steps, before.engine) == (after.steps, after.engine) == (7, "a")


def test_a_name_the_query_does_not_have_says_which_it_has(store: Store) -> None:
    row = only(store.query("SELECT 1 AS decisions, count() FROM numbers(2)"))
    with pytest.raises(AttributeError, match=r"no column 'lanes' \(its columns: decisions, count\(\)\).*AS"):
        _ = row.lanes
    # An expression without an alias is no attribute (its name is no identifier): it has to be named to be read.
    assert row.columns == ("decisions", "count()") and not hasattr(row, "count()")


def test_one_row_none_or_a_scalar(store: Store) -> None:
    assert first_or_none(store.query("SELECT 1 AS one WHERE 0")) is None
    row = first_or_none(store.query("SELECT number AS n FROM numbers(5) ORDER BY n DESC"))
    assert row is not None and row.n == 4
    assert scalar(store.query("SELECT count() FROM numbers(12)")) == 12
    with pytest.raises(ValueError, match="expected one row, the query answered 3"):
        only(store.query("SELECT number FROM numbers(3)"))
    with pytest.raises(ValueError, match="expected one column, the query answered 2: a, b"):
        scalar(store.query("SELECT 1 AS a, 2 AS b"))
