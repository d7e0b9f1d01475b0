"""Typed rows that sources yield; each type maps to one timeline table, fields in column order."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple


def micros(seconds: float) -> int:
    """Wall-clock seconds to the DateTime64(6) integer the store takes."""
    return round(seconds * 1_000_000)


class EngineSample(NamedTuple):
    """One scraped /metrics sample."""

    ts: int
    host: str
    engine: str
    engine_index: str
    model_name: str
    metric: str
    kind: str
    labels: dict[str, str]
    value: float
    delta: float


class Event(NamedTuple):
    """Something that happened once: an engine went down, a configuration was seen, data was dropped."""

    ts: int
    host: str
    engine: str
    source: str
    kind: str
    severity: str
    message: str
    attributes: dict[str, str]


class Step(NamedTuple):
    """One engine iteration, as the stat-logger plugin saw it."""

    ts: int
    host: str
    engine: str
    engine_index: int
    model_name: str
    step: int
    elapsed_ms: float
    num_ctx_requests: int
    num_ctx_tokens: int
    num_generation_requests: int
    num_generation_tokens: int
    running: int
    waiting: int
    skipped_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    preempted: int
    spec_num_drafts: int
    spec_num_draft_tokens: int
    spec_num_accepted_tokens: int
    ttft_seconds: Sequence[float]  # a list, or an array of float32 as the plugin's wire carried them
    itl_seconds: Sequence[float]
    is_dummy: bool
    # vLLM's own reading (SchedulerIterationDetails.elapsed_ms) beside elapsed_ms, the step's duration as stepline
    # derives it, and which reading that is (sources.step_time); see the `steps` columns' comments.
    vllm_elapsed_ms: float = math.nan
    step_time: str = ""


# The finish reason of a request no report gave one for (vLLM's spans carry none). `requests` merges a request's
# reports by max: "(" sorts below every letter and digit, so a reason another report gives wins over this one, and
# this one over the "" of a report that says nothing.
UNKNOWN_FINISH_REASON = "(unknown)"


class Request(NamedTuple):
    """One finished request; ts is when it finished, arrival_ts when it reached the server."""

    ts: int
    host: str
    engine: str
    engine_index: int
    model_name: str
    request_id: str
    source: str  # "plugin" or "otlp"
    finish_reason: str
    arrival_ts: int
    queue_seconds: float
    prefill_seconds: float
    decode_seconds: float
    inference_seconds: float
    e2e_seconds: float
    ttft_seconds: float
    mean_tpot_seconds: float
    prompt_tokens: int
    cached_tokens: int
    generation_tokens: int
    max_tokens: int
    preemptions: int


class GpuSample(NamedTuple):
    """One NVML sample of one GPU; NaN (None for integers) where the GPU does not support a reading or it failed.

    Fields added after the first release come last, with defaults, so that the table only ever grows at its end.
    """

    ts: int
    host: str
    engine: str
    gpu_index: int
    gpu_uuid: str
    gpu_name: str
    sm_clock_mhz: float
    mem_clock_mhz: float
    power_w: float
    energy_mj: int | None  # cumulative: None when the read failed, never 0
    temp_gpu_c: float
    temp_mem_c: float
    util_gpu_pct: float
    util_mem_copy_pct: float
    mem_used_bytes: int | None  # None when the read failed, never 0
    mem_total_bytes: int | None
    pcie_tx_bytes_per_s: float
    pcie_rx_bytes_per_s: float
    pcie_replay_total: int | None  # cumulative: None when the read failed, never 0
    nvlink_tx_bytes_per_s: float
    nvlink_rx_bytes_per_s: float
    clock_event_reasons: int
    clock_event_flags: list[str]
    dram_bw_util_pct: float
    tensor_active_pct: float
    sm_occupancy_pct: float
    processes: dict[int, int]
    driver_version: str = ""
    power_instant_w: float = math.nan
    mem_reserved_bytes: int | None = None
    sm_active_pct: float = math.nan
    graphics_active_pct: float = math.nan
    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    remapped_rows_pending: bool | None = None
    remapped_rows_failure: bool | None = None


class HostSample(NamedTuple):
    """One psutil sample: of the host (scope "host", pid 0) or of one engine process (scope "process")."""

    ts: int
    host: str
    engine: str
    scope: str
    pid: int
    cpu_pct: float
    cpu_per_core_pct: list[float]
    load1: float
    mem_used_bytes: int
    mem_available_bytes: int
    mem_total_bytes: int
    swap_used_bytes: int
    rss_bytes: int
    threads: int
    open_files: int
    net_rx_bytes: dict[str, int]
    net_tx_bytes: dict[str, int]
    net_errors: dict[str, int]
    disk_read_bytes: int
    disk_write_bytes: int


class GatewayDecision(NamedTuple):
    """One routing attempt of a gateway in front of the engines: what it measured, what it chose, how it ended.
    `engine` is the backend chosen, named as stepline names engines (a URL's host:port); ts is when it decided."""

    ts: int
    host: str
    engine: str
    gateway: str
    request_id: str
    attempt: int
    lane: str
    candidates: list[str]
    size_chars: int | None
    size_bytes: int | None
    size_tokens: int | None
    threshold: float | None
    threshold_unit: str
    health: str
    in_flight: int | None
    status: int
    error_type: str
    client_disconnected: bool
    first_byte_ts: int | None
    end_ts: int
    swallowed_exception: str
    backend_engines: tuple[str, ...] = ()  # the engines behind a backend that stands for several (the join's)
    model: str = ""  # the model the backend was asked for (a LoRA adapter's name where one was)
    key: str = ""  # who sent it, where the gateway says: the API key's alias, its team, its user, the end user
    team: str = ""
    user: str = ""
    end_user: str = ""

    @property
    def tenant(self) -> str:
        """Who sent it, as one name (`tenant_of`)."""
        return tenant_of(self.team, self.key, self.end_user, self.user)


def tenant_of(team: str, key: str, end_user: str, user: str) -> str:
    """A request's tenant: the team where the gateway names one, else the API key's alias, else the end user, else
    the user ('' where it names none): the most stable name of who pays for it."""
    return team or key or end_user or user


class GatewaySample(NamedTuple):
    """One sample scraped from a gateway's /metrics; `engine` is the backend the series is about ('' for the
    gateway's own)."""

    ts: int
    host: str
    engine: str
    gateway: str
    metric: str
    kind: str
    labels: dict[str, str]
    value: float
    delta: float


class UsageMinute(NamedTuple):
    """One line of a minute's usage rollup (the usage_minutes table): a group of requests, or an engine's idle or
    unattributed time."""

    ts: int  # the minute's start
    host: str
    engine: str
    line: str  # request, idle or unattributed
    gpu_name: str
    model: str
    lane: str
    adapter: str
    key: str
    team: str
    user: str
    end_user: str
    requests: int
    prompt_tokens: int
    generation_tokens: int
    engine_us: int
    gpu_seconds: float
    energy_mj: int | None
    gpus: int


Row = (EngineSample | Event | Step | Request | GpuSample | HostSample | GatewayDecision | GatewaySample
       | UsageMinute)

TABLE_OF: dict[type[Row], str] = {
    EngineSample: "engine_samples",
    Event: "events",
    Step: "steps",
    Request: "requests",
    GpuSample: "gpu_samples",
    HostSample: "host_samples",
    GatewayDecision: "gateway_decisions",
    GatewaySample: "gateway_samples",
    UsageMinute: "usage_minutes",
}
