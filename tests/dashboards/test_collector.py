"""The collector-health dashboard: whether the collector collects, writes and watches, from its own /metrics."""

from __future__ import annotations

import re

from stepline.alerting.config import AlertConfig
from stepline.app.selfmetrics import SelfMetrics
from stepline.dashboards import collector
from stepline.dashboards.query import PROMETHEUS
from tests.dashboards.conftest import GOLDEN, clickhouse_queries, panels, promql, rendered

MODEL = rendered(collector.dashboard)
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",), "info": ("_info",)}


def _exported() -> set[str]:
    """The sample names the collector's /metrics can carry."""
    return {family.name + suffix for family in SelfMetrics().registry.collect()
            for suffix in _SUFFIXES.get(family.type, ("",))}


def test_the_uid_is_stable() -> None:
    assert collector.UID == MODEL["uid"] == "stepline-collector"
    assert f'"uid": "{collector.UID}"' in (GOLDEN / "collector-health.json").read_text()


def test_it_shows_sources_writes_drops_and_the_watchdog() -> None:
    assert list(panels(MODEL)) == ["Sources up", "Source errors", "Rows written", "Rows dropped",
                                   "Writer queue depth", "Write latency p99", "Watchdog state",
                                   "Progress age vs budget"]


def test_it_reads_prometheus_only_and_only_metrics_the_collector_exports() -> None:
    assert not clickhouse_queries(MODEL)
    assert {p["datasource"]["uid"] for p in MODEL["panels"]} == {PROMETHEUS.uid}
    used = {name for expr in promql(MODEL) for name in re.findall(r"\bstepline_\w+", expr)}
    assert used and used <= _exported(), used - _exported()


def test_every_query_selects_the_configured_collector() -> None:
    exprs = promql(rendered(collector.dashboard, AlertConfig(selector='job="edge",cluster="a"')))
    assert len(exprs) == 9  # the age-vs-budget panel draws two
    assert all('{job="edge",cluster="a"}' in e for e in exprs), exprs
