"""The HTTP listener every endpoint is served by: IPv4 or IPv6 as the host needs, bracketed URLs, one token check."""

from __future__ import annotations

import contextlib
import http.client
import socket
import struct
import sys
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from stepline.core.listener import (
    LISTEN_BACKLOG,
    Address,
    HttpServer,
    ServerThread,
    address_family,
    bearer_authorized,
    url,
)


def ipv6_loopback() -> bool:
    """Whether this machine can listen on ::1 (a kernel or container without IPv6 cannot)."""
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


# For every listener's test that binds ::1.
needs_ipv6 = pytest.mark.skipif(not ipv6_loopback(),
                                reason="no IPv6 here: socket.has_ipv6 is false or ::1 cannot be bound")


class _Hello(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = f"hello {self.client_address[0]}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        """Silenced."""


@contextlib.contextmanager
def serve(host: str) -> Iterator[HttpServer]:
    server = HttpServer((host, 0), _Hello)
    serving = ServerThread(server, "test-listener")
    try:
        yield server
    finally:
        serving.stop()


def get(host: str, port: int) -> tuple[int, str]:
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        conn.request("GET", "/")
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


@pytest.mark.parametrize(("host", "family"), [
    ("::1", socket.AF_INET6), ("::", socket.AF_INET6), ("fd00::5", socket.AF_INET6),
    ("::ffff:127.0.0.1", socket.AF_INET6),
    ("127.0.0.1", socket.AF_INET), ("0.0.0.0", socket.AF_INET), ("localhost", socket.AF_INET),
])
def test_the_family_is_the_hosts(host: str, family: socket.AddressFamily) -> None:
    assert address_family(host) == family


def test_urls_bracket_ipv6_hosts() -> None:
    assert url("::1", 8124) == "http://[::1]:8124"
    assert url("::", 1) == "http://[::]:1"
    assert url("127.0.0.1", 8124) == "http://127.0.0.1:8124"
    assert url("localhost", 80) == "http://localhost:80"


@needs_ipv6
def test_binds_ipv6_loopback_when_given_it() -> None:
    with serve("::1") as server:
        assert server.socket.family == socket.AF_INET6 and server.server_address[0] == "::1"
        assert get("::1", server.server_address[1]) == (200, "hello ::1")


def test_binds_ipv4_loopback_when_given_it() -> None:
    with serve("127.0.0.1") as server:
        assert server.socket.family == socket.AF_INET and server.server_address[0] == "127.0.0.1"
        assert get("127.0.0.1", server.server_address[1]) == (200, "hello 127.0.0.1")


@needs_ipv6
def test_the_ipv6_wildcard_takes_ipv4_too_where_the_kernel_allows() -> None:
    with serve("::") as server:
        port = server.server_address[1]
        assert get("::1", port) == (200, "hello ::1")
        if server.socket.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY):
            pytest.skip("this kernel keeps IPv6 sockets IPv6-only (net.ipv6.bindv6only=1)")
        assert get("127.0.0.1", port) == (200, "hello ::ffff:127.0.0.1")


def test_stop_releases_the_port() -> None:
    server = HttpServer(("127.0.0.1", 0), _Hello)
    port = server.server_address[1]
    ServerThread(server, "test-listener").stop()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    HttpServer(("127.0.0.1", port), _Hello).server_close()  # the port is free to bind again


class _Listener(Address):
    def __init__(self, host: str, port: int) -> None:
        self.host, self._port, self._server = host, port, None


def test_an_address_gives_the_bound_port_and_a_bracketed_url() -> None:
    listener = _Listener("::1", 4318)
    assert listener.port == 4318 and listener.base_url == "http://[::1]:4318"
    with serve("127.0.0.1") as server:
        listener = _Listener("127.0.0.1", 0)
        listener._server = server
        assert listener.port == server.server_address[1] > 0
        assert listener.base_url == f"http://127.0.0.1:{listener.port}"


TOKENS = [b"t0ken", b"other"]


@pytest.mark.parametrize(("header", "authorized"), [
    ("Bearer t0ken", True), ("Bearer other", True), ("bearer t0ken", True), ("  BEARER   t0ken  ", True),
    ("Bearer wrong", False), ("Bearer t0ken2", False), ("Bearer", False), ("", False), ("t0ken", False),
    ("Basic t0ken", False), ("Bearer t0ken\x00", False), ("Bearert0ken", False), ("Bearer é", False),
])
def test_the_bearer_token_check(header: str, authorized: bool) -> None:
    assert bearer_authorized(header, TOKENS) is authorized


def test_no_token_authorizes_nobody() -> None:
    assert not bearer_authorized("Bearer ", []) and not bearer_authorized("Bearer t0ken", [])


class _KeepAlive(_Hello):
    protocol_version = "HTTP/1.1"
    timeout = 30.0  # as the query, OTLP and events handlers have

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@contextlib.contextmanager
def serving(server: HttpServer) -> Iterator[HttpServer]:
    thread = ServerThread(server, "test-listener")
    try:
        yield server
    finally:
        thread.stop()


def _closed_by_server(sock: socket.socket) -> bool:
    """Whether the server has closed `sock` (its end of stream, or a reset), without waiting."""
    sock.setblocking(False)
    try:
        return sock.recv(1 << 16) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        sock.setblocking(True)


def test_a_head_dripped_a_byte_at_a_time_is_cut_off_at_the_deadline() -> None:
    with serving(HttpServer(("127.0.0.1", 0), _KeepAlive, head_deadline_s=1.0)) as server:
        with socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=5) as sock:
            started = time.monotonic()
            sock.sendall(b"GET / HTTP/1.1\r\n")
            closed_after = None
            # Each byte well within the handler's 30 s per-recv timeout: only a deadline on the whole head ends this.
            for byte in b"X-Drip: " + b"z" * 50:
                with contextlib.suppress(OSError):
                    sock.send(bytes([byte]))
                time.sleep(0.2)
                if _closed_by_server(sock):
                    closed_after = time.monotonic() - started
                    break
        assert closed_after is not None, "the dripping client was still connected after 10 s"
        assert 0.9 <= closed_after <= 2.5
        assert server.stats() == {"slow_heads": 1, "busy_refused": 0}
        assert get("127.0.0.1", server.server_address[1]) == (200, "hello 127.0.0.1")  # others are served as ever


def test_the_deadline_is_per_request_not_the_keep_alive_connections_idle_time() -> None:
    with serving(HttpServer(("127.0.0.1", 0), _KeepAlive, head_deadline_s=0.5)) as server:
        conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=10)
        try:
            for body in (b"one", b"two"):
                conn.request("POST", "/", body=body)
                response = conn.getresponse()
                assert (response.status, response.read()) == (200, body)
                time.sleep(1.0)  # idle between requests, past the deadline: the handler's own timeout governs that
        finally:
            conn.close()
        assert server.stats()["slow_heads"] == 0


def test_a_slow_body_is_left_to_the_handlers_timeout() -> None:
    with serving(HttpServer(("127.0.0.1", 0), _KeepAlive, head_deadline_s=0.5)) as server, \
            socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=5) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\n")
        for byte in b"body":
            time.sleep(0.3)
            sock.sendall(bytes([byte]))
        reply = b""
        while not reply.endswith(b"\r\n\r\nbody") and (chunk := sock.recv(1 << 16)):
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 200 ") and reply.endswith(b"\r\n\r\nbody")
        assert server.stats()["slow_heads"] == 0


def test_connections_past_the_thread_bound_are_refused_at_once() -> None:
    with serving(HttpServer(("127.0.0.1", 0), _KeepAlive, max_handler_threads=2)) as server:
        address = ("127.0.0.1", server.server_address[1])
        held = [socket.create_connection(address, timeout=5) for _ in range(2)]
        try:
            time.sleep(0.3)  # both accepted, each holding a handler thread
            with socket.create_connection(address, timeout=5) as refused:
                started = time.monotonic()
                assert refused.recv(1 << 16).startswith(b"HTTP/1.1 503 ")
                assert refused.recv(1 << 16) == b""
                assert time.monotonic() - started < 1.0
            assert server.stats() == {"slow_heads": 0, "busy_refused": 1}
        finally:
            for sock in held:
                sock.close()
        deadline = time.monotonic() + 5
        while (reply := _try_get(*address)) != (200, "hello 127.0.0.1") and time.monotonic() < deadline:
            time.sleep(0.1)  # the held connections' threads give their places back as they end
        assert reply == (200, "hello 127.0.0.1")


def _try_get(host: str, port: int) -> tuple[int, str] | None:
    """get(), or None where a refused connection was reset before its 503 could be read."""
    try:
        return get(host, port)
    except (OSError, http.client.HTTPException):
        return None


@pytest.mark.skipif(sys.platform != "linux", reason="reads the listen backlog from Linux's TCP_INFO")
def test_the_listen_backlog_is_raised_from_pythons_5() -> None:
    server = HttpServer(("127.0.0.1", 0), _Hello)
    try:
        assert server.request_queue_size == LISTEN_BACKLOG == 128
        # For a listening socket Linux reports its backlog in tcpi_sacked (as `ss -lt` shows in Send-Q), capped by
        # net.core.somaxconn.
        info = server.socket.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
        (backlog,) = struct.unpack_from("I", info, 28)
        somaxconn = int(Path("/proc/sys/net/core/somaxconn").read_text())
        assert backlog == min(LISTEN_BACKLOG, somaxconn)
    finally:
        server.server_close()


def test_accepted_connections_send_without_waiting_for_an_ack() -> None:
    # Headers then body in two writes: Nagle would hold the second for the client's delayed ACK (40 ms).
    seen: list[int] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.connection.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            self.send_response(204)
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            """Quiet."""

    server = HttpServer(("127.0.0.1", 0), Handler)
    serving = ServerThread(server, "nodelay")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_address[1]}/", timeout=10) as response:
            assert response.status == 204
    finally:
        serving.stop()
    assert seen and seen[0] != 0
