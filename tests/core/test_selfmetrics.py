"""The collector's /metrics: prometheus_client's exposition, answered on IPv4 or IPv6 exactly as make_wsgi_app did."""

from __future__ import annotations

import gzip
import re
import socket
import urllib.request
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote

import pytest
from prometheus_client import CollectorRegistry, Gauge, generate_latest, make_wsgi_app
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from stepline.core.selfmetrics import ListenerCounts, MetricsServer
from tests.core.test_listener import needs_ipv6


class Served:
    """A registry as the collector's is: gauges its subsystems declared, and the listeners' refusals."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        Gauge("stepline_gpu_present", "GPU samples arrived.", registry=self.registry).set(1)
        Gauge("stepline_source_up", "Last poll succeeded.", ["source"], registry=self.registry).labels("gpu").set(1)
        Gauge("stepline_engine_up", "Its /metrics answered.", ["engine"], registry=self.registry).labels("sim").set(0)
        self.listeners = ListenerCounts()
        self.registry.register(self.listeners)


@pytest.fixture
def metrics() -> Served:
    return Served()


@pytest.fixture
def server(metrics: Served) -> Iterator[MetricsServer]:
    s = MetricsServer(metrics.registry, "127.0.0.1", 0)
    s.start()
    yield s
    s.stop()


def exchange(port: int, request: bytes, host: str = "127.0.0.1") -> bytes:
    """One raw request; the whole reply until the server closes, Date and Server lines left out."""
    with socket.create_connection((host, port), timeout=10) as conn:
        conn.sendall(request)
        reply = b""
        while chunk := conn.recv(1 << 16):
            reply += chunk
    return re.sub(rb"(?im)^(date|server): [^\r\n]*\r\n", b"", reply)


def wsgi_reply(registry: CollectorRegistry, method: str, target: str, headers: dict[str, str]) -> bytes:
    """What prometheus_client's WSGI app answers, framed as wsgiref framed it (HTTP/1.0, Content-Length)."""
    path, _, query = target.partition("?")
    environ = {"REQUEST_METHOD": method, "PATH_INFO": unquote(path, "iso-8859-1"), "QUERY_STRING": query,
               **{"HTTP_" + k.upper().replace("-", "_"): v for k, v in headers.items()}}
    answer: dict[str, Any] = {}

    def start_response(status: str, response_headers: list[tuple[str, str]]) -> None:
        answer.update(status=status, headers=response_headers)

    body = b"".join(make_wsgi_app(registry)(environ, start_response))
    lines = [f"HTTP/1.0 {answer['status']}", *(f"{k}: {v}" for k, v in answer["headers"]),
             f"Content-Length: {len(body)}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


@pytest.mark.parametrize(("method", "target", "headers"), [
    ("GET", "/metrics", {}),
    ("GET", "/", {"Accept": "application/openmetrics-text; version=1.0.0"}),
    ("GET", "/metrics", {"Accept": "text/plain; version=1.0.0; escaping=underscores"}),
    ("GET", "/metrics?name[]=stepline_gpu_present&name[]=stepline_engine_up", {}),
    ("GET", "/favicon.ico", {}),
    ("GET", "/favicon%2Eico", {}),
    ("GET", "/metrics%3F", {}),
    ("OPTIONS", "/metrics", {}),
    ("POST", "/metrics", {"Content-Length": "0"}),
    ("HEAD", "/metrics", {}),
    ("DELETE", "/anything", {}),
    ("BREW", "/metrics", {}),
])
def test_answers_as_prometheus_clients_wsgi_app(server: MetricsServer, metrics: Served, method: str,
                                                target: str, headers: dict[str, str]) -> None:
    request = f"{method} {target} HTTP/1.1\r\nHost: x\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    expected = wsgi_reply(metrics.registry, method, target, headers)
    assert exchange(server.port, request.encode() + b"\r\n") == expected


def test_gzip_when_asked(server: MetricsServer, metrics: Served) -> None:
    reply = exchange(server.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept-Encoding: br, gzip;q=0.5\r\n\r\n")
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.split(b"\r\n") == [b"HTTP/1.0 200 OK", f"Content-Type: {CONTENT_TYPE_PLAIN_0_0_4}".encode(),
                                   b"Content-Encoding: gzip", f"Content-Length: {len(body)}".encode()]
    assert gzip.decompress(body) == generate_latest(metrics.registry)


def test_repeated_accept_headers_are_read_together(server: MetricsServer) -> None:
    reply = exchange(server.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: text/html\r\n"
                                  b"Accept:  application/openmetrics-text; version=1.0.0 \r\n\r\n")
    assert reply.split(b"\r\n")[1].startswith(b"Content-Type: application/openmetrics-text; version=1.0.0")


def test_serves_ipv4_loopback(server: MetricsServer, metrics: Served) -> None:
    assert server.url == f"http://127.0.0.1:{server.port}/metrics"
    with urllib.request.urlopen(server.url, timeout=10) as response:
        assert response.headers["Content-Type"] == CONTENT_TYPE_PLAIN_0_0_4
        assert response.read() == generate_latest(metrics.registry)


@needs_ipv6
def test_serves_ipv6_loopback(metrics: Served) -> None:
    server = MetricsServer(metrics.registry, "::1", 0)
    server.start()
    try:
        assert server.url == f"http://[::1]:{server.port}/metrics"
        with urllib.request.urlopen(server.url, timeout=10) as response:
            assert response.headers["Content-Type"] == CONTENT_TYPE_PLAIN_0_0_4
            text = response.read().decode()
        assert 'stepline_source_up{source="gpu"} 1.0' in text and "stepline_gpu_present 1.0" in text
    finally:
        server.stop()


def test_the_port_is_known_before_start_and_free_after_stop(metrics: Served) -> None:
    server = MetricsServer(metrics.registry, "127.0.0.1", 0)
    port = server.port
    assert port > 0
    server.stop()  # never started: the socket is closed all the same
    MetricsServer(metrics.registry, "127.0.0.1", port).stop()


def test_each_listeners_refusals_are_read_when_scraped(metrics: Served) -> None:
    counts = {"slow_heads": 0, "busy_refused": 0}
    metrics.listeners.add("query", lambda: counts)
    assert metrics.registry.get_sample_value("stepline_listener_connections_refused_total",
                                             {"listener": "query", "reason": "busy_refused"}) == 0
    counts["busy_refused"] = 3
    assert metrics.registry.get_sample_value("stepline_listener_connections_refused_total",
                                             {"listener": "query", "reason": "busy_refused"}) == 3
