"""Output formats over chDB's streaming: per-block documents joined into the one response ClickHouse would write,
and the Content-Type it is sent with.

chDB's `send_query` encodes every block as a whole document of the format (its header, its rows, its footer),
so the blocks of a row format concatenate as they are, but a format with a header repeats it per block and a
one-document format (JSON, Arrow) would arrive as several documents. `joiner(fmt)` says how to join a format's
blocks while streaming, or None for the formats that can only be written whole (XML, Pretty, Parquet, ...).
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable, Iterator

Joiner = Callable[[Iterator[bytes]], Iterator[bytes]]

# Formats with neither header nor footer: ClickHouse writes their blocks back to back.
_ROWS = frozenset({
    "native", "rowbinary", "tabseparated", "tsv", "tabseparatedraw", "tsvraw", "raw", "csv", "jsoneachrow",
    "jsonlines", "ndjson", "jsonstringseachrow", "jsoncompacteachrow", "jsoncompactstringseachrow", "lineasstring",
    "rawblob", "msgpack", "null",
})
# One-document JSON formats: {"meta": [...], "data": [ rows ], "rows": N, "statistics": {...}}.
_JSON_DOCUMENTS = frozenset({"json", "jsoncompact", "jsonstrings", "jsoncompactstrings"})
# A row format with one header line (names) or two (names, types).
_HEADED = re.compile(r"(?P<base>.+?)withnames(?P<types>andtypes)?\Z")
_CONTENT_TYPES = (
    (("json",), "application/json"), (("tabseparated", "tsv"), "text/tab-separated-values"), (("csv",), "text/csv"),
    (("xml",), "application/xml"), (("pretty", "vertical", "markdown", "values", "prometheus"), "text/plain"),
)


def joiner(fmt: str) -> Joiner | None:
    """How to join `fmt`'s per-block documents into one stream; None where it can only be written whole."""
    name = fmt.lower()
    if name in _ROWS:
        return _concatenate
    if name in _JSON_DOCUMENTS:
        return _join_json
    if name == "arrowstream":
        return _join_arrow_stream
    if (headed := _HEADED.match(name)) is not None and headed.group("base") in _ROWS:
        if headed.group("base") == "rowbinary":
            return _row_binary_headed(bool(headed.group("types")))
        return _text_headed(2 if headed.group("types") else 1)
    return None


def content_type(fmt: str) -> str:
    """Content-Type ClickHouse sends for an output format."""
    f = fmt.lower()
    for prefixes, mime in _CONTENT_TYPES:
        if f.startswith(prefixes):
            return f"{mime}; charset=UTF-8"
    return "application/octet-stream"


def needs_header(fmt: str) -> bool:
    """Whether an empty result still has bytes in `fmt` (a header, a document), which no block carries."""
    name = fmt.lower()
    return name not in _ROWS


def _concatenate(blocks: Iterator[bytes]) -> Iterator[bytes]:
    return blocks


def _without_repeated_header(header_end: Callable[[bytes], int]) -> Joiner:
    """Every block repeats the first block's header (`header_end` finds where it ends): keep it once."""
    def join(blocks: Iterator[bytes]) -> Iterator[bytes]:
        header: bytes | None = None
        for block in blocks:
            if header is None:
                header = block[:header_end(block)]
                yield block
            elif block.startswith(header):
                yield block[len(header):]
            else:
                raise ValueError("a block does not start with the header the first block had")
    return join


def _text_headed(lines: int) -> Joiner:
    def header_end(block: bytes) -> int:
        end = 0
        for _ in range(lines):  # names and types are escaped: a header line holds no raw newline
            end = block.index(b"\n", end) + 1
        return end
    return _without_repeated_header(header_end)


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _row_binary_headed(types: bool) -> Joiner:
    """RowBinaryWithNames[AndTypes]: a column count, then names (and types) as length-prefixed strings."""
    def header_end(block: bytes) -> int:
        count, pos = _varint(block, 0)
        for _ in range(count * (2 if types else 1)):
            size, pos = _varint(block, pos)
            pos += size
        return pos
    return _without_repeated_header(header_end)


_JSON_DATA_OPEN = b'\n\t"data":\n\t[\n'
_JSON_DATA_CLOSE = re.compile(rb'\n\t\],\n\n\t"rows": (\d+),')


def _join_json(blocks: Iterator[bytes]) -> Iterator[bytes]:
    """Keep the first block's meta, every block's rows, and the last block's footer with the total row count.

    Rows are written one per line with strings escaped, so the markers cannot occur inside a row.
    """
    total, footer, first = 0, b"", True
    for block in blocks:
        opened = block.index(_JSON_DATA_OPEN) + len(_JSON_DATA_OPEN)
        closing = _JSON_DATA_CLOSE.search(block, opened)
        if closing is None:
            raise ValueError("a JSON block without its data array's end")
        total += int(closing.group(1))
        rows = block[opened:closing.start()]
        if first:
            yield block[:opened] + rows
            first = False
        elif rows:
            yield b",\n" + rows
        footer = block[closing.start():]
    yield re.sub(rb'"rows": \d+,', b'"rows": %d,' % total, footer, count=1)


def _join_arrow_stream(blocks: Iterator[bytes]) -> Iterator[bytes]:
    """One Arrow IPC stream (one schema, then every block's record batches) out of one stream per block."""
    import pyarrow as pa  # chDB's own dependency; imported on the first Arrow query, not at start-up

    sink = io.BytesIO()
    writer: pa.ipc.RecordBatchStreamWriter | None = None
    for block in blocks:
        reader = pa.ipc.open_stream(block)
        if writer is None:
            writer = pa.ipc.new_stream(sink, reader.schema)
        for batch in reader:
            writer.write_batch(batch)
        yield _drain(sink)
    if writer is not None:
        writer.close()
        yield _drain(sink)


def _drain(sink: io.BytesIO) -> bytes:
    data = sink.getvalue()
    sink.seek(0)
    sink.truncate()
    return data
