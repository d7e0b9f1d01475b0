"""The HTTP listener every endpoint is served by: IPv4 or IPv6 as the host needs, bracketed URLs, one token check."""

from __future__ import annotations

import contextlib
import http.client
import socket
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler

import pytest

from stepline.core.listener import (
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
