"""What a page says: the title and text templates every receiver sends, checked as templates (actions balanced, no
`$` for Grafana's provisioning to expand) and for what they name."""

from __future__ import annotations

import re

import pytest

from stepline.alerting.notifications import NOTIFICATION_TEXT, NOTIFICATION_TITLE, PAGERDUTY_SEVERITY

TEMPLATES = {"title": NOTIFICATION_TITLE, "text": NOTIFICATION_TEXT, "pagerduty severity": PAGERDUTY_SEVERITY}


def _actions(template: str) -> list[str]:
    return [a.strip() for a in re.findall(r"\{\{(.*?)\}\}", template)]


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_every_block_is_closed_and_nothing_is_left_for_grafana_to_expand(name: str) -> None:
    template = TEMPLATES[name]
    assert "$" not in template
    assert template.count("{{") == template.count("}}") == len(_actions(template))
    depth = 0
    for action in _actions(template):
        if action.split()[0] in ("range", "with", "if"):
            depth += 1
        elif action == "end":
            depth -= 1
        assert depth >= 0, f"{name}: an end without its block"
    assert depth == 0, f"{name}: a block left open"


def test_the_title_names_the_alert_its_engine_and_the_first_summary() -> None:
    assert NOTIFICATION_TITLE.startswith("[{{ .Status | toUpper }}] {{ .CommonLabels.alertname }}")
    assert "{{ with .CommonLabels.engine }} on {{ . }}{{ end }}" in NOTIFICATION_TITLE
    assert NOTIFICATION_TITLE.endswith("{{ with index .Alerts 0 }}{{ .Annotations.summary }}{{ end }}")
    assert "\n" not in NOTIFICATION_TITLE  # a subject line


def test_the_text_gives_every_alert_its_summary_description_and_runbook() -> None:
    assert NOTIFICATION_TEXT.startswith("{{ range .Alerts }}") and NOTIFICATION_TEXT.endswith("{{ end }}")
    for field in ("summary", "description", "runbook_url"):
        assert f"{{{{ .Annotations.{field} }}}}" in NOTIFICATION_TEXT
    assert '{{ if eq .Status "resolved" }}Resolved: {{ end }}' in NOTIFICATION_TEXT


def test_pagerduty_gets_only_severities_its_events_api_knows() -> None:
    said = set(re.findall(r"\}\}(\w+)\{\{", PAGERDUTY_SEVERITY))
    assert said == {"critical", "warning", "info"} <= {"critical", "error", "warning", "info"}
