"""Fleet overview: is every engine up, fast enough, and not queueing; what is firing."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as db

from stepline.alerting.config import AlertConfig
from stepline.dashboards.buckets import GATE, per_interval
from stepline.dashboards.engine import ITL
from stepline.dashboards.panels import (
    ENGINE,
    HOST,
    WHERE,
    grid,
    series,
    single,
    timeline_base,
)
from stepline.dashboards.query import PROMETHEUS, ClickHouseQuery, Format, promql
from stepline.queries.requests import MERGED
from stepline.queries.steps import generated

UID = "stepline-fleet"


def _gauge(metric: str, alias: str) -> str:
    """One vllm: gauge per engine and interval (summed over the engine's label sets first)."""
    return f"""
        SELECT $__timeInterval(ts) AS time, engine, max(v) AS {alias}
        FROM (SELECT ts, engine, sum(value) AS v FROM engine_samples
              WHERE $__timeFilter(ts) AND metric = '{metric}' AND {WHERE} GROUP BY ts, engine)
        GROUP BY time, engine ORDER BY time"""


def dashboard(config: AlertConfig) -> db.Dashboard:
    """The fleet overview dashboard."""
    slo, sel = config.slo, config.selector
    d = timeline_base("stepline / Fleet overview", UID,
                      "Every engine at a glance: up, throughput, latency, queues, alerts.",
                      ["fleet"])
    d = d.with_panel(single(
        "Engines up", "How many engines' /metrics answer the collector right now (of all it knows).", "none",
        promql(f'sum(stepline_source_up{{{sel},source=~"vllm_metrics:.*"}})', "up"),
        [(None, "red"), (1, "green")]))
    d = d.with_panel(single(
        "Engines known", "How many engine /metrics sources the collector scrapes.", "none",
        promql(f'count(stepline_source_up{{{sel},source=~"vllm_metrics:.*"}})', "known"),
        [(None, "blue")]))
    d = d.with_panel(grid(
        "Firing alerts", "Which alerts are firing now, on which engine, at what severity.",
        promql('sum by (alertname, severity, engine) (ALERTS{alertstate="firing"})', instant=True),
        w=12, h=5, datasource=PROMETHEUS))
    d = d.with_panel(series(
        "Generation throughput", "How many tokens per second each engine generates for requests past their first "
        "token (from steps; speculative drafts count once accepted, not when scheduled).",
        "suffix: tok/s",
        ClickHouseQuery(per_interval(f"""
            SELECT $__timeInterval_ms(bucket) AS time, engine,
                   {generated("sumIf(num_generation_tokens, NOT is_dummy)")} / ($__interval_ms / 1000) AS tokens_per_s
            FROM steps WHERE {GATE} AND $__timeFilter_ms(bucket) AND {WHERE}
            GROUP BY time, engine"""))))
    d = d.with_panel(grid(
        "Decode rate per request, by prompt band",
        "What decode speed a request sees, as a range per prompt-size band (never one number for all).",
        ClickHouseQuery(f"""
            SELECT multiIf(prompt_tokens < 1024, '< 1k', prompt_tokens < 8192, '1k-8k',
                           prompt_tokens < 32768, '8k-32k', prompt_tokens < 100000, '32k-100k', '>= 100k') AS band,
                   count() AS requests,
                   quantileIf(0.01)(1 / mean_tpot_seconds, mean_tpot_seconds > 0) AS tok_per_s_p1,
                   quantileIf(0.5)(1 / mean_tpot_seconds, mean_tpot_seconds > 0) AS tok_per_s_p50,
                   quantileIf(0.99)(1 / mean_tpot_seconds, mean_tpot_seconds > 0) AS tok_per_s_p99,
                   quantile(0.99)(ttft_seconds) AS ttft_p99
            FROM {MERGED} WHERE $__timeFilter(ts) AND {WHERE} AND isFinite(ttft_seconds)
            GROUP BY band ORDER BY min(prompt_tokens)""", Format.TABLE),
        units=[("tok_per_s.*", "suffix: tok/s"), ("ttft.*", "s")], w=12, h=8))
    d = d.with_panel(series(
        "Time to first token", "How long requests wait for their first token (p50, p99), against the TTFT SLO.",
        "s",
        ClickHouseQuery(f"""
            SELECT $__timeInterval(ts) AS time, engine, quantile(0.5)(ttft_seconds) AS p50,
                   quantile(0.99)(ttft_seconds) AS p99
            FROM {MERGED} WHERE $__timeFilter(ts) AND {WHERE} AND isFinite(ttft_seconds)
            GROUP BY time, engine ORDER BY time"""),
        lines=[(slo.ttft_p99_seconds, "red")]))
    d = d.with_panel(series(
        "Inter-token latency", "How smoothly streams decode (ITL p50, p99), against the warning and critical SLO.",
        "s",
        ClickHouseQuery(per_interval(f"""
            SELECT $__timeInterval_ms(bucket) AS time, engine, {ITL}
            FROM steps WHERE {GATE} AND $__timeFilter_ms(bucket) AND {WHERE}
            GROUP BY time, engine HAVING isFinite(p50)""")),
        lines=[(slo.itl_p99_seconds, "orange"), (slo.itl_p99_critical_seconds, "red")]))
    d = d.with_panel(series(
        "Queue depth", "How many requests wait for admission on each engine.", "short",
        ClickHouseQuery(_gauge("vllm:num_requests_waiting", "waiting"))))
    d = d.with_panel(series(
        "KV cache usage", "How full each engine's KV cache is (preemptions follow near the top).", "percentunit",
        ClickHouseQuery(_gauge("vllm:kv_cache_usage_perc", "kv_usage")),
        lines=[(config.kv_usage_warning_ratio, "orange"), (config.kv_usage_critical_ratio, "red")]))
    return d.with_panel(grid(
        "Findings and events", "What happened: engine up/down, configuration, XIDs, drops, diagnoses.",
        ClickHouseQuery(f"""
            SELECT ts, host, engine, toString(severity) AS severity, kind, message
            FROM events WHERE $__timeFilter(ts) AND {HOST} AND (engine = '' OR {ENGINE})
            ORDER BY ts DESC LIMIT 200""", Format.TABLE)))
