"""The timeline's DDL: one definition per table, rendered for one node or for a cluster."""

from __future__ import annotations

from dataclasses import dataclass

# Bump when a table changes shape; `Store` refuses a store that holds a newer version.
SCHEMA_VERSION = 1

TIME = "DateTime64(6, 'UTC') CODEC(DoubleDelta, ZSTD(1))"
DIM = "LowCardinality(String)"
COUNTER = "UInt64 CODEC(Delta, ZSTD(1))"
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

    def select(self) -> str:
        keys = ", ".join(self.keys)
        return f"SELECT {keys}, {', '.join(self.aggregates)} GROUP BY {keys}"


@dataclass(frozen=True)
class Table:
    """One timeline table: its columns (name, type), its sorting key and its projections."""

    name: str
    columns: tuple[tuple[str, str], ...]
    order_by: tuple[str, ...]
    comment: str
    projections: tuple[Projection, ...] = ()

    @property
    def column_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.columns)


KEY = (("ts", TIME), ("host", DIM), ("engine", DIM))

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
# NVML at 10 Hz is 6.9M rows a day for eight GPUs; per minute, 11.5k.
GPU_AGGREGATES = (
    "count()",
    "any(gpu_name)",
    "avg(sm_clock_mhz)",
    "min(sm_clock_mhz)",
    "avg(mem_clock_mhz)",
    "avg(power_w)",
    "max(power_w)",
    "min(energy_mj)",
    "max(energy_mj)",
    "max(temp_gpu_c)",
    "max(temp_mem_c)",
    "avg(util_gpu_pct)",
    "avg(tensor_active_pct)",
    "avg(sm_occupancy_pct)",
    "avg(dram_bw_util_pct)",
    "max(mem_used_bytes)",
    "max(mem_total_bytes)",
    "avg(pcie_tx_bytes_per_s)",
    "avg(pcie_rx_bytes_per_s)",
    "avg(nvlink_tx_bytes_per_s)",
    "avg(nvlink_rx_bytes_per_s)",
    "avg(nvlink_tx_bytes_per_s + nvlink_rx_bytes_per_s)",
    "avg(pcie_tx_bytes_per_s + pcie_rx_bytes_per_s)",
)
GPU_SAMPLES_PER_MINUTE = Projection("gpu_samples_per_minute", ("host", "engine", "gpu_index", "toStartOfMinute(ts)"),
                                    GPU_AGGREGATES)

