"""Compression on ClickHouse's HTTP interface: request Content-Encodings, compressed blocks, response encodings."""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Callable

import brotli
import lz4.frame
import pytest
from backports import zstd

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
