"""What of vLLM's configuration the timeline needs, read defensively (fields move between versions); and the
plugin's own settings from the environment."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

log = logging.getLogger("stepline.plugin")

TOKEN_VAR = "STEPLINE_PLUGIN_TOKEN"

# (section of VllmConfig, attribute, name on the timeline)
FIELDS = (
    ("model_config", "model", "model"),  # the path or hub id the weights came from
    ("model_config", "served_model_name", "served_model_name"),  # /metrics' model_name label; the timeline's name
    ("model_config", "max_model_len", "max_model_len"),
    ("scheduler_config", "max_num_batched_tokens", "max_num_batched_tokens"),
    ("scheduler_config", "max_num_seqs", "max_num_seqs"),
    ("scheduler_config", "enable_chunked_prefill", "enable_chunked_prefill"),
    ("scheduler_config", "long_prefill_token_threshold", "long_prefill_token_threshold"),
    ("scheduler_config", "prefill_schedule_interval", "prefill_schedule_interval"),
    ("scheduler_config", "policy", "scheduling_policy"),
    ("cache_config", "block_size", "block_size"),
    ("cache_config", "num_gpu_blocks", "num_gpu_blocks"),
    ("cache_config", "enable_prefix_caching", "enable_prefix_caching"),
    ("cache_config", "gpu_memory_utilization", "gpu_memory_utilization"),
    # How the engine core steps (vLLM 0.33 vllm/config/vllm.py:1668-1719 resolves async_scheduling: on by default on
    # GPUs; vllm/platforms/cpu.py turns it off on CPUs). With it, or with pipeline parallelism, the core steps
    # through its batch queue and SchedulerIterationDetails.elapsed_ms is the wait for a launched step, not its time.
    ("scheduler_config", "async_scheduling", "async_scheduling"),
    ("parallel_config", "tensor_parallel_size", "tensor_parallel_size"),
    ("parallel_config", "pipeline_parallel_size", "pipeline_parallel_size"),
    ("parallel_config", "data_parallel_size", "data_parallel_size"),
    ("parallel_config", "data_parallel_rank", "data_parallel_rank"),
    ("parallel_config", "enable_expert_parallel", "enable_expert_parallel"),
    ("parallel_config", "enable_elastic_ep", "enable_elastic_ep"),
    ("parallel_config", "_api_process_count", "api_server_count"),  # --api-server-count (config/parallel.py:447)
    ("parallel_config", "_api_process_rank", "api_server_rank"),
    ("compilation_config", "cudagraph_mode", "cudagraph_mode"),
    ("kv_transfer_config", "kv_role", "kv_role"),  # disaggregated prefill: kv_producer, kv_consumer or kv_both
    ("speculative_config", "method", "speculative_method"),
    ("speculative_config", "num_speculative_tokens", "num_speculative_tokens"),
    ("observability_config", "enable_logging_iteration_details", "enable_logging_iteration_details"),
)


def describe_config(vllm_config: Any, engine_index: int = 0) -> dict[str, Any]:
    """The settings that decide scheduling, as plain values; a missing section or field is left out."""
    described: dict[str, Any] = {"engine_index": engine_index}
    for section_name, attribute, name in FIELDS:
        section = getattr(vllm_config, section_name, None)
        if section is None:
            continue
        value = getattr(section, attribute, None)
        if isinstance(value, (list, tuple)):  # several served names: vLLM labels its metrics with the first
            value = value[0] if value else None
        if value is None:
            continue
        described[name] = value if isinstance(value, (bool, int, float, str)) else str(value)
    described["speculative_decoding"] = getattr(vllm_config, "speculative_config", None) is not None
    batches = _max_concurrent_batches(vllm_config)
    if batches is not None:
        described["max_concurrent_batches"] = batches
    if "served_model_name" not in described and "model" in described:
        described["served_model_name"] = described["model"]  # what vLLM serves (and labels) without --served-model-name
    return described


def _max_concurrent_batches(vllm_config: Any) -> int | None:
    """VllmConfig.max_concurrent_batches (a property: 2 with async scheduling, the pipeline's size with pipeline
    parallelism; vLLM 0.33 vllm/config/vllm.py:587-598); None where this vLLM has none or cannot say."""
    try:
        value = getattr(vllm_config, "max_concurrent_batches", None)
    except Exception:  # a property of a config this plugin does not know: left out, as a missing field is
        log.debug("stepline plugin: max_concurrent_batches unreadable", exc_info=True)
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def batch_queue(config: Mapping[str, Any]) -> bool:
    """Whether the engine core steps through its batch queue (vLLM 0.33 vllm/v1/engine/core.py:208-214: when
    max_concurrent_batches > 1): then it schedules the next step before the last one's outputs are back, and
    SchedulerIterationDetails.elapsed_ms times only its wait for a launched step (core.py:777-783), not the step.
    From max_concurrent_batches where the plugin read it, else from async scheduling or pipeline parallelism."""
    batches = config.get("max_concurrent_batches")
    if isinstance(batches, int) and not isinstance(batches, bool):
        return batches > 1
    pipeline = config.get("pipeline_parallel_size")
    return config.get("async_scheduling") is True or (isinstance(pipeline, int) and pipeline > 1)


def model_name(config: Mapping[str, Any]) -> str:
    """The name the timeline gives an engine's model: the served name, as vLLM's /metrics labels it; the model
    path only from a plugin that predates sending the served name."""
    return str(config.get("served_model_name") or config.get("model") or "")


def token_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The datagram token, read as the collector reads it: STEPLINE_PLUGIN_TOKEN, else the content of the file
    STEPLINE_PLUGIN_TOKEN_FILE names (without surrounding whitespace); None when neither is set.

    Never raises: an unreadable or empty file is logged (never its content) and means no token, so the
    collector rejects and counts this engine's datagrams, and the engine still starts.
    """
    env = os.environ if environ is None else environ
    token = env.get(TOKEN_VAR)
    if token:
        return token
    path = env.get(f"{TOKEN_VAR}_FILE")
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            token = fh.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        log.error("stepline plugin: cannot read %s_FILE=%s (%s): sending without a credential; a collector with a "
                  "token will reject this engine's data", TOKEN_VAR, path, getattr(exc, "strerror", None) or
                  type(exc).__name__)
        return None
    if not token:
        log.error("stepline plugin: %s_FILE=%s is empty: sending without a credential", TOKEN_VAR, path)
        return None
    return token
