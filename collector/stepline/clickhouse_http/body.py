"""Request bodies: strictly framed HTTP/1.1 reading under a limit, and the fields of a multipart/form-data body.

Public: `read_body` and its `BodyTooLarge`, `too_large` (the ClickHouse refusal of a body over the limit),
`form_fields`.
"""

from __future__ import annotations

import re
from email import policy
from email.message import Message
from email.parser import BytesParser
from io import BufferedIOBase

from stepline.clickhouse_http.errors import BAD_ARGUMENTS, NOT_IMPLEMENTED, QUERY_IS_TOO_LARGE, SqlRefused
from stepline.core.oneline import one_line

_LENGTH = re.compile(rb"[0-9]{1,18}\Z")
_CHUNK_SIZE = re.compile(rb"([0-9A-Fa-f]{1,15})[ \t]*(?:;[^\r\n]*)?\r?\n\Z")
_MAX_TRAILERS = 64


def too_large(size: int, limit: int) -> SqlRefused:
    """The refusal for a request body over the endpoint's limit."""
    message = f"request body of {size} bytes exceeds the query endpoint's limit of {limit} bytes"
    return SqlRefused(message, QUERY_IS_TOO_LARGE, "QUERY_IS_TOO_LARGE")


class BodyTooLarge(Exception):
    """A request body over the limit: `size` so far, `declared` bytes still worth draining before closing."""

    def __init__(self, size: int, declared: int) -> None:
        super().__init__(size)
        self.size, self.declared = size, declared


def read_body(rfile: BufferedIOBase, headers: Message, limit: int, *, drain_cap: int) -> bytes:
    """An HTTP/1.1 request body, chunked or by Content-Length, strictly framed.

    ValueError for broken framing, OSError when the client goes away mid-body (a truncated body is never
    returned), BodyTooLarge past `limit` bytes.
    """
    if "chunked" in headers.get("Transfer-Encoding", "").lower():  # clickhouse-connect's inserts
        parts: list[bytes] = []
        total = 0
        while True:
            line = rfile.readline(1024)
            if (size_line := _CHUNK_SIZE.match(line)) is None:
                raise ValueError(f"bad chunk size line {line[:40]!r}")
            if not (size := int(size_line.group(1), 16)):
                break
            total += size
            if total > limit:  # how much is still coming is unknown: drain up to the cap before closing
                raise BodyTooLarge(total, drain_cap)
            parts.append(_read_exactly(rfile, size))
            if rfile.readline(8) not in (b"\r\n", b"\n"):
                raise ValueError("a chunk is not followed by CRLF")
        for _ in range(_MAX_TRAILERS):
            if not rfile.readline(1024).strip():
                return b"".join(parts)
        raise ValueError(f"more than {_MAX_TRAILERS} trailer lines")
    lengths = {value.strip() for value in headers.get_all("Content-Length", [])}
    if len(lengths) > 1 or not all(_LENGTH.match(value.encode()) for value in lengths):
        raise ValueError(f"Content-Length {', '.join(sorted(lengths))[:60]!r} is not one byte count")
    declared = int(lengths.pop()) if lengths else 0
    if declared > limit:
        raise BodyTooLarge(declared, declared)
    return _read_exactly(rfile, declared)


def _read_exactly(rfile: BufferedIOBase, size: int) -> bytes:
    data = rfile.read(size)
    if len(data) < size:  # the client closed or stalled past the timeout: never run a truncated query
        raise OSError(f"the body ended after {len(data)} of {size} bytes")
    return data


def form_fields(content_type: str, body: bytes) -> dict[str, str]:
    """Fields of a multipart/form-data body (clickhouse-connect sends long bind parameters that way)."""
    fields: dict[str, str] = {}
    try:
        head = f"Content-Type: {content_type}\r\n\r\n".encode("utf-8", errors="replace")
        parts = list(BytesParser(policy=policy.HTTP).parsebytes(head + body).iter_parts())
        for part in parts:
            name = part.get_param("name", header="content-disposition")
            if part.get_filename() is not None or not isinstance(name, str):
                raise SqlRefused("external data tables are not supported", NOT_IMPLEMENTED, "NOT_IMPLEMENTED")
            payload = part.get_payload(decode=True)
            fields[name] = payload.decode() if isinstance(payload, bytes) else ""
    except SqlRefused:
        raise
    except Exception as ex:  # untrusted bytes: the email parser's failures and undecodable fields are the body's
        detail = one_line(ex, 160) or type(ex).__name__
        raise SqlRefused(f"cannot read the multipart/form-data body: {detail}", BAD_ARGUMENTS,
                         "BAD_ARGUMENTS") from None
    return fields
