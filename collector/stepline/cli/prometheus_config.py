"""`stepline prometheus-config [--target HOST:PORT]... [--rules PATH] [--alertmanager HOST:PORT]`: print the
Prometheus configuration that scrapes the collector as the alert rules select it."""

from __future__ import annotations

import argparse
import dataclasses

HELP = "print a prometheus.yml that scrapes the collector as the alert rules select it"
DESCRIPTION = ("For a bare-metal install: a Prometheus configuration that scrapes each collector's /metrics under the "
               "job the alert rules select (job=\"stepline\"), every 5 s, loads the rules `stepline alerts build` "
               "writes and sends their alerts to Alertmanager. Redirect it to a file: "
               "`stepline prometheus-config > prometheus.yml`.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The collectors, the rules file and the Alertmanager."""
    from stepline.config.settings import Settings

    defaults = {f.name: f.default for f in dataclasses.fields(Settings)}
    collector = f"{defaults['listen']}:{defaults['metrics_port']}"
    parser.add_argument("--target", action="append", default=None, metavar="HOST:PORT",
                        help=f"a collector's /metrics address (repeat for several; default {collector}, the "
                             "collector's --listen and --metrics-port defaults)")
    parser.add_argument("--rules", default="alerts/prometheus-rules.yaml", metavar="PATH",
                        help="the rules file, as `stepline alerts build --out alerts` writes it (default: "
                             "%(default)s; Prometheus resolves a relative path from the config file's folder)")
    parser.add_argument("--alertmanager", default="127.0.0.1:9093", metavar="HOST:PORT",
                        help="where the alerts go (default: %(default)s; '' for none)")
    parser.set_defaults(default_target=collector)


def run(args: argparse.Namespace) -> int:
    """Print the configuration; 0. A target that is no host:port is a UsageError (exit 2)."""
    from stepline.alerting.scrape import prometheus_config
    from stepline.core.usageerror import UsageError

    targets = args.target or [args.default_target]
    for address in [*targets, *([args.alertmanager] if args.alertmanager else [])]:
        host, sep, port = address.rpartition(":")
        if not (sep and host and port.isdigit() and 0 < int(port) < 65536) or "/" in address:
            raise UsageError(f"{address!r} is no HOST:PORT (Prometheus scrapes http://HOST:PORT/metrics)")
    print(prometheus_config(targets, args.rules, [args.alertmanager] if args.alertmanager else []), end="")
    return 0
