"""The Prometheus side as plain data: each rule with its labels, annotations and runbook link, the fast group for
the pages that must arrive within 30 s, and Alertmanager's routes and inhibitions (checked by amtool)."""

from __future__ import annotations

import json
import re

from stepline.alerting.definitions import alerts
from stepline.alerting.prometheus import HEARTBEAT, INHIBITED_BY_ENGINE_GONE, alertmanager, rule, rule_groups
from tests.alerting.test_build import ALERTS, AMTOOL, CFG, _tool, needs_amtool


def test_a_rule_carries_its_severity_runbook_and_for_only_when_it_waits() -> None:
    every = {a.name: a for a in alerts(CFG)}
    gone = rule(CFG, every["EngineGone"])
    assert gone["labels"] == {"severity": "critical"} and "for" not in gone  # pages at once
    annotations = gone["annotations"]
    assert isinstance(annotations, dict)
    assert annotations["runbook_url"].endswith("/alerts/runbook.md#enginegone")
    down = rule(CFG, every["EngineDown"])
    assert down["for"] == CFG.engine_down_for


def test_the_fast_group_holds_the_fast_rules_and_the_main_one_the_rest() -> None:
    groups = rule_groups(CFG)["groups"]
    assert isinstance(groups, list)
    main, fast = groups
    assert (main["name"], main["interval"], fast["name"], fast["interval"]) == ("stepline", "30s", "stepline-fast",
                                                                                "5s")
    assert {r["alert"] for r in fast["rules"]} == {a.name for a in alerts(CFG) if a.fast} != set()
    assert {r["alert"] for r in main["rules"] if "alert" in r} == {a.name for a in alerts(CFG) if not a.fast}
    assert HEARTBEAT in {r["alert"] for r in main["rules"] if "alert" in r}


def test_a_crash_pages_once() -> None:
    inhibit = alertmanager(CFG)["inhibit_rules"]
    assert isinstance(inhibit, list)
    gone = next(r for r in inhibit if r["source_matchers"] == ['alertname="EngineGone"'])
    assert all(name in gone["target_matchers"][0] for name in INHIBITED_BY_ENGINE_GONE)


def test_inhibition_and_routing_in_alertmanager_config() -> None:
    am = alertmanager(CFG)
    inhibit = am["inhibit_rules"]
    assert isinstance(inhibit, list)
    rule = next(r for r in inhibit if r["source_matchers"] == ['alertname="EngineDown"'])
    assert rule["equal"] == ["engine"]
    assert "EngineStalled" in rule["target_matchers"][0] and "EngineWedgedWithQueue" in rule["target_matchers"][0]
    # The default tells a person through the Slack URL in a secret file, not a loopback port where nothing listens.
    assert not re.search(r"//(127\.0\.0\.1|localhost)[:/]", json.dumps(am)), am["receivers"]
    by_name = {r["name"]: r for r in am["receivers"]}  # type: ignore[attr-defined]
    for name in ("stepline-page", "stepline-ticket"):
        [slack] = by_name[name]["slack_configs"]
        assert slack["api_url_file"] == CFG.slack_api_url_file == "/etc/alertmanager/secrets/slack_api_url"
    assert by_name["heartbeat"] == {"name": "heartbeat"}, "no heartbeat receiver is named: it tells nobody"


@needs_amtool
def test_amtool_check_config_and_routes() -> None:
    config = str(ALERTS / "alertmanager.example.yaml")
    _tool(str(AMTOOL), "check-config", config)

    def route(*labels: str) -> str:
        return _tool(str(AMTOOL), "config", "routes", "test", f"--config.file={config}", *labels).strip()

    assert route("alertname=Watchdog", "severity=none") == "heartbeat"
    assert route("alertname=EngineStalled", "severity=critical", "engine=e1") == "stepline-page"
    assert route("alertname=DecodeStarvation", "severity=warning", "engine=e1") == "stepline-ticket"
    assert route("alertname=Something", "severity=info") == "stepline-ticket", "an unrouted alert is ticketed"

