"""Prometheus rule groups and an example Alertmanager configuration, as plain data."""

from __future__ import annotations

from stepline.alerting import templates
from stepline.alerting.config import AlertConfig
from stepline.alerting.definitions import Alert, alerts

HEARTBEAT = "Watchdog"
INHIBITED_BY_ENGINE_DOWN = ("EngineStalled", "EngineWedgedWithQueue")


def rule(cfg: AlertConfig, a: Alert) -> dict[str, object]:
    """One alerting rule of a Prometheus rule group."""
    out: dict[str, object] = {
        "alert": a.name,
        "expr": a.expr,
        "labels": {"severity": a.severity, **a.labels},
        "annotations": {
            "summary": templates.prometheus(cfg, a.summary),
            "description": templates.prometheus(cfg, a.description),
            "runbook_url": cfg.runbook(a.name),
        },
    }
    if a.for_ != "0m":
        out["for"] = a.for_
    return out


def rule_groups(cfg: AlertConfig) -> dict[str, object]:
    """The `groups:` document for `rule_files`."""
    return {"groups": [{
        "name": cfg.group_name,
        "interval": cfg.evaluation_interval,
        "rules": [rule(cfg, a) for a in alerts(cfg)],
    }]}


def alertmanager(cfg: AlertConfig) -> dict[str, object]:
    """Routing by severity, grouped by engine, watchdog pages inhibited while the engine is down."""
    def webhook(name: str, url: str, resolved: bool = True) -> dict[str, object]:
        return {"name": name, "webhook_configs": [{"url": url, "send_resolved": resolved}]}

    return {
        "global": {"resolve_timeout": "5m"},
        "route": {
            "receiver": "stepline-default",
            "group_by": ["alertname", "engine"],
            "group_wait": "30s",
            "group_interval": "5m",
            "repeat_interval": "4h",
            "routes": [
                {"matchers": [f'alertname="{HEARTBEAT}"'], "receiver": "heartbeat",
                 "group_wait": "0s", "group_interval": "1m", "repeat_interval": "1m"},
                {"matchers": ['severity="critical"'], "receiver": "stepline-page",
                 "group_wait": "10s", "repeat_interval": "1h"},
                {"matchers": ['severity="warning"'], "receiver": "stepline-ticket"},
            ],
        },
        "inhibit_rules": [
            {"source_matchers": ['alertname="EngineDown"'],
             "target_matchers": [f'alertname=~"{"|".join(INHIBITED_BY_ENGINE_DOWN)}"'],
             "equal": ["engine"]},
            {"source_matchers": ['severity="critical"'], "target_matchers": ['severity="warning"'],
             "equal": ["alertname", "engine", "gpu", "instance"]},
        ],
        "receivers": [
            webhook("stepline-default", cfg.webhook_url),
            webhook("stepline-page", cfg.webhook_url),
            webhook("stepline-ticket", cfg.webhook_url),
            webhook("heartbeat", cfg.heartbeat_url, resolved=False),
        ],
    }
