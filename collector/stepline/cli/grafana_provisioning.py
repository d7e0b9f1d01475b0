"""`stepline grafana-provisioning --out DIR`: a local Grafana's datasources and dashboards, no ClickHouse server."""

from __future__ import annotations

import argparse
import sys

from stepline.dashboards.provisioning import DEFAULT_QUERY_URL

HELP = "write Grafana provisioning for the embedded store (datasource + dashboards)"
DESCRIPTION = ("A local Grafana against `stepline collect`, with no ClickHouse server: a ClickHouse datasource "
               "(protocol http) pointing at the collector's query endpoint, and the dashboards.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Where to write, what the datasources point at, and which dashboards."""
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="output folder; Grafana's paths.provisioning is DIR/provisioning")
    parser.add_argument("--query-url", default=DEFAULT_QUERY_URL, metavar="URL",
                        help=f"the collector's query endpoint or a ClickHouse server (default {DEFAULT_QUERY_URL}); "
                             "a password comes from STEPLINE_QUERY_PASSWORD in Grafana's environment")
    parser.add_argument("--dashboards", default=None, metavar="DIR",
                        help="dashboard JSON to copy instead of the dashboards stepline generates")
    parser.add_argument("--prometheus-url", default=None, metavar="URL",
                        help="also provision a Prometheus datasource (uid stepline-prometheus)")


def run(args: argparse.Namespace) -> int:
    """Writes the files and lists them; 2 with a one-line message when an input is unusable."""
    from stepline.dashboards.provisioning import ProvisioningError, write_provisioning

    try:
        written = write_provisioning(args.out, query_url=args.query_url, dashboards_dir=args.dashboards,
                                     prometheus_url=args.prometheus_url)
    except (ProvisioningError, OSError) as exc:
        print(f"stepline grafana-provisioning: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    if not any(path.suffix == ".json" for path in written):
        print(f"no dashboards (*.json) in {args.dashboards}: wrote the datasources only", file=sys.stderr)
    return 0
