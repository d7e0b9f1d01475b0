"""The progress watchdog's metrics, declared beside it on the registry the collector passes: what it judges of each
engine, of its GPUs and of the gateways in front of it, and the SLI counters (`slo.SloMetrics`).

Names, labels and help texts are what the alert rules and dashboards read: they do not change.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from stepline.watchdog.slo import SloMetrics


class WatchdogMetrics:
    """Each engine's progress and figures, its GPUs, the gateways in front of it, its top finding, the SLIs."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._engine_metrics(registry)
        self._gpu_metrics(registry)
        self._gateway_metrics(registry)
        self.slo = SloMetrics(registry)
        self.top_finding = Gauge("stepline_engine_top_finding_info",
                                 "The engine's top warning or critical diagnosis finding over the last 5 minutes "
                                 "(refreshed on each state change and every few seconds while work is in flight).",
                                 ["engine", "kind", "severity", "title"], registry=registry)

    def _engine_metrics(self, r: CollectorRegistry) -> None:
        """The progress watchdog's view of each engine (names shared with the alert rules)."""
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

    def _gpu_metrics(self, r: CollectorRegistry) -> None:
        """Each engine's GPUs as their latest samples and events tell the watchdog."""
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

    def _gateway_metrics(self, r: CollectorRegistry) -> None:
        """The gateways in front of the engines, as their decisions and /metrics tell the watchdog."""
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
