"""The alert definitions: each with a runbook section and a severity, warning and critical pairs, every threshold
and duration read from the AlertConfig (the rules as Prometheus and Grafana get them: test_build.py)."""

from __future__ import annotations

import re
from dataclasses import replace

from stepline.alerting.config import AlertConfig
from stepline.alerting.definitions import alerts
from tests.alerting.test_build import ALERTS, CFG


def test_every_alert_has_a_runbook_section_and_severity() -> None:
    runbook = (ALERTS / "runbook.md").read_text()
    anchors = {re.sub(r"[^a-z0-9]", "", h.lower()) for h in re.findall(r"^## (.+)$", runbook, re.M)}
    for a in alerts(CFG):
        assert a.anchor in anchors, f"runbook.md has no section for {a.name}"
        assert a.severity in ("critical", "warning", "none")
    names = [(a.name, a.severity) for a in alerts(CFG)]
    assert len(names) == len(set(names))



def test_the_thresholds_and_durations_come_from_the_config() -> None:
    tuned = replace(AlertConfig(), kv_usage_critical_ratio=0.99, wedged_for="3m", selector='job="mine"')
    by_name = {(a.name, a.severity): a for a in alerts(tuned)}
    defaults = {(a.name, a.severity): a for a in alerts(CFG)}
    assert by_name.keys() == defaults.keys()
    changed = {key for key in by_name if by_name[key] != defaults[key]}
    assert changed, "no alert read the tuned config"
    assert any("0.99" in by_name[key].expr for key in changed)
    assert any(by_name[key].for_ == "3m" for key in changed)
    assert all('job="stepline"' not in a.expr for a in alerts(tuned) if 'job="mine"' in a.expr)


def test_every_alert_is_named_in_camel_case_and_only_the_heartbeat_has_no_severity() -> None:
    for a in alerts(CFG):
        assert re.fullmatch(r"[A-Z][A-Za-z]+", a.name), a.name
        assert a.summary and a.description, a.name
    assert [a.name for a in alerts(CFG) if a.severity == "none"] == ["Watchdog"]
