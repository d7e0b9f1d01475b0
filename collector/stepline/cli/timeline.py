"""`stepline timeline --around T`: each engine step beside the GPU samples taken with it."""

from __future__ import annotations

import argparse

from stepline.cli.options import READ_STORE_HELP

HELP = "engine steps beside GPU counters, around a moment"
DESCRIPTION = ("Each engine step beside the sample of each of its GPUs taken at or just before it (the `timeline` "
               "view), from --window seconds before to --window seconds after --around.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The moment, the seconds around it, the bucket, the engine."""
    parser.add_argument("--around", required=True, metavar="TIME",
                        help="ISO 8601 (UTC unless it says otherwise), epoch seconds, or HH:MM:SS today (UTC)")
    parser.add_argument("--window", type=float, default=30.0, metavar="SECONDS",
                        help="seconds on each side (default 30)")
    parser.add_argument("--bucket", type=float, default=1.0, metavar="SECONDS",
                        help="aggregate per this many seconds; 0 prints every step (default 1)")
    parser.add_argument("--engine", default="", help="only this engine (default: all)")
    parser.add_argument("--store", help=READ_STORE_HELP)


def run(args: argparse.Namespace) -> int:
    """Print the timeline; 0. A bad moment, window or bucket raises UsageError (exit 2)."""
    from stepline.analysis import timeline
    from stepline.store.reader import open_located

    moment = timeline.parse_moment(args.around)
    reader = open_located(args.store)[0]
    try:
        print(timeline.around(reader.client, reader.database, moment, window_s=args.window, engine=args.engine,
                              bucket_s=args.bucket))
    finally:
        reader.close()
    return 0
