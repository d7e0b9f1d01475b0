"""The SLO dashboard: a row per objective, from the collector's SLI counters and the burn-rate recording rules."""

from __future__ import annotations

import json
import re

from stepline.alerting.config import AlertConfig
from stepline.alerting.slo import recording_rules
from stepline.app.selfmetrics import SelfMetrics
from stepline.config.objectives import Objective
from stepline.config.slo import Slo
from stepline.dashboards import slo
from stepline.dashboards.query import PROMETHEUS
from tests.dashboards.conftest import GOLDEN, clickhouse_queries, panels, promql, rendered

MODEL = rendered(slo.dashboard)


def _available() -> set[str]:
    """What the queries may read: the collector's counters, and what the alert rules record."""
    counters = {f.name + "_total" for f in SelfMetrics().registry.collect() if f.type == "counter"}
    recorded = {str(r["record"]) for r in recording_rules(AlertConfig())}
    return counters | recorded


def test_the_uid_is_stable() -> None:
    assert slo.UID == MODEL["uid"] == "stepline-slo"
    assert f'"uid": "{slo.UID}"' in (GOLDEN / "slo.json").read_text()


def test_each_objective_shows_its_budget_left_its_sli_and_its_burn_rate() -> None:
    names = [o.name for o in Slo().objectives]
    assert list(panels(MODEL)) == [f"{n}: {p}" for n in names
                                   for p in ("error budget left (30d)", "SLI", "burn rate")]


def test_it_reads_prometheus_only_and_only_series_the_collector_or_the_rules_give() -> None:
    assert not clickhouse_queries(MODEL)
    assert {p["datasource"]["uid"] for p in MODEL["panels"]} == {PROMETHEUS.uid}
    used = {name for expr in promql(MODEL) for name in re.findall(r"\bstepline_[\w:]+", expr)}
    assert used and used <= _available(), used - _available()


def test_the_objectives_and_selector_come_from_the_shared_config() -> None:
    config = AlertConfig(selector='job="edge"', slo=Slo(objectives=(
        Objective("fast_ttft", "ttft", target=0.995, scope="lane", window_days=7),)))
    model = rendered(slo.dashboard, config)
    assert list(panels(model)) == ["fast_ttft: error budget left (7d)", "fast_ttft: SLI", "fast_ttft: burn rate"]
    [left] = [e for e in promql(model) if "[7d]" in e]
    assert "/ 0.005" in left and "sum by (lane)" in left and 'job="edge", objective="fast_ttft"' in left
    assert '"value": 0.995' in json.dumps(model)
