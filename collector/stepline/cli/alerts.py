"""`stepline alerts build [--out alerts] [--receiver ROUTE=KIND:KEY=VALUE,...]...`: regenerate the Prometheus,
Alertmanager and Grafana alert files (and copy the rules and dashboards into the Kubernetes kustomization)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from stepline.alerting.config import AlertConfig
from stepline.cli.options import add_objectives, chosen_slo

HELP = "generate the alert rules, Alertmanager example and Grafana alert provisioning"
DESCRIPTION = ("`stepline alerts build` regenerates everything in alerts/ from the one alert config: Prometheus "
               "rules, an Alertmanager example, Grafana-managed rules, contact points and policy, delivering to the "
               "receivers --receiver names.")
RECEIVER_HELP = (
    "who a route tells, as ROUTE=KIND:KEY=VALUE,... (repeat it; several on one route all get told). "
    "ROUTE: critical (pages), warning (tickets) or heartbeat (the Watchdog, for a dead man's switch). "
    "KIND and its keys: slack:api_url_file=PATH[,channel=#C][,username=U]; "
    "pagerduty:routing_key_file=PATH|service_key_file=PATH[,url=URL]; "
    "email:to=A@B[;C@D],from=A@B,smarthost=HOST:PORT[,auth_username=U,auth_password_file=PATH][,require_tls=true]; "
    "webhook:url=URL[,bearer_token_file=PATH][,max_alerts=N]. Secrets only as absolute paths of files, which "
    "Alertmanager reads on each notification and Grafana as $__file{PATH}. A route none is named for keeps its "
    f"default: critical and warning post to Slack through the URL in {AlertConfig.slack_api_url_file}; the "
    "heartbeat tells nobody. Example: --receiver critical=pagerduty:routing_key_file=/etc/alertmanager/secrets/pd "
    "--receiver warning=slack:api_url_file=/etc/alertmanager/secrets/slack,channel=#vllm")


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
    b.add_argument("--receiver", action="append", default=[], metavar="ROUTE=KIND:KEY=VALUE,...", help=RECEIVER_HELP)
    b.add_argument("--grafana-via-alertmanager", action="store_true",
                   help="Grafana forwards every Grafana-managed alert to the Alertmanager (so its inhibit rules "
                        "apply) instead of delivering the routes named by --receiver itself")
    b.add_argument("--kustomization", default="deploy/kubernetes",
                   help="copy the rules and the dashboards into DIR/generated/ when DIR exists, for "
                        "`kubectl apply -k` (default: deploy/kubernetes; '' to skip)")
    b.add_argument("--dashboards", default="dashboards", help="the dashboards to copy (default: dashboards)")
    add_objectives(b)


def run(args: argparse.Namespace) -> int:
    """Writes the files and lists them; 0 on success."""
    from stepline.alerting.build import build, copy_into_kustomization
    from stepline.alerting.receivers import parse, routed

    changes = {k: v for k, v in (("selector", args.selector), ("grafana_datasource_uid", args.datasource_uid),
                                 ("runbook_url", args.runbook_url)) if v is not None}
    cfg = dataclasses.replace(AlertConfig(), **changes, receivers=tuple(parse(text) for text in args.receiver),
                              slo=chosen_slo(args.objectives),
                              grafana_via_alertmanager=args.grafana_via_alertmanager)
    routed(cfg)  # a receiver named twice is refused before any file is written
    written = build(args.out, cfg)
    kustomization = Path(args.kustomization) if args.kustomization else None
    if kustomization is not None and kustomization.is_dir():
        written += copy_into_kustomization(kustomization, Path(args.out) / "prometheus-rules.yaml", args.dashboards)
    for path in written:
        print(path)
    return 0
