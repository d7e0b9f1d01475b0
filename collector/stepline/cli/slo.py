"""`stepline slo`: each objective's SLI and error budget over a window, from the store."""

from __future__ import annotations

import argparse
import json
import time

from stepline.cli.options import READ_STORE_HELP, add_objectives, chosen_slo
from stepline.core.timeparse import parse_duration

HELP = "each objective's SLI and error budget left, from the store"
DESCRIPTION = ("Count, per objective (TTFT, TPOT, availability, the gateway's availability and first byte; "
               "`Slo.objectives`, or those of --objectives) and scope (model, lane, engine or tenant), the requests "
               "its SLI judged and those good over the window, against its target: the SLI and the share of the "
               "error budget spent and left. The SLO dashboard and the burn-rate alerts read the same objectives from "
               "the collector's counters.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The window, the store, the format."""
    parser.add_argument("--since", default="30d", metavar="DURATION",
                        help="how far back, e.g. 1d, 7d (default 30d: the objectives' window)")
    parser.add_argument("--json", action="store_true", help="print the objectives as JSON")
    parser.add_argument("--store", help=READ_STORE_HELP)
    add_objectives(parser)


def run(args: argparse.Namespace) -> int:
    """Print each objective and scope (or say there were no requests); 0."""
    from stepline.analysis import slo
    from stepline.store.reader import open_located

    since = max(0.0, time.time() - parse_duration(args.since))
    slo_ = chosen_slo(args.objectives)
    reader = open_located(args.store)[0]
    try:
        found = slo.statuses(reader.client, slo_, since=since)
    finally:
        reader.close()
    if args.json:
        print(json.dumps([s.as_dict() for s in found], indent=2))
    elif not found:
        print(f"no finished requests in the last {args.since} (the plugin or OTLP fills `requests`, a gateway "
              "`gateway_decisions`)")
    else:
        print(slo.render(found))
    return 0
