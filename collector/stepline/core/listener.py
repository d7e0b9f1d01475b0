"""The collector's HTTP listeners, written once: a threaded server on the address family its host needs (IPv4 or
IPv6), the URL that reaches it, the bearer-token check, and the daemon thread each one starts and stops the same way.

Public: HttpServer, ServerThread, Address, url, address_family, bearer_authorized, BEARER_CHALLENGE, linger.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import socket
import socketserver
import threading
from collections.abc import Sequence
from http.server import ThreadingHTTPServer

LINGER_CAP_BYTES = 1 << 20  # how much of an unread request body linger() reads and drops at most
BEARER_CHALLENGE = 'Bearer realm="stepline"'  # the WWW-Authenticate header of a 401 from a listener with a token


def address_family(host: str) -> socket.AddressFamily:
    """AF_INET6 for an IPv6 literal (`::1`, `::`, `fd00::5`), AF_INET for anything else (`127.0.0.1`, `localhost`)."""
    try:
        return socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:  # a name: resolved as IPv4, as socketserver's TCPServer always did
        return socket.AF_INET


def url(host: str, port: int) -> str:
    """http://host:port, an IPv6 host in brackets (RFC 3986 section 3.2.2)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def bearer_authorized(header: str, tokens: Sequence[bytes]) -> bool:
    """Whether an Authorization header is `Bearer <one of tokens>` (the scheme in any case)."""
    scheme, _, supplied = header.strip().partition(" ")
    given = supplied.strip().encode()
    # hmac.compare_digest on bytes: constant time for a token's length, whatever the header holds; and every token is
    # compared, whichever matches, so the time taken does not say which one it was.
    matches = [hmac.compare_digest(given, token) for token in tokens]
    return scheme.lower() == "bearer" and any(matches)


class HttpServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer on the family its host needs: IPv6 for an IPv6 literal (`::` takes IPv4 too where the
    kernel allows dual-stack), IPv4 otherwise. Handler threads are daemons: a stalled client never holds up exit."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[socketserver.BaseRequestHandler]) -> None:
        self.address_family = address_family(address[0])
        self._dual_stack = self.address_family == socket.AF_INET6 and ipaddress.ip_address(address[0]).is_unspecified
        super().__init__(address, handler)

    def server_bind(self) -> None:
        # As CPython's own `python -m http.server --bind ::` does (Lib/http/server.py, DualStackServer).
        if self._dual_stack:
            with contextlib.suppress(OSError):  # no dual-stack here (net.ipv6.bindv6only, BSDs): IPv6 only
                self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()


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
        return url(self.host, self.port)


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