TABLES: tuple[Table, ...] = (
    Table(
        "steps",
        (
            *KEY,
            ("engine_index", "UInt16"),
            ("model_name", DIM),
            ("step", COUNTER),
            ("elapsed_ms", SMALL_GAUGE),
            ("num_ctx_requests", COUNT),
            ("num_ctx_tokens", COUNT),
            ("num_generation_requests", COUNT),
            ("num_generation_tokens", COUNT),
            ("running", COUNT),
            ("waiting", COUNT),
            ("skipped_waiting", COUNT),
            ("kv_cache_usage", SMALL_GAUGE),
            ("prefix_cache_queries", COUNT),
            ("prefix_cache_hits", COUNT),
            ("preempted", COUNT),
            ("spec_num_drafts", COUNT),
            ("spec_num_draft_tokens", COUNT),
            ("spec_num_accepted_tokens", COUNT),
            ("ttft_seconds", SAMPLES),
            ("itl_seconds", SAMPLES),
            ("is_dummy", "Bool"),
        ),
        ("host", "engine", "engine_index", "ts", "step"),
        "One row per engine iteration, from the stat-logger plugin.",
        (STEPS_PER_SECOND, STEPS_PER_MINUTE),
    ),
    Table(
        "requests",
        (
            *KEY,
            ("engine_index", "UInt16"),
            ("model_name", DIM),
            ("request_id", "String"),
            ("source", DIM),
            ("finish_reason", DIM),
            ("arrival_ts", TIME),
            ("queue_seconds", SMALL_GAUGE),
            ("prefill_seconds", SMALL_GAUGE),
            ("decode_seconds", SMALL_GAUGE),
            ("inference_seconds", SMALL_GAUGE),
            ("e2e_seconds", SMALL_GAUGE),
            ("ttft_seconds", SMALL_GAUGE),
            ("mean_tpot_seconds", SMALL_GAUGE),
            ("prompt_tokens", COUNT),
            ("cached_tokens", COUNT),
            ("generation_tokens", COUNT),
            ("max_tokens", COUNT),
            ("preemptions", COUNT),
        ),
        ("host", "engine", "ts", "request_id", "source"),
        "One row per finished request (ts = finish time), from the plugin and/or OTLP spans.",
    ),
    Table(
        "engine_samples",
        (
            *KEY,
            ("engine_index", DIM),
            ("model_name", DIM),
            ("metric", DIM),
            ("kind", "Enum8('counter' = 1, 'gauge' = 2, 'bucket' = 3, 'sum' = 4, 'count' = 5, 'info' = 6)"),
            ("labels", "Map(LowCardinality(String), String)"),
            ("value", GAUGE),
            ("delta", GAUGE),
        ),
        ("host", "engine", "metric", "ts"),
        "Every vllm: sample scraped from /metrics; delta is the reset-safe increase for counter kinds.",
    ),
    Table(
        "gpu_samples",
        (
            *KEY,
            ("gpu_index", "UInt8"),
            ("gpu_uuid", DIM),
            ("gpu_name", DIM),
            ("sm_clock_mhz", SMALL_GAUGE),
            ("mem_clock_mhz", SMALL_GAUGE),
            ("power_w", SMALL_GAUGE),
            ("energy_mj", COUNTER),
            ("temp_gpu_c", SMALL_GAUGE),
            ("temp_mem_c", SMALL_GAUGE),
            ("util_gpu_pct", SMALL_GAUGE),
            ("util_mem_copy_pct", SMALL_GAUGE),
            ("mem_used_bytes", COUNTER),
            ("mem_total_bytes", COUNTER),
            ("pcie_tx_bytes_per_s", GAUGE),
            ("pcie_rx_bytes_per_s", GAUGE),
            ("pcie_replay_total", COUNTER),
            ("nvlink_tx_bytes_per_s", GAUGE),
            ("nvlink_rx_bytes_per_s", GAUGE),
            ("clock_event_reasons", "UInt64"),
            ("clock_event_flags", "Array(LowCardinality(String))"),
            ("dram_bw_util_pct", SMALL_GAUGE),
            ("tensor_active_pct", SMALL_GAUGE),
            ("sm_occupancy_pct", SMALL_GAUGE),
            ("processes", "Map(UInt32, UInt64)"),
        ),
        ("host", "gpu_index", "ts"),
        "NVML samples per GPU; engine is the engine it serves ('' when unknown); NaN = unsupported; "
        "processes maps PID to GPU memory used.",
        (GPU_SAMPLES_PER_MINUTE,),
    ),
    Table(
        "host_samples",
        (
            *KEY,
            ("scope", "Enum8('host' = 1, 'process' = 2)"),
            ("pid", "UInt32"),
            ("cpu_pct", SMALL_GAUGE),
            ("cpu_per_core_pct", SAMPLES),
            ("load1", SMALL_GAUGE),
            ("mem_used_bytes", COUNTER),
            ("mem_available_bytes", COUNTER),
            ("mem_total_bytes", COUNTER),
            ("swap_used_bytes", COUNTER),
            ("rss_bytes", COUNTER),
            ("threads", COUNT),
            ("open_files", COUNT),
            ("net_rx_bytes", "Map(LowCardinality(String), UInt64)"),
            ("net_tx_bytes", "Map(LowCardinality(String), UInt64)"),
            ("net_errors", "Map(LowCardinality(String), UInt64)"),
            ("disk_read_bytes", COUNTER),
            ("disk_write_bytes", COUNTER),
        ),
        ("host", "scope", "engine", "ts"),
        "psutil samples: one host row, and one process row per engine process found; net and disk are "
        "cumulative counters.",
    ),
    Table(
        "events",
        (
            *KEY,
            ("source", DIM),
            ("kind", DIM),
            ("severity", "Enum8('info' = 1, 'warning' = 2, 'critical' = 3)"),
            ("message", "String"),
            ("attributes", "Map(LowCardinality(String), String)"),
        ),
        ("host", "engine", "ts", "kind"),
        "Discrete happenings: engine up/down/restart, configuration seen, source errors, drops, XIDs.",
    ),
)

TABLE_BY_NAME = {table.name: table for table in TABLES}

# Each engine step beside the sample of each of the engine's GPUs taken at or just before the step ended.
# STEP_FILTER and GPU_FILTER are empty for the view; `stepline timeline` bounds both sides by time.
TIMELINE_SELECT = """
SELECT s.ts AS ts, s.host AS host, s.engine AS engine, s.engine_index AS engine_index, s.step AS step,
       s.elapsed_ms AS elapsed_ms, s.num_ctx_tokens AS prefill_tokens, s.num_generation_requests AS decoding,
       s.running AS running, s.waiting AS waiting, s.kv_cache_usage AS kv_cache_usage,
       g.gpu_index AS gpu_index, g.ts AS gpu_ts, g.sm_clock_mhz AS sm_clock_mhz, g.power_w AS power_w,
       g.dram_bw_util_pct AS dram_bw_util_pct, g.tensor_active_pct AS tensor_active_pct,
       g.util_gpu_pct AS util_gpu_pct, g.nvlink_tx_bytes_per_s + g.nvlink_rx_bytes_per_s AS nvlink_bytes_per_s,
       g.clock_event_flags AS clock_event_flags
FROM DB.steps AS s
INNER JOIN (SELECT DISTINCT host, engine, gpu_index FROM DB.gpu_samples WHERE engine != '' GPU_FILTER) AS eg
    ON eg.host = s.host AND eg.engine = s.engine
ASOF LEFT JOIN (SELECT * FROM DB.gpu_samples WHERE 1 GPU_FILTER) AS g
    ON g.host = eg.host AND g.gpu_index = eg.gpu_index AND g.ts <= s.ts
WHERE 1 STEP_FILTER"""


