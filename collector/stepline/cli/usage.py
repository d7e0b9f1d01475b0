"""`stepline usage`: who used the GPUs over a window, grouped by tenant, key, team, model, adapter, lane or engine."""

from __future__ import annotations

import argparse
import os

HELP = "GPU-seconds, energy and cost per tenant, key, team, model, adapter, lane or engine"
DESCRIPTION = ("Each request's share of its engine's GPU time and energy over the window (each step shared among the "
               "requests it carried, by what each cost it), grouped by who sent it (the gateway's key, team, user "
               "and end user), the model or adapter, the lane or the engine; with requests, tokens, cost at a price "
               "per GPU-hour per GPU model, $/1M tokens, and the idle time as its own line.")
PRICES_ENV = "STEPLINE_GPU_PRICES"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The window, the grouping, the prices and the output's form."""
    from stepline.analysis.usage_by import DIMENSIONS
    from stepline.cli.diagnose import add_window_arguments

    add_window_arguments(parser)
    parser.set_defaults(since="1d")
    parser.add_argument("--by", choices=DIMENSIONS, default="engine",
                        help="group by this (default engine; tenant: the team, else the key, else the end user, "
                             "else the user, as the gateway says)")
    parser.add_argument("--gpu-price", action="append", default=None, metavar="MODEL=USD",
                        help="price per GPU-hour of a GPU model as NVML names it, e.g. 'NVIDIA H100 80GB HBM3=2.49' "
                             f"(repeatable; ${PRICES_ENV}, comma-separated); no price, no cost")
    parser.add_argument("--format", choices=("table", "csv", "json"), default="table", help="default table")
    parser.add_argument("--exact", action="store_true",
                        help="one pass over the window's steps, even where the per-minute rollup covers it (windows "
                             "over an hour read the rollup where the collectors wrote it)")


def run(args: argparse.Namespace) -> int:
    """Print the report; 0."""
    from stepline.analysis import usage_by, usage_rollup
    from stepline.cli.diagnose import window_of
    from stepline.core.usageerror import UsageError
    from stepline.store.reader import open_located

    specs = args.gpu_price if args.gpu_price is not None else [
        part.strip() for part in os.environ.get(PRICES_ENV, "").split(",") if part.strip()]
    try:
        prices = usage_by.parse_prices(specs)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    window = window_of(args)
    reader = open_located(args.store)[0]
    try:
        found = usage_rollup.report(reader.client, window, args.by, prices, exact=args.exact)
    finally:
        reader.close()
    print({"csv": usage_by.as_csv, "json": usage_by.as_json}.get(args.format, usage_by.render)(found))
    return 0
