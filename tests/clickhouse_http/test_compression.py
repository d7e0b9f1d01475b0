"""Compression on ClickHouse's HTTP interface: request Content-Encodings, compressed blocks, response encodings."""

from __future__ import annotations

import functools
import gzip
import struct
import tracemalloc
import zlib
from collections.abc import Callable

import brotli
import lz4.block
import lz4.frame
import pytest
from backports import zstd
from clickhouse_cityhash.cityhash import CityHash128

from stepline.clickhouse_http.body import too_large
from stepline.clickhouse_http.compression import (
    compress_block,
    decode_content,
    decompress_blocks,
    encoder,
    method_byte,
    response_encoding,
)
from stepline.clickhouse_http.errors import (
    CANNOT_DECOMPRESS,
    CHECKSUM_DOESNT_MATCH,
    NOT_IMPLEMENTED,
    QUERY_IS_TOO_LARGE,
    UNKNOWN_COMPRESSION_METHOD,
    SqlRefused,
)

QUERY = b"SELECT number FROM system.numbers LIMIT 10 FORMAT JSONEachRow"
ENCODERS: dict[str, Callable[[bytes], bytes]] = {
    "gzip": gzip.compress, "x-gzip": gzip.compress, "deflate": zlib.compress, "lz4": lz4.frame.compress,
    "zstd": zstd.compress,
}
BOMB_BYTES = 200 << 20  # what each bomb inflates to: far beyond LIMIT, small enough to build in well under a second
LIMIT = 1 << 20
ZSTD_BLOCK = 0x90


def _stream(compress: Callable[[bytes], bytes], flush: Callable[[], bytes], head: bytes = b"") -> bytes:
    """BOMB_BYTES of zeros through a streaming compressor, never holding them whole."""
    zeros = bytes(1 << 20)
    return head + b"".join(compress(zeros) for _ in range(BOMB_BYTES >> 20)) + flush()


@functools.cache
def _bomb(encoding: str) -> bytes:
    """A body of at most a few hundred KB in `encoding` that inflates to BOMB_BYTES (built once per run)."""
    if encoding == "x-gzip":
        return _bomb("gzip")
    if encoding in ("gzip", "deflate"):
        deflater = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS)
        return _stream(deflater.compress, deflater.flush)
    if encoding == "lz4":
        frame = lz4.frame.LZ4FrameCompressor()
        return _stream(frame.compress, frame.flush, frame.begin())
    packer = zstd.ZstdCompressor()  # streaming: the frame header states no content size, as an attacker's need not
    return _stream(packer.compress, packer.flush)


def _refusal_and_peak(decode: Callable[[], bytes]) -> tuple[SqlRefused, int]:
    """The refusal `decode` raises and the most memory Python's allocators held for it (decoder buffers included)."""
    tracemalloc.start()
    try:
        with pytest.raises(SqlRefused) as err:
            decode()
        return err.value, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _block(method: int, packed: bytes, raw_size: int) -> bytes:
    """One ClickHouse compressed block whose header claims `raw_size`, with a good checksum (as a client writes it)."""
    body = struct.pack("<BII", method, 9 + len(packed), raw_size) + packed
    checksum = CityHash128(body)
    return struct.pack("<QQ", checksum >> 64, checksum & ((1 << 64) - 1)) + body


@pytest.mark.parametrize("encoding", sorted(ENCODERS))
def test_a_request_body_is_decoded_as_its_content_encoding_says(encoding: str) -> None:
    assert decode_content(encoding, ENCODERS[encoding](QUERY), 1 << 16) == QUERY


def test_identity_bodies_pass_and_gzip_reads_zlib_framing_too() -> None:
    assert decode_content("", QUERY, 1) is QUERY  # not decoded, so not held to the decoded limit
    assert decode_content("identity", QUERY, 1) is QUERY
    assert decode_content("gzip", zlib.compress(QUERY), 1 << 16) == QUERY
    assert decode_content("deflate", gzip.compress(QUERY), 1 << 16) == QUERY


