"""`stepline alerts build [--out alerts]`: regenerate the Prometheus, Alertmanager and Grafana alert files
(and copy the rules and dashboards into the Kubernetes kustomization)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from stepline.alerting.config import AlertConfig

HELP = "generate the alert rules, Alertmanager example and Grafana alert provisioning"
DESCRIPTION = ("`stepline alerts build` regenerates everything in alerts/ from the one alert config: Prometheus "
               "rules, an Alertmanager example, Grafana-managed rules, contact point and policy.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `build` action and what the generated files point at."""
    sub = parser.add_subparsers(dest="alerts_command", required=True, metavar="ACTION")
    b = sub.add_parser("build", help="write the rule, Alertmanager and Grafana provisioning files")
    b.add_argument("--out", default="alerts", help="output folder (default: alerts)")
    b.add_argument("--selector", default=None,
                   help=f"label matchers for the collector's /metrics (default: {AlertConfig.selector})")
    b.add_argument("--datasource-uid", default=None,
                   help=f"Grafana Prometheus datasource uid (default: {AlertConfig.grafana_datasource_uid})")
    b.add_argument("--runbook-url", default=None, help="runbook URL pattern with {anchor}")
    b.add_argument("--kustomization", default="deploy/kubernetes",
                   help="copy the rules and the dashboards into DIR/generated/ when DIR exists, for "
                        "`kubectl apply -k` (default: deploy/kubernetes; '' to skip)")
    b.add_argument("--dashboards", default="dashboards", help="the dashboards to copy (default: dashboards)")


def run(args: argparse.Namespace) -> int:
    """Writes the files and lists them; 0 on success."""
    from stepline.alerting.build import build, copy_into_kustomization

    changes = {k: v for k, v in (("selector", args.selector), ("grafana_datasource_uid", args.datasource_uid),
                                 ("runbook_url", args.runbook_url)) if v is not None}
    cfg = dataclasses.replace(AlertConfig(), **changes)
    written = build(args.out, cfg)
    kustomization = Path(args.kustomization) if args.kustomization else None
    if kustomization is not None and kustomization.is_dir():
        written += copy_into_kustomization(kustomization, Path(args.out) / "prometheus-rules.yaml", args.dashboards)
    for path in written:
        print(path)
    return 0
