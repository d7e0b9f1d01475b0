"""`stepline alerts build [--out alerts]`: regenerate the Prometheus, Alertmanager and Grafana alert files."""

from __future__ import annotations

import argparse
import dataclasses

from stepline.alerting.build import build
from stepline.alerting.config import AlertConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="alerts_command", required=True, metavar="ACTION")
    b = sub.add_parser("build", help="write the rule, Alertmanager and Grafana provisioning files")
    b.add_argument("--out", default="alerts", help="output folder (default: alerts)")
    b.add_argument("--selector", default=None,
                   help=f"label matchers for the collector's /metrics (default: {AlertConfig.selector})")
    b.add_argument("--datasource-uid", default=None,
                   help=f"Grafana Prometheus datasource uid (default: {AlertConfig.grafana_datasource_uid})")
    b.add_argument("--runbook-url", default=None, help="runbook URL pattern with {anchor}")


def run(args: argparse.Namespace) -> int:
    """Writes the files and lists them; 0 on success."""
    changes = {k: v for k, v in (("selector", args.selector), ("grafana_datasource_uid", args.datasource_uid),
                                 ("runbook_url", args.runbook_url)) if v is not None}
    cfg = dataclasses.replace(AlertConfig(), **changes)
    for path in build(args.out, cfg):
        print(path)
    return 0
