"""Request bodies: strict HTTP/1.1 framing under a limit, and multipart/form-data fields."""

from __future__ import annotations

import io
from email.message import Message

import pytest

from stepline.clickhouse_http.body import BodyTooLarge, form_fields, read_body, too_large
from stepline.clickhouse_http.errors import BAD_ARGUMENTS, NOT_IMPLEMENTED, QUERY_IS_TOO_LARGE, SqlRefused

FORM = "multipart/form-data; boundary=B"


def headers(*pairs: tuple[str, str]) -> Message:
    message = Message()
    for name, value in pairs:
        message[name] = value  # Message appends: a header given twice is there twice
    return message


def read(data: bytes, *pairs: tuple[str, str], limit: int = 100) -> tuple[bytes, bytes]:
    """The body read, and what is left on the stream after it."""
    stream = io.BytesIO(data)
    return read_body(stream, headers(*pairs), limit, drain_cap=7), stream.read()


def test_content_length_reads_exactly_that_many_bytes() -> None:
    assert read(b"SELECT 1GET / HTTP/1.1", ("Content-Length", "8")) == (b"SELECT 1", b"GET / HTTP/1.1")
    assert read(b"SELECT 1", ("Content-Length", " 8 "), ("Content-Length", "8")) == (b"SELECT 1", b"")
    assert read(b"SELECT 1") == (b"", b"SELECT 1")  # no length, no chunks: no body


@pytest.mark.parametrize("lengths", [("8", "9"), ("+8",), ("8x",), ("0x8",), ("-1",), ("",), ("1" * 19,)])
def test_a_length_that_is_not_one_byte_count_is_broken_framing(lengths: tuple[str, ...]) -> None:
    with pytest.raises(ValueError, match="is not one byte count"):
        read(b"SELECT 1", *(("Content-Length", value) for value in lengths))


def test_a_declared_length_over_the_limit_is_refused_before_reading() -> None:
    with pytest.raises(BodyTooLarge) as err:
        read(b"x" * 200, ("Content-Length", "101"))
    assert (err.value.size, err.value.declared) == (101, 101)
    assert read(b"x" * 100, ("Content-Length", "100")) == (b"x" * 100, b"")


def test_a_body_cut_short_is_never_returned() -> None:
    with pytest.raises(OSError, match="the body ended after 3 of 8 bytes"):
        read(b"SEL", ("Content-Length", "8"))
    with pytest.raises(OSError, match="after 2 of 5 bytes"):
        read(b"5\r\nab", ("Transfer-Encoding", "chunked"))


def test_chunks_are_joined_and_trailers_skipped() -> None:
    chunked = ("Transfer-Encoding", "chunked")
    assert read(b"3\r\nSEL\r\n5;ext=1\r\nECT 1\r\n0\r\n\r\nnext", chunked) == (b"SELECT 1", b"next")
    assert read(b"3 \nSEL\n0\nX-Trailer: y\r\n\r\nnext", chunked) == (b"SEL", b"next")  # bare LFs, a trailer
    assert read(b"a\r\n0123456789\r\n0\r\n\r\n", ("Transfer-Encoding", "gzip, Chunked")) == (b"0123456789", b"")


@pytest.mark.parametrize(("data", "message"), [
    (b"x\r\nabc\r\n0\r\n\r\n", "bad chunk size line"),
    (b"3\r\nabcd\r\n0\r\n\r\n", "a chunk is not followed by CRLF"),
    (b"1234567890abcdef\r\n", "bad chunk size line"),  # 16 hex digits: more than any body
    (b"0\r\n" + b"X: y\r\n" * 64 + b"\r\n", "more than 64 trailer lines"),
])
def test_broken_chunks_are_broken_framing(data: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        read(data, ("Transfer-Encoding", "chunked"))


def test_chunks_past_the_limit_leave_the_drain_cap_to_discard() -> None:
    with pytest.raises(BodyTooLarge) as err:
        read(b"3c\r\n" + b"x" * 60 + b"\r\n3c\r\n" + b"x" * 60 + b"\r\n0\r\n\r\n", ("Transfer-Encoding", "chunked"))
    assert (err.value.size, err.value.declared) == (120, 7)


def test_too_large_is_clickhouses_query_is_too_large() -> None:
    refused = too_large(70_000, 65_536)
    assert (refused.code, refused.name) == (QUERY_IS_TOO_LARGE, "QUERY_IS_TOO_LARGE")
    assert str(refused) == "request body of 70000 bytes exceeds the query endpoint's limit of 65536 bytes"


def test_form_fields_are_the_named_parts() -> None:
    body = (b'--B\r\nContent-Disposition: form-data; name="query"\r\n\r\nSELECT {x:UInt8}\r\n'
            b'--B\r\nContent-Disposition: form-data; name="param_x"\r\n\r\n7\r\n--B--\r\n')
    assert form_fields(FORM, body) == {"query": "SELECT {x:UInt8}", "param_x": "7"}
    assert form_fields(FORM, b"") == {}


@pytest.mark.parametrize(("body", "code"), [
    (b'--B\r\nContent-Disposition: form-data; name="t"; filename="t.tsv"\r\n\r\n1\r\n--B--\r\n', NOT_IMPLEMENTED),
    (b"--B\r\nContent-Disposition: form-data\r\n\r\n1\r\n--B--\r\n", NOT_IMPLEMENTED),  # no name: not a field
    (b'--B\r\nContent-Disposition: form-data; name="q"\r\n\r\n\xff\xfe\r\n--B--\r\n', BAD_ARGUMENTS),
])
def test_files_and_undecodable_fields_are_refused(body: bytes, code: int) -> None:
    with pytest.raises(SqlRefused) as err:
        form_fields(FORM, body)
    assert err.value.code == code
