"""A socket server run on a daemon thread: every listener of the collector starts and stops the same way."""

from __future__ import annotations

import contextlib
import socket
import socketserver
import threading

LINGER_CAP_BYTES = 1 << 20  # how much of an unread request body linger() reads and drops at most


class Address:
    """Where an HTTP listener is: `host`, and the port it asked for until it is bound (port 0: any free one)."""

    host: str
    _port: int
    _server: socketserver.TCPServer | None

    @property
    def port(self) -> int:
        """The bound port once started (useful with port 0), else the configured one."""
        return self._server.server_address[1] if self._server is not None else self._port

    @property
    def base_url(self) -> str:
        """http://host:port, an IPv6 host in brackets."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


class ServerThread:
    """Serves `server` from a background thread until stop(), which also releases its port."""

    def __init__(self, server: socketserver.BaseServer, name: str) -> None:
        self.server = server
        # A short poll interval keeps stop() prompt.
        self._thread = threading.Thread(target=server.serve_forever, args=(0.2,), name=name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join()


def linger(sock: socket.socket) -> None:
    """After replying to a request whose body was left unread: half-close, then read (and drop) a little of what is
    still coming. Closing with the client's body still arriving resets the connection, and the client may lose the
    reply before reading it. A connection that breaks meanwhile is closing anyway."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(1.0)
        left = LINGER_CAP_BYTES
        while left > 0 and (chunk := sock.recv(min(left, 1 << 16))):
            left -= len(chunk)
