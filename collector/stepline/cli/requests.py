"""`stepline requests`: the slowest finished requests, each with the engine steps that slowed it."""

from __future__ import annotations

import argparse
import time

from stepline.cli.options import READ_STORE_HELP
from stepline.core.timeparse import parse_duration

HELP = "the slowest finished requests, with the steps that slowed them"
DESCRIPTION = ("Join each of the slowest requests with the engine steps around it: time it queued while prefill "
               "ran, tokens it decoded beside a long prefill chunk, and its step-time tail.")


def count(text: str) -> int:
    """A whole number 1..2^32-1: it is bound to a UInt32 query parameter."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 1 <= value < 1 << 32:
        raise argparse.ArgumentTypeError(f"{value} is not between 1 and {(1 << 32) - 1}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """How many, slowest by what, over which window and engine."""
    parser.add_argument("--slowest", type=count, default=20, metavar="N", help="how many requests (default 20)")
    parser.add_argument("--by", choices=("e2e", "ttft", "tpot", "queue"), default="e2e",
                        help="what 'slowest' means: end-to-end, time to first token, time per output "
                             "token, or queue time (default e2e)")
    parser.add_argument("--since", default="1h", metavar="DURATION",
                        help="how far back, e.g. 30m, 2h, 1d (default 1h)")
    parser.add_argument("--engine", default="", help="only this engine (default: all)")
    parser.add_argument("--long-prefill", type=count, default=None, metavar="TOKENS",
                        help="a step carrying at least this many prefill tokens counts as a long prefill chunk "
                             "(default: half of the engine's max_num_batched_tokens, else of its largest chunk)")
    parser.add_argument("--store", help=READ_STORE_HELP)


def run(args: argparse.Namespace) -> int:
    """Print the requests (or say there are none); 0."""
    from stepline.analysis import perrequest
    from stepline.store.reader import open_located

    since = max(0.0, time.time() - parse_duration(args.since))
    reader = open_located(args.store)[0]
    try:
        found = perrequest.slowest(reader.client, since=since, limit=args.slowest, by=args.by, engine=args.engine,
                                   long_prefill_tokens=args.long_prefill)
    finally:
        reader.close()
    if not found:
        print(f"no finished requests in the last {args.since}"
              + (f" on engine {args.engine}" if args.engine else "") + " (the plugin or OTLP fills `requests`)")
        return 0
    print(perrequest.render(found))
    return 0
