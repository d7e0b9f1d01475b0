"""The Prometheus configuration a bare-metal install needs: scrape the collector's /metrics as the rules select it.

Every rule selects the collector's series by `AlertConfig.selector` (`job="stepline"`): Prometheus sets `job` to the
scrape config's `job_name`, so the job is named from that selector. Beside it, the rules file `stepline alerts build`
writes, and the Alertmanager they page through. Compose and Kubernetes ship their own (deploy/prometheus/).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from stepline.alerting import yamlout
from stepline.alerting.config import AlertConfig

# Prometheus' scrape of the collector: the watchdog's liveness rules count on 5 s (docs/alerts.md: a wedged engine
# pages within the collector's scrape, Prometheus' scrape, the fast group's evaluation and Alertmanager's wait).
SCRAPE_INTERVAL = "5s"
_JOB = re.compile(r'\s*job\s*=\s*"([^"\\]+)"\s*')


def job_name(cfg: AlertConfig) -> str:
    """The job the rules select (`job="stepline"` -> "stepline"); ValueError for a selector that names no one job."""
    match = _JOB.fullmatch(cfg.selector)
    if match is None:
        raise ValueError(f"the alert selector {cfg.selector!r} names no single job (job=\"NAME\"): write the scrape "
                         "config by hand so that its series carry what the selector matches")
    return match.group(1)


def prometheus_config(targets: Sequence[str], rules: str, alertmanagers: Sequence[str],
                      cfg: AlertConfig | None = None) -> str:
    """prometheus.yml: the collectors at `targets` (host:port) scraped as the rules select them, the rules file
    `rules` (a path Prometheus resolves from the config file's folder) and the Alertmanagers at `alertmanagers`."""
    cfg = cfg or AlertConfig()
    if not targets:
        raise ValueError("no collector to scrape: give at least one host:port")
    config: dict[str, object] = {
        "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": cfg.evaluation_interval},
        "rule_files": [rules],
        "scrape_configs": [{"job_name": job_name(cfg), "static_configs": [{"targets": list(targets)}]}],
    }
    if alertmanagers:
        config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": list(alertmanagers)}]}]}
    header = (f"Prometheus for stepline: the collector's /metrics as job {job_name(cfg)!r}, which every rule "
              f"selects ({cfg.selector}).\n"
              f"The rules: `stepline alerts build --out DIR` writes DIR/prometheus-rules.yaml ({rules} here, from "
              "this file's folder).\n"
              "Written by `stepline prometheus-config`; check it with `promtool check config`.")
    return yamlout.dump(config, header)
