"""The collector's HTTP listeners, written once: a threaded server on the address family its host needs (IPv4 or
IPv6), the URL that reaches it, the bearer-token check, and the daemon thread each one starts and stops the same way.

Every listener holds a request's line and headers to a deadline and its handler threads to a number; what it closes
or refuses for either is counted (HttpServer.stats) and logged, rate limited.

Public: HttpServer, ServerThread, Address, url, address_family, bearer_authorized, BEARER_CHALLENGE, linger,
LISTEN_BACKLOG, HEAD_DEADLINE_S, MAX_HANDLER_THREADS.
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import ipaddress
import logging
import os
import socket
import socketserver
import sys
import threading
import time
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeVar, cast

from stepline.core.ratelimit import RateLimitedLog

log = logging.getLogger(__name__)

LINGER_CAP_BYTES = 1 << 20  # how much of an unread request body linger() reads and drops at most
BEARER_CHALLENGE = 'Bearer realm="stepline"'  # the WWW-Authenticate header of a 401 from a listener with a token
# Connections the kernel queues before they are accepted. Python's default of 5 overflows when clients connect at
# once (a Grafana dashboard's panels, OTLP exporters reconnecting after a restart): the kernel then drops their SYNs
# and each waits out a retransmit (1 s, then 2 s, ...). 128 was Linux's SOMAXCONN for years (net.core.somaxconn
# caps it).
LISTEN_BACKLOG = 128
# A request's line and headers, however slowly they trickle in: a per-recv timeout restarts with every byte, so a
# client sending one every few seconds would hold a handler thread forever. Real clients send them in one write.
HEAD_DEADLINE_S = 30.0
# Handler threads (one per open connection, keep-alive ones included) a listener runs at once; more are refused at
# once. Generous for its clients (Grafana's and clickhouse-connect's pools, OTLP exporters, scrapes, the sim's
# streaming completions), and a bound on what a flood of connections costs.
MAX_HANDLER_THREADS = 256
_BUSY_REPLY = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\nRetry-After: 1\r\n\r\n"

_T = TypeVar("_T")


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
    kernel allows dual-stack), IPv4 otherwise. Handler threads are daemons: a stalled client never holds up exit.

    A connection whose request line and headers take over `head_deadline_s` is closed (`slow_heads`); one beyond
    `max_handler_threads` open at once is answered 503 and closed (`busy_refused`)."""

    daemon_threads = True
    request_queue_size = LISTEN_BACKLOG

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], *,
                 head_deadline_s: float = HEAD_DEADLINE_S, max_handler_threads: int = MAX_HANDLER_THREADS) -> None:
        self.address_family = address_family(address[0])
        self._dual_stack = self.address_family == socket.AF_INET6 and ipaddress.ip_address(address[0]).is_unspecified
        self.head_deadline_s = head_deadline_s
        self.max_handler_threads = max_handler_threads
        self._handler_slots = threading.BoundedSemaphore(max_handler_threads)
        self._counts = {"slow_heads": 0, "busy_refused": 0}
        self._counts_lock = threading.Lock()
        self._log = RateLimitedLog(log, interval_s=60.0)
        super().__init__(address, _with_head_deadline(handler))

    def stats(self) -> dict[str, int]:
        """Connections closed for a slow head, and refused for want of a handler thread, since the start."""
        with self._counts_lock:
            return dict(self._counts)

    def server_bind(self) -> None:
        # As CPython's own `python -m http.server --bind ::` does (Lib/http/server.py, DualStackServer).
        if self._dual_stack:
            with contextlib.suppress(OSError):  # no dual-stack here (net.ipv6.bindv6only, BSDs): IPv6 only
                self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()

    def get_request(self) -> tuple[socket.socket, Any]:
        accepted, client = self.socket.accept()
        fd = accepted.detach()
        try:
            conn = _Connection(accepted.family, accepted.type, accepted.proto, fileno=fd)
        except BaseException:
            os.close(fd)
            raise
        conn.limit_head(self.head_deadline_s, functools.partial(self._head_too_slow, client))
        # A reply goes out as headers, then a body (or chunks): without this, Nagle holds the second write for the
        # client's delayed ACK, 40 ms on Linux, longer than most of the queries and scrapes answered here.
        with contextlib.suppress(OSError):
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn, client

    def process_request(self, request: Any, client_address: Any) -> None:
        # Refused in the accepting thread, before a thread is spent on it.
        if not self._handler_slots.acquire(blocking=False):
            self._refuse_busy(request, client_address)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._handler_slots.release()  # no thread started to give it back
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._handler_slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], _HeadDeadlinePassed):
            return  # counted and logged when it passed; not a traceback
        super().handle_error(request, client_address)

    def _count(self, counter: str) -> None:
        with self._counts_lock:
            self._counts[counter] += 1

    def _head_too_slow(self, client: Any) -> None:
        self._count("slow_heads")
        self._log.warning("slow_heads", "listener %s: closed a connection from %s: its request line and headers took "
                          "over %.0f s", self._where(), _peer(client), self.head_deadline_s)

    def _refuse_busy(self, request: socket.socket, client: Any) -> None:
        self._count("busy_refused")
        self._log.warning("busy", "listener %s: refused a connection from %s: %d connections open already",
                          self._where(), _peer(client), self.max_handler_threads)
        with contextlib.suppress(OSError):  # best effort, never blocking the accepting thread: it is closing anyway
            request.send(_BUSY_REPLY, socket.MSG_DONTWAIT)
        self.shutdown_request(request)

    def _where(self) -> str:
        host, port = self.server_address[:2]
        return url(host if isinstance(host, str) else host.decode(), port)


