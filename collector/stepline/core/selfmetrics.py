"""The plumbing of the collector's own /metrics: the server of its registry, and the listeners' refusals.

Each subsystem declares its metrics beside its code (`stepline.ingest.metrics`, `stepline.watchdog.metrics`, the
query endpoint's), on the one registry the collector builds and passes down (`stepline.app.selfmetrics`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, Metric

from stepline.core.listener import HttpServer, ServerThread, url


class ListenerCounts:
    """stepline_listener_connections_refused_total{listener, reason}: the connections each HTTP listener closed or
    refused (reason slow_heads: request line and headers past the deadline; busy_refused: every handler thread
    taken), read from the listeners when scraped."""

    NAME = "stepline_listener_connections_refused"
    LABELS = ("listener", "reason")

    def __init__(self) -> None:
        self._listeners: dict[str, Callable[[], Mapping[str, int]]] = {}

    def add(self, name: str, stats: Callable[[], Mapping[str, int]]) -> None:
        """Count the listener `name` by what `stats` returns (counter name -> count since it started)."""
        self._listeners[name] = stats

    def describe(self) -> Iterator[Metric]:
        yield self._family()

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        for name, stats in sorted(self._listeners.items()):
            for reason, count in sorted(stats().items()):
                family.add_metric([name, reason], count)
        yield family

    @staticmethod
    def _family() -> CounterMetricFamily:
        return CounterMetricFamily(
            ListenerCounts.NAME, "Connections an HTTP listener closed or refused: slow_heads (request line and headers "
            "past the deadline), busy_refused (every handler thread taken).", labels=list(ListenerCounts.LABELS))


class MetricsServer:
    """Serves a registry on /metrics in a background thread; bound (and its port known) from the start."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self.host = host
        self._server = _Server((host, port), _QuietHandler)
        self._server.set_app(make_wsgi_app(registry))
        self._serving: ServerThread | None = None

    @property
    def port(self) -> int:
        return int(self._server.server_port)

    @property
    def url(self) -> str:
        """http://host:port/metrics, an IPv6 host in brackets."""
        return f"{url(self.host, self.port)}/metrics"

    def start(self) -> None:
        self._serving = ServerThread(self._server, "self-metrics")

    def refused_connections(self) -> dict[str, int]:
        """What the listener closed or refused since it started (HttpServer.stats)."""
        return self._server.stats()

    def stop(self) -> None:
        if self._serving is not None:
            self._serving.stop()
        else:
            self._server.server_close()


class _Server(HttpServer, WSGIServer):
    """The listener's binding (IPv4, or IPv6 for an IPv6 literal) serving prometheus_client's own WSGI app through
    wsgiref, so /metrics answers as make_wsgi_app does: content negotiation, gzip, name[], 405s."""


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        """Scrapes are routine; they are not logged."""
