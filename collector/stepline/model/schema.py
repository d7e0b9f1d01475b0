"""The timeline's DDL: one definition per table, rendered for one node or for a cluster."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from stepline.model.rows import UNKNOWN_FINISH_REASON

# Bump when a table changes shape; `Store` refuses a store that holds a newer version. Comments are not shape:
# `Store` gives any store today's comments, so an older stepline can still open a store a newer one described.
# 2: `requests` became an AggregatingMergeTree keyed by (host, engine, request_id) that merges the plugin's and
# OTLP's reports of a request field by field (`Store` rebuilds a version-1 table in place).
# 3: `gpu_samples`' cumulative counters (energy_mj, pcie_replay_total) became Nullable: a failed read is NULL, which
# min/max (and so max - min) pass over, where it was a 0 that made one minute's energy everything since the driver
# loaded (`Store` converts them in place, and turns version 2's zero energy readings, which were failures, to NULL).
# 4: `gpu_samples`' memory (mem_used_bytes, mem_total_bytes) became Nullable: a failed read is NULL, where it was a 0
# that read as an empty GPU (`Store` converts them in place, and turns version 3's failed reads, a total of 0, to NULL).
# 5: `requests` is keyed by (host, engine, request_id, arrival_ts): two requests that share an id (a client's or a
# gateway's X-Request-Id, reused by retries) are two rows, where they merged into one (`Store` rebuilds a version-4
# table in place; what version 4 had already merged stays one row).
# 6: `steps` gained vllm_elapsed_ms and step_time, and elapsed_ms became the step's duration as stepline derives it
# (under async scheduling vLLM's reading is a wait, not a duration); added columns, no rebuild (rows older collectors
# wrote hold 0 and '' in them).
# 7: `gateway_decisions` gained backend_engines, and who sent each request: model, key, team, user, end_user
# (added columns, no rebuild: rows written before hold [] and ''); and `usage_minutes`, the collector's per-minute
# rollup of who used the GPUs (a new table: `Store` creates it in a store of version 6).
SCHEMA_VERSION = 7

TIME = "DateTime64(6, 'UTC') CODEC(DoubleDelta, ZSTD(1))"
DIM = "LowCardinality(String)"
COUNTER = "UInt64 CODEC(Delta, ZSTD(1))"
# A cumulative counter read from a device: NULL when the read failed, so that max - min over a window ignores it.
MAYBE_COUNTER = "Nullable(UInt64) CODEC(Delta, ZSTD(1))"
# A byte count read from a device: NULL when the read failed, never a 0 that reads as real.
MAYBE_BYTES = "Nullable(UInt64) CODEC(Delta, ZSTD(1))"
MAYBE_COUNT = "Nullable(UInt32) CODEC(T64, ZSTD(1))"
GAUGE = "Float64 CODEC(Gorilla, ZSTD(1))"
SMALL_GAUGE = "Float32 CODEC(Gorilla, ZSTD(1))"
COUNT = "UInt32 CODEC(T64, ZSTD(1))"
SAMPLES = "Array(Float32) CODEC(ZSTD(1))"


@dataclass(frozen=True)
class Projection:
    """Aggregates a table keeps per bucket beside its rows (inside each part, so they merge, expire and
    deduplicate with it: a retried insert the table drops adds nothing to them). ClickHouse reads them instead of
    the rows for a query that filters and groups on the bucket expression (or functions of it) and whose
    aggregates are all among these, written the same way. On a cluster they belong to each shard's `_local`
    table (a Distributed table has none: it reads them through the shards)."""

    name: str
    keys: tuple[str, ...]
    aggregates: tuple[str, ...]
    # A copy of some columns sorted by `keys` instead (`aggregates` are then the columns carried beside them):
    # rows, not aggregates, so a query that merges a request's reports reads them as it reads the table's.
    ordered: bool = False

    def select(self) -> str:
        keys = ", ".join(self.keys)
        if self.ordered:
            return f"SELECT {keys}, {', '.join(self.aggregates)} ORDER BY {keys}"
        return f"SELECT {keys}, {', '.join(self.aggregates)} GROUP BY {keys}"


def merged(type_: str, function: str = "max") -> str:
    """A column of an AggregatingMergeTree whose rows of one key merge to one value by `function` (codec kept).

    `max` is what merging two partial reports needs: an unknown value is the type's least ('' for text, 0 for
    counts, NaN for seconds, which max passes over), so the report that knows a field gives it, in any order,
    and merging a report with itself (a retry, a replayed batch) changes nothing. `min` and `max` are the
    functions whose state is the value itself, so the column reads as its plain type.
    """
    base, codec = type_.split(" CODEC(", 1) if " CODEC(" in type_ else (type_, "")
    return f"SimpleAggregateFunction({function}, {base})" + (f" CODEC({codec}" if codec else "")


class Column(NamedTuple):
    """One column: its name, its type (codec included) and its comment: what it holds, in which unit, from where."""

    name: str
    type: str
    comment: str


@dataclass(frozen=True)
class Table:
    """One table stepline creates: its columns, its sorting key, its comment and its projections."""

    name: str
    definition: tuple[Column, ...]
    order_by: tuple[str, ...]
    comment: str
    projections: tuple[Projection, ...] = ()
    engine: str = "MergeTree"  # the MergeTree family member; on a cluster, its Replicated form

    @property
    def columns(self) -> tuple[tuple[str, str], ...]:
        """(name, type) of each column, in order."""
        return tuple((c.name, c.type) for c in self.definition)

    @property
    def column_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.definition)

    @property
    def column_comments(self) -> dict[str, str]:
        return {c.name: c.comment for c in self.definition}


_HOST_COMMENT = "The collector's host name (--host-name, STEPLINE_HOST_NAME; default the machine's hostname)."
_PLUGIN_ENGINE = ("the plugin's STEPLINE_ENGINE, else OTEL_SERVICE_NAME, else 'vllm' (the NAME= of --engine should be "
                 "the same)")


def _key(ts: str, engine: str) -> tuple[Column, Column, Column]:
    """The (ts, host, engine) every table starts with; `ts` and `engine` mean something per table."""
    return (Column("ts", TIME, f"{ts}; UTC, microseconds."), Column("host", DIM, _HOST_COMMENT),
            Column("engine", DIM, engine))


# What the dashboards and the detectors read per second or per minute of steps instead of every step: a day of
# eight engines is 30M steps and 1.5G ITL samples, but 690k seconds and 11.5k minutes. Quantiles come from
# bfloat16 histograms (about 3 significant digits).
STEP_AGGREGATES = (
    "count()",
    "sum(elapsed_ms)",
    "max(elapsed_ms)",
    "sum(num_ctx_tokens)",
    "countIf(num_ctx_tokens > 0)",
    "maxIf(num_ctx_tokens, num_ctx_requests = 1)",
    "max(num_ctx_tokens + num_generation_tokens)",
    "sum(num_generation_tokens)",
    "sumIf(num_generation_tokens, NOT is_dummy)",
    "max(running)",
    "max(waiting)",
    "argMax(waiting, ts)",
    "min(ts)",
    "max(ts)",
    "max(kv_cache_usage)",
    "countIf(kv_cache_usage >= 0.95)",
    "sum(preempted)",
    "sum(prefix_cache_hits)",
    "sum(prefix_cache_queries)",
    "sum(spec_num_drafts)",
    "sum(spec_num_draft_tokens)",
    "sum(spec_num_accepted_tokens)",
    "countIf(num_ctx_tokens = 0 AND num_generation_requests BETWEEN 1 AND 4 AND elapsed_ms > 0)",
    "maxArray(itl_seconds)",
    "quantilesBFloat16Array(0.5, 0.99)(itl_seconds)",
)
# The detectors' baselines over long windows (decode-only steps; "alone": 1-4 decoders, no prefill), per minute
# only: per second they would cost inserts more than they save.
STEP_BASELINES = (
    "quantilesBFloat16ArrayIf(0.5, 0.99)(itl_seconds, num_ctx_tokens = 0)",
    "quantilesBFloat16If(0.5)(elapsed_ms, num_ctx_tokens = 0 AND num_generation_requests > 0)",
    "quantilesBFloat16If(0.5)(elapsed_ms, num_ctx_tokens = 0 AND num_generation_requests BETWEEN 1 AND 4 "
    "AND elapsed_ms > 0)",
)
STEPS_PER_SECOND = Projection("steps_per_second", ("host", "engine", "engine_index", "toStartOfSecond(ts)"),
                              STEP_AGGREGATES)
STEPS_PER_MINUTE = Projection("steps_per_minute", ("host", "engine", "engine_index", "toStartOfMinute(ts)"),
                              STEP_AGGREGATES + STEP_BASELINES)
# The baselines' quantile states per hour too: over a day of 64 engines the per-minute states are 92k rows of
# bfloat16 histograms to merge (0.29 s for the decode-only baselines), per hour 1.5k. Windows of HOURS_FROM whole
# hours or more read them (diagnosis.rollup.approximate_span).
STEPS_BASELINES_PER_HOUR = Projection("steps_baselines_per_hour",
                                      ("host", "engine", "engine_index", "toStartOfHour(ts)"), STEP_BASELINES)
# Steps in which requests waited while some running requests were not scheduled: leaked_slots reads the steps of the
# engines that had any, not of every engine (the last 6 h of a day of 64 engines: 62M steps, 0.45 s; a healthy
# engine schedules every running request while others wait, unless its budget is spent). A projection of its own:
# the others' definitions are those stores already hold. `waiting` counts deferred requests too (the steps table).
UNSCHEDULED_WHILE_WAITING = "countIf(waiting > 0 AND toInt64(running) > num_generation_requests + num_ctx_requests)"
STEPS_UNSCHEDULED_PER_MINUTE = Projection("steps_unscheduled_per_minute",
                                          ("host", "engine", "engine_index", "toStartOfMinute(ts)"),
                                          (UNSCHEDULED_WHILE_WAITING,))
# NVML at 10 Hz is 6.9M rows a day for eight GPUs; per minute, 11.5k.
GPU_AGGREGATES = (
    "count()",
    "any(gpu_name)",
    "avg(sm_clock_mhz)",
    "min(sm_clock_mhz)",
    "avg(mem_clock_mhz)",
    "avg(power_w)",
    "max(power_w)",
    "avg(power_instant_w)",
    "max(power_instant_w)",
    "min(energy_mj)",
    "max(energy_mj)",
    "min(pcie_replay_total)",
    "max(pcie_replay_total)",
    "max(temp_gpu_c)",
    "max(temp_mem_c)",
    "avg(util_gpu_pct)",
    "avg(tensor_active_pct)",
    "avg(sm_occupancy_pct)",
    "avg(sm_active_pct)",
    "avg(graphics_active_pct)",
    "avg(dram_bw_util_pct)",
    "max(mem_used_bytes)",
    "max(mem_total_bytes)",
    "avg(pcie_tx_bytes_per_s)",
    "avg(pcie_rx_bytes_per_s)",
    "avg(nvlink_tx_bytes_per_s)",
    "avg(nvlink_rx_bytes_per_s)",
    "avg(nvlink_tx_bytes_per_s + nvlink_rx_bytes_per_s)",
    "avg(pcie_tx_bytes_per_s + pcie_rx_bytes_per_s)",
    "max(remapped_rows_uncorrectable)",
    "max(remapped_rows_pending)",
    "max(remapped_rows_failure)",
)
# nvmlClocksEventReason* bits (nvml.h, whose nvmlClocksEventReasonAll ORs 0x001-0x100). 0x200 and 0x400 are in no
# nvml.h: only pynvml defines them (nvmlClocksThrottleReasonBoardLimit, ...Reliability), so their names say so.
CLOCK_EVENT_FLAGS = (
    (0x001, "gpu_idle"), (0x002, "applications_clocks_setting"), (0x004, "sw_power_cap"), (0x008, "hw_slowdown"),
    (0x010, "sync_boost"), (0x020, "sw_thermal_slowdown"), (0x040, "hw_thermal_slowdown"),
    (0x080, "hw_power_brake_slowdown"), (0x100, "display_clock_setting"), (0x200, "pynvml_only_board_limit"),
    (0x400, "pynvml_only_reliability"),
)
# The reasons that hold a busy GPU's clocks down (not idling, not a clock setting), and a GPU busy from this
# util_gpu_pct (a share of its time): what gpu_throttling counts. Per minute in a projection of their own, read
# from the bitmask (a day of 64 GPUs at 10 Hz is 55M samples: 3.4 s with hasAny over the flags' names, 1.1 s over
# the bits, a few ms per minute).
THROTTLE_FLAGS = ("sw_power_cap", "hw_slowdown", "hw_thermal_slowdown", "sw_thermal_slowdown",
                  "hw_power_brake_slowdown")
THROTTLE_BITS = sum(bit for bit, name in CLOCK_EVENT_FLAGS if name in THROTTLE_FLAGS)
BUSY_GPU_PCT = 5.0
GPU_BUSY = f"util_gpu_pct >= {BUSY_GPU_PCT}"
GPU_THROTTLED = f"bitAnd(clock_event_reasons, {THROTTLE_BITS}) != 0"
GPU_THROTTLING = (
    "any(gpu_name)",
    "max(sm_clock_mhz)",
    f"countIf({GPU_BUSY})",
    f"countIf({GPU_BUSY} AND {GPU_THROTTLED})",
    f"sumIf(sm_clock_mhz, {GPU_BUSY} AND {GPU_THROTTLED})",
    f"sumIf(sm_clock_mhz, {GPU_BUSY} AND NOT {GPU_THROTTLED})",
    f"groupBitOr(bitAnd(clock_event_reasons, {THROTTLE_BITS}))",
    f"minIf(ts, {GPU_THROTTLED})",
    f"maxIf(ts, {GPU_THROTTLED})",
)
GPU_THROTTLING_PER_MINUTE = Projection("gpu_throttling_per_minute",
                                       ("host", "engine", "gpu_index", "toStartOfMinute(ts)"), GPU_THROTTLING)
GPU_SAMPLES_PER_MINUTE = Projection("gpu_samples_per_minute", ("host", "engine", "gpu_index", "toStartOfMinute(ts)"),
                                    GPU_AGGREGATES)

# Which engines were scraped when: `diagnose` lists a window's engines from it (a day of 64 engines' /metrics is
# 91M samples, 0.34 s to list the engines in, a few ms per minute).
ENGINE_SAMPLES_PER_MINUTE = Projection("engine_samples_per_minute", ("host", "engine", "toStartOfMinute(ts)"),
                                       ("count()",))

# The requests of each engine by prompt size: the long-prefill candidates (a few hundred of a day's 16.6M requests
# on 64 engines, all with prompts of 32k+ tokens) are read from the 3% of rows that large instead of every row
# (that read over 24 h: 1.53 s -> 0.35 s on a loaded machine; benchmarks/RESULTS.md, 2026-12-04). Rows, not
# aggregates: the reads merge a request's reports by key as they do from the table, so a report not yet merged in
# the background is merged there, never counted twice. Only the columns those reads take.
REQUESTS_BY_PROMPT = Projection("requests_by_prompt", ("engine", "prompt_tokens"),
                                ("host", "request_id", "arrival_ts", "ts", "cached_tokens", "queue_seconds",
                                 "ttft_seconds"), ordered=True)

# Decode rates differ by workload class: reads report them per prompt-size band (name, upper bound), never as one
# number; a band's index groups millions of requests for less than its name.
PROMPT_BANDS = (("< 1k", 1024), ("1k-8k", 8192), ("8k-32k", 32768), ("32k-100k", 100000), (">= 100k", None))
PROMPT_BAND_INDEX = "multiIf(" + ", ".join(f"prompt_tokens < {bar}, {i}" for i, (_, bar) in enumerate(PROMPT_BANDS)
                                           if bar) + f", {len(PROMPT_BANDS) - 1})"
# A request whose decode rate (1 / mean TPOT) means something: it generated two tokens or more.
DECODED = "mean_tpot_seconds > 0 AND isFinite(mean_tpot_seconds) AND generation_tokens > 1"
# Each engine's requests per minute of their finish, by source and prompt band: what the detectors read over long
# windows instead of every request (a day of 64 engines: 16.6M requests, 0.4-0.55 s a full read, merged; 410k rows
# here). These are aggregates of reports, not of merged requests: a request two reports gave (a span written before
# its plugin report) counts once per source until a background merge rebuilds the part's projection from its merged
# rows (deduplicate_merge_projection_mode = 'rebuild'). The collector writes a source's report of a request once
# (stepline.ingest.merge), so a read of one source's rows counts each request once.
REQUEST_AGGREGATES = (
    "count()",
    "countIf(prompt_tokens > 0)",
    "sumIf(least(cached_tokens, prompt_tokens) / prompt_tokens, prompt_tokens > 0)",
    "sum(prompt_tokens)",
    f"minIf(prompt_tokens, {DECODED})",
    f"countIf({DECODED})",
    f"quantilesBFloat16If(0.01, 0.5)(1 / mean_tpot_seconds, {DECODED})",
)
REQUESTS_PER_MINUTE = Projection("requests_per_minute", ("host", "engine", "source", "toStartOfMinute(ts)",
                                                         PROMPT_BAND_INDEX), REQUEST_AGGREGATES)

TABLES: tuple[Table, ...] = (
    Table(
        "steps",
        (
            *_key("End of the engine step: vLLM's IterationStats.iteration_timestamp (the plugin's clock when vLLM "
                  "gives none)", f"Engine name: {_PLUGIN_ENGINE}."),
            Column("engine_index", "UInt16", "vLLM's engine index (data-parallel rank) the step ran on: the "
                   "engine_idx vLLM passes to the stat logger."),
            Column("model_name", DIM, "The served model, from the engine's configuration (the plugin's "
                   "engine_config event); '' until the collector has seen it."),
            Column("step", COUNTER, "Iteration number: SchedulerIterationDetails.iteration_index; without "
                   "iteration details, the plugin's own count per engine index."),
            Column("elapsed_ms", SMALL_GAUGE, "Duration of the step, ms, as every stepline reader takes it; "
                   "`step_time` says which reading it is. An engine core that steps synchronously: vLLM's "
                   "SchedulerIterationDetails.elapsed_ms, the step's wall time ('elapsed'). One that steps through "
                   "its batch queue (async scheduling, vLLM 0.33's default on GPUs, or pipeline parallelism), where "
                   "vLLM's reading is only the core's wait for a step it launched earlier: the time since the "
                   "core's previous step ended, per step in between, and never less than vLLM's reading "
                   "('cadence'); vLLM's reading where no previous step bounds it, after an idle engine or out of "
                   "order ('wait'). NaN when vLLM runs without --enable-logging-iteration-details."),
            Column("num_ctx_requests", COUNT, "Requests that had prompt (prefill) tokens computed in the step "
                   "(SchedulerIterationDetails.num_ctx_requests); 0 without iteration details."),
            Column("num_ctx_tokens", COUNT, "Prompt (prefill) tokens computed in the step, summed over its "
                   "requests (SchedulerIterationDetails.num_ctx_tokens); 0 without iteration details. The timeline "
                   "view calls it prefill_tokens, and `stepline timeline` prints it as prefill."),
            Column("num_generation_requests", COUNT, "Requests that decoded in the step "
                   "(SchedulerIterationDetails.num_generation_requests); 0 without iteration details. The timeline "
                   "view and `stepline timeline` call it decoding."),
            Column("num_generation_tokens", COUNT, "With iteration details, the tokens scheduled in the step for "
                   "the requests past their prefill (SchedulerIterationDetails.num_generation_tokens): with "
                   "speculative decoding each one's drafts too, accepted or not. Tokens generated are "
                   "num_generation_tokens - (spec_num_draft_tokens - spec_num_accepted_tokens) "
                   "(stepline.queries.steps.GENERATED). Without iteration details (elapsed_ms NaN), the tokens "
                   "generated (IterationStats.num_generation_tokens)."),
            Column("running", COUNT, "Requests running after the step (SchedulerStats.num_running_reqs)."),
            Column("waiting", COUNT, "Requests waiting to be scheduled after the step, deferred ones included, as "
                   "vllm:num_requests_waiting counts them: SchedulerStats.num_waiting_reqs (which leaves the deferred "
                   "out) + num_skipped_waiting_reqs (older collectors stored num_waiting_reqs alone)."),
            Column("skipped_waiting", COUNT, "Of `waiting`, the requests the scheduler deferred: passed over for a "
                   "transient constraint (LoRA budget, KV transfer, output still in flight) or a blocked status "
                   "(structured-output grammar, remote KVs, streaming input); SchedulerStats.num_skipped_waiting_reqs, "
                   "vllm:num_requests_waiting_by_reason{reason='deferred'}. waiting - skipped_waiting wait for "
                   "capacity."),
            Column("kv_cache_usage", SMALL_GAUGE, "Share of the KV cache in use after the step, 0-1 fraction "
                   "(SchedulerStats.kv_cache_usage)."),
            Column("prefix_cache_queries", COUNT, "Prompt tokens looked up in the prefix cache in the step "
                   "(PrefixCacheStats.queries; preempted requests' lookups are not counted)."),
            Column("prefix_cache_hits", COUNT, "Of those, the tokens found in the prefix cache "
                   "(PrefixCacheStats.hits); hits / queries is the hit rate."),
            Column("preempted", COUNT, "Requests preempted in the step (IterationStats.num_preempted_reqs)."),
            Column("spec_num_drafts", COUNT, "Speculative-decoding drafts proposed in the step "
                   "(SpecDecodingStats.num_drafts); 0 without speculative decoding."),
            Column("spec_num_draft_tokens", COUNT, "Draft tokens proposed in the step "
                   "(SpecDecodingStats.num_draft_tokens); 0 without speculative decoding."),
            Column("spec_num_accepted_tokens", COUNT, "Draft tokens accepted in the step "
                   "(SpecDecodingStats.num_accepted_tokens); accepted / draft tokens is the acceptance rate."),
            Column("ttft_seconds", SAMPLES, "Time to first token of each request whose first token came in the "
                   "step, s (IterationStats.time_to_first_tokens_iter)."),
            Column("itl_seconds", SAMPLES, "Inter-token latency of each token generated in the step after a "
                   "request's first, s (IterationStats.inter_token_latencies_iter)."),
            Column("is_dummy", "Bool", "A dummy step that a data-parallel rank with no work runs to keep in step "
                   "with the others (SchedulerIterationDetails.is_dummy)."),
            Column("vllm_elapsed_ms", SMALL_GAUGE, "vLLM's own SchedulerIterationDetails.elapsed_ms, ms: the step's "
                   "wall time when the engine core steps synchronously, the core's wait for it when it steps "
                   "through its batch queue (vLLM 0.33 vllm/v1/engine/core.py:777-783: near 0 when the GPU "
                   "finished first). NaN without iteration details; 0 in rows older collectors wrote."),
            Column("step_time", DIM, "Which reading elapsed_ms is: 'elapsed' (vLLM's, a synchronous engine core), "
                   "'cadence' (time between the batch-queued core's step ends), 'wait' (vLLM's wait reading, where "
                   "no cadence bounds it); '' without iteration details and in rows older collectors wrote."),
        ),
        ("host", "engine", "engine_index", "ts", "step"),
        "One row per engine iteration, from the stat-logger plugin.",
        (STEPS_PER_SECOND, STEPS_PER_MINUTE, STEPS_BASELINES_PER_HOUR, STEPS_UNSCHEDULED_PER_MINUTE),
    ),
    # Both the plugin and OTLP report a finished request, each knowing fields the other does not (the plugin:
    # finish reason, cached tokens, preemptions, engine index; OTLP: whatever it was sent). Each report is a row;
    # rows of one (host, engine, request_id, arrival_ts) merge into one with each field's largest value (`merged`),
    # in whichever order and however often they arrive: after a collector restart, from a replayed spool, or
    # retried. Request ids repeat (clients set X-Request-Id and retries reuse it), so the arrival is part of the key:
    # the collector gives every report of one request the arrival its first report had, and a report of another
    # request its own (stepline.ingest.merge says how it tells them apart). It writes a report only when it adds a
    # field, so most requests are one row from the start; until ClickHouse merges the rest in the background,
    # readers use FINAL. The two reports' finish times differ by milliseconds (the plugin's step against the span's
    # end): the earlier stays.
    Table(
        "requests",
        (
            Column("ts", merged(TIME, "min"), "When the request finished: the plugin's step timestamp, or the OTLP "
                   "span's end, the earlier where both report it; UTC, microseconds."),
            Column("host", DIM, _HOST_COMMENT),
            Column("engine", DIM, f"Engine name: {_PLUGIN_ENGINE}; for spans, the resource attribute "
                   "stepline.engine, else service.name."),
            Column("engine_index", merged("UInt16"), "vLLM's engine index (data-parallel rank); 0 for OTLP spans."),
            Column("model_name", merged(DIM), "The served model: the engine's configuration (plugin); for a span, "
                   "gen_ai.response.model, else the engine's model as the collector knows it (its plugin's "
                   "engine_config, its /metrics' model_name label; vLLM's spans name no model), else "
                   "gen_ai.request.model; the larger where two differ."),
            Column("request_id", "String", "vLLM's request id (FinishedRequestStats.request_id; gen_ai.request.id), "
                   "built from the client's X-Request-Id where it sent one: not unique, since retries reuse it; "
                   "(engine, request_id, arrival_ts) is."),
            Column("source", merged(DIM), "'plugin' when the stat-logger plugin reported the request (finish_reason, "
                   "cached_tokens and preemptions are then vLLM's), 'otlp' when only an OTLP span did. A request "
                   "both report is one row with the fields of both (read it with FINAL)."),
            Column("finish_reason", merged(DIM), "Why it finished: stop, length, abort, error or repetition "
                   "(FinishedRequestStats.finish_reason; the first of gen_ai.response.finish_reasons); "
                   f"'{UNKNOWN_FINISH_REASON}' when no report said which: a span without the attribute (vLLM's "
                   "never carry it) and no plugin report, or a reason the plugin does not know. It sorts below "
                   "every reason, so that a report's reason wins the merge."),
            Column("arrival_ts", TIME, "When the request reached the server: ts less e2e_seconds (plugin), or the "
                   "span's start (OTLP), as its first report gave it; UTC, microseconds. Part of the key: requests "
                   "that share a request_id are told apart by it."),
            Column("queue_seconds", merged(SMALL_GAUGE), "Time waiting before first scheduled, s "
                   "(FinishedRequestStats.queued_time; gen_ai.latency.time_in_queue)."),
            Column("prefill_seconds", merged(SMALL_GAUGE), "Time from first scheduled to first token, s "
                   "(FinishedRequestStats.prefill_time; gen_ai.latency.time_in_model_prefill)."),
            Column("decode_seconds", merged(SMALL_GAUGE), "Time from first token to last, s "
                   "(FinishedRequestStats.decode_time; gen_ai.latency.time_in_model_decode)."),
            Column("inference_seconds", merged(SMALL_GAUGE), "Time from first scheduled to finish (prefill + "
                   "decode), s (FinishedRequestStats.inference_time; gen_ai.latency.time_in_model_inference)."),
            Column("e2e_seconds", merged(SMALL_GAUGE), "Time from arrival to finish, s "
                   "(FinishedRequestStats.e2e_latency; gen_ai.latency.e2e)."),
            Column("ttft_seconds", merged(SMALL_GAUGE), "Time from arrival to first token, s: e2e less decode "
                   "(plugin), or gen_ai.latency.time_to_first_token (OTLP)."),
            Column("mean_tpot_seconds", merged(SMALL_GAUGE), "Mean time per output token after the first, s "
                   "(FinishedRequestStats.mean_time_per_output_token; OTLP: decode / (generation_tokens - 1), NaN "
                   "under 2 tokens)."),
            Column("prompt_tokens", merged(COUNT), "Prompt length, tokens (FinishedRequestStats.num_prompt_tokens; "
                   "gen_ai.usage.prompt_tokens)."),
            Column("cached_tokens", merged(COUNT), "Prompt tokens served from the prefix cache "
                   "(FinishedRequestStats.num_cached_tokens); OTLP spans do not carry it: 0 where source is 'otlp'."),
            Column("generation_tokens", merged(COUNT), "Tokens generated (FinishedRequestStats.num_generation_tokens; "
                   "gen_ai.usage.completion_tokens)."),
            Column("max_tokens", merged(COUNT), "The request's max_tokens (FinishedRequestStats.max_tokens_param; "
                   "gen_ai.request.max_tokens); 0 when unset."),
            Column("preemptions", merged(COUNT), "Times the request was preempted "
                   "(FinishedRequestStats.num_preemptions); OTLP spans do not carry it: 0 where source is 'otlp'."),
        ),
        ("host", "engine", "request_id", "arrival_ts"),
        "One row per finished request (ts = finish time), the plugin's and OTLP's reports merged field by field: "
        "read it with FINAL (SELECT ... FROM requests FINAL) for one row per request.",
        (REQUESTS_BY_PROMPT, REQUESTS_PER_MINUTE),
        engine="AggregatingMergeTree",
    ),
    Table(
        "engine_samples",
        (
            *_key("When the collector scraped the engine's /metrics (the collector's clock)",
                  "Engine name: the NAME of --engine NAME=URL, else the URL's host:port."),
            Column("engine_index", DIM, "vLLM's engine label (engine index) of the series; '' when absent."),
            Column("model_name", DIM, "vLLM's model_name label of the series (else of the scrape's other series)."),
            Column("metric", DIM, "Sample name as exposed, histogram suffix included, e.g. vllm:num_requests_waiting, "
                   "vllm:time_to_first_token_seconds_bucket."),
            Column("kind", "Enum8('counter' = 1, 'gauge' = 2, 'bucket' = 3, 'sum' = 4, 'count' = 5, 'info' = 6)",
                   "What the sample is, from the family's TYPE: counter, gauge, info, or a histogram's bucket, sum or "
                   "count."),
            Column("labels", "Map(LowCardinality(String), String)", "The series' other labels (le, "
                   "finished_reason, ...), without model_name and engine."),
            Column("value", GAUGE, "The sample's value as exposed, in the metric's unit (cumulative for counter "
                   "kinds)."),
            Column("delta", GAUGE, "For counter kinds (counter, bucket, sum, count): the increase since the "
                   "previous scrape, reset-safe (sum it for rates); 0 for gauges and info, and at the collector's "
                   "first scrape."),
        ),
        ("host", "engine", "metric", "ts"),
        "Every vllm: sample scraped from /metrics; delta is the reset-safe increase for counter kinds.",
        (ENGINE_SAMPLES_PER_MINUTE,),
    ),
    Table(
        "gpu_samples",
        (
            *_key("When the collector sampled the GPU (the collector's clock); gpu_ts in the timeline view",
                  "The engine whose process, or a child of it, runs on the GPU (NVML's compute processes "
                  "matched to the engine processes the host source found); '' when unknown."),
            Column("gpu_index", "UInt8", "NVML device index (nvmlDeviceGetHandleByIndex)."),
            Column("gpu_uuid", DIM, "GPU UUID (nvmlDeviceGetUUID)."),
            Column("gpu_name", DIM, "GPU model, e.g. NVIDIA H200 (nvmlDeviceGetName)."),
            Column("sm_clock_mhz", SMALL_GAUGE, "SM clock, MHz (nvmlDeviceGetClockInfo, NVML_CLOCK_SM); NaN when "
                   "unsupported."),
            Column("mem_clock_mhz", SMALL_GAUGE, "Memory clock, MHz (nvmlDeviceGetClockInfo, NVML_CLOCK_MEM), read "
                   "once a second and carried forward in between; NaN when unsupported."),
            Column("power_w", SMALL_GAUGE, "Power draw averaged by the driver over the last second, W (field "
                   "NVML_FI_DEV_POWER_AVERAGE, mW / 1000; where a GPU lacks the field, nvmlDeviceGetPowerUsage, which "
                   "is the same 1 s average on Ampere (except GA100) and newer and instantaneous before); smooths a "
                   "10 Hz series: power_instant_w is the current draw. NaN when unsupported or the read failed."),
            Column("energy_mj", MAYBE_COUNTER, "Energy used since the driver loaded, mJ, cumulative (field "
                   "NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION, as nvmlDeviceGetTotalEnergyConsumption); NULL when "
                   "unsupported or the read failed, so max - min over a window is the energy used in it."),
            Column("temp_gpu_c", SMALL_GAUGE, "GPU temperature, degrees C (nvmlDeviceGetTemperature, "
                   "NVML_TEMPERATURE_GPU); NaN when unsupported."),
            Column("temp_mem_c", SMALL_GAUGE, "Memory (HBM) temperature, degrees C (field "
                   "NVML_FI_DEV_MEMORY_TEMP); NaN when unsupported."),
            Column("util_gpu_pct", SMALL_GAUGE, "Share of the driver's last sample period in which a kernel ran, "
                   "% 0-100 (nvmlDeviceGetUtilizationRates .gpu); NaN when unsupported."),
            Column("util_mem_copy_pct", SMALL_GAUGE, "Share of the driver's last sample period in which memory was "
                   "read or written, % 0-100 (nvmlDeviceGetUtilizationRates .memory); NaN when unsupported."),
            Column("mem_used_bytes", MAYBE_BYTES, "GPU memory in use, bytes: total - free of "
                   "nvmlDeviceGetMemoryInfo_v2 (the driver's reservation included, as nvmlDeviceGetMemoryInfo's "
                   ".used), read once a second and carried forward in between; NULL when unsupported or the read "
                   "failed."),
            Column("mem_total_bytes", MAYBE_BYTES, "GPU memory in all, bytes (nvmlDeviceGetMemoryInfo .total); NULL "
                   "when unsupported or the read failed."),
            Column("pcie_tx_bytes_per_s", GAUGE, "PCIe transmit rate, bytes/s: the change of field "
                   "NVML_FI_DEV_PCIE_COUNT_TX_BYTES (cumulative bytes, wrapping) between two samples over the change "
                   "of the field's own timestamp; where a GPU lacks the field, GPM PCIE_TX_PER_SEC (MiB/s, over the "
                   "last GPM interval, carried forward). NaN on the first sample and when the read failed."),
            Column("pcie_rx_bytes_per_s", GAUGE, "PCIe receive rate, bytes/s, read as pcie_tx_bytes_per_s is (field "
                   "NVML_FI_DEV_PCIE_COUNT_RX_BYTES, else GPM PCIE_RX_PER_SEC)."),
            Column("pcie_replay_total", MAYBE_COUNTER, "PCIe replays since the driver loaded, cumulative (field "
                   "NVML_FI_DEV_PCIE_REPLAY_COUNTER, as nvmlDeviceGetPcieReplayCounter); NULL when unsupported or "
                   "the read failed."),
            Column("nvlink_tx_bytes_per_s", GAUGE, "NVLink transmit rate summed over links, bytes/s: the change of "
                   "field NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX (KiB, all links) between two samples over the change "
                   "of the field's own timestamp (nvmlFieldValue_t.timestamp); NaN on the first sample, when the read "
                   "failed and where there is no NVLink."),
            Column("nvlink_rx_bytes_per_s", GAUGE, "NVLink receive rate summed over links, bytes/s, from "
                   "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX as for transmit."),
            Column("clock_event_reasons", "UInt64", "Why clocks are held down, as NVML's bitmask "
                   "(nvmlDeviceGetCurrentClocksEventReasons, or ...ThrottleReasons on older drivers)."),
            Column("clock_event_flags", "Array(LowCardinality(String))", "The bits of clock_event_reasons by name: "
                   "gpu_idle, sw_power_cap, hw_slowdown, sw_thermal_slowdown, hw_power_brake_slowdown, ...; bits "
                   "0x200 and 0x400 are named pynvml_only_board_limit and pynvml_only_reliability: pynvml defines "
                   "them, no nvml.h does."),
            Column("dram_bw_util_pct", SMALL_GAUGE, "DRAM bandwidth used, % 0-100 of peak, over the last GPM "
                   "interval (about 1 s; GPM metric DRAM_BW_UTIL); NaN before Hopper."),
            Column("tensor_active_pct", SMALL_GAUGE, "Share of time any tensor core was active, % 0-100, over the "
                   "last GPM interval (GPM metric ANY_TENSOR_UTIL); NaN before Hopper."),
            Column("sm_occupancy_pct", SMALL_GAUGE, "SM occupancy (resident warps of the maximum), % 0-100, over the "
                   "last GPM interval (GPM metric SM_OCCUPANCY); NaN before Hopper."),
            Column("processes", "Map(UInt32, UInt64)", "PID to GPU memory used, bytes, of each compute process "
                   "on the GPU (nvmlDeviceGetComputeRunningProcesses), read once a second and carried forward in "
                   "between."),
            Column("driver_version", DIM, "The NVIDIA driver's version, e.g. 570.124.06 "
                   "(nvmlSystemGetDriverVersion, read once when NVML starts); '' when unknown."),
            Column("power_instant_w", SMALL_GAUGE, "Power draw at the moment of the read, W (field "
                   "NVML_FI_DEV_POWER_INSTANT, mW / 1000); power_w is the driver's 1 s average. NaN when "
                   "unsupported or the read failed."),
            Column("mem_reserved_bytes", "Nullable(UInt64) CODEC(ZSTD(1))", "GPU memory the driver reserves for "
                   "itself, bytes (nvmlDeviceGetMemoryInfo_v2 .reserved), read once a second; NULL where the driver "
                   "has no _v2."),
            Column("sm_active_pct", SMALL_GAUGE, "Share of SMs active (at least one warp resident), % 0-100, over "
                   "the last GPM interval (GPM metric SM_UTIL: DCGM's SM active); NaN before Hopper or when the GPU "
                   "refuses the metric."),
            Column("graphics_active_pct", SMALL_GAUGE, "Share of time the graphics/compute engine was busy, % 0-100, "
                   "over the last GPM interval (GPM metric GRAPHICS_UTIL: DCGM's graphics engine active); NaN before "
                   "Hopper or when the GPU refuses the metric."),
            Column("remapped_rows_correctable", MAYBE_COUNT, "HBM rows remapped because of correctable errors, "
                   "since manufacture (nvmlDeviceGetRemappedRows corrRows), read once a second and carried forward; "
                   "NULL where unsupported (before Ampere) or not read yet."),
            Column("remapped_rows_uncorrectable", MAYBE_COUNT, "HBM rows remapped because of uncorrectable errors, "
                   "since manufacture (nvmlDeviceGetRemappedRows uncRows), read as the correctable count is."),
            Column("remapped_rows_pending", "Nullable(Bool)", "A row remap is pending: it takes effect at the next "
                   "GPU reset, which the GPU needs (nvmlDeviceGetRemappedRows isPending); NULL where unsupported."),
            Column("remapped_rows_failure", "Nullable(Bool)", "A row remap failed (no spare row left): the GPU "
                   "needs service (nvmlDeviceGetRemappedRows failureOccurred); NULL where unsupported."),
        ),
        ("host", "gpu_index", "ts"),
        "NVML samples per GPU; engine is the engine it serves ('' when unknown); NaN = unsupported; "
        "processes maps PID to GPU memory used.",
        (GPU_SAMPLES_PER_MINUTE, GPU_THROTTLING_PER_MINUTE),
    ),
    Table(
        "host_samples",
        (
            *_key("When the collector sampled (the collector's clock)",
                  "For a process row, the engine whose process it is (found by the port of its --engine, or "
                  "--engine-process); '' for the host row."),
            Column("scope", "Enum8('host' = 1, 'process' = 2)", "'host' for the machine, 'process' for one engine "
                   "process."),
            Column("pid", "UInt32", "The engine process's PID; 0 for the host row."),
            Column("cpu_pct", SMALL_GAUGE, "CPU use since the previous sample: host, % 0-100 of all cores "
                   "(psutil.cpu_percent()); process, % of one core, can pass 100 (Process.cpu_percent()); NaN at the "
                   "first sample."),
            Column("cpu_per_core_pct", SAMPLES, "Host only: CPU use per core since the previous sample, % 0-100 "
                   "each (psutil.cpu_percent(percpu=True)); empty for process rows."),
            Column("load1", SMALL_GAUGE, "Host only: 1-minute load average (psutil.getloadavg()[0]); 0 for process "
                   "rows."),
            Column("mem_used_bytes", COUNTER, "Host only: memory in use, bytes (psutil.virtual_memory().used)."),
            Column("mem_available_bytes", COUNTER, "Host only: memory available without swapping, bytes "
                   "(psutil.virtual_memory().available)."),
            Column("mem_total_bytes", COUNTER, "Host only: physical memory, bytes (psutil.virtual_memory().total)."),
            Column("swap_used_bytes", COUNTER, "Host only: swap in use, bytes (psutil.swap_memory().used)."),
            Column("rss_bytes", COUNTER, "Process only: resident set size, bytes (Process.memory_info().rss)."),
            Column("threads", COUNT, "Process only: threads (Process.num_threads())."),
            Column("open_files", COUNT, "Process only: open file descriptors, sockets included (Process.num_fds()); "
                   "0 when the OS refuses to tell."),
            Column("net_rx_bytes", "Map(LowCardinality(String), UInt64)", "Host only: bytes received per network "
                   "interface since boot, cumulative (psutil.net_io_counters(pernic=True) .bytes_recv)."),
            Column("net_tx_bytes", "Map(LowCardinality(String), UInt64)", "Host only: bytes sent per network "
                   "interface since boot, cumulative (.bytes_sent)."),
            Column("net_errors", "Map(LowCardinality(String), UInt64)", "Host only: errors and drops per network "
                   "interface since boot, cumulative (errin + errout + dropin + dropout)."),
            Column("disk_read_bytes", COUNTER, "Host only: bytes read from all disks since boot, cumulative "
                   "(psutil.disk_io_counters().read_bytes); 0 where the kernel shows no disks."),
            Column("disk_write_bytes", COUNTER, "Host only: bytes written to all disks since boot, cumulative "
                   "(psutil.disk_io_counters().write_bytes); 0 where the kernel shows no disks."),
        ),
        ("host", "scope", "engine", "ts"),
        "psutil samples: one host row, and one process row per engine process found; net and disk are "
        "cumulative counters.",
    ),
    Table(
        "events",
        (
            *_key("When it happened (the collector's clock)", "The engine it concerns; '' for the collector's own."),
            Column("source", DIM, "Who reported it: vllm_metrics, plugin, gpu, host, watchdog, matrix, collector, "
                   "or a source's name (source_error)."),
            Column("kind", DIM, "What happened, e.g. engine_up, engine_down, engine_restart, engine_config, "
                   "engine_state, plugin_data_lost, gpu_xid, gpu_lost, gpu_reading_unsupported, matrix_run."),
            Column("severity", "Enum8('info' = 1, 'warning' = 2, 'critical' = 3)", "info, warning or critical."),
            Column("message", "String", "One line for people."),
            Column("attributes", "Map(LowCardinality(String), String)", "The kind's details as text, e.g. xid and "
                   "uuid of gpu_xid, dropped_records of plugin_data_lost, the whole configuration of engine_config."),
        ),
        ("host", "engine", "ts", "kind"),
        "Discrete happenings: engine up/down/restart, configuration seen, source errors, drops, XIDs.",
    ),
    Table(
        "gateway_decisions",
        (
            *_key("When the gateway decided (the start of its stepline.gateway.decision span, the gateway's clock)",
                  "The backend the gateway chose, named as stepline names engines: a URL's host:port (the router's "
                  "own name when it is not a URL); '' when it chose none."),
            Column("gateway", DIM, "The gateway: the span's stepline.gateway.name, else its service.name, else "
                   "'gateway'."),
            Column("request_id", "String", "The request id the engine will see (the X-Request-Id the gateway "
                   "forwards; vLLM builds its own from it); '' when the gateway forwards none."),
            Column("attempt", "UInt16", "1 for the first try of a request, 2 for its first retry or fallback, ..."),
            Column("lane", DIM, "The lane (traffic class) the gateway put the request in, e.g. fast or heavy; '' "
                   "for a gateway without lanes."),
            Column("candidates", "Array(LowCardinality(String))", "The backends the gateway could choose from, "
                   "named as `engine` is."),
            Column("size_chars", "Nullable(UInt64)", "The request's size in characters as the gateway measured "
                   "it; NULL when it did not (a hook that failed open measures nothing)."),
            Column("size_bytes", "Nullable(UInt64)", "The request's size in bytes as the gateway measured it; NULL "
                   "when it did not."),
            Column("size_tokens", "Nullable(UInt64)", "The request's size in tokens as the gateway estimated or "
                   "counted it; NULL when it did not."),
            Column("threshold", "Nullable(Float64)", "The size bar the lane decision compared with, in "
                   "threshold_unit; NULL when none was in force."),
            Column("threshold_unit", DIM, "The unit of threshold: chars, bytes or tokens ('' when none)."),
            Column("health", DIM, "The gateway's health-cache state for the chosen backend when it chose, as the "
                   "gateway names it (e.g. healthy, stale, cooled_down); '' when it keeps none."),
            Column("in_flight", "Nullable(UInt32)", "Requests the gateway held in flight to the chosen backend "
                   "(its slots taken) when it decided, this one included where it was sent; NULL when the gateway "
                   "does not say. Above the engine's running + waiting, slots leaked."),
            Column("status", "UInt16", "The HTTP status the gateway answered the client with; 0 when it never "
                   "answered (499-style disconnects have 499 where the gateway says so)."),
            Column("error_type", DIM, "The error's class (OpenTelemetry error.type), e.g. timeout, "
                   "ConnectionRefusedError; '' when it succeeded."),
            Column("client_disconnected", "Bool", "The client went away before the response ended."),
            Column("first_byte_ts", "Nullable(DateTime64(6, 'UTC'))", "When the first byte of the response "
                   "reached the gateway; NULL when none did."),
            Column("end_ts", TIME, "When the attempt ended (the span's end)."),
            Column("swallowed_exception", "String", "An exception the routing hook caught and went on past "
                   "(type: message), so that failing open is seen; '' when none."),
            Column("backend_engines", "Array(LowCardinality(String))", "The engines behind the chosen backend "
                   "where its address stands for several (a service in front of replicas, `stepline collect "
                   "--backend`): the join looks for the request among theirs; [] where it is one engine."),
            Column("model", DIM, "The model the backend was asked for (LiteLLM: the deployment's model, its "
                   "provider prefix cut): a LoRA adapter's name where the request named one; '' when not said."),
            Column("key", DIM, "The API key the request came with, by its alias (LiteLLM: user_api_key_alias, "
                   "else the first 12 characters of the key's hash; never the key); '' when not said."),
            Column("team", DIM, "The key's team (LiteLLM: user_api_key_team_alias, else its id); '' when none."),
            Column("user", DIM, "The key's user (LiteLLM: user_api_key_user_id); '' when none."),
            Column("end_user", DIM, "The end user the client named (OpenAI's `user` field; LiteLLM: "
                   "user_api_key_end_user_id); '' when none."),
        ),
        ("host", "gateway", "ts"),
        "One row per routing attempt of a gateway in front of the engines: size measured, lane and backend chosen, "
        "threshold and its unit, outcome, and what a hook swallowed.",
    ),
    Table(
        "gateway_samples",
        (
            *_key("When the collector scraped the gateway's /metrics (the collector's clock)",
                  "The backend the series is about, named as stepline names engines (from its worker, api_base or "
                  "deployment URL label, as host:port); '' for the gateway's own series."),
            Column("gateway", DIM, "Gateway name: the NAME of --gateway NAME=URL, else the URL's host:port."),
            Column("metric", DIM, "Sample name as exposed, histogram suffix included, e.g. vllm_router_worker_load, "
                   "litellm_deployment_total_requests_total."),
            Column("kind", "Enum8('counter' = 1, 'gauge' = 2, 'bucket' = 3, 'sum' = 4, 'count' = 5, 'info' = 6)",
                   "What the sample is, from the family's TYPE: counter, gauge, info, or a histogram's bucket, sum or "
                   "count."),
            Column("labels", "Map(LowCardinality(String), String)", "The series' labels, as exposed."),
            Column("value", GAUGE, "The sample's value as exposed (cumulative for counter kinds)."),
            Column("delta", GAUGE, "For counter kinds: the increase since the previous scrape, reset-safe; 0 for "
                   "gauges and info, and at the collector's first scrape."),
        ),
        ("host", "gateway", "metric", "ts"),
        "Every litellm_ and vllm_router_ sample scraped from a gateway's /metrics; delta as in engine_samples.",
    ),
    Table(
        "usage_minutes",
        (
            *_key("The minute rolled up (its start; the rollup covers [ts, ts + 60 s))",
                  "The engine whose GPU time the row is, named as in `steps`."),
            Column("line", "Enum8('request' = 1, 'idle' = 2, 'unattributed' = 3)", "What the row counts: the "
                   "requests of one group ('request'), or the engine's time with no request on it ('idle') or its "
                   "busy time no known request can take ('unattributed': still running when the minute was rolled "
                   "up, aborted without a report, recomputed after a preemption)."),
            Column("gpu_name", DIM, "The GPU model the engine ran on in the minute (its commonest in "
                   "`gpu_samples`), for a price per GPU-hour at read time; '' where none was sampled."),
            Column("model", DIM, "The engine's served model, as its requests report it ('' on idle and "
                   "unattributed rows)."),
            Column("lane", DIM, "The gateway's lane of the group's requests ('' where no gateway decision joins)."),
            Column("adapter", DIM, "The model the gateway asked the backend for (a LoRA adapter's name where the "
                   "request named one); '' where none joins."),
            Column("key", DIM, "The API key's alias the gateway saw (gateway_decisions.key); '' where none joins."),
            Column("team", DIM, "The key's team (gateway_decisions.team); '' where none."),
            Column("user", DIM, "The key's user (gateway_decisions.user); '' where none."),
            Column("end_user", DIM, "The end user the client named (gateway_decisions.end_user); '' where none."),
            Column("requests", COUNT, "Requests of the group that finished in the minute."),
            Column("prompt_tokens", COUNTER, "Their prompt tokens, as the engine counted them."),
            Column("generation_tokens", COUNTER, "Their generated tokens, as the engine counted them."),
            Column("engine_us", COUNTER, "The row's part of the engine's time in the minute, microseconds summed "
                   "over its engine indices: the group's shares of the steps, or the idle or unattributed time "
                   "(stepline.analysis.usage; an engine's rows add up to 60 s x its indices while it was up)."),
            Column("gpu_seconds", GAUGE, "engine_us x the engine's GPUs per engine index, in seconds (a Float64: "
                   "GPUs divided among engine indices need not be whole); 1 GPU per index where none was sampled."),
            Column("energy_mj", "Nullable(UInt64) CODEC(ZSTD(1))", "The row's part of the GPUs' energy in the "
                   "minute, mJ; NULL where the engine's GPUs were not sampled."),
            Column("gpus", "UInt16", "GPUs seen serving the engine in the minute; 0 where none was sampled."),
        ),
        # host first like every table (a cluster shards by host and engine); then engine and time: a read of a span of
        # minutes takes each engine's run of them.
        ("host", "engine", "ts", "line"),
        "Who used the GPUs, per minute: `stepline usage`'s numbers for each closed minute, rolled up by the "
        "collector of the engines' host a few minutes after it (USAGE_ROLLUP_LAG_S); one row per engine, line and "
        "group of requests (model, lane, adapter, key, team, user, end user). The Usage dashboard and `stepline "
        "usage` over long windows read it.",
    ),
)

# Not a timeline table (no ts, host or engine): the one ledger of which schema a store holds.
SCHEMA_VERSION_TABLE = Table(
    "schema_version",
    (
        Column("version", "UInt32", "A schema version stepline applied to this store; a stepline refuses a store "
               "whose newest version is above its own."),
        Column("applied_at", "DateTime64(6, 'UTC')", "When that version was applied; UTC, microseconds."),
    ),
    ("version",),
    "One row per schema version applied to the store.",
)

TABLE_BY_NAME = {table.name: table for table in TABLES}
# Columns whose 0 meant "the read failed" before they became Nullable, each with the column whose 0 marks that
# failure: the migration turns those values to NULL. An energy counter since the driver loaded is never 0 on a GPU
# that ran; a PCIe replay count of 0 is real; a failed memory read wrote 0 for used and total alike, and no GPU has
# 0 bytes in all, so total's 0 marks both.
ZERO_WAS_UNKNOWN = {"gpu_samples": {"energy_mj": "energy_mj", "mem_used_bytes": "mem_total_bytes",
                                    "mem_total_bytes": "mem_total_bytes"}}
# Every table stepline creates (the timeline view aside): what carries a comment on every column.
STORE_TABLES = (*TABLES, SCHEMA_VERSION_TABLE)

# Each engine step beside the sample of each of the engine's GPUs taken at or just before the step ended.
TIMELINE_COLUMNS = """s.ts AS ts, s.host AS host, s.engine AS engine, s.engine_index AS engine_index, s.step AS step,
       s.elapsed_ms AS elapsed_ms, s.num_ctx_tokens AS prefill_tokens, s.num_generation_requests AS decoding,
       s.running AS running, s.waiting AS waiting, s.kv_cache_usage AS kv_cache_usage,
       g.gpu_index AS gpu_index, g.ts AS gpu_ts, g.sm_clock_mhz AS sm_clock_mhz, g.power_w AS power_w,
       g.dram_bw_util_pct AS dram_bw_util_pct, g.tensor_active_pct AS tensor_active_pct,
       g.util_gpu_pct AS util_gpu_pct, g.nvlink_tx_bytes_per_s + g.nvlink_rx_bytes_per_s AS nvlink_bytes_per_s,
       g.clock_event_flags AS clock_event_flags"""


def timeline_sql(database: str, step_filter: str = "", gpu_filter: str = "") -> str:
    """The timeline join; filters are SQL fragments starting with AND (bound parameters, never user text), empty for
    the view (`stepline timeline` bounds both sides by time). An empty `database` leaves the tables to the session's
    database."""
    db = f"`{database}`." if database else ""
    return f"""
