"""A result in HTTP/1.1 chunks: framed, encoded, and cut by ClickHouse's tagged error block when the engine fails."""

from __future__ import annotations

import gzip
import socket

from stepline.endpoints.chunked import ChunkedBody


def _chunks(raw: bytes) -> tuple[list[bytes], bool]:
    """The chunks of a chunked body, and whether it had its last (zero-size) chunk."""
    out: list[bytes] = []
    while raw:
        size_line, _, raw = raw.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return out, True
        out.append(raw[:size])
        raw = raw[size + 2:]
    return out, False


def test_pieces_go_out_as_chunks_then_the_last_one() -> None:
    ours, theirs = socket.socketpair()
    body = ChunkedBody(ours, None, None)
    body.write(b"1\n")
    body.write(b"")  # nothing: no chunk (a zero-size chunk would end the body)
    body.write(b"2\n")
    body.finish()
    ours.close()
    assert _chunks(theirs.recv(1 << 16)) == ([b"1\n", b"2\n"], True)


def test_an_encoded_result_decodes_as_it_arrives() -> None:
    ours, theirs = socket.socketpair()
    body = ChunkedBody(ours, None, "gzip")
    body.write(b"a" * 1000)
    body.finish()
    ours.close()
    pieces, ended = _chunks(theirs.recv(1 << 16))
    assert ended and gzip.decompress(b"".join(pieces)) == b"a" * 1000


def test_a_failure_after_the_result_began_is_tagged_and_never_looks_whole() -> None:
    ours, theirs = socket.socketpair()
    body = ChunkedBody(ours, None, None)
    body.write(b"1\n")
    body.fail("Code: 241. DB::Exception: Memory limit exceeded. (MEMORY_LIMIT_EXCEEDED)\n", "TAG123")
    ours.close()
    pieces, ended = _chunks(theirs.recv(1 << 16))
    assert not ended  # no last chunk: no client takes the cut result for a whole one
    assert pieces[0] == b"1\n" and b"__exception__\r\nTAG123\r\nCode: 241." in pieces[1]
