"""The collector's own metrics, on a registry of its own, served on its /metrics."""

from __future__ import annotations

from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from stepline.serving import ServerThread

WRITE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class SelfMetrics:
    """Every metric the collector exports about itself."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.rows_written = Counter(
            "stepline_writer_rows_written", "Rows written to the store.", ["table"], registry=r
        )
        self.rows_dropped = Counter(
            "stepline_writer_rows_dropped", "Rows dropped before reaching the store.", ["table", "reason"],
            registry=r,
        )
        self.queue_depth = Gauge(
            "stepline_writer_queue_rows", "Rows accepted and not yet written.", ["table"], registry=r
        )
        self.write_seconds = Histogram(
            "stepline_writer_write_duration_seconds", "Time of one batch insert into the store.", ["table"],
            buckets=WRITE_BUCKETS, registry=r,
        )
        self.write_errors = Counter(
            "stepline_writer_write_errors", "Batch inserts the store refused or could not take.", ["table"],
            registry=r,
        )
        self.source_up = Gauge(
            "stepline_source_up", "1 when the source's last poll succeeded.", ["source"], registry=r
        )
        self.source_seconds = Gauge(
            "stepline_source_poll_duration_seconds", "Duration of the source's last poll.", ["source"],
            registry=r,
        )
        self.source_errors = Counter(
            "stepline_source_errors", "Polls of the source that failed.", ["source"], registry=r
        )
        self.source_counts = Counter(
            "stepline_source_counts", "What a source counted: datagrams, malformed input, data the engine side "
            "dropped, spans rejected.", ["source", "counter"], registry=r,
        )
        self.source_rows = Counter(
            "stepline_source_rows", "Rows the source produced.", ["source"], registry=r
        )
        self.engine_up = Gauge(
            "stepline_engine_up", "1 when the engine's /metrics answered with a valid exposition.", ["engine"],
            registry=r,
        )
        self.requests_deduplicated = Counter(
            "stepline_requests_deduplicated", "Finished requests already written from another source, by the source "
            "whose report was skipped.", ["source"], registry=r,
        )
        self.queries = Counter(
            "stepline_query_requests", "Requests to the read-only query endpoint, by outcome.", ["outcome"],
            registry=r,
        )


class MetricsServer:
    """Serves a registry on /metrics in a background thread."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self._server = make_server(
            host, port, make_wsgi_app(registry), ThreadingWSGIServer, handler_class=_QuietHandler
        )
        self._serving: ServerThread | None = None

    @property
    def port(self) -> int:
        return int(self._server.server_port)

    def start(self) -> None:
        self._serving = ServerThread(self._server, "self-metrics")

    def stop(self) -> None:
        if self._serving is not None:
            self._serving.stop()
        else:
            self._server.server_close()


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        """Scrapes are routine; they are not logged."""
