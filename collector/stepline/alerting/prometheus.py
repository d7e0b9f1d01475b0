"""Prometheus rule groups and an example Alertmanager configuration, as plain data."""

from __future__ import annotations

from stepline.alerting import receivers, templates
from stepline.alerting.config import AlertConfig
from stepline.alerting.definitions import Alert, alerts
from stepline.alerting.slo import recording_rules

HEARTBEAT = "Watchdog"
INHIBITED_BY_ENGINE_DOWN = ("EngineStalled", "EngineWedgedWithQueue")
# A crash pages EngineGone within seconds; EngineDown would page the same crash again a minute later.
INHIBITED_BY_ENGINE_GONE = ("EngineDown", *INHIBITED_BY_ENGINE_DOWN)


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
    """The `groups:` document for `rule_files`: the rules (after the SLO recording rules they read), and those that
    page within 30 s of their cause in a group evaluated more often."""
    every = alerts(cfg)
    return {"groups": [
        {"name": cfg.group_name, "interval": cfg.evaluation_interval,
         "rules": [*recording_rules(cfg), *(rule(cfg, a) for a in every if not a.fast)]},
        {"name": cfg.fast_group_name, "interval": cfg.fast_evaluation_interval,
         "rules": [rule(cfg, a) for a in every if a.fast]},
    ]}


def alertmanager(cfg: AlertConfig) -> dict[str, object]:
    """Routing by severity to the receivers of `receivers.routed(cfg)`, grouped by engine, watchdog pages inhibited
    while the engine is down."""
    names = receivers.RECEIVER_NAMES
    return {
        "global": {"resolve_timeout": "5m"},
        "route": {
            # Whatever no route matches (a severity the rules do not use) is ticketed rather than dropped.
            "receiver": names["warning"],
            "group_by": ["alertname", "engine"],
            "group_wait": "30s",
            "group_interval": "5m",
            "repeat_interval": "4h",
            "routes": [
                {"matchers": [f'alertname="{HEARTBEAT}"'], "receiver": names["heartbeat"],
                 "group_wait": "0s", "group_interval": "1m", "repeat_interval": "1m"},
                {"matchers": ['severity="critical"'], "receiver": names["critical"],
                 "group_wait": "10s", "repeat_interval": "1h"},
                {"matchers": ['severity="warning"'], "receiver": names["warning"]},
            ],
        },
        "inhibit_rules": [
            {"source_matchers": ['alertname="EngineDown"'],
             "target_matchers": [f'alertname=~"{"|".join(INHIBITED_BY_ENGINE_DOWN)}"'],
             "equal": ["engine"]},
            {"source_matchers": ['alertname="EngineGone"'],
             "target_matchers": [f'alertname=~"{"|".join(INHIBITED_BY_ENGINE_GONE)}"'],
             "equal": ["engine"]},
            # An SLO's page silences its ticket, of the same objective and scope only.
            {"source_matchers": ['severity="critical"'], "target_matchers": ['severity="warning"'],
             "equal": ["alertname", "engine", "gpu", "instance", "objective", "model", "lane"]},
        ],
        "receivers": [_receiver(names[route], integrations) for route, integrations in receivers.routed(cfg).items()],
    }


def _receiver(name: str, integrations: tuple[receivers.Receiver, ...]) -> dict[str, object]:
    """One Alertmanager receiver holding each integration (none: a receiver that tells nobody, said so in the
    file's header)."""
    configs: dict[str, list[dict[str, object]]] = {}
    for r in integrations:
        key, config = receivers.alertmanager_config(r)
        configs.setdefault(key, []).append(config)
    return {"name": name, **configs}


def alertmanager_header(cfg: AlertConfig) -> str:
    """The example's header lines after the generator's: who each route tells, and what its default needs."""
    named = receivers.named_routes(cfg)
    lines = ["Who is told (name receivers with `stepline alerts build --receiver ROUTE=KIND:KEY=VALUE,...`,",
             "alerts/README.md \"Receivers\"):"]
    for route, integrations in receivers.routed(cfg).items():
        also = " (and whatever no route matches)" if route == "warning" else ""
        default = " (default)" if route not in named and integrations else ""
        lines.append(f"  {route} -> receiver {receivers.RECEIVER_NAMES[route]}{also}{default}:")
        lines += [f"    {r.describe()}" for r in integrations] or \
            ["    nobody: point it at a dead man's switch (--receiver heartbeat=webhook:url=...)"]
    if not cfg.webhook_url and not named >= {"critical", "warning"}:
        lines += ["", "The default reaches a person through one Slack incoming webhook, whose URL Alertmanager reads",
                  f"from {cfg.slack_api_url_file} on every notification: mount it there as a secret",
                  "(alerts/README.md); no secret is in this file. Until the file exists every notification fails,",
                  "naming the file, in Alertmanager's log and in",
                  'alertmanager_notifications_failed_total{integration="slack"}.']
    return "\n\n" + "\n".join(lines)
