"""vLLM 0.33.0's /metrics exposition, fed from simulated steps, in a registry of its own.

Names, types, help texts, label names and buckets follow the exposition that vLLM 0.33.0's
PrometheusStatLogger rendered (shared/fixtures/vllm-0.33.0-metrics.txt). Label names are listed
sorted, so samples render with labels in the fixture's order.
"""

from __future__ import annotations

from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from stepline.sim.config import EngineConfig
from stepline.sim.records import FinishedRequest, StepRecord

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 20_000, 50_000, 100_000)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
CACHE_TIERS = ("device", "host", "p2p", "disk", "external_unspecified")
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
REJECTION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")

_WAITING_BY_REASON_HELP = (
    "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; "
    "'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). "
    "Sum of all reasons equals vllm:num_requests_waiting."
)
_SLEEP_HELP = (
    "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
    "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2."
)
_CACHED_BY_SOURCE_HELP = (
    "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), host (offloaded "
    "to DRAM), disk, p2p (transferred from another vLLM instance) or external_unspecified. Counted at "
    "admission; sums to vllm:prefix_cache_hits + vllm:external_prefix_cache_hits."
)
_MFU = "(for Model Flops Utilization calculations)."
_Family = TypeVar("_Family", Counter, Gauge)


class _Families:
    """Makes one engine's families in a registry, each labelled with the engine and its model."""

    def __init__(self, registry: CollectorRegistry, config: EngineConfig) -> None:
        self.registry = registry
        self.base = ("engine", "model_name")
        self.values = {"engine": config.engine, "model_name": config.model}

    def counter(self, name: str, doc: str) -> Counter:
        return Counter(name, doc, self.base, registry=self.registry).labels(**self.values)

    def gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, self.base, registry=self.registry).labels(**self.values)

    def histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(name, doc, self.base, registry=self.registry, buckets=buckets).labels(**self.values)

    def by(self, kind: type[_Family], name: str, doc: str, label: str) -> _Family:
        """A family with one label more than the engine's, its children left to the caller."""
        return kind(name, doc, (*self.base, label), registry=self.registry)


