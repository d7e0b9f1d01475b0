"""Compression on ClickHouse's HTTP interface: its own compressed blocks (compress=1, decompress=1), the HTTP
Content-Encodings a request body may come in, and those a response is given with enable_http_compression=1.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from typing import Protocol

import brotli
import lz4.block
import lz4.frame
from backports import zstd
from clickhouse_cityhash.cityhash import CityHash128

from stepline.clickhouse_http.body import too_large
from stepline.clickhouse_http.errors import (
    CANNOT_DECOMPRESS,
    CHECKSUM_DOESNT_MATCH,
    NOT_IMPLEMENTED,
    UNKNOWN_COMPRESSION_METHOD,
    SqlRefused,
)
from stepline.core.oneline import one_line

# ClickHouse's compressed block: a 16-byte CityHash128 (v1.0.2) of the rest, then a method byte, the block's size
# with its 9-byte header and the decompressed size (UInt32 little-endian each), then the compressed bytes
# (src/Compression/CompressionInfo.h, ICompressionCodec.cpp in ClickHouse/ClickHouse).
_NONE, _LZ4, _ZSTD = 0x02, 0x82, 0x90
_METHODS = {"lz4": _LZ4, "lz4hc": _LZ4, "zstd": _ZSTD, "none": _NONE}
_METHOD_NAMES = {_LZ4: "lz4", _ZSTD: "zstd", _NONE: "none"}
_HEADER = struct.Struct("<BII")
_BLOCK_BYTES = 1 << 20  # ClickHouse's max_compress_block_size


def _checksum(data: bytes) -> bytes:
    value = CityHash128(data)
    return struct.pack("<QQ", value >> 64, value & ((1 << 64) - 1))  # as ClickHouse's clients read it


def method_byte(name: str) -> int:
    """The method byte for `network_compression_method` (ClickHouse's default is LZ4)."""
    try:
        return _METHODS[name.strip().lower() or "lz4"]
    except KeyError:
        raise SqlRefused(f"Unknown compression method {name[:40]!r}: use lz4, zstd or none",
                         UNKNOWN_COMPRESSION_METHOD, "UNKNOWN_COMPRESSION_METHOD") from None


def compress_block(data: bytes, method: int) -> bytes:
    """`data` as one or more ClickHouse compressed blocks."""
    out = []
    for start in range(0, len(data), _BLOCK_BYTES):
        raw = data[start:start + _BLOCK_BYTES]
        if method == _LZ4:
            packed = lz4.block.compress(raw, store_size=False)
        elif method == _ZSTD:
            packed = zstd.compress(raw)
        else:
            packed = raw
        body = _HEADER.pack(method, _HEADER.size + len(packed), len(raw)) + packed
        out.append(_checksum(body) + body)
    return b"".join(out)


def decompress_blocks(data: bytes, limit: int) -> bytes:
    """The bytes a sequence of ClickHouse compressed blocks holds (decompress=1 bodies); at most `limit` of them."""
    out: list[bytes] = []
    pos = total = 0
    while pos < len(data):
        if len(data) - pos < 16 + _HEADER.size:
            raise _corrupt(f"a compressed block's header is cut short at byte {pos}")
        method, size, raw_size = _HEADER.unpack_from(data, pos + 16)
        body = data[pos + 16:pos + 16 + size]
        if size < _HEADER.size or len(body) < size:
            raise _corrupt(f"a compressed block at byte {pos} claims {size} bytes, {len(body)} are there")
        if _checksum(body) != data[pos:pos + 16]:
            raise SqlRefused(f"checksum doesn't match in the compressed block at byte {pos}", CHECKSUM_DOESNT_MATCH,
                             "CHECKSUM_DOESNT_MATCH")
        total += raw_size
        if total > limit:  # before a byte is inflated: the claimed size bounds each decoder below
            raise too_large(total, limit)
        out.append(_block_bytes(method, body[_HEADER.size:], raw_size, pos))
        pos += 16 + size
    return b"".join(out)


def _block_bytes(method: int, packed: bytes, raw_size: int, pos: int) -> bytes:
    """One block's bytes, exactly `raw_size` of them, never inflating more than raw_size + 1."""
    name = _METHOD_NAMES.get(method)
    if name is None:
        raise SqlRefused(f"Unknown compression method byte 0x{method:02x}", UNKNOWN_COMPRESSION_METHOD,
                         "UNKNOWN_COMPRESSION_METHOD")
    claims = f"the {name} block at byte {pos} claims {raw_size} bytes"
    raw: bytes
    try:
        if method == _LZ4:  # LZ4_decompress_safe into a raw_size buffer: more output is an error, not a write
            raw, ended = lz4.block.decompress(packed, uncompressed_size=raw_size), True
        elif method == _ZSTD:
            raw, ended = _inflate(zstd.ZstdDecompressor, packed, raw_size)
        else:
            raw, ended = packed, True
    except Exception as ex:  # untrusted bytes: every decompressor failure is the body's
        raise _corrupt(f"{claims}: {one_line(ex, 120)}") from None
    if len(raw) > raw_size:
        raise _corrupt(f"{claims} and holds more")
    if not ended:
        raise _corrupt(f"{claims} and ends mid-frame after {len(raw)}")
    if len(raw) < raw_size:
        raise _corrupt(f"{claims} and holds {len(raw)}")
    return raw


def _corrupt(message: str) -> SqlRefused:
    return SqlRefused(message, CANNOT_DECOMPRESS, "CANNOT_DECOMPRESS")


class _Decoder(Protocol):
    """A streaming decompressor of one frame (gzip member): zlib's, lz4.frame's and zstd's share this much."""

    @property
    def eof(self) -> bool: ...

    @property
    def unused_data(self) -> bytes: ...

    def decompress(self, data: bytes, max_length: int, /) -> bytes: ...


def _inflate(new_decoder: Callable[[], _Decoder], data: bytes, most: int) -> tuple[bytes, bool]:
    """The frames in `data` one after another, and whether the last one ended.

    Output stops one byte past `most` (the caller's refusal), so a bomb costs about `most` bytes of memory.
    """
    out: list[bytes] = []
    produced = 0
    rest = data
    while True:
        decoder = new_decoder()
        # max_length is never 0, zlib's "no bound". Short of it a decoder consumes all it is given: one call a frame.
        piece = decoder.decompress(rest, most + 1 - produced)
        out.append(piece)
        produced += len(piece)
        if produced > most or not decoder.eof:
            break
        rest = decoder.unused_data
        if not rest:  # frames may follow one another, as ClickHouse's inflating buffers read them
            break
    return b"".join(out), decoder.eof


def _zlib_or_gzip() -> _Decoder:
    return zlib.decompressobj(32 + zlib.MAX_WBITS)  # 32+: zlib or gzip framing, whichever the header says


# The request Content-Encodings served: the zlib family, and lz4 and zstd (clickhouse-connect's dependencies).
_DECODERS: dict[str, Callable[[], _Decoder]] = {
    "gzip": _zlib_or_gzip, "x-gzip": _zlib_or_gzip, "deflate": _zlib_or_gzip, "lz4": lz4.frame.LZ4FrameDecompressor,
    "zstd": zstd.ZstdDecompressor,
}


def decode_content(encoding: str, body: bytes, limit: int) -> bytes:
    """Undo a request Content-Encoding, refusing output beyond `limit` bytes (a zip bomb is a large body)."""
    if encoding in ("", "identity"):
        return body
    if encoding not in _DECODERS:
        raise SqlRefused(f"Unknown Content-Encoding of HTTP request: {encoding[:40]}", NOT_IMPLEMENTED,
                         "NOT_IMPLEMENTED")
    try:
        out, ended = _inflate(_DECODERS[encoding], body, limit)
    except Exception as ex:  # untrusted bytes: every decompressor failure (zlib.error, ZstdError, ...) is the body's
        detail = one_line(ex, 160) or type(ex).__name__
        raise SqlRefused(f"cannot decompress the {encoding} request body: {detail}", CANNOT_DECOMPRESS,
                         "CANNOT_DECOMPRESS") from None
    if len(out) > limit:
        raise too_large(len(out), limit)
    if not ended:  # zlib hands out what it has: a body cut short would run as a prefix of its query
        raise SqlRefused(f"cannot decompress the {encoding} request body: it ends before its stream does",
                         CANNOT_DECOMPRESS, "CANNOT_DECOMPRESS")
    return out


class Encoder(Protocol):
    """A streaming Content-Encoding: each piece's output decodes as soon as it arrives; finish() ends the stream."""

    def encode(self, data: bytes) -> bytes: ...

    def finish(self) -> bytes: ...


class _Zlib:
    def __init__(self, wbits: int) -> None:
        self._z = zlib.compressobj(3, zlib.DEFLATED, wbits)  # ClickHouse's default http_zlib_compression_level

    def encode(self, data: bytes) -> bytes:
        return self._z.compress(data) + self._z.flush(zlib.Z_SYNC_FLUSH)

    def finish(self) -> bytes:
        return self._z.flush(zlib.Z_FINISH)


class _Zstd:
    def __init__(self) -> None:
        self._z = zstd.ZstdCompressor()

    def encode(self, data: bytes) -> bytes:
        return self._z.compress(data, zstd.ZstdCompressor.FLUSH_BLOCK)

    def finish(self) -> bytes:
        return self._z.flush(zstd.ZstdCompressor.FLUSH_FRAME)


class _Brotli:
    def __init__(self) -> None:
        self._b = brotli.Compressor(quality=3)

    def encode(self, data: bytes) -> bytes:
        return bytes(self._b.process(data) + self._b.flush())

    def finish(self) -> bytes:
        return bytes(self._b.finish())


class _Lz4Frame:
    def __init__(self) -> None:
        self._f = lz4.frame.LZ4FrameCompressor()
        self._started = False

    def encode(self, data: bytes) -> bytes:
        # No flush per piece: an LZ4 frame's flush() ends the frame. Whole blocks go out as they fill.
        head = b"" if self._started else self._f.begin()
        self._started = True
        return bytes(head + self._f.compress(data))

    def finish(self) -> bytes:
        head = b"" if self._started else self._f.begin()
        self._started = True
        return bytes(head + self._f.flush())


# In ClickHouse's order of preference when a client accepts several (HTTPHandler: gzip, deflate, then the rest).
_ENCODINGS: dict[str, Callable[[], Encoder]] = {
    "gzip": lambda: _Zlib(16 + zlib.MAX_WBITS), "deflate": lambda: _Zlib(zlib.MAX_WBITS),
    "br": _Brotli, "zstd": _Zstd, "lz4": _Lz4Frame,
}


def response_encoding(accept_encoding: str) -> str | None:
    """The Content-Encoding to answer with for an Accept-Encoding header (None: identity)."""
    offered = {part.split(";")[0].strip().lower() for part in accept_encoding.split(",")}
    offered |= {"gzip"} if "x-gzip" in offered else set()
    return next((name for name in _ENCODINGS if name in offered), None)


def encoder(name: str) -> Encoder:
    """A fresh streaming encoder for a Content-Encoding that response_encoding() chose."""
    return _ENCODINGS[name]()
