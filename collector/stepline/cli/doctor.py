"""`stepline doctor`: is this engine wired to stepline? One line a check, OK or what is wrong with the fix."""

from __future__ import annotations

import argparse
import sys

from stepline.cli.options import READ_STORE_HELP

HELP = "check that an engine and its collector are wired: one line a check, with the fix"
DESCRIPTION = ("Check, against the running engine and collector, each thing stepline needs: the engine's /metrics, "
               "the plugin's steps (iteration details on), OTLP spans, one model name, GPUs, the store and spool, "
               "the clocks, and Prometheus and Alertmanager when given. It sends the engine one 2-token completion "
               "so that an idle engine shows its steps and a span. Exit 0 when no check FAILs (a SKIP, a check not "
               "asked for or not possible, does not count), 1 otherwise.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from stepline.alerting.config import AlertConfig

    parser.add_argument("--engine", default="", metavar="[NAME=]URL",
                        help="the vLLM server, named as the collector names it (default: the first of "
                             "$STEPLINE_ENGINES, else the one engine the collector scrapes)")
    parser.add_argument("--store", help=READ_STORE_HELP)
    parser.add_argument("--prometheus", default="", metavar="URL",
                        help="a Prometheus to check scrapes the collector, e.g. http://127.0.0.1:9090")
    parser.add_argument("--prometheus-selector", default=AlertConfig().selector, metavar="MATCHERS",
                        help="the collector's target in it, as the alert rules select it (default: %(default)s)")
    parser.add_argument("--alertmanager", default="", metavar="URL",
                        help="an Alertmanager to check is ready, e.g. http://127.0.0.1:9093")
    parser.add_argument("--wait", type=float, default=30.0, metavar="SECONDS",
                        help="how long to wait for steps and spans to arrive (default: %(default)s)")
    parser.add_argument("--no-probe", dest="probe", action="store_false",
                        help="send the engine no completion: wait for its own traffic instead")
    parser.add_argument("--host-name", default="", help="the collector's host name on the timeline (default: "
                                                        "$STEPLINE_HOST_NAME, else this machine's)")
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")


def run(args: argparse.Namespace) -> int:
    """Print every check; 0 when none FAILed, 1 otherwise."""
    from stepline.app.doctor import Doctor, Options, as_json, exit_code

    if args.wait <= 0:
        from stepline.core.usageerror import UsageError

        raise UsageError(f"--wait must be positive, got {args.wait:g}")
    options = Options(engine=args.engine, store=args.store, prometheus=args.prometheus,
                      prometheus_selector=args.prometheus_selector, alertmanager=args.alertmanager,
                      wait_s=args.wait, probe=args.probe, host=args.host_name)
    doctor = Doctor(options)
    if not args.json:
        print(f"stepline doctor: waiting up to {args.wait:g} s for steps and spans...", file=sys.stderr, flush=True)
    checks = doctor.run()
    print(as_json(checks) if args.json else "\n".join(c.line() for c in checks))
    return exit_code(checks)