def timeline_sql(database: str, step_filter: str = "", gpu_filter: str = "") -> str:
    """The timeline join; filters are SQL fragments starting with AND (bound parameters, never user text).
    An empty `database` leaves the tables to the session's database."""
    return (TIMELINE_SELECT.replace("DB.", f"`{database}`." if database else "").replace("GPU_FILTER", gpu_filter)
            .replace("STEP_FILTER", step_filter))


def _columns_sql(table: Table) -> str:
    return ",\n".join([f"    `{name}` {type_}" for name, type_ in table.columns]
                      + [f"    PROJECTION `{p.name}` ({p.select()})" for p in table.projections])


def add_projection_sql(database: str, table: Table, projection: Projection) -> list[str]:
    """What gives a store created before `projection` existed the projection, for new parts and then the old ones.

    MATERIALIZE is a background mutation: until it reaches a part, queries read that part's rows (same answers).
    """
    target = f"`{database}`.`{table.name}`"
    return [f"ALTER TABLE {target} ADD PROJECTION IF NOT EXISTS `{projection.name}` ({projection.select()})",
            f"ALTER TABLE {target} MATERIALIZE PROJECTION `{projection.name}`"]


def _storage_sql(table: Table, retention_days: int) -> str:
    return (
        f"PARTITION BY toDate(ts)\n"
        f"ORDER BY ({', '.join(table.order_by)})\n"
        f"TTL toDateTime(ts) + INTERVAL {retention_days} DAY\n"
        # Whole-day parts expire at once: cheap, and no partial rewrites of old parts.
        # The deduplication window makes retried inserts with the same token idempotent.
        "SETTINGS ttl_only_drop_parts = 1, non_replicated_deduplication_window = 1000\n"
        f"COMMENT {_quote(table.comment)}"
    )


def _quote(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def ddl(database: str, retention_days: int, cluster: str | None = None) -> list[str]:
    """The statements that create the store: database, tables, and the schema-version table."""
    if retention_days < 1:
        raise ValueError(f"retention must be at least 1 day, got {retention_days}")
    on_cluster = f" ON CLUSTER `{cluster}`" if cluster else ""
    statements = [f"CREATE DATABASE IF NOT EXISTS `{database}`{on_cluster}"]
    for table in TABLES:
        if cluster is None:
            statements.append(
                f"CREATE TABLE IF NOT EXISTS `{database}`.`{table.name}`\n(\n{_columns_sql(table)}\n)\n"
                f"ENGINE = MergeTree\n{_storage_sql(table, retention_days)}"
            )
            continue
        local = f"{table.name}_local"
        statements.append(
            f"CREATE TABLE IF NOT EXISTS `{database}`.`{local}`{on_cluster}\n(\n{_columns_sql(table)}\n)\n"
            f"ENGINE = ReplicatedMergeTree('/clickhouse/tables/{{shard}}/{database}/{local}', '{{replica}}')\n"
            f"{_storage_sql(table, retention_days)}"
        )
        # Shard by (host, engine) so one engine's timeline stays on one shard.
        statements.append(
            f"CREATE TABLE IF NOT EXISTS `{database}`.`{table.name}`{on_cluster}\n"
            f"AS `{database}`.`{local}`\n"
            f"ENGINE = Distributed(`{cluster}`, `{database}`, `{local}`, cityHash64(host, engine))"
        )
    # OR REPLACE: the view holds no data, and a store created by an older stepline gets today's definition.
    statements.append(f"CREATE OR REPLACE VIEW `{database}`.`timeline`{on_cluster} AS{timeline_sql(database)}")
    version_engine = (
        f"ReplicatedMergeTree('/clickhouse/tables/{{shard}}/{database}/schema_version', '{{replica}}')"
        if cluster
        else "MergeTree"
    )
    statements.append(
        f"CREATE TABLE IF NOT EXISTS `{database}`.`schema_version`{on_cluster}\n"
        "(\n    `version` UInt32,\n    `applied_at` DateTime64(6, 'UTC')\n)\n"
        f"ENGINE = {version_engine}\nORDER BY version"
    )
    return statements
