"""Collector health: the collector's own /metrics through Prometheus."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import timeseries

from stepline.alerting.config import AlertConfig
from stepline.dashboards.panels import base, datasource_variables, grid, series
from stepline.dashboards.query import PROMETHEUS, promql

UID = "stepline-collector"


def dashboard(config: AlertConfig) -> db.Dashboard:
    """The collector health dashboard."""
    s = config.selector
    d = base("stepline / Collector health", UID, "Is the collector collecting, writing and watching?", ["collector"])
    for variable in datasource_variables():
        d = d.with_variable(variable)

    def prom(title: str, description: str, unit: str, expr: str, legend: str) -> timeseries.Panel:
        return series(title, description, unit, promql(expr, legend), datasource=PROMETHEUS)

    d = d.with_panel(prom("Sources up", "Which sources answered their last poll (1) and which did not (0).", "none",
                          f"stepline_source_up{{{s}}}", "{{instance}} {{source}}"))
    d = d.with_panel(prom("Source errors", "Which sources fail, and how often.", "cps",
                          f"sum by (source) (rate(stepline_source_errors_total{{{s}}}[$__rate_interval]))",
                          "{{source}}"))
    d = d.with_panel(prom("Rows written", "How many rows per second reach each table.", "cps",
                          f"sum by (table) (rate(stepline_writer_rows_written_total{{{s}}}[$__rate_interval]))",
                          "{{table}}"))
    d = d.with_panel(prom("Rows dropped", "Which tables lose rows, and why (queue full, write failed...).", "cps",
                          f"sum by (table, reason) (rate(stepline_writer_rows_dropped_total{{{s}}}"
                          "[$__rate_interval]))", "{{table}} {{reason}}"))
    d = d.with_panel(prom("Writer queue depth", "How many rows wait in each table's writer queue.", "short",
                          f"sum by (table) (stepline_writer_queue_rows{{{s}}})", "{{table}}"))
    d = d.with_panel(prom("Write latency p99", "How long one batch insert into the store takes (p99).", "s",
                          "histogram_quantile(0.99, sum by (le, table) "
                          f"(rate(stepline_writer_write_duration_seconds_bucket{{{s}}}[$__rate_interval])))",
                          "{{table}}"))
    d = d.with_panel(grid("Watchdog state", "Which state the progress watchdog holds each engine in now.",
                          promql(f"max by (engine, state) (stepline_engine_state{{{s}}} == 1)", instant=True),
                          w=12, h=8, datasource=PROMETHEUS))
    return d.with_panel(series(
        "Progress age vs budget", "How long since each engine progressed, against the time the watchdog allows.",
        "s", promql(f"max by (engine) (stepline_engine_progress_age_seconds{{{s}}})", "{{engine}} age"),
        promql(f"max by (engine) (stepline_engine_progress_budget_seconds{{{s}}})", "{{engine}} budget", "B"),
        datasource=PROMETHEUS))
