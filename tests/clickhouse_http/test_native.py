"""chDB's Native blocks re-framed for a `client_protocol_version` client, read back by clickhouse-driver's decoder."""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any, cast
from uuid import UUID

import chdb
import pytest

from stepline.clickhouse_http.errors import NOT_IMPLEMENTED, SqlRefused
from stepline.clickhouse_http.native import (
    BLOCK_INFO,
    REVISION_WITH_CUSTOM_SERIALIZATION,
    UnsupportedColumn,
    native_for_revision,
    reframe,
)
from tests.clients.test_clients import _driver_rows

# The layouts the re-framing walks (tuples below: the shared clickhouse-driver reader has no settings for them),
# in three blocks of two rows and one of one.
COLUMNS = {
    "u8": "toUInt8(number)", "s": "toString(number)", "maybe": "if(number % 2 = 0, NULL, number)",
    "arr": "[number, 7]", "m": "map('k', toString(number))", "lc": "toLowCardinality(toString(number % 2))",
    "lcn": "toLowCardinality(if(number = 1, NULL, 'x'))", "e": "CAST('b', 'Enum8(\\'a\\' = 1, \\'b\\' = 2)')",
    "fs": "toFixedString('abc', 3)", "d": "toDecimal64(number, 2)", "ts": "toDateTime64(1700000000 + number, 6, 'UTC')",
    "alc": "[toLowCardinality('q')]", "id": "toUUID('00000000-0000-0000-0000-000000000001')",
    "nested_arr": "[[number], []]",
}
AT = {name: i for i, name in enumerate(COLUMNS)}
SQL = f"SELECT {', '.join(f'{e} AS {n}' for n, e in COLUMNS.items())} FROM numbers(7) SETTINGS max_block_size = 2"


@pytest.fixture(scope="module")
def conn(chdb_dir: Path) -> Iterator[Any]:
    c: Any = cast(Any, chdb).connect(str(chdb_dir))  # untyped: chDB ships no annotations
    yield c
    c.close()


def _native(conn: Any, sql: str = SQL) -> bytes:
    return bytes(conn.query(sql, "Native").bytes())


def test_chdb_writes_revision_0_blocks(conn: Any) -> None:
    assert _native(conn, "SELECT toUInt8(7) AS a") == b"\x01\x01\x01a\x05UInt8\x07"


@pytest.mark.parametrize("revision", [54405, REVISION_WITH_CUSTOM_SERIALIZATION, 54460])
def test_reframed_blocks_read_the_same_rows_as_the_engine_wrote(conn: Any, revision: int) -> None:
    data = _native(conn)
    expected = _driver_rows(data, 0)
    assert len(expected) == 7
    assert expected[1][:4] == (1, "1", 1, [1, 7]) and expected[0][AT["maybe"]] is None
    assert (expected[3][AT["d"]], expected[0][AT["id"]]) == (Decimal("3.00"), UUID(int=1))
    assert _driver_rows(reframe(data, revision), revision) == expected


@pytest.mark.parametrize(("type_sql", "value_sql", "data"), [
    ("Tuple(UInt64, String)", "(number, 'x')", lambda n: struct.pack("<Q", n) + b"\x01x"),
    ("Tuple(a UInt64, `b c` String)", "(number, 'y')", lambda n: struct.pack("<Q", n) + b"\x01y"),
    ("Point", "(1.5, 2.5)", lambda n: struct.pack("<dd", 1.5, 2.5)),
])
def test_a_tuple_is_skipped_element_by_element(conn: Any, type_sql: str, value_sql: str,
                                               data: Callable[[int], bytes]) -> None:
    """A column after the tuple, in blocks of one row: a wrong tuple length would misplace everything after it."""
    native = _native(conn, f"SELECT CAST({value_sql}, '{type_sql}') AS t, toUInt8(9) AS z FROM numbers(2) "
                           "SETTINGS max_block_size = 1")
    type_name = type_sql.encode()
    expected = b"".join(BLOCK_INFO + b"\x02\x01\x01t" + bytes([len(type_name)]) + type_name + b"\x00" + data(n)
                        + b"\x01z\x05UInt8\x00\x09" for n in range(2))
    assert reframe(native, 54460) == expected


def test_each_block_gets_its_info_and_each_column_its_serialization_flag(conn: Any) -> None:
    data = _native(conn, "SELECT toUInt8(7) AS a, 'xy' AS s")
    assert reframe(data, 54460) == BLOCK_INFO + b"\x02\x01\x01a\x05UInt8\x00\x07\x01s\x06String\x00\x02xy"
    assert reframe(data, 54405) == BLOCK_INFO + data  # before custom serialization: no flag
    blocks = _native(conn, "SELECT number FROM numbers(5) SETTINGS max_block_size = 2")
    assert reframe(blocks, 54460).count(BLOCK_INFO) == 3


def test_revision_0_and_empty_answers_are_left_as_they_are(conn: Any) -> None:
    data = _native(conn)
    assert reframe(data, 0) is data
    assert reframe(b"", 54460) == b""
    empty = _native(conn, "SELECT number FROM numbers(10) WHERE number > 100")
    assert _driver_rows(reframe(empty, 54460), 54460) == _driver_rows(empty, 0)


def test_a_column_of_an_unknown_layout_is_refused_as_not_implemented(conn: Any) -> None:
    data = _native(conn, "SELECT uniqState(number) AS u FROM numbers(3)")
    with pytest.raises(UnsupportedColumn, match="AggregateFunction"):
        reframe(data, 54460)
    with pytest.raises(SqlRefused) as refused:
        native_for_revision(data, 54460)
    assert (refused.value.code, refused.value.name) == (NOT_IMPLEMENTED, "NOT_IMPLEMENTED")
    assert native_for_revision(data, 0) == data  # a revision-0 client reads what chDB wrote