class _HeadDeadlinePassed(TimeoutError):
    """A request's line and headers took longer than the listener allows: the connection is closed."""


class _Connection(socket.socket):
    """An accepted connection that reads a request's line and headers to a deadline, the handler's own per-recv
    timeout still applying within it. Its handler says where each request's head begins and ends."""

    _deadline_s = HEAD_DEADLINE_S
    _in_head = False
    _head_since: float | None = None
    _heads_read = 0
    _on_deadline: Callable[[], None] | None = None

    def limit_head(self, deadline_s: float, on_deadline: Callable[[], None]) -> None:
        """The first request's clock starts now, at accept: a client that connects and says nothing holds a thread
        as surely as one that drips, and not every handler has a per-recv timeout."""
        self._deadline_s, self._on_deadline = deadline_s, on_deadline
        self._in_head, self._head_since = True, time.monotonic()

    def head_begins(self) -> None:
        # A keep-alive connection's next request: its clock starts at its first byte; the wait for that byte is the
        # handler's idle timeout.
        if self._heads_read and self._on_deadline is not None:
            self._in_head, self._head_since = True, None

    def head_ends(self) -> None:
        self._in_head = False
        self._heads_read += 1

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        if not self._in_head:
            return super().recv_into(buffer, nbytes, flags)
        return self._read_head(functools.partial(super().recv_into, buffer, nbytes, flags))

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        if not self._in_head:
            return super().recv(bufsize, flags)
        return self._read_head(functools.partial(super().recv, bufsize, flags))

    def _read_head(self, read: Callable[[], _T]) -> _T:
        since = self._head_since
        if since is None:
            got = read()
            if got:
                self._head_since = time.monotonic()
            return got
        left = since + self._deadline_s - time.monotonic()
        if left <= 0:
            self._passed()
        idle = self.gettimeout()
        self.settimeout(left if idle is None else min(idle, left))
        try:
            return read()
        except TimeoutError:
            if idle is None or left <= idle:
                self._passed()  # the deadline, not the handler's own timeout, ran out
            raise
        finally:
            self.settimeout(idle)

    def _passed(self) -> None:
        self._in_head = False
        if self._on_deadline is not None:
            self._on_deadline()
        raise _HeadDeadlinePassed(f"request line and headers took over {self._deadline_s:g} s")


class _HeadDeadline(BaseHTTPRequestHandler):
    """Put in front of a listener's handler: tells its connection where each request's line and headers begin
    (handle_one_request; the first is armed at accept, as handlers that read one request themselves never call it)
    and end (parse_request, which reads the headers)."""

    def handle_one_request(self) -> None:
        if isinstance(self.connection, _Connection):
            self.connection.head_begins()
        super().handle_one_request()

    def parse_request(self) -> bool:
        try:
            return super().parse_request()
        finally:
            if isinstance(self.connection, _Connection):
                self.connection.head_ends()


def _with_head_deadline(handler: type[BaseHTTPRequestHandler]) -> type[BaseHTTPRequestHandler]:
    """`handler` with _HeadDeadline in front, under its own name: its callers' classes stay as they wrote them."""
    if issubclass(handler, _HeadDeadline):
        return handler
    namespace = {"__module__": handler.__module__, "__qualname__": handler.__qualname__, "__doc__": handler.__doc__}
    return cast(type[BaseHTTPRequestHandler], type(handler.__name__, (_HeadDeadline, handler), namespace))


def _peer(client: Any) -> str:
    return str(client[0]) if isinstance(client, tuple) and client else str(client)


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

    def refused_connections(self) -> dict[str, int]:
        """What the listener closed or refused since it started (HttpServer.stats); nothing before it starts."""
        return self._server.stats() if isinstance(self._server, HttpServer) else {}


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
