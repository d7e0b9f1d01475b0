"""Engine timeline: what each engine step did, beside what its GPUs did at the same moment."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as db

from stepline.alerting.config import AlertConfig
from stepline.dashboards.buckets import GATE, MINUTE, RAW, per_interval
from stepline.dashboards.panels import WHERE, right_axis, series, timeline_base
from stepline.dashboards.query import ClickHouseQuery

UID = "stepline-engine-timeline"
SLUG = "stepline-engine-timeline"

STEPS = f"FROM steps WHERE {GATE} AND $__timeFilter_ms(bucket) AND {WHERE}"
GPUS = f"FROM gpu_samples WHERE {GATE} AND $__timeFilter_ms(bucket) AND {WHERE}"
GPU_SERIES = "concat(engine, '/gpu', toString(gpu_index)) AS gpu"
# Written with the aggregates the steps projections hold (schema.STEP_AGGREGATES), so long ranges read those.
ITL = ("quantilesBFloat16Array(0.5, 0.99)(itl_seconds)[1] AS p50, "
       "quantilesBFloat16Array(0.5, 0.99)(itl_seconds)[2] AS p99")


def _steps(columns: str, having: str = "") -> ClickHouseQuery:
    return ClickHouseQuery(per_interval(f"""
        SELECT $__timeInterval_ms(bucket) AS time, engine, {columns}
        {STEPS}
        GROUP BY time, engine{having}"""))


def _gpus(columns: str) -> ClickHouseQuery:
    return ClickHouseQuery(per_interval(f"""
        SELECT $__timeInterval_ms(bucket) AS time, {GPU_SERIES}, {columns}
        {GPUS}
        GROUP BY time, gpu""", levels=(RAW, MINUTE)))


def _spec_delta(metric: str) -> str:
    return f"sumIf(delta, metric = '{metric}')"


def dashboard(config: AlertConfig) -> db.Dashboard:
    """The engine timeline dashboard."""
    slo = config.slo
    d = timeline_base("stepline / Engine timeline", UID,
                      "Step by step: scheduling, latency, cache and GPUs on one time axis.",
                      ["engine"])
    d = d.with_panel(series(
        "Step duration", "How long each engine iteration takes (mean and worst per interval).", "ms",
        _steps("sum(elapsed_ms) / count() AS mean, max(elapsed_ms) AS max")))
    d = d.with_panel(series(
        "Prefill vs decode tokens per step", "What each step spends its token budget on: prompt chunks or decode "
        "(scheduled tokens: with speculative decoding, each decoding request's drafts too, accepted or not).",
        "short", _steps("sum(num_ctx_tokens) / count() AS prefill, sum(num_generation_tokens) / count() AS decode"),
        stacked=True))
    d = d.with_panel(series(
        "Running and waiting", "How many requests are in the batch and how many queue behind it (those the "
        "scheduler deferred included, as vllm:num_requests_waiting counts them).", "short",
        _steps("max(running) AS running, max(waiting) AS waiting")))
    d = d.with_panel(right_axis(series(
        "KV cache usage and preemptions", "How full the KV cache is, and whether requests get evicted for it.",
        "percentunit", _steps("max(kv_cache_usage) AS kv_usage, sum(preempted) AS preempted"),
        lines=[(config.kv_usage_warning_ratio, "orange"), (config.kv_usage_critical_ratio, "red")]),
        "preempted.*", "short"))
    d = d.with_panel(series(
        "Inter-token latency", "How long decoding streams wait between tokens (p50, p99, max) against the SLO.", "s",
        _steps(f"{ITL}, maxArray(itl_seconds) AS max", " HAVING isFinite(p50)"),
        lines=[(slo.itl_p99_seconds, "orange"), (slo.itl_p99_critical_seconds, "red")]))
    d = d.with_panel(series(
        "Prefix-cache hit rate", "What share of prompt tokens the prefix cache served.", "percentunit",
        _steps("sum(prefix_cache_hits) / nullIf(sum(prefix_cache_queries), 0) AS hit_rate")))
    d = d.with_panel(series(
        "Spec-decode acceptance", "What share of drafted tokens the target model accepted (from counter deltas).",
        "percentunit",
        ClickHouseQuery(f"""
            SELECT $__timeInterval_ms(ts) AS time, engine,
                   {_spec_delta('vllm:spec_decode_num_accepted_tokens_total')}
                   / nullIf({_spec_delta('vllm:spec_decode_num_draft_tokens_total')}, 0) AS acceptance
            FROM engine_samples
            WHERE $__timeFilter_ms(ts) AND {WHERE} AND metric IN
                  ('vllm:spec_decode_num_accepted_tokens_total', 'vllm:spec_decode_num_draft_tokens_total')
            GROUP BY time, engine ORDER BY time""")))
    d = d.with_panel(series(
        "SM clock", "Whether the GPUs serving this engine ran at full clock during its steps.", "rotmhz",
        _gpus("min(sm_clock_mhz) AS sm_clock_min")))
    d = d.with_panel(series(
        "Power", "How much power the engine's GPUs drew (a cap shows as a flat top).", "watt",
        _gpus("max(power_w) AS power")))
    d = d.with_panel(series(
        "DRAM bandwidth", "How busy GPU memory was (decode is bandwidth-bound).", "percent",
        _gpus("avg(dram_bw_util_pct) AS dram_bw")))
    return d.with_panel(series(
        "NVLink and PCIe", "How much the engine's GPUs moved over NVLink and PCIe.", "Bps",
        _gpus("avg(nvlink_tx_bytes_per_s + nvlink_rx_bytes_per_s) AS nvlink, "
              "avg(pcie_tx_bytes_per_s + pcie_rx_bytes_per_s) AS pcie")))
