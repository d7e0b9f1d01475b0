"""One rule, as each backend places it: a fast rule in the fast group of Prometheus (every 5 s) and of Grafana (every
10 s, its scheduler's tick), every other rule in the main group."""

from __future__ import annotations

from typing import Any

from stepline.alerting.config import AlertConfig
from stepline.alerting.grafana import grafana_interval, rules_file
from stepline.alerting.prometheus import rule_groups
from stepline.alerting.rule import Alert, diagnose_hint

CFG = AlertConfig()


def test_an_alert_is_anchored_by_its_name_and_ends_with_the_diagnose_hint() -> None:
    a = Alert("EngineGone", "critical", "vector(1)", "0m", "s", "d " + diagnose_hint(CFG), fast=True)
    assert a.anchor == "enginegone"
    assert a.description.endswith("Run: stepline diagnose --engine [engine] --since 30m")


def _groups(doc: dict[str, object]) -> dict[str, tuple[str, list[str]]]:
    groups: list[dict[str, Any]] = doc["groups"]  # type: ignore[assignment]
    return {g["name"]: (g["interval"], [r.get("alert") or r.get("title") for r in g["rules"]]) for g in groups}


def test_fast_rules_go_to_the_fast_group_of_each_backend() -> None:
    prometheus = _groups(rule_groups(CFG))
    assert prometheus["stepline-fast"] == ("5s", ["EngineGone"])
    assert prometheus["stepline"][0] == "30s" and "EngineGone" not in prometheus["stepline"][1]
    grafana = _groups(rules_file(CFG))
    assert grafana["stepline-fast"] == ("10s", ["EngineGone"])
    assert grafana["stepline"][0] == "30s"
    assert [grafana_interval(d) for d in ("5s", "10s", "15s", "30s", "60s", "2m")] == \
        ["10s", "10s", "20s", "30s", "1m", "2m"]
