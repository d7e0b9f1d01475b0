"""A response body in HTTP/1.1 chunks, as ClickHouse's HTTP interface writes a result: through its compressed
blocks (compress=1) and a Content-Encoding when asked, and ended by its tagged error block when the engine fails
after the result began.

Public: ChunkedBody.
"""

from __future__ import annotations

import socket
from collections.abc import Callable

from stepline.clickhouse_http import compression as chcompress


class ChunkedBody:
    """A response body in HTTP/1.1 chunks, through compress=1 framing and a Content-Encoding when asked."""

    def __init__(self, sock: socket.socket, frame: Callable[[bytes], bytes] | None, encoding: str | None) -> None:
        self._sock = sock
        self._frame = frame
        self._encoder = chcompress.encoder(encoding) if encoding is not None else None

    def write(self, data: bytes) -> None:
        if data and self._frame is not None:
            data = self._frame(data)
        if data and self._encoder is not None:
            data = self._encoder.encode(data)
        self._chunk(data)

    def finish(self) -> None:
        if self._encoder is not None:
            self._chunk(self._encoder.finish())
        self._sock.sendall(b"0\r\n\r\n")

    def fail(self, text: str, tag: str) -> None:
        """ClickHouse's error after a result began (25.11 and newer): a tagged block, and no last chunk, so that
        no client can take the cut result for a whole one (src/Server/HTTP/HTTP1/HTTP1ServerResponse.cpp)."""
        message = text.rstrip("\n").encode() + b"\n"
        block = (b"\r\n__exception__\r\n" + tag.encode() + b"\r\n" + message
                 + f"{len(message)} {tag}\r\n__exception__\r\n".encode())
        if self._encoder is not None:
            block = self._encoder.encode(block) + self._encoder.finish()
        self._chunk(block)

    def _chunk(self, data: bytes) -> None:
        """One chunk in one gathered write: a block is never copied to put its frame around it."""
        parts = [memoryview(b"%x\r\n" % len(data)), memoryview(data), memoryview(b"\r\n")] if data else []
        while parts:
            sent = self._sock.sendmsg(parts)
            while parts and sent >= len(parts[0]):
                sent -= len(parts[0])
                parts.pop(0)
            if parts:
                parts[0] = parts[0][sent:]
