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
import sys
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import datetime
from itertools import accumulate, chain
from typing import Any

from clickhouse_connect.datatypes.base import ClickHouseType
from clickhouse_connect.datatypes.registry import get_from_name
from clickhouse_connect.driver.buffer import ResponseBuffer
from clickhouse_connect.driver.insert import InsertContext
from clickhouse_connect.driver.query import QueryResult
from clickhouse_connect.driver.transform import NativeTransform

from stepline.core.oneline import one_line
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
    columns = _plain_columns(table)
    if columns is not None and rows:
        try:
            return _encode_plain(columns, rows)
        except (TypeError, ValueError, OverflowError, AttributeError, UnicodeError):
            pass  # a value that does not fit: the general encoder below says which, as EncodeError
    return _encode_general(table, rows)


def _encode_general(table: str, rows: Sequence[Sequence[Any]]) -> bytes:
    """`rows` as one Native block by clickhouse-connect's encoder (every type it knows)."""
    names = schema.TABLE_BY_NAME[table].column_names
    context = InsertContext(f"`{table}`", list(names), list(column_types(table)), data=rows)
    data = b"".join(NativeTransform.build_insert(context, _raise))
    if data.startswith(b"INSERT INTO"):  # the HTTP body's statement line, which a raw insert does not take
        data = data[data.index(_STATEMENT_END) + len(_STATEMENT_END):]
    return data


# The writer's hot path (steps and requests: every engine step and finished request) in a form of its own: each
# column written whole by C code (array, bytes.join) instead of value by value, byte for byte what clickhouse-connect
# writes (tests/store/test_batches.py), about 3x faster on steps. Native: the column and row counts, then each
# column's name, type and values: fixed-width numbers little-endian; strings as a varint length and the UTF-8 bytes;
# an array as each row's end offset (UInt64) and then every element. Tables with other types (maps, nullables, tuples)
# take the general encoder.
# https://clickhouse.com/docs/interfaces/formats/Native
_FIXED = {"UInt8": "B", "Bool": "B", "UInt16": "H", "UInt32": "I", "UInt64": "Q", "Int8": "b", "Int16": "h",
          "Int32": "i", "Int64": "q", "Float32": "f", "Float64": "d"}
_SIMPLE_AGGREGATE = re.compile(r"SimpleAggregateFunction\(\w+, (.*)\)\Z")
_DATETIME64_MICROS = re.compile(r"DateTime64\(6(, '[^']*')?\)\Z")
_ARRAY = re.compile(r"Array\((\w+)\)\Z")
_SHORT = [bytes([n]) for n in range(128)]
_SWAP = sys.byteorder != "little"


def _varint(n: int) -> bytes:
    if n < 128:
        return _SHORT[n]
    out = bytearray()
    while n >= 128:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _numbers(code: str, values: Iterable[Any]) -> bytes:
    packed = array(code, values)
    if _SWAP:
        packed.byteswap()
    return packed.tobytes()


def _strings(values: Sequence[Any]) -> bytes:
    # Hosts, engines, models and reasons repeat down a batch: each distinct value is encoded once.
    seen: dict[str, bytes] = {}
    out = []
    for value in values:
        encoded = seen.get(value)
        if encoded is None:
            if value.__class__ is not str:
                raise TypeError(f"{value!r} is not text")
            raw = value.encode()
            encoded = seen[value] = _varint(len(raw)) + raw
        out.append(encoded)
    return b"".join(out)


def _writer(type_: str) -> Callable[[Sequence[Any]], bytes] | None:
    """What writes a column of this (plain) type, or None for one only the general encoder writes."""
    found = _SIMPLE_AGGREGATE.match(type_)
    if found:
        return _writer(found.group(1))
    if type_ in _FIXED:
        code = _FIXED[type_]
        return lambda values: _numbers(code, values)
    if _DATETIME64_MICROS.match(type_):  # rows hold integer microseconds
        return lambda values: _numbers("q", values)
    if type_ == "String":
        return _strings
    found = _ARRAY.match(type_)
    if found and found.group(1) == "Float32":
        return _float32_arrays
    if found and found.group(1) in _FIXED:
        code = _FIXED[found.group(1)]
        return lambda values: _arrays(code, values)
    return None


def _arrays(code: str, values: Sequence[Any]) -> bytes:
    """An array column: each row's end offset, then every element."""
    return _numbers("Q", accumulate(map(len, values))) + _numbers(code, chain.from_iterable(values))


def _float32_arrays(values: Sequence[Any]) -> bytes:
    """Array(Float32): samples decoded from the plugin's wire (arrays of float32: stepline.plugin.wire) are written
    as their bytes, little-endian on a little-endian machine as Native is everywhere; any others are converted."""
    if not _SWAP and all(map(_is_float32, values)):
        return _numbers("Q", accumulate(map(len, values))) + b"".join(values)
    return _arrays("f", values)


def _is_float32(value: Any) -> bool:
    return value.__class__ is array and value.typecode == "f"


@functools.cache
def _plain_columns(table: str) -> tuple[tuple[bytes, Callable[[Sequence[Any]], bytes]], ...] | None:
    """Each column's name-and-type header and writer, when the fast form writes every column of `table`."""
    out = []
    for (name, _), type_ in zip(schema.TABLE_BY_NAME[table].columns, column_types(table), strict=True):
        writer = _writer(type_.name)
        if writer is None:
            return None
        head = name.encode()
        kind = type_.name.encode()
        out.append((_varint(len(head)) + head + _varint(len(kind)) + kind, writer))
    return tuple(out)


def _encode_plain(columns: Sequence[tuple[bytes, Callable[[Sequence[Any]], bytes]]],
                  rows: Sequence[Sequence[Any]]) -> bytes:
    parts = [_varint(len(columns)), _varint(len(rows))]
    # strict: rows of unequal length, or of another length than the table's, raise ValueError (the general encoder).
    for (head, writer), column in zip(columns, zip(*rows, strict=True), strict=True):
        parts.append(head)
        parts.append(writer(column))
    return b"".join(parts)


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
    raise EncodeError(one_line(exc, 200)) from exc


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
