"""Native blocks as a `client_protocol_version` HTTP client reads them: block info, per-column flags.

Public: `native_for_revision` (what the endpoints answer with), `reframe` and its `UnsupportedColumn`, `BLOCK_INFO`.
"""

from __future__ import annotations

import re
import struct

from stepline.clickhouse_http.errors import NOT_IMPLEMENTED, SqlRefused

# A quoted literal or identifier, as a type name may hold one (Enum8('a' = 1), Tuple(`a b` UInt8)).
_QUOTED_RE = re.compile(r"'(?:[^'\\]|\\.|'')*'|\"(?:[^\"\\]|\\.|\"\")*\"|`(?:[^`\\]|\\.|``)*`", re.S)


class UnsupportedColumn(ValueError):
    """A column type whose Native layout this re-framing does not know."""


BLOCK_INFO = b"\x01\x00\x02\xff\xff\xff\xff\x00"  # is_overflows=0, bucket_num=-1, end of fields
REVISION_WITH_CUSTOM_SERIALIZATION = 54454
_FIXED_WIDTH = {
    "UInt8": 1, "Int8": 1, "Bool": 1, "Enum8": 1, "Nothing": 1, "UInt16": 2, "Int16": 2, "Date": 2,
    "Enum16": 2, "BFloat16": 2, "UInt32": 4, "Int32": 4, "Float32": 4, "Date32": 4, "DateTime": 4, "IPv4": 4,
    "Decimal32": 4, "Time": 4, "UInt64": 8, "Int64": 8, "Float64": 8, "DateTime64": 8, "Decimal64": 8,
    "Time64": 8, "UInt128": 16, "Int128": 16, "UUID": 16, "IPv6": 16, "Decimal128": 16, "UInt256": 32,
    "Int256": 32, "Decimal256": 32,
}
_ALIASES = {
    "Point": "Tuple(Float64, Float64)", "Ring": "Array(Point)", "LineString": "Array(Point)",
    "Polygon": "Array(Ring)", "MultiLineString": "Array(LineString)", "MultiPolygon": "Array(Polygon)",
}
_U64 = struct.Struct("<Q")
_KEY_WIDTH = (1, 2, 4, 8)
_HAS_ADDITIONAL_KEYS = 1 << 9


def _split_args(inner: str) -> list[str]:
    args, depth, start, i = [], 0, 0, 0
    while i < len(inner):
        c = inner[i]
        if quoted := _QUOTED_RE.match(inner, i):
            i = quoted.end()
            continue
        depth += 1 if c == "(" else -1 if c == ")" else 0
        if c == "," and depth == 0:
            args.append(inner[start:i].strip())
            start = i + 1
        i += 1
    args.append(inner[start:].strip())
    return args


def _parse_type(text: str) -> tuple[str, list[str]]:
    text = _ALIASES.get(text.strip(), text.strip())
    paren = text.find("(")
    if paren < 0:
        return text, []
    return text[:paren].strip(), _split_args(text[paren + 1 : text.rindex(")")])


def _element_type(arg: str) -> str:
    """Type of a Tuple element, dropping its name (`a UInt8`, `` `a b` String``) when it has one."""
    if arg[:1] in "`\"" and (quoted := _QUOTED_RE.match(arg)):
        return arg[quoted.end() :].strip()
    head = arg.split("(", 1)[0]
    return arg.split(None, 1)[1] if len(head.split()) > 1 else arg


def _children(name: str, args: list[str]) -> list[str]:
    if name in ("Array", "Nullable", "LowCardinality"):
        return args[:1]
    if name == "SimpleAggregateFunction":
        return args[-1:]
    if name == "Map":
        return args
    if name in ("Tuple", "Nested"):
        return [_element_type(a) for a in args]
    return []


def _prefix_count(type_name: str) -> int:
    """LowCardinality columns write an 8-byte state prefix before any data, in type-tree order."""
    name, args = _parse_type(type_name)
    return (name == "LowCardinality") + sum(_prefix_count(a) for a in _children(name, args))


def _skip(buf: bytes, pos: int, type_name: str, rows: int) -> int:
    """Position after `rows` values of `type_name` in Native bulk layout starting at `pos`."""
    if rows == 0:
        return pos
    name, args = _parse_type(type_name)
    if name in _FIXED_WIDTH or name.startswith("Interval"):
        return pos + _FIXED_WIDTH.get(name, 8) * rows
    if name == "Decimal":
        precision = int(args[0])
        return pos + (4 if precision <= 9 else 8 if precision <= 18 else 16 if precision <= 38 else 32) * rows
    if name == "FixedString":
        return pos + int(args[0]) * rows
    if name == "String":
        for _ in range(rows):
            length, pos = _varint(buf, pos)
            pos += length
        return pos
    if name == "Nullable":
        return _skip(buf, pos + rows, args[0], rows)
    if name == "SimpleAggregateFunction":
        return _skip(buf, pos, args[-1], rows)
    if name in ("Array", "Map", "Nested"):
        nested: int = _U64.unpack_from(buf, pos + 8 * (rows - 1))[0]
        pos += 8 * rows
        inner = args[0] if name == "Array" else f"Tuple({', '.join(args)})"
        return _skip(buf, pos, inner, nested)
    if name == "Tuple":
        for element in _children(name, args):
            pos = _skip(buf, pos, element, rows)
        return pos
    if name == "LowCardinality":
        index_type: int = _U64.unpack_from(buf, pos)[0]
        pos += 8
        if index_type & _HAS_ADDITIONAL_KEYS:
            keys: int = _U64.unpack_from(buf, pos)[0]
            dictionary = _parse_type(args[0])
            pos = _skip(buf, pos + 8, dictionary[1][0] if dictionary[0] == "Nullable" else args[0], keys)
        indexes: int = _U64.unpack_from(buf, pos)[0]
        return pos + 8 + _KEY_WIDTH[index_type & 0xFF] * indexes
    raise UnsupportedColumn(f"column type {type_name} cannot be sent in Native format to a client_protocol_version "
                            "client; cast it or use another format")


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while buf[pos] & 0x80:
        value, shift, pos = value | (buf[pos] & 0x7F) << shift, shift + 7, pos + 1
    return value | buf[pos] << shift, pos + 1


def reframe(data: bytes, revision: int) -> bytes:
    """Re-frame revision-0 Native blocks (what chDB writes) as ClickHouse does for `client_protocol_version`."""
    if revision <= 0 or not data:
        return data
    out, pos, n = bytearray(), 0, len(data)
    while pos < n:
        out += BLOCK_INFO
        start = pos
        columns, pos = _varint(data, pos)
        rows, pos = _varint(data, pos)
        out += data[start:pos]
        for _ in range(columns):
            start = pos
            name_length, pos = _varint(data, pos)
            type_length, pos = _varint(data, pos + name_length)
            type_name = data[pos : pos + type_length].decode()
            pos += type_length
            out += data[start:pos]
            if revision >= REVISION_WITH_CUSTOM_SERIALIZATION:
                out.append(0)  # no custom (sparse) serialization
            start = pos
            if rows:
                pos = _skip(data, pos + 8 * _prefix_count(type_name), type_name, rows)
            out += data[start:pos]
    return bytes(out)


def native_for_revision(data: bytes, revision: int) -> bytes:
    """reframe() for an endpoint's answer: a column type it cannot re-frame is ClickHouse's NOT_IMPLEMENTED."""
    try:
        return reframe(data, revision)
    except UnsupportedColumn as ex:
        raise SqlRefused(str(ex), NOT_IMPLEMENTED, "NOT_IMPLEMENTED") from None
