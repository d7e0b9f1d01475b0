"""What a simulated engine sends besides /metrics: plugin datagrams and OTLP `llm_request` spans.

The plugin is the real one (PluginCore, fed vLLM-shaped stand-ins per step, and its periodic path called
about every 10 s of wall time, idle or not, as vLLM calls a stat logger's `log()`); the spans go through
the real opentelemetry-sdk and its OTLP/HTTP exporter, with the attributes vLLM sets.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind

from stepline.plugin.config import token_from_env
from stepline.plugin.core import PluginCore
from stepline.sim.config import EngineConfig
from stepline.sim.records import FinishedRequest, StepRecord
from stepline.testing import vllm_standins as standins

LOG_INTERVAL_S = 10.0  # vLLM's do_log_stats cadence (VLLM_LOG_STATS_INTERVAL's default)

_REASONS = {"stop": standins.FinishReason.STOP, "length": standins.FinishReason.LENGTH,
            "abort": standins.FinishReason.ABORT}


def scheduler_stats(step: StepRecord) -> standins.SchedulerStats:
    """The SchedulerStats (with iteration details) vLLM would hand its stat loggers for this step."""
    return standins.SchedulerStats(
        num_running_reqs=step.num_running_reqs,
        num_waiting_reqs=step.num_waiting_reqs,
        kv_cache_usage=step.kv_cache_usage,
        iteration_details=standins.SchedulerIterationDetails(
            iteration_index=step.iteration_index,
            num_ctx_requests=step.num_ctx_requests,
            num_ctx_tokens=step.num_ctx_tokens,
            num_generation_requests=step.num_generation_requests,
            num_generation_tokens=step.num_generation_tokens,
            # What vLLM measures: under async scheduling, the core's wait for the step (StepRecord.wait_ms).
            elapsed_ms=step.elapsed_ms if step.wait_ms is None else step.wait_ms,
        ),
        prefix_cache_stats=standins.PrefixCacheStats(
            requests=step.prefix_cache_requests, queries=step.prefix_cache_queries, hits=step.prefix_cache_hits
        ),
        # vLLM hands its loggers spec-decode stats only for steps that verified drafts.
        spec_decoding_stats=standins.SpecDecodingStats(
            num_spec_tokens=len(step.spec_accepted_per_pos), num_drafts=step.spec_num_drafts,
            num_draft_tokens=step.spec_num_draft_tokens, num_accepted_tokens=step.spec_num_accepted_tokens,
            num_accepted_tokens_per_pos=list(step.spec_accepted_per_pos),
        ) if step.spec_num_drafts else None,
    )


def iteration_stats(step: StepRecord) -> standins.IterationStats:
    """The IterationStats vLLM would hand its stat loggers for this step."""
    return standins.IterationStats(
        iteration_timestamp=step.ts,
        num_generation_tokens=step.num_output_tokens,
        num_preempted_reqs=step.num_preempted_reqs,
        finished_requests=[_finished(r) for r in step.finished_requests],
        time_to_first_tokens_iter=list(step.time_to_first_tokens_iter),
        inter_token_latencies_iter=list(step.inter_token_latencies_iter),
    )


def _finished(r: FinishedRequest) -> standins.FinishedRequestStats:
    return standins.FinishedRequestStats(
        finish_reason=_REASONS[r.finish_reason],
        request_id=r.request_id,
        e2e_latency=r.e2e_latency,
        num_prompt_tokens=r.num_prompt_tokens,
        num_generation_tokens=r.num_generation_tokens,
        max_tokens_param=r.max_tokens_param,
        queued_time=r.queued_time,
        prefill_time=r.prefill_time,
        inference_time=r.inference_time,
        decode_time=r.decode_time,
        mean_time_per_output_token=r.mean_time_per_output_token,
        num_cached_tokens=r.num_cached_tokens,
        num_preemptions=r.num_preemptions,
    )


def engine_config(config: EngineConfig) -> dict[str, Any]:
    """The configuration the plugin reports at engine start-up."""
    spec = config.speculative
    described: dict[str, Any] = {
        "model": config.model,
        "served_model_name": config.model,  # the simulator serves (and labels /metrics with) its model name
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "max_num_seqs": config.max_num_seqs,
        "enable_chunked_prefill": True,
        "long_prefill_token_threshold": config.long_prefill_token_threshold,
        "prefill_schedule_interval": config.prefill_schedule_interval,
        # scheduler_config.policy, under the name the plugin gives it on the timeline (plugin/config.py).
        "scheduling_policy": config.policy,
        "block_size": config.block_size,
        "num_gpu_blocks": config.num_gpu_blocks,
        "enable_prefix_caching": config.enable_prefix_caching,
        "speculative_decoding": spec is not None,
        "engine_index": int(config.engine),
        "async_scheduling": config.async_scheduling,
        "max_concurrent_batches": 2 if config.async_scheduling else 1,  # vLLM 0.33 vllm/config/vllm.py:587-598
    }
    if spec is not None:
        described["speculative_method"] = spec.method
        described["num_speculative_tokens"] = spec.num_tokens
    return described


class Telemetry:
    """Sends each simulated step through the plugin and each finished request as an OTLP span."""

    def __init__(self, engine: str, config: EngineConfig, *, plugin_socket: str | None = None,
                 otlp_endpoint: str | None = None, plugin_token: str | None = None,
                 log_interval_s: float = LOG_INTERVAL_S) -> None:
        """`plugin_token` defaults to STEPLINE_PLUGIN_TOKEN (or _FILE), as a collector started from the same
        environment reads it, so the demo's and the scenarios' collectors accept the simulated engine's data."""
        token = plugin_token if plugin_token is not None else token_from_env()
        self.plugin = (PluginCore(engine, plugin_socket, token=token, batch_queue=config.async_scheduling)
                       if plugin_socket else None)
        self._engine_index = int(config.engine)
        self._provider: TracerProvider | None = None
        if otlp_endpoint:
            self._provider = TracerProvider(resource=Resource.create({"service.name": engine}))
            self._provider.add_span_processor(BatchSpanProcessor(
                OTLPSpanExporter(endpoint=f"{otlp_endpoint.rstrip('/')}/v1/traces"), max_queue_size=65_536,
            ))
        self._tracer = self._provider.get_tracer("stepline.sim") if self._provider else None
        self._closed = threading.Event()
        self._logger: threading.Thread | None = None
        if self.plugin is not None:
            self.plugin.engine_initialized(engine_config(config))
            self._logger = threading.Thread(target=self._log_periodically, args=(self.plugin, log_interval_s),
                                            name=f"stepline-sim-log-{engine}", daemon=True)
            self._logger.start()

    def _log_periodically(self, plugin: PluginCore, interval_s: float) -> None:
        """vLLM's periodic `log()` to every stat logger, whether or not the engine steps."""
        while not self._closed.wait(interval_s):
            plugin.flush()

    def on_step(self, step: StepRecord) -> None:
        """Report one finished step, as vLLM's output processor would."""
        if self.plugin is not None:
            self.plugin.record(scheduler_stats(step), iteration_stats(step), self._engine_index)
        if self._tracer is not None:
            for request in step.finished_requests:
                self._span(request)

    def _span(self, r: FinishedRequest) -> None:
        assert self._tracer is not None
        span = self._tracer.start_span(
            "llm_request", kind=SpanKind.SERVER, start_time=round(r.arrival_ts * 1e9),
            attributes={
                # What vLLM 0.33 sets (vllm/v1/engine/output_processor.py:964-993): no model, no finish reason.
                "gen_ai.request.id": r.request_id,
                "gen_ai.usage.prompt_tokens": r.num_prompt_tokens,
                "gen_ai.usage.completion_tokens": r.num_generation_tokens,
                "gen_ai.request.max_tokens": r.max_tokens_param,
                "gen_ai.latency.time_in_queue": r.queued_time,
                "gen_ai.latency.time_to_first_token": r.time_to_first_token,
                "gen_ai.latency.e2e": r.e2e_latency,
                "gen_ai.latency.time_in_model_prefill": r.prefill_time,
                "gen_ai.latency.time_in_model_decode": r.decode_time,
                "gen_ai.latency.time_in_model_inference": r.inference_time,
            },
        )
        span.end(end_time=round(r.finished_ts * 1e9))

    def close(self) -> None:
        """Send everything still buffered."""
        self._closed.set()
        if self._logger is not None:
            self._logger.join()
        if self.plugin is not None:
            self.plugin.close()
        if self._provider is not None:
            self._provider.force_flush()
            self._provider.shutdown()


class LateBound:
    """A step callback for a simulator started before what it feeds: `first` gets each step at once, `then`
    (attached later, e.g. once a collector's receivers exist) gets every step, the early ones replayed."""

    def __init__(self, first: Callable[[StepRecord], None]) -> None:
        self._lock = threading.Lock()
        self._first = first
        self._early: list[StepRecord] = []
        self._then: Callable[[StepRecord], None] | None = None

    def __call__(self, step: StepRecord) -> None:
        self._first(step)
        with self._lock:
            if self._then is None:
                self._early.append(step)
                return
            self._then(step)

    def attach(self, then: Callable[[StepRecord], None]) -> None:
        with self._lock:
            self._then = then
            for step in self._early:
                then(step)
            self._early.clear()