@pytest.mark.parametrize("encoding", sorted(ENCODERS))
def test_a_decoded_body_over_the_limit_is_refused(encoding: str) -> None:
    with pytest.raises(SqlRefused) as err:
        decode_content(encoding, ENCODERS[encoding](b" " * 1_000_000), 1000)
    assert (err.value.code, err.value.name) == (QUERY_IS_TOO_LARGE, "QUERY_IS_TOO_LARGE")
    assert str(err.value).startswith("request body of 1001 bytes")  # decoding stopped one byte past the limit


@pytest.mark.parametrize("encoding", sorted(ENCODERS))
def test_a_corrupt_body_is_cannot_decompress(encoding: str) -> None:
    with pytest.raises(SqlRefused, match=f"cannot decompress the {encoding} request body: ") as err:
        decode_content(encoding, b"\x00not " + QUERY, 1 << 16)
    assert (err.value.code, err.value.name) == (CANNOT_DECOMPRESS, "CANNOT_DECOMPRESS")


@pytest.mark.parametrize("encoding", sorted(ENCODERS))
def test_a_content_encoding_bomb_costs_about_the_limit_in_memory(encoding: str) -> None:
    bomb = _bomb(encoding)
    refusal, peak = _refusal_and_peak(lambda: decode_content(encoding, bomb, LIMIT))
    assert refusal.code == QUERY_IS_TOO_LARGE and str(refusal) == str(too_large(LIMIT + 1, LIMIT))
    assert peak < 4 * LIMIT  # the output bound and the decoder's buffers, not BOMB_BYTES


