"""Batches in ClickHouse's Native format, built once: what the spool keeps and what the store is sent.

Encoding a batch is most of an insert's Python cost; doing it once, when the batch is cut, means the
spool holds exactly the bytes the store takes (a retry or a replay after a restart re-sends them
without re-encoding), and the insert itself is the engine parsing Native, which runs outside the GIL.
Column types come from `schema`, so a batch can be built while the store is unreachable.
"""

from __future__ import annotations

import calendar
import functools
import re
from collections.abc import Iterator, Sequence
from datetime import datetime
from typing import Any

from clickhouse_connect.datatypes.base import ClickHouseType
from clickhouse_connect.datatypes.registry import get_from_name
from clickhouse_connect.driver.buffer import ResponseBuffer
from clickhouse_connect.driver.insert import InsertContext
from clickhouse_connect.driver.query import QueryResult
from clickhouse_connect.driver.transform import NativeTransform

from stepline.model import schema

_CODEC = re.compile(r"\s+CODEC\(.*\)\Z")
_LOW_CARDINALITY = re.compile(r"LowCardinality\((\w+)\)")
_STATEMENT_END = b" FORMAT Native\n"


@functools.cache
def column_types(table: str) -> tuple[ClickHouseType, ...]:
    """The types a batch is encoded as: the table's, without codecs (storage, not type) and without
    LowCardinality. Building a LowCardinality dictionary is most of what encoding costs in Python; sent as
    plain strings, the engine builds it while it parses the block (Native input converts types)."""
    return tuple(get_from_name(_LOW_CARDINALITY.sub(r"\1", _CODEC.sub("", type_)))
                 for _, type_ in schema.TABLE_BY_NAME[table].columns)


class EncodeError(ValueError):
    """A value does not fit its column's type."""


def encode(table: str, rows: Sequence[Sequence[Any]]) -> bytes:
    """`rows` (in the table's column order) as one Native block; raises EncodeError on a value that does not fit."""
    names = schema.TABLE_BY_NAME[table].column_names
    context = InsertContext(f"`{table}`", list(names), list(column_types(table)), data=rows)
    data = b"".join(NativeTransform.build_insert(context, _raise))
    if data.startswith(b"INSERT INTO"):  # the HTTP body's statement line, which a raw insert does not take
        data = data[data.index(_STATEMENT_END) + len(_STATEMENT_END):]
    return data


def encode_valid(table: str, rows: Sequence[Sequence[Any]]) -> tuple[bytes, int, str]:
    """Native blocks of the rows that fit their columns: (data, rows kept, the first error or "").

    A bad value costs its own row, not its batch: a batch that fails is split in halves until the
    rows that do not fit are alone.
    """
    try:
        return encode(table, rows), len(rows), ""
    except EncodeError as exc:
        if len(rows) == 1:
            return b"", 0, str(exc)
        half = len(rows) // 2
        first, kept_first, error_first = encode_valid(table, rows[:half])
        second, kept_second, error_second = encode_valid(table, rows[half:])
        return first + second, kept_first + kept_second, error_first or error_second


def _raise(exc: Exception) -> None:
    raise EncodeError(" ".join(str(exc).split())[:200]) from exc


def first_block_rows(data: bytes) -> int:
    """The row count in the header of the first Native block (a batch is one block unless rows were rejected)."""
    pos = 0
    values = []
    for _ in range(2):  # LEB128 column count, then row count
        value = shift = 0
        while True:
            byte = data[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                break
        values.append(value)
    return values[1]


class _Bytes:
    """A finished byte source, as clickhouse-connect's parser reads one."""

    last_message = None

    def __init__(self, data: bytes) -> None:
        self._data = data

    @property
    def gen(self) -> Iterator[bytes]:
        yield self._data

    def close(self) -> None:
        return None


def decode(data: bytes) -> tuple[tuple[str, ...], list[tuple[Any, ...]]]:
    """Column names and rows of Native bytes; DateTime64 values come back as integer microseconds, as rows hold them."""
    result = NativeTransform.parse_response(ResponseBuffer(_Bytes(data)))  # type: ignore[no-untyped-call]
    if not isinstance(result, QueryResult):
        raise TypeError("expected row results from the Native parser")
    rows = [tuple(_micros(v) if isinstance(v, datetime) else v for v in row) for row in result.result_rows]
    return tuple(result.column_names), rows


def _micros(value: datetime) -> int:
    return calendar.timegm(value.utctimetuple()) * 1_000_000 + value.microsecond