class VllmMetrics:
    """vLLM's Prometheus families for one engine, updated from `StepRecord`s."""

    def __init__(self, config: EngineConfig) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # Families register in the order vLLM's exposition lists them: the groups below keep that order.
        families = _Families(self.registry, config)
        self._mfu(families)
        self._scheduler(families)
        self._caches(families)
        self._tokens(families)
        self._outcomes(families, config.model)
        self._request_histograms(families)
        self._phase_histograms(families)
        self._spec_decode(families, config)
        self._cache_config(config)

    def _mfu(self, f: _Families) -> None:
        for unit, what in (
            ("flops", "floating point operations"),
            ("read_bytes", "bytes read from memory"),
            ("write_bytes", "bytes written to memory"),
        ):
            # Filled only with --enable-mfu-metrics, which the simulator does not model.
            f.counter(f"vllm:estimated_{unit}_per_gpu", f"Estimated number of {what} per GPU {_MFU}")

    def _scheduler(self, f: _Families) -> None:
        values = f.values
        self.running = f.gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = f.gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        by_reason = f.by(Gauge, "vllm:num_requests_waiting_by_reason", _WAITING_BY_REASON_HELP, "reason")
        self.waiting_capacity = by_reason.labels(reason="capacity", **values)
        by_reason.labels(reason="deferred", **values)
        sleep = f.by(Gauge, "vllm:engine_sleep_state", _SLEEP_HELP, "sleep_state")
        for state in SLEEP_STATES:
            sleep.labels(sleep_state=state, **values).set(1 if state == "awake" else 0)
        self.kv_usage = f.gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")

    def _caches(self, f: _Families) -> None:
        self.prefix_queries = f.counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_hits = f.counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        external = "External prefix cache {} from KV connector cross-instance cache sharing, in terms of number of {}."
        f.counter("vllm:external_prefix_cache_queries", external.format("queries", "queried tokens"))
        f.counter("vllm:external_prefix_cache_hits", external.format("hits", "cached tokens"))
        f.counter("vllm:mm_cache_queries", "Multi-modal cache queries, in terms of number of queried items.")
        f.counter("vllm:mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items.")
        self.preemptions = f.counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")

    def _tokens(self, f: _Families) -> None:
        values = f.values
        self.prompt_tokens = f.counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        by_source = f.by(Counter, "vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", "source")
        self.prompt_computed, self.prompt_cache_hit, _ = (by_source.labels(source=s, **values) for s in PROMPT_SOURCES)
        self.prompt_cached = f.counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        )
        cached_by_source = f.by(Counter, "vllm:prompt_tokens_cached_by_source", _CACHED_BY_SOURCE_HELP, "source")
        self.cached_device = cached_by_source.labels(source="device", **values)
        for tier in CACHE_TIERS[1:]:
            cached_by_source.labels(source=tier, **values)
        self.generation_tokens = f.counter("vllm:generation_tokens", "Number of generation tokens processed.")

    def _outcomes(self, f: _Families, model: str) -> None:
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            ("engine", "finished_reason", "model_name"),
            registry=f.registry,
        )
        self.success = {reason: success.labels(finished_reason=reason, **f.values) for reason in FINISHED_REASONS}
        rejections = Counter(
            "vllm:admission_rejections",
            "Number of admission attempts rejected by a queue limit, by reason.",
            ("model_name", "reason"),
            registry=f.registry,
        )
        for reason in REJECTION_REASONS:
            rejections.labels(model_name=model, reason=reason)

    def _request_histograms(self, f: _Families) -> None:
        histogram = f.histogram
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", TOKEN_BUCKETS
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", TOKEN_BUCKETS
        )
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", ITERATION_TOKEN_BUCKETS
        )
        self.max_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            TOKEN_BUCKETS,
        )
        self.params_n = histogram("vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS)
        self.params_max_tokens = histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", TOKEN_BUCKETS
        )
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", TOKEN_LATENCY_BUCKETS
        )
        self.tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            TOKEN_LATENCY_BUCKETS,
        )

    def _phase_histograms(self, f: _Families) -> None:
        def phase(name: str, doc: str) -> Histogram:
            return f.histogram(name, doc, REQUEST_LATENCY_BUCKETS)

        self.e2e = phase("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.")
        self.queue = phase("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.")
        self.inference = phase(
            "vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request."
        )
        self.prefill = phase(
            "vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request."
        )
        self.decode = phase("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.")
        self.request_preemptions = f.histogram(
            "vllm:request_num_preemptions",
            "Histogram of the number of times a request was preempted.",
            PREEMPTION_BUCKETS,
        )
        self.kv_computed = f.histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            TOKEN_BUCKETS,
        )

    def _spec_decode(self, f: _Families, config: EngineConfig) -> None:
        # vLLM registers the spec-decode families only when a speculative config is set.
        self.spec_drafts: Counter | None = None
        self.spec_draft_tokens: Counter | None = None
        self.spec_accepted: Counter | None = None
        self.spec_accepted_per_pos: list[Counter] = []
        if config.speculative is None:
            return
        self.spec_drafts = f.counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_draft_tokens = f.counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.spec_accepted = f.counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        per_pos = f.by(Counter, "vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
                       "position")
        self.spec_accepted_per_pos = [per_pos.labels(position=str(i), **f.values)
                                      for i in range(config.speculative.num_tokens)]

    def _cache_config(self, config: EngineConfig) -> None:
        info = {
            "block_size": str(config.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": str(config.enable_prefix_caching),
            "engine": config.engine,
            "gpu_memory_utilization": str(config.gpu_memory_utilization),
            "num_gpu_blocks": str(config.num_gpu_blocks),
        }
        cache_info = Gauge(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", info, registry=self.registry
        )
        cache_info.labels(**info).set(1)

    def observe_queue(self, running: int, waiting: int, kv_cache_usage: float) -> None:
        """The scheduler's queue gauges."""
        self.running.set(running)
        self.waiting.set(waiting)
        self.waiting_capacity.set(waiting)
        self.kv_usage.set(kv_cache_usage)

    def observe_step(self, step: StepRecord) -> None:
        """Apply one step's scheduler and iteration stats, as PrometheusStatLogger.record does."""
        self.observe_queue(step.num_running_reqs, step.num_waiting_reqs, step.kv_cache_usage)
        if step.prefix_cache_queries:
            self.prefix_queries.inc(step.prefix_cache_queries)
            self.prefix_hits.inc(step.prefix_cache_hits)
            self.cached_device.inc(step.prefix_cache_hits)
        if step.num_preempted_reqs:
            self.preemptions.inc(step.num_preempted_reqs)
        if step.num_prompt_tokens:
            self.prompt_tokens.inc(step.num_prompt_tokens)
            self.prompt_computed.inc(step.num_prompt_tokens_computed)
            self.prompt_cache_hit.inc(step.num_prompt_tokens_cached)
            self.prompt_cached.inc(step.num_prompt_tokens_cached)
        if step.num_output_tokens:
            self.generation_tokens.inc(step.num_output_tokens)
        # A step that only advanced a prompt's middle chunk returns no outputs, so nothing is logged.
        if step.num_prompt_tokens or step.num_output_tokens:
            self.iteration_tokens.observe(step.num_prompt_tokens + step.num_output_tokens)
        for ttft in step.time_to_first_tokens_iter:
            self.ttft.observe(ttft)
        observe_itl = self.itl.observe
        for itl in step.inter_token_latencies_iter:
            observe_itl(itl)
        for finished in step.finished_requests:
            self.observe_finished(finished)
        if step.spec_num_drafts and self.spec_drafts is not None:
            self.spec_drafts.inc(step.spec_num_drafts)
            if self.spec_draft_tokens is not None:
                self.spec_draft_tokens.inc(step.spec_num_draft_tokens)
            if self.spec_accepted is not None:
                self.spec_accepted.inc(step.spec_num_accepted_tokens)
            for counter, accepted in zip(self.spec_accepted_per_pos, step.spec_accepted_per_pos, strict=False):
                counter.inc(accepted)

    def observe_finished(self, request: FinishedRequest) -> None:
        """Apply one finished request's stats."""
        self.success[request.finish_reason].inc()
        self.e2e.observe(request.e2e_latency)
        self.queue.observe(request.queued_time)
        self.prefill.observe(request.prefill_time)
        self.inference.observe(request.inference_time)
        self.decode.observe(request.decode_time)
        self.tpot.observe(request.mean_time_per_output_token)
        self.request_prompt_tokens.observe(request.num_prompt_tokens)
        self.request_generation_tokens.observe(request.num_generation_tokens)
        self.request_preemptions.observe(request.num_preemptions)
        self.kv_computed.observe(request.num_prompt_tokens - request.num_cached_tokens)
        self.params_max_tokens.observe(request.max_tokens_param)
        # No parallel sampling here: n is 1 and the request's own length is the group's maximum.
        self.params_n.observe(1)
        self.max_generation_tokens.observe(request.num_generation_tokens)

    def render(self) -> bytes:
        """The exposition in Prometheus text format 0.0.4."""
        return generate_latest(self.registry)