SELECT {TIMELINE_COLUMNS}
FROM {db}steps AS s
GLOBAL INNER JOIN (SELECT DISTINCT host, engine, gpu_index FROM {db}gpu_samples WHERE engine != '' {gpu_filter}) AS eg
    ON eg.host = s.host AND eg.engine = s.engine
GLOBAL ASOF LEFT JOIN (SELECT * FROM {db}gpu_samples WHERE 1 {gpu_filter}) AS g
    ON g.host = eg.host AND g.gpu_index = eg.gpu_index AND g.ts <= s.ts
WHERE 1 {step_filter}"""


def column_sql(column: Column) -> str:
    """The column's declaration: name, type, comment, then the codec (ClickHouse's own order)."""
    type_, codec = column.type.split(" CODEC(", 1) if " CODEC(" in column.type else (column.type, "")
    return f"`{column.name}` {type_} COMMENT {_quote(column.comment)}" + (f" CODEC({codec}" if codec else "")


def comment_columns_sql(database: str, table: Table, names: Sequence[str]) -> str:
    """What sets the comments of these columns of a store's table to today's (metadata only: no part is touched)."""
    comments = table.column_comments
    return (f"ALTER TABLE `{database}`.`{table.name}` "
            + ", ".join(f"COMMENT COLUMN `{name}` {_quote(comments[name])}" for name in names))


def comment_table_sql(database: str, table: Table) -> str:
    return f"ALTER TABLE `{database}`.`{table.name}` MODIFY COMMENT {_quote(table.comment)}"


def _columns_sql(table: Table) -> str:
    return ",\n".join([f"    {column_sql(c)}" for c in table.definition]
                      + [f"    PROJECTION `{p.name}` ({p.select()})" for p in table.projections])


def add_projection_sql(database: str, table: Table, projection: Projection, name: str | None = None,
                       cluster: str | None = None) -> list[str]:
    """What gives a store created before `projection` existed the projection, for new parts and then the old ones
    (on table `name`, when not the table's own: a cluster's `*_local`, ON CLUSTER `cluster`).

    MATERIALIZE is a background mutation: until it reaches a part, queries read that part's rows (same answers).
    """
    target = f"`{database}`.`{name or table.name}`" + (f" ON CLUSTER `{cluster}`" if cluster else "")
    return [f"ALTER TABLE {target} ADD PROJECTION IF NOT EXISTS `{projection.name}` ({projection.select()})",
            f"ALTER TABLE {target} MATERIALIZE PROJECTION `{projection.name}`"]


def _storage_sql(table: Table, retention_days: int, replicated: bool = False) -> str:
    return (
        f"PARTITION BY toDate(ts)\n"
        f"ORDER BY ({', '.join(table.order_by)})\n"
        f"TTL toDateTime(ts) + INTERVAL {retention_days} DAY\n"
        # Whole-day parts expire at once: cheap, and no partial rewrites of old parts.
        f"SETTINGS ttl_only_drop_parts = 1, {_dedup_window(replicated)}{_projection_mode(table)}\n"
        f"COMMENT {_quote(table.comment)}"
    )


# A retried insert with the same deduplication token (the spool's, per segment) is stored once while the table still
# remembers the token: the last DEDUP_INSERTS inserts per table (per shard on a cluster), for at most DEDUP_SECONDS.
# A retry is only needed when an insert's answer is lost; a writer retries within its backoff (30 s at most) while the
# store answers, so the window must outlast that at the fleet's insert rate. On a cluster every sidecar's insert is a
# block id in Keeper (asynchronous inserts keep one per insert, not per flushed part): at 1,000 8-GPU nodes a shard
# sees about 200 a second per table (benchmarks/write_model.py), so 100,000 cover about 8 minutes, and the hour bounds
# the window on a smaller fleet. Keeper holds them: about 100,000 small nodes per table and shard. A retry later than
# the window (a store down for longer, with the answer to an insert lost) may store a segment twice.
# https://clickhouse.com/docs/guides/developer/deduplicating-inserts-on-retries
# https://clickhouse.com/docs/operations/settings/merge-tree-settings#replicated_deduplication_window
DEDUP_INSERTS = 100_000
DEDUP_SECONDS = 3_600


def _dedup_window(replicated: bool) -> str:
    if not replicated:
        return f"non_replicated_deduplication_window = {DEDUP_INSERTS}"
    return (f"replicated_deduplication_window = {DEDUP_INSERTS}, "
            f"replicated_deduplication_window_seconds = {DEDUP_SECONDS}, "
            f"replicated_deduplication_window_for_async_inserts = {DEDUP_INSERTS}, "
            f"replicated_deduplication_window_seconds_for_async_inserts = {DEDUP_SECONDS}")


# A MergeTree that merges rows (AggregatingMergeTree) keeps projections only when told what a merge does to them:
# 'rebuild' builds a merged part's projections from its merged rows.
# https://clickhouse.com/docs/operations/settings/merge-tree-settings#deduplicate_merge_projection_mode
PROJECTION_MODE = ("deduplicate_merge_projection_mode", "rebuild")


def needs_projection_mode(table: Table) -> bool:
    """Whether `table` merges rows and has projections: it then needs PROJECTION_MODE."""
    return table.engine != "MergeTree" and bool(table.projections)


def _projection_mode(table: Table) -> str:
    return f", {PROJECTION_MODE[0]} = '{PROJECTION_MODE[1]}'" if needs_projection_mode(table) else ""


def _quote(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def create_table_sql(database: str, table: Table, retention_days: int, name: str | None = None) -> str:
    """The statement that creates one table on one node (under `name`, when not its own)."""
    return (f"CREATE TABLE IF NOT EXISTS `{database}`.`{name or table.name}`\n(\n{_columns_sql(table)}\n)\n"
            f"ENGINE = {table.engine}\n{_storage_sql(table, retention_days)}")


# Each replicated table's Keeper path holds its UUID, which ON CLUSTER gives every replica alike: a table dropped and
# made again (a rebuild) gets a new path, never the old table's leftovers. ClickHouse's own default_replica_path.
# https://clickhouse.com/docs/engines/table-engines/mergetree-family/replication#creating-replicated-tables
REPLICA_PATH = "/clickhouse/tables/{uuid}/{shard}"
REPLICA_NAME = "{replica}"
# schema_version is one table replicated on every server (no shard in its path), so any server answers its version.
VERSION_REPLICA_PATH = "/clickhouse/tables/{uuid}/all"
VERSION_REPLICA_NAME = "{shard}-{replica}"


def local_name(table: str) -> str:
    """The name of a timeline table's shard-local table on a cluster."""
    return f"{table}_local"


