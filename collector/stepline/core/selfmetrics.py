"""The collector's own metrics, on a registry of its own, served on its /metrics."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, Metric

from stepline.core.listener import HttpServer, ServerThread, url

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
        self.source_last_error = Gauge(
            "stepline_source_last_error_info", "1 while the source's last poll failed, with why (one line, at most "
            "200 characters); absent while it succeeds.", ["source", "error"], registry=r,
        )
        self.source_failure = Gauge(
            "stepline_source_failure_info", "1 while the source's last poll failed, with the failure's kind: for an "
            "engine's scrape refused (nothing listens: its process is gone), gone (closed without an answer), "
            "timeout, unreachable, http, invalid; error otherwise. Absent while it succeeds.", ["source", "reason"],
            registry=r,
        )
        self.source_counts = Counter(
            "stepline_source_counts", "What a source counted: datagrams, malformed input, data the engine side "
            "dropped, spans rejected.", ["source", "counter"], registry=r,
        )
        self.source_rows = Counter(
            "stepline_source_rows", "Rows the source produced.", ["source"], registry=r
        )
        self.clock_skew = Gauge(
            "stepline_source_clock_skew_max_seconds", "Largest row ts minus the collector's clock in the source's "
            "latest batch (positive: its clock runs ahead; rows over 300 s ahead are dropped).", ["source"],
            registry=r,
        )
        self.engine_up = Gauge(
            "stepline_engine_up", "1 when the engine's /metrics answered with a valid exposition.", ["engine"],
            registry=r,
        )
        self.requests_deduplicated = Counter(
            "stepline_requests_deduplicated", "Request reports not written because they added no field to what "
            "earlier reports of the same request gave, by the source of the skipped report.", ["source"], registry=r,
        )
        self.requests_unresolved = Counter(
            "stepline_requests_unresolved", "Request reports older than the collector's memory of requests that "
            "could not be looked up in the store (it was down): each was written as a request of its own, so a "
            "request reported before and after a restart may be two rows.", registry=r,
        )
        self.queries = Counter(
            "stepline_query_requests", "Requests to the read-only query endpoint, by outcome.", ["outcome"],
            registry=r,
        )
        self._watchdog_metrics(r)
        self.spool_bytes = Gauge("stepline_spool_bytes", "Bytes of batches waiting in the spool for the store.",
                                 registry=r)
        self.spool_limit = Gauge("stepline_spool_limit_bytes", "The spool's bound; past it the oldest batches go.",
                                 registry=r)

    def _watchdog_metrics(self, r: CollectorRegistry) -> None:
        """The progress watchdog's view of each engine and its GPUs (names shared with the alert rules)."""
        e = ["engine"]
        self.progress_age = Gauge("stepline_engine_progress_age_seconds",
                                  "Seconds since the engine last made progress.", e, registry=r)
        self.progress_budget = Gauge("stepline_engine_progress_budget_seconds",
                                     "Seconds allowed without progress, given the work in flight.", e, registry=r)
        self.engine_state = Gauge("stepline_engine_state", "1 for the engine's current watchdog state, else 0.",
                                  ["engine", "state"], registry=r)
        self.waiting_requests = Gauge("stepline_engine_waiting_requests", "Requests waiting.", e, registry=r)
        self.running_requests = Gauge("stepline_engine_running_requests", "Requests running.", e, registry=r)
        self.plugin_silent = Gauge(
            "stepline_engine_plugin_silent_seconds", "Seconds since the engine's /metrics counters began moving with "
            "no step from its stat-logger plugin, once that is a silent plugin (30 s); 0 while its steps arrive.", e,
            registry=r)
        self.inflight_prefill = Gauge("stepline_engine_inflight_prefill_tokens",
                                      "Prefill tokens of the last step (the work in flight).", e, registry=r)
        self.longest_context = Gauge("stepline_engine_longest_context_tokens",
                                     "Longest prompt known to be in flight (a lower bound; 0 when unknown).", e,
                                     registry=r)
        self.gpu_utilization = Gauge("stepline_engine_gpu_utilization_ratio",
                                     "Mean utilisation of the engine's GPUs over the last 10 s.", e, registry=r)
        self.itl_p99 = Gauge("stepline_engine_itl_p99_seconds", "Inter-token latency p99 over the last 60 s.", e,
                             registry=r)
        self.prefill_step_share = Gauge("stepline_engine_prefill_step_share",
                                        "Share of the last 60 s of steps that carried prefill tokens.", e, registry=r)
        self.prefix_cache_hit_ratio = Gauge("stepline_engine_prefix_cache_hit_ratio",
                                            "Prefix-cache hit ratio (tokens) over the last 60 s.", e, registry=r)
        self.kv_cache_usage = Gauge("stepline_engine_kv_cache_usage_ratio", "KV cache usage, 0-1.", e, registry=r)
        self.preemptions = Counter("stepline_engine_preemptions", "Requests preempted.", e, registry=r)
        self.queued_behind_prefill = Gauge(
            "stepline_engine_queued_behind_prefill",
            "Requests waiting while a prefill of >= 8192 tokens has been in flight for >= 10 s.", e, registry=r)
        self.gpu_clock_event_active = Gauge("stepline_gpu_clock_event_active",
                                            "1 when the clock-event flag is set in the GPU's latest sample.",
                                            ["engine", "gpu", "reason"], registry=r)
        self.gpu_sm_clock = Gauge("stepline_gpu_sm_clock_mhz", "SM clock in the GPU's latest sample.",
                                  ["engine", "gpu"], registry=r)
        self.gpu_xid_errors = Counter("stepline_gpu_xid_errors", "XID errors reported by the GPU.",
                                      ["engine", "gpu", "xid"], registry=r)
        self.gpu_present = Gauge("stepline_gpu_present", "1 when GPU samples arrived in the last 60 s.",
                                 registry=r)
        self.gpu_expected = Gauge("stepline_gpu_expected", "1 when GPUs are expected here (STEPLINE_EXPECT_GPUS): a "
                                  "gpu source that never reached NVML is then no machine without GPUs.", registry=r)
        self.gpu_lost = Counter("stepline_gpu_lost", "GPUs NVML reported lost (fell off the bus, reset required).",
                                ["engine", "gpu"], registry=r)
        self.gpu_gone = Gauge("stepline_gpu_gone", "1 while a GPU NVML reported lost has not been sampled again; "
                              "absent once it answers (GpuLost fires while it is out).", ["engine", "gpu"], registry=r)
        self.gpu_row_remap = Gauge(
            "stepline_gpu_row_remap", "1 while the GPU's latest row-remapping reading has the state: pending (a "
            "remap waits for a GPU reset) or failed (no spare rows left); NVML nvmlDeviceGetRemappedRows.",
            ["engine", "gpu", "state"], registry=r)
        # The gateways in front of the engines, as their decisions and /metrics tell the watchdog.
        self.lane_info = Gauge("stepline_engine_lane_info", "1 for the gateway and lane whose latest decision sent "
                               "a request to the engine (a per-lane budget, when one is set, applies to it).",
                               ["engine", "gateway", "lane"], registry=r)
        self.gateway_in_flight = Gauge(
            "stepline_gateway_in_flight", "Requests a gateway holds in flight to a backend engine, from the gateway's "
            "own /metrics (source: the metric) or its latest decision's in_flight (source: decisions), while fresh "
            "(60 s); above the engine's running + waiting, slots leaked.", ["gateway", "engine", "source"], registry=r)
        self.gateway_decisions = Counter(
            "stepline_gateway_decisions", "Routing decisions received, by outcome: answered, refused (429/503), error, "
            "disconnected (the client left), failed_open (a hook swallowed an exception or measured nothing).",
            ["gateway", "lane", "outcome"], registry=r)
        self._slo_metrics(r)
        self.listeners = ListenerCounts()
        r.register(self.listeners)
        self.top_finding = Gauge("stepline_engine_top_finding_info",
                                 "The engine's top warning or critical diagnosis finding over the last 5 minutes "
                                 "(refreshed on each state change and every few seconds while work is in flight).",
                                 ["engine", "kind", "severity", "title"], registry=r)


    def _slo_metrics(self, r: CollectorRegistry) -> None:
        """The SLIs of the objectives (`stepline.config.objectives`) as good/total counters, what the burn-rate
        rules divide."""
        labels = ["objective", "engine", "model", "lane", "tenant"]
        self.slo_requests = Counter(
            "stepline_slo_requests", "Requests the objective's SLI judged (those whose reports tell it: a TTFT, a "
            "mean TPOT, a finish reason, a gateway's status or first byte), each once; lane: the gateway lane of the "
            "engine's latest decision ('' without a gateway); model '' for a gateway's decisions; tenant: who sent "
            "it as the gateway says, for a tenant's objective only ('' otherwise).", labels, registry=r)
        self.slo_good_requests = Counter(
            "stepline_slo_good_requests", "Of stepline_slo_requests_total, those good by the objective's SLI.", labels,
            registry=r)
        self.slo_dropped = Counter(
            "stepline_slo_requests_dropped", "Requests an objective's SLI did not count because their label set "
            "would have passed the collector's bound on SLI series.", ["objective"], registry=r)


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
