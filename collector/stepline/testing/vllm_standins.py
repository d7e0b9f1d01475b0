"""Stand-ins for vLLM 0.33's stats classes, with exactly their attribute names.

vLLM (and its GPU stack) is not installed where stepline is tested, so these carry the shapes the
plugin reads: `SchedulerStats` with `SchedulerIterationDetails`, `PrefixCacheStats` and
`SpecDecodingStats`; `IterationStats` with `FinishedRequestStats`. The simulator feeds the plugin
through them too. `write_vllm_package` writes a stand-in `vllm` package with the plugin's base class.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path


class FinishReason(enum.IntEnum):
    """vLLM's FinishReason: an IntEnum (its str() is the lower-case name)."""

    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3
    REPETITION = 4

    def __str__(self) -> str:
        return self.name.lower()


@dataclass
class SchedulerIterationDetails:
    iteration_index: int
    num_ctx_requests: int
    num_ctx_tokens: int
    num_generation_requests: int
    num_generation_tokens: int
    elapsed_ms: float
    num_encoder_inputs: int = 0
    num_encoder_output_tokens: int = 0
    is_dummy: bool = False


@dataclass
class PrefixCacheStats:
    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0


@dataclass
class SpecDecodingStats:
    num_spec_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)


@dataclass
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_skipped_waiting_reqs: int = 0
    step_counter: int = 0
    current_wave: int = 0
    kv_cache_usage: float = 0.0
    iteration_details: SchedulerIterationDetails | None = None
    prefix_cache_stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    connector_prefix_cache_stats: PrefixCacheStats | None = None
    spec_decoding_stats: SpecDecodingStats | None = None


@dataclass
class FinishedRequestStats:
    finish_reason: FinishReason
    request_id: str | None = None
    e2e_latency: float = 0.0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    max_tokens_param: int | None = None
    queued_time: float = 0.0
    prefill_time: float = 0.0
    inference_time: float = 0.0
    decode_time: float = 0.0
    mean_time_per_output_token: float = 0.0
    is_corrupted: bool = False
    num_cached_tokens: int = 0
    num_preemptions: int = 0


@dataclass
class PromptTokenStats:
    computed: int = 0
    local_cache_hit: int = 0
    external_kv_transfer: int = 0
    cached_tokens: int = 0
    total: int = 0


@dataclass
class IterationStats:
    iteration_timestamp: float = 0.0
    num_generation_tokens: int = 0
    prompt_token_stats: PromptTokenStats = field(default_factory=PromptTokenStats)
    num_preempted_reqs: int = 0
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    max_num_generation_tokens_iter: list[int] = field(default_factory=list)
    n_params_iter: list[int] = field(default_factory=list)
    time_to_first_tokens_iter: list[float] = field(default_factory=list)
    inter_token_latencies_iter: list[float] = field(default_factory=list)
    num_corrupted_reqs: int = 0


# vLLM's module that stat-logger plugins import, with its ABC as vLLM 0.32/0.33 declare it: for tests that load
# the plugin class as vLLM would, in a process where vLLM itself is not installed.
STAT_LOGGER_BASE_SOURCE = '''
from abc import ABC, abstractmethod


class StatLoggerBase(ABC):
    @abstractmethod
    def __init__(self, vllm_config, engine_index=0): ...

    @abstractmethod
    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0): ...

    @abstractmethod
    def log_engine_initialized(self): ...

    def log(self):
        pass

    def record_sleep_state(self, is_awake, level):
        pass
'''


def write_vllm_package(root: Path) -> Path:
    """Write a stand-in `vllm` package (just `vllm.v1.metrics.loggers.StatLoggerBase`) under `root`; returns root."""
    loggers = root / "vllm" / "v1" / "metrics"
    loggers.mkdir(parents=True, exist_ok=True)
    for package in (root / "vllm", root / "vllm" / "v1", loggers):
        (package / "__init__.py").write_text("")
    (loggers / "loggers.py").write_text(STAT_LOGGER_BASE_SOURCE)
    return root