def ddl(database: str, retention_days: int, cluster: str | None = None) -> list[str]:
    """The statements that create the store: database, tables, the timeline view, then the schema-version table."""
    if retention_days < 1:
        raise ValueError(f"retention must be at least 1 day, got {retention_days}")
    on_cluster = f" ON CLUSTER `{cluster}`" if cluster else ""
    statements = [f"CREATE DATABASE IF NOT EXISTS `{database}`{on_cluster}"]
    for table in TABLES:
        if cluster is None:
            statements.append(create_table_sql(database, table, retention_days))
            continue
        local = local_name(table.name)
        statements.append(
            f"CREATE TABLE IF NOT EXISTS `{database}`.`{local}`{on_cluster}\n(\n{_columns_sql(table)}\n)\n"
            f"ENGINE = Replicated{table.engine}('{REPLICA_PATH}', '{REPLICA_NAME}')\n"
            f"{_storage_sql(table, retention_days, replicated=True)}"
        )
        statements.append(distributed_sql(database, table, cluster))
    # OR REPLACE: the view holds no data, and a store created by an older stepline gets today's definition.
    statements.append(f"CREATE OR REPLACE VIEW `{database}`.`timeline`{on_cluster} AS{timeline_sql(database)}")
    version_engine = (f"ReplicatedMergeTree('{VERSION_REPLICA_PATH}', '{VERSION_REPLICA_NAME}')" if cluster
                      else "MergeTree")
    statements.append(
        f"CREATE TABLE IF NOT EXISTS `{database}`.`schema_version`{on_cluster}\n"
        f"(\n{_columns_sql(SCHEMA_VERSION_TABLE)}\n)\n"
        f"ENGINE = {version_engine}\nORDER BY version\nCOMMENT {_quote(SCHEMA_VERSION_TABLE.comment)}"
    )
    return statements


def distributed_sql(database: str, table: Table, cluster: str) -> str:
    """The Distributed table over a cluster's `*_local` tables: sharded by (host, engine), so one engine's timeline,
    both reports of each of its requests included, stays on one shard."""
    return (f"CREATE TABLE IF NOT EXISTS `{database}`.`{table.name}` ON CLUSTER `{cluster}`\n"
            f"AS `{database}`.`{local_name(table.name)}`\n"
            f"ENGINE = Distributed(`{cluster}`, `{database}`, `{local_name(table.name)}`, {SHARDING_KEY})")


SHARDING_KEY = "cityHash64(host, engine)"
