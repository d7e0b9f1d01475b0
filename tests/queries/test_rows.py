"""Rows read by name, built from column names alone: a name Row uses itself or a repeated one shadows nothing, and a
row crosses a process boundary with its names (what a query answers: tests/store/test_reads.py)."""

from __future__ import annotations

import pickle

from stepline.queries.rows import Row, row_type, rows_of


def test_a_name_that_is_rows_own_or_repeated_does_not_shadow_it() -> None:
    (row,) = rows_of(("columns", "as_dict", "engine", "engine", "_private"), [(1, 2, "first", "second", 3)])
    assert row.columns == ("columns", "as_dict", "engine", "engine", "_private")
    assert row.engine == row.as_dict()["engine"] == "first"  # the first of two equal names
    assert callable(row.as_dict) and row.as_dict()["_private"] == 3


def test_rows_cross_a_process_boundary_with_their_names() -> None:
    (row,) = rows_of(("engine", "steps"), [("prod-a", 3)])
    back = pickle.loads(pickle.dumps(row))
    assert isinstance(back, Row) and back == row and (back.engine, back.steps) == ("prod-a", 3)
    assert type(back) is row_type(("engine", "steps"))


def test_one_class_per_distinct_select() -> None:
    assert row_type(("a", "b")) is row_type(("a", "b")) and row_type(("a", "b")) is not row_type(("b", "a"))
    (ab,) = rows_of(("a", "b"), [(1, 2)])
    (ba,) = rows_of(("b", "a"), [(2, 1)])
    assert (ab.a, ab.b) == (ba.a, ba.b) == (1, 2)
