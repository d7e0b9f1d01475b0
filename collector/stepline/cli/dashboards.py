"""`stepline dashboards build [--out dashboards]`."""

from __future__ import annotations

import argparse

from stepline.cli.options import add_objectives, chosen_slo

HELP = "generate the Grafana dashboards"
DESCRIPTION = ("`stepline dashboards build` regenerates the dashboards in dashboards/ from code: fleet overview, "
               "engine timeline, requests, GPU, collector health and gateway lanes.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `build` subcommand to `parser` (the `dashboards` command's parser)."""
    sub = parser.add_subparsers(dest="dashboards_command", required=True)
    b = sub.add_parser("build", help="write the Grafana dashboards' JSON")
    b.add_argument("--out", default="dashboards", help="output folder (default: dashboards)")
    add_objectives(b)


def run(args: argparse.Namespace) -> int:
    """Write the dashboards; prints one line per file; returns the exit code."""
    from stepline.alerting.config import AlertConfig
    from stepline.dashboards.generate import build

    for path in build(args.out, AlertConfig(slo=chosen_slo(args.objectives))):
        print(path)
    return 0