@pytest.mark.parametrize("encoding", sorted(ENCODERS))
def test_a_body_cut_short_is_cannot_decompress(encoding: str) -> None:
    # zlib flushes what it has: a body cut mid-stream would otherwise run as a prefix of the query it was.
    body = ENCODERS[encoding](QUERY * 100)
    refusal = f"cannot decompress the {encoding} request body: it ends before its stream does"
    for cut in (body[:len(body) // 2], body[:-1], b""):
        with pytest.raises(SqlRefused, match=refusal) as err:
            decode_content(encoding, cut, 1 << 16)
        assert err.value.code == CANNOT_DECOMPRESS


@pytest.mark.parametrize("encoding", sorted(ENCODERS))
def test_concatenated_members_decode_whole_and_trailing_garbage_is_refused(encoding: str) -> None:
    # As ClickHouse's inflating buffers do: a new gzip member (zstd, LZ4 frame) may follow the end of one.
    body = ENCODERS[encoding](QUERY) + ENCODERS[encoding](b" SETTINGS max_threads = 1")
    assert decode_content(encoding, body, 1 << 16) == QUERY + b" SETTINGS max_threads = 1"
    with pytest.raises(SqlRefused) as err:
        decode_content(encoding, ENCODERS[encoding](QUERY) + b"\xffgarbage-garbage", 1 << 16)
    assert err.value.code == CANNOT_DECOMPRESS
    with pytest.raises(SqlRefused) as err:
        decode_content(encoding, body, len(QUERY) + 5)  # the limit holds across members
    assert err.value.code == QUERY_IS_TOO_LARGE


@pytest.mark.parametrize("encoding", ["br", "xz", "GZIP", "compress"])
def test_other_content_encodings_are_not_implemented(encoding: str) -> None:
    with pytest.raises(SqlRefused, match=f"Unknown Content-Encoding of HTTP request: {encoding}") as err:
        decode_content(encoding, QUERY, 1 << 16)
    assert err.value.code == NOT_IMPLEMENTED


@pytest.mark.parametrize("method", ["lz4", "LZ4HC", "zstd", "none", ""])
def test_compressed_blocks_round_trip(method: str) -> None:
    data = bytes(range(256)) * 5000  # more than one 1 MiB block
    packed = compress_block(data, method_byte(method))
    assert decompress_blocks(packed, len(data)) == data
    with pytest.raises(SqlRefused) as err:
        decompress_blocks(packed, len(data) - 1)
    assert err.value.code == QUERY_IS_TOO_LARGE


def test_a_damaged_block_or_an_unknown_method_is_refused() -> None:
    packed = compress_block(QUERY, method_byte("lz4"))
    for damaged, code in ((packed[:-1] + b"\x00", CHECKSUM_DOESNT_MATCH), (packed[:20], CANNOT_DECOMPRESS)):
        with pytest.raises(SqlRefused) as err:
            decompress_blocks(damaged, 1 << 20)
        assert err.value.code == code
    with pytest.raises(SqlRefused) as err:
        method_byte("snappy")
    assert err.value.code == UNKNOWN_COMPRESSION_METHOD


def test_a_zstd_block_that_inflates_past_its_claimed_size_is_refused_without_inflating() -> None:
    head = compress_block(b"SELECT ", ZSTD_BLOCK)
    body = head + _block(ZSTD_BLOCK, _bomb("zstd"), 10)
    refusal, peak = _refusal_and_peak(lambda: decompress_blocks(body, LIMIT))
    assert (refusal.code, refusal.name) == (CANNOT_DECOMPRESS, "CANNOT_DECOMPRESS")
    assert peak < LIMIT  # claimed size + 1 of output: an unbounded zstd.decompress peaks at twice BOMB_BYTES
    assert str(refusal) == f"the zstd block at byte {len(head)} claims 10 bytes and holds more"


@pytest.mark.parametrize(("method", "packed"), [
    ("zstd", zstd.compress(QUERY)), ("zstd", zstd.compress(QUERY)[:-4]),
    ("lz4", lz4.block.compress(QUERY, store_size=False)), ("none", QUERY),
])
def test_a_block_holding_less_than_it_claims_is_refused(method: str, packed: bytes) -> None:
    with pytest.raises(SqlRefused) as err:
        decompress_blocks(_block(method_byte(method), packed, len(QUERY) + 1), 1 << 16)
    assert err.value.code == CANNOT_DECOMPRESS
    assert f"the {method} block at byte 0 claims {len(QUERY) + 1} bytes" in str(err.value)


@pytest.mark.parametrize(("method", "packed"), [
    ("zstd", zstd.compress(QUERY)), ("lz4", lz4.block.compress(QUERY, store_size=False)), ("none", QUERY),
])
def test_a_block_holding_more_than_it_claims_is_refused(method: str, packed: bytes) -> None:
    with pytest.raises(SqlRefused) as err:
        decompress_blocks(_block(method_byte(method), packed, 10), 1 << 16)
    assert err.value.code == CANNOT_DECOMPRESS
    assert f"the {method} block at byte 0 claims 10 bytes" in str(err.value)


def test_a_block_claiming_more_than_the_limit_is_refused_before_it_is_inflated() -> None:
    body = _block(ZSTD_BLOCK, _bomb("zstd"), BOMB_BYTES)
    refusal, peak = _refusal_and_peak(lambda: decompress_blocks(body, LIMIT))
    assert (refusal.code, str(refusal)) == (QUERY_IS_TOO_LARGE, str(too_large(BOMB_BYTES, LIMIT)))
    assert peak < LIMIT


def test_the_response_encoding_is_clickhouses_first_choice_among_those_offered() -> None:
    assert response_encoding("br, gzip;q=0.5, zstd") == "gzip"
    assert response_encoding("zstd, BR") == "br"
    assert response_encoding("x-gzip") == "gzip"
    assert response_encoding("identity, compress") is None


@pytest.mark.parametrize(("name", "decode"), [
    ("gzip", gzip.decompress), ("deflate", zlib.decompress), ("br", brotli.decompress), ("zstd", zstd.decompress),
    ("lz4", lz4.frame.decompress),
])
def test_an_encoded_stream_decodes_whole(name: str, decode: Callable[[bytes], bytes]) -> None:
    stream = encoder(name)
    pieces = [stream.encode(QUERY), stream.encode(b""), stream.encode(QUERY), stream.finish()]
    assert decode(b"".join(pieces)) == QUERY * 2
