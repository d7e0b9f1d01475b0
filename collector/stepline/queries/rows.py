"""A query's rows read by name: what a query answers (`Result`) and each of its rows (`Row`).

A row of a result is a `Row`: the tuple of its values (it unpacks, compares and hashes as before) whose columns are
also attributes, named as the query names them (`SELECT engine, count() AS steps` gives `row.engine`, `row.steps`).
Readers read rows by name, never by position, so that adding a column to a SELECT shifts no one's numbers.
"""

from __future__ import annotations

import functools
import keyword
from collections.abc import Iterable, Sequence
from operator import itemgetter
from typing import Any, ClassVar, Protocol


class Result(Protocol):
    """What a query answers, as clickhouse-connect's QueryResult has it (the chDB store's client is one too)."""

    @property
    def column_names(self) -> Sequence[str]: ...

    @property
    def result_rows(self) -> Sequence[Sequence[Any]]: ...


class Row(tuple[Any, ...]):
    """One row of a query's result: its values in the SELECT's order, each also an attribute named by its column."""

    __slots__ = ()
    columns: ClassVar[tuple[str, ...]] = ()
    _distinct: ClassVar[bool] = True  # no two columns share a name

    def __getattr__(self, name: str) -> Any:
        # Reached only for a name that is no column's: the columns are properties of the row's class.
        raise AttributeError(f"the query has no column {name!r} (its columns: {', '.join(self.columns) or 'none'}); "
                             "name it with AS in the SELECT")

    def as_dict(self) -> dict[str, Any]:
        """Column name -> value, in the SELECT's order (the first of two equal names, as its attribute)."""
        if self._distinct:
            return dict(zip(self.columns, self, strict=True))
        out: dict[str, Any] = {}
        for name, value in zip(self.columns, self, strict=True):
            out.setdefault(name, value)
        return out

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuilt, (self.columns, tuple(self))


def _attribute(name: str) -> bool:
    """Whether a column can be read as an attribute: an identifier that is not one of Row's own names (an expression
    such as `count()` cannot: give it an alias)."""
    return name.isidentifier() and not keyword.iskeyword(name) and not name.startswith("_") and name not in {
        "columns", "as_dict"}


@functools.lru_cache(maxsize=512)
def row_type(columns: tuple[str, ...]) -> type[Row]:
    """The Row class of a result with these columns (one per distinct SELECT; the first of two equal names wins)."""
    properties: dict[str, Any] = {}
    for i, name in enumerate(columns):
        if _attribute(name) and name not in properties:
            properties[name] = property(itemgetter(i), doc=f"column {i}: {name}")
    return type("Row", (Row,), {"__slots__": (), "columns": columns, "_distinct": len(set(columns)) == len(columns),
                                **properties})


def _rebuilt(columns: tuple[str, ...], values: tuple[Any, ...]) -> Row:
    return row_type(columns)(values)


def rows_of(columns: Sequence[str], values: Iterable[Sequence[Any]]) -> list[Row]:
    """Rows of the given columns from plain value tuples (a reader that assembles rows of its own, or a test)."""
    make = row_type(tuple(columns))
    return [make(v) for v in values]


def named(result: Result) -> list[Row]:
    """A query's rows, each read by column name."""
    return rows_of(result.column_names, result.result_rows)


def first_or_none(result: Result) -> Row | None:
    """A query's first row by column name, or None when it has none."""
    rows = result.result_rows
    return row_type(tuple(result.column_names))(rows[0]) if rows else None


def only(result: Result) -> Row:
    """The one row of a query that always answers one (an aggregate without GROUP BY); raises when it did not."""
    rows = result.result_rows
    if len(rows) != 1:
        raise ValueError(f"expected one row, the query answered {len(rows)}")
    return row_type(tuple(result.column_names))(rows[0])


def scalar(result: Result) -> Any:
    """The one value of a query that answers one row of one column (a count, a maximum); raises when it did not."""
    row = only(result)
    if len(row) != 1:
        raise ValueError(f"expected one column, the query answered {len(row)}: {', '.join(row.columns)}")
    (value,) = row
    return value
